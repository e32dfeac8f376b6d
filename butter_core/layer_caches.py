"""Creating one cache per attention layer: scheme lookup, validation, eviction wrapping.

This is the only place the plugin layer is consulted; the caches it returns are plain
objects whose methods the decode loop calls directly.
"""

from __future__ import annotations

from collections.abc import Sequence

from butter_core.cache import LayerCache, LayerSpec
from butter_core.config import CacheKind, Eviction, Window
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
    host = host or get_plugin_host()
    scheme = host.scheme_for(kind)
    for spec in specs:
        kind.check_layer(spec.head_dim)
    windows = [_tighter(eviction, w) for w in (layer_windows or [None] * len(specs))]

    def create(selected_specs):
        caches = scheme.create(kind, selected_specs)
        if len(caches) != len(selected_specs):
            raise RuntimeError(f"scheme {scheme.name!r} made {len(caches)} caches for {len(selected_specs)} layers")
        return caches

    caches: list[LayerCache | None] = [None] * len(specs)
    groups: dict[Eviction | None, list[int]] = {}
    for index, window in enumerate(windows):
        groups.setdefault(window, []).append(index)
    for window, indices in groups.items():
        group_specs = [specs[i] for i in indices]
        made = create(group_specs) if window is None else host.eviction_for(window).wrap(window, create, group_specs)
        for i, cache in zip(indices, made):
            caches[i] = cache
    return caches


def _tighter(eviction: Eviction | None, layer: Window | None) -> Eviction | None:
    if layer is None or eviction is None:
        return layer or eviction
    if isinstance(eviction, Window) and eviction.max_size <= layer.max_size:
        return eviction
    return layer
