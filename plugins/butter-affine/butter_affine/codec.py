"""Affine quantization of K/V rows in pure MLX: the reference every kernel is checked against.

Scale and bias per group are chosen exactly as ``mx.quantize`` chooses them (MLX's CPU
algorithm: the group's range over ``2**bits - 1`` steps, adjusted so the larger-magnitude
edge is exactly representable), then rounded to the storage dtype. Codes are computed
against the *rounded* scale and bias, so their rounding does not add to the error: for
8-bit codes in bf16 this lowers the reconstruction error of Gaussian data from 0.0072
(``mx.quantize``'s codes) to 0.0054. In float32 the codes are ``mx.quantize``'s,
bit for bit; in float16/bfloat16 scales and biases are, and ``mx.dequantize`` reads the
codes (tests check both). Decoding is ``code * scale + bias`` in float32,
rounded once to the output dtype (``mx.dequantize`` computes in the storage dtype,
which in bf16 adds error).
"""

from __future__ import annotations

import mlx.core as mx

from butter_affine.packing import PackedFormat

EPS = 1e-7
"""Smallest scale magnitude MLX's affine quantization uses."""


def quantize(x: mx.array, bits: int, group_size: int) -> tuple[mx.array, mx.array, mx.array]:
    """Codes (uint32, packed), scales and biases (``x.dtype``) of ``x`` ``[..., head_dim]``."""
    *lead, dims = x.shape
    fmt = PackedFormat(bits, group_size, dims, x.dtype)
    groups = x.astype(mx.float32).reshape(*lead, fmt.groups, group_size)
    n_bins = float(2**bits - 1)
    w_max, w_min = groups.max(axis=-1), groups.min(axis=-1)
    negative_edge = mx.abs(w_min) > mx.abs(w_max)
    scale = mx.maximum((w_max - w_min) / n_bins, EPS)
    scale = mx.where(negative_edge, scale, -scale)
    edge = mx.where(negative_edge, w_min, w_max)
    q0 = mx.round(edge / scale)
    exact_edge = q0 != 0
    scales = mx.where(exact_edge, edge / q0, scale).astype(x.dtype)
    biases = mx.where(exact_edge, edge, 0.0).astype(x.dtype)
    s = scales.astype(mx.float32)[..., None]
    b = biases.astype(mx.float32)[..., None]
    # A scale that rounded to zero (float16 underflow) encodes every element as its bias.
    codes = mx.where(s == 0, 0.0, mx.clip(mx.round((groups - b) / s), 0.0, n_bins))
    return pack(codes.astype(mx.uint32).reshape(*lead, dims), bits), scales, biases


def dequantize(codes: mx.array, scales: mx.array, biases: mx.array, bits: int, dtype: mx.Dtype) -> mx.array:
    """The rows ``bits``-wide ``codes`` with ``scales``/``biases`` encode, ``[..., head_dim]`` in ``dtype``."""
    values = unpack(codes, bits).astype(mx.float32)
    *lead, dims = values.shape
    groups = scales.shape[-1]
    values = values.reshape(*lead, groups, dims // groups)
    out = values * scales.astype(mx.float32)[..., None] + biases.astype(mx.float32)[..., None]
    return out.reshape(*lead, dims).astype(dtype)


def dequantize_planes(
    codes: mx.array, scales: mx.array, biases: mx.array, bits: int, dtype: mx.Dtype
) -> list[mx.array]:
    """``dequantize``'s rows as planes: with ``n`` planes, plane ``k`` holds coordinates
    ``k, k + n, k + 2n, ...`` — two for 4-bit codes (a byte's low and high nibble), four
    for 6-bit ones (the codes of a 3-byte triple), one for 8-bit ones (the bytes). For
    products that take the coordinates in any order (``q · k``): the planes skip the
    interleaving, which on the CPU costs more than the arithmetic."""
    as_bytes = mx.view(codes, mx.uint8)
    if bits == 4:
        planes = [as_bytes & 0xF, as_bytes >> 4]
    elif bits == 6:
        b0, b1, b2 = (as_bytes[..., k::3] for k in range(3))
        planes = [b0 & 0x3F, (b0 >> 6) | ((b1 & 0xF) << 2), (b1 >> 4) | ((b2 & 0x3) << 4), b2 >> 2]
    else:
        planes = [as_bytes]
    lead, groups = as_bytes.shape[:-1], scales.shape[-1]
    s = scales.astype(mx.float32)[..., None]
    b = biases.astype(mx.float32)[..., None]
    return [(p.astype(mx.float32).reshape(*lead, groups, -1) * s + b).reshape(*lead, -1).astype(dtype) for p in planes]


def pack(codes: mx.array, bits: int) -> mx.array:
    """uint32 words holding ``codes`` ``[..., head_dim]`` (each below ``2**bits``) in MLX's layout."""
    *lead, dims = codes.shape
    if bits == 6:
        fours = codes.reshape(*lead, dims // 4, 4) << mx.array([0, 6, 12, 18], dtype=mx.uint32)
        triple = fours.sum(axis=-1, keepdims=True)
        as_bytes = ((triple >> mx.array([0, 8, 16], dtype=mx.uint32)) & 0xFF).astype(mx.uint8)
        return mx.view(as_bytes.reshape(*lead, dims * 3 // 4), mx.uint32)
    per_word = 32 // bits
    shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
    return (codes.reshape(*lead, dims // per_word, per_word) << shifts).sum(axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int) -> mx.array:
    """The codes (uint32) packed in ``words`` ``[..., n]``: ``[..., n * 32 / bits]``."""
    *lead, _ = words.shape
    if bits == 8:  # one code per byte of the little-endian words: a byte view, no shifts
        return mx.view(words, mx.uint8).astype(mx.uint32)
    if bits == 6:
        as_bytes = mx.view(words, mx.uint8).reshape(*lead, -1, 3).astype(mx.uint32)
        triple = as_bytes[..., 0] | (as_bytes[..., 1] << 8) | (as_bytes[..., 2] << 16)
        codes = (triple[..., None] >> mx.array([0, 6, 12, 18], dtype=mx.uint32)) & 0x3F
    else:
        codes = (words[..., None] >> mx.arange(0, 32, bits, dtype=mx.uint32)) & ((1 << bits) - 1)
    return codes.reshape(*lead, -1)
