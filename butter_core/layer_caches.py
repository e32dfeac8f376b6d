"""Creating one cache per layer: scheme lookup by layer type, validation, eviction wrapping.

This is the only place the plugin layer is consulted; the caches it returns are plain
objects whose methods the decode loop calls directly.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence

from butter_core.cache import ATTENTION, LayerCache, LayerSpec
from butter_core.config import DEFAULT_KV_CACHE, DEFAULT_STATE_CACHE, CacheKind, Eviction, LoadOptions, Window
from butter_core.errors import ConfigError
from butter_core.plugins import PluginHost, get_plugin_host
from butter_core.recurrent import StateSpec


def make_layer_caches(
    kind: CacheKind | Mapping[str, CacheKind] | Callable[[str], CacheKind],
    specs: Sequence[LayerSpec | StateSpec],
    eviction: Eviction | None = None,
    *,
    layer_windows: Sequence[Window | None] | None = None,
    host: PluginHost | None = None,
) -> list[LayerCache]:
    """One cache per spec, of scheme ``kind``, attention layers under ``eviction`` if given.

    ``kind`` is one kind for every layer, or a kind per layer type (``{ATTENTION: raw,
    MAMBA2: ssm}``, or a function of the type such as ``layer_kinds(options)``): each spec's
    ``layer_type`` picks its scheme, which must store that type.
    ``layer_windows`` lets a model family bound individual attention layers (sliding-window
    layers); where a layer has one and ``eviction`` is also a ``Window``, the smaller wins;
    another eviction policy yields to the family's window on that layer. Eviction never
    applies to recurrent layers (``StateSpec``): their state does not grow.
    """
    _check_arguments(kind, specs, eviction, layer_windows)
    host = host or get_plugin_host()
    kinds = [_kind_for(kind, spec) for spec in specs]
    for spec, layer_kind in zip(specs, kinds):
        _check_stores(host.scheme_for(layer_kind), spec)  # an unknown scheme is named before any cache is made
    windows = [
        tighter(eviction, w) if isinstance(spec, LayerSpec) else None
        for spec, w in zip(specs, layer_windows or [None] * len(specs))
    ]
    caches: list[LayerCache | None] = [None] * len(specs)
    groups: dict[tuple[CacheKind, Eviction | None], list[int]] = {}
    for index, key in enumerate(zip(kinds, windows)):
        groups.setdefault(key, []).append(index)
    for (layer_kind, window), indices in groups.items():
        create = functools.partial(host.create_caches, layer_kind)
        group_specs = [specs[i] for i in indices]
        made = create(group_specs) if window is None else host.wrap_caches(window, create, group_specs)
        for i, cache in zip(indices, made):
            caches[i] = cache
    return caches


def layer_kinds(options: LoadOptions, host: PluginHost | None = None) -> Callable[[str], CacheKind]:
    """The kind ``options`` gives each layer type: ``kv_cache`` for attention, ``state_cache``
    for recurrent types, defaults looked up only when a layer of theirs asks."""
    def kind_for(layer_type: str) -> CacheKind:
        if layer_type == ATTENTION:
            return kv_cache_kind(options, host)
        return options.state_cache or (host or get_plugin_host()).parse_kv_cache(DEFAULT_STATE_CACHE)

    return kind_for


def kv_cache_kind(options: LoadOptions, host: PluginHost | None = None) -> CacheKind:
    """The scheme ``options`` gives attention layers: ``kv_cache``, or the default scheme's kind."""
    return options.kv_cache or (host or get_plugin_host()).parse_kv_cache(DEFAULT_KV_CACHE)


def _kind_for(kind, spec) -> CacheKind:
    if isinstance(kind, CacheKind):
        return kind
    if callable(kind):
        return kind(spec.layer_type)
    if spec.layer_type not in kind:
        raise ConfigError(
            f"make_layer_caches: layer {spec.layer_index} is a {spec.layer_type} layer, but no kind was given "
            f"for that type (given: {', '.join(kind)})"
        )
    return kind[spec.layer_type]


def _check_stores(scheme, spec) -> None:
    if spec.layer_type in scheme.layer_types:
        return
    if spec.layer_type == ATTENTION:
        hint = "attention layers take --kv-cache (LoadOptions.kv_cache), e.g. raw"
    else:
        hint = (f"recurrent layers take --state-cache (LoadOptions.state_cache; default {DEFAULT_STATE_CACHE}: "
                f"pip install butter-{DEFAULT_STATE_CACHE})")  # fmt: skip
    raise ConfigError(
        f"layer {spec.layer_index} is a {spec.layer_type} layer; the {scheme.name!r} scheme stores "
        f"{', '.join(scheme.layer_types)} layers only: {hint}"
    )


def _check_arguments(kind, specs, eviction, layer_windows) -> None:
    per_type = isinstance(kind, Mapping) and all(isinstance(k, CacheKind) for k in kind.values())
    if not (isinstance(kind, CacheKind) or per_type or callable(kind)):
        hint = f"; to parse the string use parse_kv_cache({kind!r})" if isinstance(kind, str) else ""
        raise ConfigError(
            f"make_layer_caches: kind must be a CacheKind (an installed scheme's kind, as parse_kv_cache returns), "
            f"got {kind!r} ({type(kind).__name__}){hint}"
        )
    if not isinstance(specs, Sequence) or not all(isinstance(spec, LayerSpec | StateSpec) for spec in specs):
        raise ConfigError(f"make_layer_caches: specs must be a list of LayerSpec (or StateSpec), one per layer; got {specs!r}")
    if eviction is not None and not isinstance(eviction, Eviction):
        raise ConfigError(f"make_layer_caches: eviction must be None, Window(max_size, keep) or a plugin's Eviction; got {eviction!r}")
    if layer_windows is not None and len(layer_windows) != len(specs):
        raise ConfigError(f"make_layer_caches: {len(layer_windows)} layer_windows for {len(specs)} specs")


def tighter(eviction: Eviction | None, layer: Window | None) -> Eviction | None:
    """What bounds a layer under ``eviction`` whose family gives it ``layer``'s window: the smaller
    window, or the family's where ``eviction`` is another policy."""
    if layer is None or eviction is None:
        return layer or eviction
    if isinstance(eviction, Window) and eviction.max_size <= layer.max_size:
        return eviction
    return layer
