"""butter-affine: affine-quantized KV caches (affine8, affine6, affine4, affine{bits}g{group}).

The kind, ``Affine``, is defined here (``butter_affine.kind``); this distribution parses its
CLI strings, creates ``AffineCache`` layers and ships the scheme's GPU kernels with their checks.
"""

from __future__ import annotations

import re

from butter_core.plugin_api import CacheScheme, PrefillPipeline, hookimpl

from butter_affine.cache import AffineCache
from butter_affine.kind import AFFINE_BITS, Affine

__all__ = ["Affine", "AffineCache", "butter_register_cache_schemes", "parse"]

_NAME = re.compile(r"affine(\d+)(?:g(\d+))?")
EXAMPLES = ("affine4", "affine6", "affine8", "affine4g64", "affine8g32")


def parse(text: str) -> Affine | None:
    """``affine{bits}`` (default group size: 64 for 8 bits, 32 otherwise) or ``affine{bits}g{group}``.

    Returns None for strings that are not this scheme's; a string of this form with an
    unsupported width or group size raises ``ConfigError`` saying what is valid.
    """
    match = _NAME.fullmatch(text)
    if not match:
        return None
    bits = int(match[1])
    return Affine(bits) if match[2] is None else Affine(bits, int(match[2]))


def create(kind: Affine, specs) -> list[AffineCache]:
    """One cache per attention layer, sharing one ``PrefillPipeline`` (the seed's shared working buffer)."""
    pipeline = PrefillPipeline()
    return [AffineCache(spec, kind, pipeline) for spec in specs]


def kernel_checks():
    """The scheme's GPU kernels with their pure-mx references, for the conformance suite."""
    from butter_affine.kernels import KERNEL_CHECKS

    return KERNEL_CHECKS


@hookimpl
def butter_register_cache_schemes(register):
    register(
        CacheScheme(
            name=Affine.scheme,
            kind_type=Affine,
            parse=parse,
            create=create,
            examples=EXAMPLES,
            description=f"affine-quantized K/V, {'/'.join(map(str, AFFINE_BITS))}-bit codes with per-group scale and bias",
            kernel_checks=kernel_checks,
            model_tolerance=0.12,  # affine4 on the tiny models: 0.053-0.064 measured
        )
    )
