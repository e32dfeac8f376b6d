"""``Raw``: the configuration of butter-raw's caches (which float dtype keys and values are kept in)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from butter_core.plugin_api import CacheKind, one_of

MODEL_DTYPE = None
CACHE_DTYPES = (MODEL_DTYPE, "float16", "bfloat16", "float32")


@attrs.frozen
class Raw(CacheKind):
    """Unquantized K/V in the model's dtype (``dtype=None``) or an explicit float dtype."""

    scheme: ClassVar[str] = "raw"
    dtype: str | None = attrs.field(default=MODEL_DTYPE, validator=one_of("dtype", CACHE_DTYPES))

    def __str__(self) -> str:
        return "raw" if self.dtype is None else f"raw-{self.dtype}"
