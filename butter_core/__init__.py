"""butter: an MLX LLM inference engine whose KV cache is a plugin system."""

from butter_core import cpu_blas  # noqa: F401 - must run before anything imports mlx.core

from butter_core.cache import LayerCache, LayerSpec, SlotCache, reference_attention
from butter_core.config import CacheKind, Eviction, LoadOptions, Window
from butter_core.errors import ButterError, ConfigError, ModelLoadError, PluginError, UnknownSchemeError
from butter_core.hookspecs import hookimpl
from butter_core.layer_caches import make_layer_caches
from butter_core.plugins import get_plugin_host
from butter_core.registry import CacheScheme, EvictionPolicy


def parse_kv_cache(text: str) -> CacheKind:
    """The cache kind a CLI string (``raw``, ``affine4``, ``aura4v2``...) names, among installed schemes."""
    return get_plugin_host().parse_kv_cache(text)


__all__ = [
    "ButterError",
    "CacheKind",
    "CacheScheme",
    "ConfigError",
    "Eviction",
    "EvictionPolicy",
    "LayerCache",
    "LayerSpec",
    "LoadOptions",
    "ModelLoadError",
    "PluginError",
    "SlotCache",
    "UnknownSchemeError",
    "Window",
    "get_plugin_host",
    "hookimpl",
    "make_layer_caches",
    "parse_kv_cache",
    "reference_attention",
]
