"""Creating one cache per attention layer: scheme lookup, validation, eviction wrapping.

This is the only place the plugin layer is consulted; the caches it returns are plain
objects whose methods the decode loop calls directly.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

from butter_core.cache import LayerCache, LayerSpec
from butter_core.config import CacheKind, Eviction, Window
from butter_core.errors import ConfigError
from butter_core.plugins import PluginHost, get_plugin_host


def make_layer_caches(
    kind: CacheKind,
    specs: Sequence[LayerSpec],
    eviction: Eviction | None = None,
    *,
    layer_windows: Sequence[Window | None] | None = None,
    host: PluginHost | None = None,
) -> list[LayerCache]:
    """One cache per spec, of scheme ``kind``, under ``eviction`` if given.

    ``layer_windows`` lets a model family bound individual layers (sliding-window
    attention layers); where a layer has one and ``eviction`` is also a ``Window``, the
    smaller wins; another eviction policy yields to the family's window on that layer.
    """
    _check_arguments(kind, specs, eviction, layer_windows)
    host = host or get_plugin_host()
    host.scheme_for(kind)  # an unknown scheme is named before any cache is made
    windows = [_tighter(eviction, w) for w in (layer_windows or [None] * len(specs))]
    create = functools.partial(host.create_caches, kind)

    caches: list[LayerCache | None] = [None] * len(specs)
    groups: dict[Eviction | None, list[int]] = {}
    for index, window in enumerate(windows):
        groups.setdefault(window, []).append(index)
    for window, indices in groups.items():
        group_specs = [specs[i] for i in indices]
        made = create(group_specs) if window is None else host.wrap_caches(window, create, group_specs)
        for i, cache in zip(indices, made):
            caches[i] = cache
    return caches


def _check_arguments(kind, specs, eviction, layer_windows) -> None:
    if not isinstance(kind, CacheKind):
        hint = f"; to parse the string use parse_kv_cache({kind!r})" if isinstance(kind, str) else ""
        raise ConfigError(
            f"make_layer_caches: kind must be a CacheKind (Raw(), Affine(bits=8), a plugin's kind), "
            f"got {kind!r} ({type(kind).__name__}){hint}"
        )
    if not isinstance(specs, Sequence) or not all(isinstance(spec, LayerSpec) for spec in specs):
        raise ConfigError(f"make_layer_caches: specs must be a list of LayerSpec, one per layer; got {specs!r}")
    if eviction is not None and not isinstance(eviction, Eviction):
        raise ConfigError(f"make_layer_caches: eviction must be None, Window(max_size, keep) or a plugin's Eviction; got {eviction!r}")
    if layer_windows is not None and len(layer_windows) != len(specs):
        raise ConfigError(f"make_layer_caches: {len(layer_windows)} layer_windows for {len(specs)} specs")


def _tighter(eviction: Eviction | None, layer: Window | None) -> Eviction | None:
    if layer is None or eviction is None:
        return layer or eviction
    if isinstance(eviction, Window) and eviction.max_size <= layer.max_size:
        return eviction
    return layer
