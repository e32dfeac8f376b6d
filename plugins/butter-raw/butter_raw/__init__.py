"""butter-raw: the default KV cache, keys and values stored unquantized."""

from butter_core.plugin_api import CacheScheme, hookimpl
from butter_raw.cache import RawCache
from butter_raw.kind import Raw

_NAMES = {"raw": Raw(), **{f"raw-{dtype}": Raw(dtype) for dtype in ("float16", "bfloat16", "float32")}}


def parse(text: str) -> Raw | None:
    """``raw`` (model dtype) or ``raw-float16`` / ``raw-bfloat16`` / ``raw-float32``."""
    return _NAMES.get(text)


def create(kind: Raw, specs) -> list[RawCache]:
    return [RawCache(spec, kind) for spec in specs]


def kernel_checks():
    from butter_raw.kernels import KERNEL_CHECKS

    return KERNEL_CHECKS


@hookimpl
def butter_register_cache_schemes(register):
    register(
        CacheScheme(
            name="raw",
            kind_type=Raw,
            parse=parse,
            create=create,
            examples=tuple(_NAMES),
            description="unquantized K/V in the model dtype (default)",
            kernel_checks=kernel_checks,
        )
    )
__all__ = ["Raw", "RawCache", "butter_register_cache_schemes", "parse"]
