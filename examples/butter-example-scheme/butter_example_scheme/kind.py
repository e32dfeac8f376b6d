"""``FP8``: the configuration of this scheme, a ``CacheKind`` defined outside butter-core."""

from __future__ import annotations

from typing import ClassVar

import attrs

from butter_core.plugin_api import CacheKind, one_of

SCALE_DTYPES = ("float16", "float32")
"""Dtypes a per-vector scale may be stored in. float16 is the default: with codes
computed against the stored (rounded) scale it loses nothing measurable for vectors
whose absmax is above ~1e-3 (see the README); float32 is there for models whose K/V
vectors are tiny enough for a float16 scale to go subnormal."""


@attrs.frozen
class FP8(CacheKind):
    """Keys and values as fp8 E4M3 codes with one scale per (batch, head, position) vector.

    CLI strings: ``fp8`` (float16 scales) and ``fp8-scale-float32``.
    """

    scheme: ClassVar[str] = "fp8"
    scale_dtype: str = attrs.field(default="float16", validator=one_of("scale_dtype", SCALE_DTYPES))

    def __str__(self) -> str:
        return "fp8" if self.scale_dtype == "float16" else f"fp8-scale-{self.scale_dtype}"


NAMES: dict[str, FP8] = {str(kind): kind for kind in (FP8(dtype) for dtype in SCALE_DTYPES)}
"""Every CLI string this scheme accepts, with the kind it parses to."""


def parse(text: str) -> FP8 | None:
    """The kind a CLI string names, or None when the string is not this scheme's."""
    return NAMES.get(text)
