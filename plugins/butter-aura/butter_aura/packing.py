"""Codes of ``bits`` bits packed into uint32 words as one little-endian bit stream.

Code ``j`` of a row occupies bits ``[j * bits, (j + 1) * bits)`` of the stream; word
``w`` holds stream bits ``[32 w, 32 w + 32)``, least significant first. For 2, 4 and 8
bits no code straddles two words (``32 / bits`` codes per word); for 3 bits some do.
A row of ``n`` codes takes ``ceil(n * bits / 32)`` words; unused high bits of the last
word are zero. Rows are packed from scratch every time, so a slot that is re-encoded
(window eviction) holds no stale bits.
"""

from __future__ import annotations

import mlx.core as mx

PACKED_BITS = (2, 3, 4, 8)


def words_per_row(n: int, bits: int) -> int:
    """uint32 words holding ``n`` codes of ``bits`` bits."""
    return -(-n * bits // 32)


def pack(codes: mx.array, bits: int) -> mx.array:
    """Pack integer codes ``[..., n]`` (each below ``2**bits``) into uint32 ``[..., words_per_row(n, bits)]``."""
    if bits not in PACKED_BITS:
        raise ValueError(f"codes are packed at {PACKED_BITS} bits; got {bits}")
    lead, n = codes.shape[:-1], codes.shape[-1]
    words = words_per_row(n, bits)
    codes = codes.astype(mx.uint32)
    if 32 % bits == 0:
        per_word = 32 // bits
        if n % per_word:
            codes = mx.concatenate([codes, mx.zeros((*lead, words * per_word - n), mx.uint32)], axis=-1)
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        return mx.sum(codes.reshape(*lead, words, per_word) << shifts, axis=-1).astype(mx.uint32)
    # General case: spell out each code's bits, lay them end to end, regroup by 32.
    stream = (codes[..., None] >> mx.arange(bits, dtype=mx.uint32)) & 1
    stream = stream.reshape(*lead, n * bits)
    pad = words * 32 - n * bits
    if pad:
        stream = mx.concatenate([stream, mx.zeros((*lead, pad), mx.uint32)], axis=-1)
    weights = mx.array(1, mx.uint32) << mx.arange(32, dtype=mx.uint32)
    return mx.sum(stream.reshape(*lead, words, 32) * weights, axis=-1).astype(mx.uint32)


def unpack(words: mx.array, bits: int, n: int) -> mx.array:
    """The first ``n`` codes (uint32 ``[..., n]``) of packed rows ``[..., words]``."""
    if bits not in PACKED_BITS:
        raise ValueError(f"codes are packed at {PACKED_BITS} bits; got {bits}")
    lead, count = words.shape[:-1], words.shape[-1]
    mask = (1 << bits) - 1
    if 32 % bits == 0:
        shifts = mx.arange(0, 32, bits, dtype=mx.uint32)
        codes = (words[..., None] >> shifts) & mask
        return codes.reshape(*lead, count * (32 // bits))[..., :n]
    # 3 bits: 32 codes per 3 words. Code j of a triple starts at bit 3 j of its 96 bits;
    # codes 0-20 lie within words 0-1 (bits 0-62), codes 21-31 within words 1-2.
    triples = -(-count // 3)
    wide = words.astype(mx.uint64)
    if triples * 3 > count:
        wide = mx.concatenate([wide, mx.zeros((*lead, triples * 3 - count), mx.uint64)], axis=-1)
    wide = wide.reshape(*lead, triples, 3)
    low = wide[..., 0] | (wide[..., 1] << 32)
    high = wide[..., 1] | (wide[..., 2] << 32)
    codes = mx.concatenate([
        low[..., None] >> mx.arange(0, 63, 3, dtype=mx.uint64),
        high[..., None] >> mx.arange(31, 64, 3, dtype=mx.uint64),
    ], axis=-1) & mask
    return codes.reshape(*lead, triples * 32)[..., :n].astype(mx.uint32)
