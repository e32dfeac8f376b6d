"""butter-aura: AURA rotated-codebook KV cache compression (``aura4v2``, ``aura4v4``, ``aura8v4``, ...).

Keys and values are rotated per layer and KV head by a randomized Hadamard transform,
then each coordinate is coded against a Lloyd–Max codebook with ``kbits``/``vbits``
bits; decode attention runs on the codes. See docs/aura.md for the design and the
measurements behind it.
"""

from __future__ import annotations

import re

from butter_core.plugin_api import CacheScheme, ConfigError, PrefillPipeline, hookimpl

from butter_aura.cache import AuraCache
from butter_aura.codebooks import available_bits
from butter_aura.kind import Aura

_NAME = re.compile(r"aura\d+v\d+")

EXAMPLES = ("aura4v2", "aura4v4", "aura8v4", "aura8v8", "aura3v2", "aura2v2")
"""CLI strings listed by ``butter plugins``; any aura{k}v{v} with k, v among the shipped
codebooks' bit widths parses."""


def parse(text: str) -> Aura | None:
    """The kind an ``aura{kbits}v{vbits}`` string names, or None when the string is not AURA's.

    A string of that shape with unsupported bit widths is a ConfigError that lists the valid ones.
    """
    if not _NAME.fullmatch(text):
        return None
    kind = Aura.named(text)
    missing = {kind.key_bits, kind.value_bits} - set(available_bits())
    if missing:
        raise ConfigError(f"{text}: no AURA codebook for {sorted(missing)}-bit codes; shipped: {available_bits()}")
    return kind


def create(kind: Aura, specs) -> list[AuraCache]:
    """One cache per attention layer; GPU kernels where MLX's default device is a GPU that can run them;
    one ``PrefillPipeline`` shared by the layers (few layers' dequantized K/V alive at once in a prefill)."""
    from butter_aura.kernels import ops_for

    pipeline = PrefillPipeline()
    return [AuraCache(spec, kind, ops=ops_for(spec), pipeline=pipeline) for spec in specs]


def kernel_checks():
    """AURA's GPU kernels with their pure-mx references, for the conformance suite."""
    from butter_aura.kernels import KERNEL_CHECKS

    return KERNEL_CHECKS


@hookimpl
def butter_register_cache_schemes(register):
    register(
        CacheScheme(
            name=Aura.scheme,
            kind_type=Aura,
            parse=parse,
            create=create,
            examples=EXAMPLES,
            description="rotated Lloyd-Max codes, independent K/V bit widths; decode attention on the codes",
            kernel_checks=kernel_checks,
            # aura4v2 on the tiny models: 1.1e-4 to 1.4e-4 measured. Their 36-token
            # sequences fit the 36-row full-precision budget, so this bounds the 16-bit
            # rows only; the codes are checked by the conformance suite and on a real
            # model by bench/aura_design.py.
            model_tolerance=2e-3,
        )
    )


__all__ = ["Aura", "AuraCache", "butter_register_cache_schemes", "parse"]
