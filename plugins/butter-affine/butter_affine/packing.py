"""How affine-quantized rows are laid out: MLX's own packing, described once.

A row is one head's ``head_dim`` values at one position. It is stored as

* ``codes``: ``head_dim * bits / 32`` uint32 words. Code ``j`` occupies bits
  ``[j * bits, (j + 1) * bits)`` of the row's little-endian bit stream. For 4 and 8 bits
  that is ``mx.quantize``'s word packing; for 6 bits it is its byte packing (four codes
  in three bytes), read as words. ``mx.dequantize`` and ``mx.quantized_matmul`` read
  these arrays as they are.
* ``scales`` and ``biases``: one value per group of ``group_size`` consecutive
  elements, in the model's dtype; element ``x`` decodes as ``code * scale + bias``.

``PackedFormat`` gives the sizes; ``BUFFERS`` names the six per-layer arrays, and
``STACKS`` how a cache keeps them: the two code buffers in one array, the four scale
and bias buffers in another, so an append writes two arrays, not six.
"""

from __future__ import annotations

import functools

import attrs
import mlx.core as mx

from butter_core.plugin_api import ConfigError

BUFFERS = ("key_codes", "key_scales", "key_biases", "value_codes", "value_scales", "value_biases")
"""The six arrays an affine layer cache holds, each ``[batch, n_kv_heads, slots, width]``."""

STACKS = {
    "codes": ("key_codes", "value_codes"),
    "scales_biases": ("key_scales", "key_biases", "value_scales", "value_biases"),
}
"""Stack name -> its buffers (``butter_core.slots.Stacks``): what ``quantize`` hands the cache,
each ``[n, batch, n_kv_heads, tokens, width]``."""

CODE_BITS = (4, 6, 8)


def stack(rows: dict[str, mx.array]) -> dict[str, mx.array]:
    """Rows by buffer name -> rows by stack (``STACKS``)."""
    return {name: mx.stack([rows[member] for member in members]) for name, members in STACKS.items()}


def stack_quantized_pair(codes: mx.array, scales: mx.array, biases: mx.array) -> dict[str, mx.array]:
    """Rows by stack (``STACKS``) from keys and values quantized together, each output with
    a leading axis of 2 (keys, values): the codes are the codes stack as they come; scales
    and biases interleave into (key scale, key bias, value scale, value bias)."""
    return {"codes": codes, "scales_biases": mx.stack([scales, biases], axis=1).reshape(4, *scales.shape[1:])}


@attrs.frozen
class PackedFormat:
    """Sizes of one packed row for ``bits`` per code, groups of ``group_size``, ``head_dim`` values."""

    bits: int
    group_size: int
    head_dim: int
    dtype: mx.Dtype

    def __attrs_post_init__(self):
        if self.bits not in CODE_BITS:
            raise ConfigError(f"affine codes are {CODE_BITS} bits wide; got {self.bits}")
        if self.head_dim % self.group_size or self.group_size % 32:
            raise ConfigError(
                f"affine group_size {self.group_size} must be a multiple of 32 that divides head_dim {self.head_dim}"
            )

    @classmethod
    def of(cls, codes: mx.array, scales: mx.array, head_dim: int) -> PackedFormat:
        """The format a packed codes/scales pair of arrays is in (read from their shapes)."""
        words, groups = codes.shape[-1], scales.shape[-1]
        if (words * 32) % head_dim or head_dim % groups:
            raise ValueError(f"codes {codes.shape} / scales {scales.shape} do not pack rows of {head_dim} values")
        return packed_format(words * 32 // head_dim, head_dim // groups, head_dim, scales.dtype)

    @property
    def words(self) -> int:
        """uint32 words of codes per row."""
        return self.head_dim * self.bits // 32

    @property
    def groups(self) -> int:
        """Scale/bias pairs per row."""
        return self.head_dim // self.group_size

    @property
    def row_bytes(self) -> int:
        """Bytes of one row: codes, scales and biases."""
        return self.words * 4 + 2 * self.groups * self.dtype.size

    @property
    def bits_per_element(self) -> float:
        """Stored bits per K or V element, scales and biases included."""
        return self.row_bytes * 8 / self.head_dim

    def buffer_layout(self) -> dict[str, tuple[int, mx.Dtype]]:
        """Name -> (row width, dtype) of the six buffers, for ``butter_core.slots.SlotBuffers``."""
        layout = {}
        for side in ("key", "value"):
            layout[f"{side}_codes"] = (self.words, mx.uint32)
            layout[f"{side}_scales"] = (self.groups, self.dtype)
            layout[f"{side}_biases"] = (self.groups, self.dtype)
        return layout


@functools.lru_cache(maxsize=256)
def packed_format(bits: int, group_size: int, head_dim: int, dtype: mx.Dtype) -> PackedFormat:
    """``PackedFormat(...)``, made once per distinct format (a decode step asks for one per layer
    and kernel call)."""
    return PackedFormat(bits, group_size, head_dim, dtype)
