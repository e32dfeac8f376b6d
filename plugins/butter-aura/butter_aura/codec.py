"""The AURA codec in pure mx: rotated vectors to packed codes and scales, and back.

This is the reference every AURA kernel is checked against and the path used where no
GPU backend exists. Vectors arrive already rotated (``rotation.py``); the codec sees the
last axis (``head_dim`` long) split into scale groups of ``group`` coordinates. A group
``y`` is coded as

* ``t = y / rms(y)``: near the law the codebook was fitted to;
* ``code_j = #{boundaries < t_j}``: the nearest level, by a ``bits``-step binary search;
* ``scale = <y, c> / <c, c>`` with ``c`` the chosen levels: the least-squares scale for
  those codes (it lowers the error of every configuration measured, docs/aura.md),
  stored as float16.

A group decodes as ``scale * levels[code]``. An all-zero group gets scale 0 and decodes
to zero.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import mlx.core as mx

from butter_aura import packing
from butter_aura.codebooks import Codebook, codebook

SCALE_DTYPE = mx.float16
_FLOAT16_MAX = 65504.0


@attrs.frozen(eq=False)
class Codec:
    """One tensor's coding: ``bits`` per coordinate, one scale per ``group`` coordinates of ``head_dim``."""

    bits: int
    group: int
    head_dim: int
    book: Codebook = attrs.field()
    fields: tuple = attrs.field(init=False, repr=False)
    """``(bits, group, head_dim, book)``, made once: equal for equal codings, so functions traced for
    a coding are cached by it (every layer's codec shares them) without rebuilding it each call;
    ``Codec(*fields)`` makes the codec again."""

    @book.default
    def _book(self) -> Codebook:
        return codebook(self.bits, self.group)

    def __attrs_post_init__(self):
        if self.head_dim % self.group:
            raise ValueError(f"scale group {self.group} does not divide head_dim {self.head_dim}")
        object.__setattr__(self, "fields", (self.bits, self.group, self.head_dim, self.book))

    @property
    def words(self) -> int:
        """uint32 words of one coded vector."""
        return packing.words_per_row(self.head_dim, self.bits)

    @property
    def groups(self) -> int:
        """Scales of one coded vector."""
        return self.head_dim // self.group

    @property
    def bytes_per_vector(self) -> int:
        return 4 * self.words + SCALE_DTYPE.size * self.groups

    def encode(self, rotated: mx.array) -> tuple[mx.array, mx.array]:
        """Codes (uint32 ``[..., words]``) and scales (float16 ``[..., groups]``) of rotated vectors ``[..., head_dim]``."""
        return self.encode_with(
            rotated,
            lambda t: nearest_level(t, self.book.boundaries_array(), self.bits),
            lambda index: mx.take(self.book.levels_array(), index),
        )

    def encode_with(
        self,
        rotated: mx.array,
        find_codes: Callable[[mx.array], mx.array],
        levels_of: Callable[[mx.array], mx.array],
    ) -> tuple[mx.array, mx.array]:
        """``encode`` with the two look-ups supplied: ``find_codes(t)``, the nearest level's
        code of each normalized coordinate (uint32), and ``levels_of(codes)``, their levels
        (float32). The CPU path (``butter_aura.cpu``) passes compiled versions."""
        codes, scales = self.codes_and_scales(rotated, find_codes, levels_of)
        return packing.pack(codes, self.bits), scales

    def codes_and_scales(
        self,
        rotated: mx.array,
        find_codes: Callable[[mx.array], mx.array],
        levels_of: Callable[[mx.array], mx.array],
    ) -> tuple[mx.array, mx.array]:
        """``encode_with`` before packing: the codes (uint32 ``[..., head_dim]``) and scales.

        Only the scale groups' shape comes from this codec: given look-ups that code each
        of a leading axis's entries with its own codebook, one call codes keys and values
        stacked (``butter_aura.cpu``'s one-token encode).
        """
        lead = rotated.shape[:-1]
        y = rotated.astype(mx.float32).reshape(*lead, self.groups, self.group)
        rms = mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True))
        t = y / mx.where(rms > 0, rms, 1.0)
        index = find_codes(t)
        chosen = levels_of(index)
        scale = mx.sum(y * chosen, axis=-1) / mx.maximum(mx.sum(chosen * chosen, axis=-1), 1e-30)
        scale = mx.clip(scale, -_FLOAT16_MAX, _FLOAT16_MAX).astype(SCALE_DTYPE)
        return index.reshape(*lead, self.head_dim), scale

    def decode(self, codes: mx.array, scales: mx.array) -> mx.array:
        """Rotated vectors ``[..., head_dim]`` (float32) that ``codes`` and ``scales`` encode."""
        lead = codes.shape[:-1]
        index = packing.unpack(codes, self.bits, self.head_dim).reshape(*lead, self.groups, self.group)
        values = mx.take(self.book.levels_array(), index) * scales.astype(mx.float32)[..., None]
        return values.reshape(*lead, self.head_dim)


def nearest_level(
    t: mx.array, boundaries: mx.array, bits: int, take: Callable[[mx.array, mx.array], mx.array] = mx.take
) -> mx.array:
    """Per element, the number of ``boundaries`` (ascending, ``2**bits - 1`` of them) below it,
    as uint32, by binary search; ``take(table, index)`` reads the boundaries (the CPU path
    passes a faster look-up)."""
    index = mx.zeros(t.shape, dtype=mx.uint32)
    step = 1 << (bits - 1)
    while step:
        probe = take(boundaries, (index + (step - 1)).astype(mx.int32))
        index = index + mx.where(t > probe, step, 0).astype(mx.uint32)
        step >>= 1
    return index
