"""The shipped Lloyd–Max codebooks (``codebooks.json``, made by ``scripts/compute_codebooks.py``).

A codebook is ``2**bits`` ascending levels for a rotated coordinate divided by the root
mean square of its scale group; the group size changes the law slightly (a normalized
coordinate of a ``g``-dimensional group is bounded by ``sqrt(g)``), so there is one
codebook per bit width and group size. A group size without its own table uses the
nearest tabulated one (the laws differ by well under 1% in MSE between neighbours).
"""

from __future__ import annotations

import functools
import json
from importlib import resources

import attrs
import mlx.core as mx

from butter_core.plugin_api import ConfigError


@attrs.frozen(eq=False)
class Codebook:
    """Levels and decision boundaries of one scalar quantizer."""

    bits: int
    group: int
    mse: float
    """Mean squared error per unit variance on the distribution it was fitted to."""
    levels: tuple[float, ...]

    @property
    def boundaries(self) -> tuple[float, ...]:
        """Midpoints between neighbouring levels: a value above boundary ``i`` gets a code above ``i``."""
        return _midpoints(self.levels)

    def levels_array(self) -> mx.array:
        """The levels as float32, made once per process (a decode step passes them to the kernels)."""
        return _as_array(self.levels)

    def boundaries_array(self) -> mx.array:
        """The boundaries as float32, made once per process."""
        return _as_array(self.boundaries)


@functools.cache
def _as_array(values: tuple[float, ...]) -> mx.array:
    array = mx.array(values, dtype=mx.float32)
    mx.eval(array)
    return array


@functools.cache
def _midpoints(levels: tuple[float, ...]) -> tuple[float, ...]:
    return tuple((a + b) / 2 for a, b in zip(levels, levels[1:]))


@functools.cache
def _table() -> dict[tuple[int, int], Codebook]:
    text = resources.files("butter_aura").joinpath("codebooks.json").read_text()
    books = json.loads(text)["codebooks"].values()
    return {(b["bits"], b["group"]): Codebook(b["bits"], b["group"], b["mse"], tuple(b["levels"])) for b in books}


def available_bits() -> tuple[int, ...]:
    """Bit widths with a shipped codebook."""
    return tuple(sorted({bits for bits, _ in _table()}))


def codebook(bits: int, group: int) -> Codebook:
    """The codebook for ``bits`` per code and scale groups of ``group`` coordinates."""
    fitted = [g for b, g in _table() if b == bits]
    if not fitted:
        raise ConfigError(f"no AURA codebook for {bits}-bit codes; shipped bit widths: {available_bits()}")
    nearest = min(fitted, key=lambda g: (abs(g - group), g))
    return _table()[bits, nearest]
