"""AURA's three operations in pure mx, fast on the CPU: the path wherever no GPU kernel applies.

Same signatures and results as ``butter_aura.reference`` (to float32 rounding; codes
identical but for coordinates within a rounding of a decision boundary), which stays the
readable reference that this module and the kernels are checked against. On the CPU a
decode step costs MLX's per-op overhead plus elementwise work, and MLX's general gather
(``mx.take``) costs ~25 elementwise ops per element. Hence:

* the rotation is a sign flip and one matmul (``Rotation.mixing_matrix``) instead of
  ``log2(head_dim)`` butterfly stages;
* codes are counted as a compiled sum of comparisons with the boundaries (the count the
  reference's binary search finds), and a decode step's one-token encode runs compiled,
  keys and values stacked so that each reduction and look-up runs once for both
  (``_compiled_joint_encoder``);
* codes become levels through ``mx.take_along_axis`` on a table broadcast to the codes'
  rank, not ``mx.take`` nor a compiled tree of selects: on MLX's CPU it is the fastest of
  the three per element. 2- and 4-bit codes are read straight from the words' bytes into
  *planes* (plane ``k`` of ``n`` holds coordinates ``k, k + n, ...``) by one 256-entry
  table per plane, indexed by the byte itself, which products use as they are;
* decode attention reads the codes of the span between the sinks and the recent ring
  (the full-precision slots are known on the host: ``StoredLayer.full_precision_slots``)
  and the full-precision rows as they are, under one softmax, instead of gathering the
  rows to full length; a scale per vector multiplies ``[query, slot]`` products rather
  than every decoded coordinate.

Measurements: docs/benchmarks.md, "plugins/butter-aura/butter_aura/cpu.py", and
docs/aura.md, "The CPU path".
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable

import mlx.core as mx

from butter_core.plugin_api import softmax_for

from butter_aura import packing
from butter_aura.codebooks import Codebook
from butter_aura.codec import Codec, nearest_level
from butter_aura.layout import by_name
from butter_aura.rotation import Rotation
from butter_aura.stored import StoredLayer

MAX_SELECT_BITS = 4
"""Widest codes coded by a compiled sum of comparisons (``_compiled_count``). Wider codes
(255 comparisons per element: no faster, and a kernel that took 80 s to compile) use
broadcast comparisons or the binary search."""

COMPARISONS_AT_ONCE = 1 << 20
"""Largest ``elements × boundaries`` that ``_nearest_level`` codes by one broadcast
comparison when codes are wider than ``MAX_SELECT_BITS``."""


# -- encode ------------------------------------------------------------------------


def encode(
    keys: mx.array, values: mx.array, rotation: Rotation, key_codec: Codec, value_codec: Codec
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """Key codes, key scales, value codes, value scales of ``[batch, kv_heads, tokens, head_dim]`` rows.

    A decode step's single token runs compiled (``_compiled_joint_encoder``, or
    ``_compiled_encoder`` where the codecs' scale groups differ or the stacked comparisons
    would be many); longer chunks, whose lengths vary and whose ops are shared by many
    rows, run op by op.
    """
    signs, mixing = _signs(rotation), rotation.mixing_matrix()
    if keys.shape[2] == 1:
        fields = key_codec.fields, value_codec.fields
        widest = max(len(key_codec.book.boundaries), len(value_codec.book.boundaries))
        if key_codec.group == value_codec.group and 2 * keys.size * widest <= COMPARISONS_AT_ONCE:
            return _compiled_joint_encoder(*fields)(keys, values, signs, mixing)
        return _compiled_encoder(*fields)(keys, values, signs, mixing)
    return _rotate_and_code(keys, values, signs, mixing, key_codec, value_codec)


def encode_rows(
    keys: mx.array, values: mx.array, rotation: Rotation, key_codec: Codec, value_codec: Codec
) -> dict[str, mx.array]:
    """``encode``'s rows by slot-buffer name, as ``AuraCache`` writes them."""
    return by_name(encode(keys, values, rotation, key_codec, value_codec))


def _rotate_and_code(
    keys: mx.array, values: mx.array, signs: mx.array, mixing: mx.array, key_codec: Codec, value_codec: Codec
) -> tuple[mx.array, mx.array, mx.array, mx.array]:
    """``encode`` given the rotation as signs and mixing matrix (``_rotated``)."""
    key_codes, key_scales = _code(key_codec, _rotated(keys, signs, mixing))
    value_codes, value_scales = _code(value_codec, _rotated(values, signs, mixing))
    return key_codes, key_scales, value_codes, value_scales


@functools.cache
def _compiled_encoder(key_fields: tuple, value_fields: tuple) -> Callable:
    """``_rotate_and_code`` compiled for one pair of codecs, named by their fields so that every layer shares it."""
    coder = functools.partial(_rotate_and_code, key_codec=Codec(*key_fields), value_codec=Codec(*value_fields))
    return mx.compile(coder)


@functools.cache
def _compiled_joint_encoder(key_fields: tuple, value_fields: tuple) -> Callable:
    """``_rotate_and_code`` for one token, compiled, with keys and values stacked on a
    leading axis: each is coded with its own codebook (the boundaries padded with +inf and
    the levels with 0 to one width), so the rotation, every reduction and the level look-up
    run once for both. Same codes and scales as coding each apart, in less time
    (measurements: docs/benchmarks.md, "plugins/butter-aura/butter_aura/cpu.py"). The two codecs must share their
    scale groups."""
    key_codec, value_codec = Codec(*key_fields), Codec(*value_fields)
    books = (key_codec.book, value_codec.book)
    bounds = _stacked_table([book.boundaries for book in books], mx.inf)
    levels = _stacked_table([book.levels for book in books], 0.0)

    def coder(keys, values, signs, mixing):
        codes, scales = key_codec.codes_and_scales(
            _rotated(mx.stack([keys, values]), signs, mixing),
            lambda t: mx.sum(t[..., None] > _per_entry(bounds, t.ndim + 1), axis=-1).astype(mx.uint32),
            lambda index: mx.take_along_axis(_per_entry(levels, index.ndim), index, axis=-1),
        )
        return (packing.pack(codes[0], key_codec.bits), scales[0],
                packing.pack(codes[1], value_codec.bits), scales[1])

    return mx.compile(coder)


def _stacked_table(rows: list[tuple[float, ...]], pad: float) -> mx.array:
    """``rows`` as one float32 ``[len(rows), widest]`` table, each padded with ``pad``."""
    width = max(len(row) for row in rows)
    table = mx.array([list(row) + [pad] * (width - len(row)) for row in rows], dtype=mx.float32)
    mx.eval(table)
    return table


def _per_entry(table: mx.array, ndim: int) -> mx.array:
    """``table`` ``[entries, n]`` shaped to broadcast against ``ndim``-rank arrays whose first
    axis runs over the entries and whose last over ``n``."""
    return table.reshape((table.shape[0],) + (1,) * (ndim - 2) + (table.shape[1],))


def _code(codec: Codec, rotated: mx.array) -> tuple[mx.array, mx.array]:
    """``codec.encode(rotated)``, with the levels found by ``_nearest_level`` and looked up by ``_levels_of``."""
    return codec.encode_with(rotated, lambda t: _nearest_level(t, codec.book), lambda index: _levels_of(codec.book, index))


def _nearest_level(t: mx.array, book: Codebook) -> mx.array:
    """``codec.nearest_level``: per element, the number of ``book``'s boundaries below it.

    Up to ``MAX_SELECT_BITS`` a compiled sum of comparisons (``_compiled_count``); wider
    codes by one broadcast comparison against every boundary where that is small (a
    decode step's token), else by the codec's binary search, which allocates less.
    """
    if book.bits <= MAX_SELECT_BITS:
        return _compiled_count(book)(t)
    boundaries = book.boundaries_array()
    if t.size * boundaries.size > COMPARISONS_AT_ONCE:
        return nearest_level(t, boundaries, book.bits, take=_lookup)
    return mx.sum(t[..., None] > boundaries, axis=-1)


@functools.cache
def _compiled_count(book: Codebook) -> Callable[[mx.array], mx.array]:
    """Per element, the number of ``book``'s boundaries below it (uint32), in one shapeless kernel."""
    return mx.compile(
        lambda t: functools.reduce(mx.add, [(t > boundary).astype(mx.uint32) for boundary in book.boundaries]),
        shapeless=True,
    )


# -- rotation -------------------------------------------------------------------------


def _signs(rotation: Rotation) -> mx.array:
    """The rotation's signs shaped to multiply ``[..., heads, rows, head_dim]`` arrays."""
    return rotation.signs[:, None, :]


def _rotated(x: mx.array, signs: mx.array, mixing: mx.array) -> mx.array:
    """``Rotation.apply``: ``(x * signs) @ M``, float32."""
    return (x.astype(mx.float32) * signs) @ mixing


def _unrotated(y: mx.array, signs: mx.array, mixing: mx.array) -> mx.array:
    """``Rotation.invert``: ``(y @ Mᵀ) * signs``."""
    return (y @ mixing.swapaxes(-1, -2)) * signs


# -- decoding codes ------------------------------------------------------------------


def _level_planes(codec: Codec, codes: mx.array) -> list[mx.array]:
    """The levels (float32) of packed code words ``[..., words]``, as planes.

    With ``n`` planes, plane ``k`` ``[..., head_dim // n]`` holds coordinates ``k, k + n,
    k + 2n, ...``: the packing is one little-endian bit stream, so each byte of the words
    holds ``n = 8 // bits`` whole 2-, 4- or 8-bit codes, and plane ``k`` is one look-up of
    every byte in a table of the level of its ``k``-th code (``_byte_table``), without
    the strided copy that interleaving them would cost. 3-bit codes, which straddle
    bytes, are unpacked first (one plane).
    """
    book, dims = codec.book, codec.head_dim
    per_byte = 8 // book.bits
    if 8 % book.bits or dims % per_byte:
        return [_levels_of(book, packing.unpack(codes, book.bits, dims))]
    code_bytes = codes.view(mx.uint8)
    planes = [_lookup(_byte_table(book, shift), code_bytes) for shift in range(0, 8, book.bits)]
    width = dims // per_byte
    return planes if code_bytes.shape[-1] == width else [plane[..., :width] for plane in planes]


def _levels_of(book: Codebook, codes: mx.array) -> mx.array:
    """``book.levels_array()[codes]`` for integer ``codes`` (``_lookup``)."""
    return _lookup(book.levels_array(), codes)


def _lookup(table: mx.array, index: mx.array) -> mx.array:
    """``table[index]`` by ``mx.take_along_axis`` on ``table`` shaped to ``index``'s rank
    (broadcast over its other axes): MLX's fast path for a small table (module docstring)."""
    return mx.take_along_axis(table.reshape((1,) * (index.ndim - 1) + (-1,)), index, axis=-1)


@functools.cache
def _byte_table(book: Codebook, shift: int) -> mx.array:
    """For each byte value ``b``, the level of the code in bits ``[shift, shift + bits)`` of ``b`` (float32, 256 entries)."""
    mask = (1 << book.bits) - 1
    table = mx.array([book.levels[(b >> shift) & mask] for b in range(256)], dtype=mx.float32)
    mx.eval(table)
    return table


def _decoded_planes(codec: Codec, codes: mx.array, scales: mx.array) -> tuple[list[mx.array], mx.array | None]:
    """Decoded rotated vectors of ``codes`` and ``scales`` as planes (``_level_planes``), and their scales if left out.

    With one scale per vector the planes hold bare levels and the scales (float32
    ``[..., length]``) come back separately, to multiply ``[query, slot]`` products or
    decoded rows; with scale groups the one plane returned holds whole scaled vectors and
    the second result is None.
    """
    planes = _level_planes(codec, codes)
    scales = scales.astype(mx.float32)
    if codec.groups == 1:
        return planes, scales[..., 0]
    rows = _interleaved(planes)
    lead = rows.shape[:-1]
    return [(rows.reshape(*lead, codec.groups, codec.group) * scales[..., None]).reshape(*lead, codec.head_dim)], None


def _interleaved(planes: list[mx.array]) -> mx.array:
    """The vectors ``planes`` hold, coordinates in order (a strided copy: only where the order matters)."""
    return planes[0] if len(planes) == 1 else mx.flatten(mx.stack(planes, axis=-1), -2, -1)


def _times_transposed(x: mx.array, planes: list[mx.array]) -> mx.array:
    """``x @ rowsᵀ`` for ``x`` ``[..., m, head_dim]`` and rows given as planes: ``[..., m, length]``."""
    n = len(planes)
    return functools.reduce(mx.add, [x[..., k::n] @ plane.swapaxes(-1, -2) for k, plane in enumerate(planes)])


def _weighted_sum(weights: mx.array, planes: list[mx.array]) -> mx.array:
    """``weights @ rows`` for ``weights`` ``[..., m, length]`` and rows given as planes: ``[..., m, head_dim]``."""
    return _interleaved([weights @ plane for plane in planes])


def _rows_times(planes: list[mx.array], matrix: mx.array) -> mx.array:
    """``rows @ matrix`` for rows given as planes and ``matrix`` ``[..., head_dim, d]``."""
    n = len(planes)
    if n == 1:
        return planes[0] @ matrix
    return mx.concatenate(planes, axis=-1) @ mx.concatenate([matrix[..., k::n, :] for k in range(n)], axis=-2)


def _with_row_scales(products: mx.array, row_scales: mx.array | None) -> mx.array:
    """``[..., query, slot]`` products times the slots' scales where ``_decoded_planes`` left them out."""
    return products if row_scales is None else products * row_scales[..., None, :]


# -- decode attention -------------------------------------------------------------------


def decode_attention(queries: mx.array, stored: StoredLayer, scale: float) -> mx.array:
    """``softmax(q kᵀ · scale) v`` over the live slots for ``queries`` ``[batch, q_heads, 1, head_dim]``.

    Accumulates in float32; returns the queries' dtype. One softmax over two parts
    (either may be empty, and is then skipped): the codes of the span of slots between
    the sinks and the recent ring (``_coded_part``) and the full-precision rows
    (``_full_precision_part``). The softmax is ``butter_core.cpu_attention.softmax_for``'s
    (from 512 slots in base 2, the scores scaled by ``scale · log2 e``: cheaper per
    element on MLX's CPU than ``mx.exp``; docs/benchmarks.md,
    "butter_core/cpu_attention.py").
    """
    batch, q_heads, tokens, dims = queries.shape
    kv_heads, length = stored.key_codes.shape[1], stored.length
    if tokens != 1 or q_heads % kv_heads or length == 0:
        raise ValueError(f"decode attention takes one query token over >= 1 slot; got {queries.shape}, length {length}")
    q = queries.astype(mx.float32).reshape(batch, kv_heads, q_heads // kv_heads, dims)
    slots, rows = stored.full_precision_slots()
    first, stop = _coded_span(slots, length)
    factor, softmax = softmax_for(length)
    parts = []
    if first < stop:
        parts.append(_coded_part(q, stored, first, stop, slots, scale * factor))
    if rows:
        parts.append(_full_precision_part(q, stored, rows, scale * factor))
    weights = softmax(mx.concatenate([scores for scores, _ in parts], axis=-1))
    bounds = list(itertools.accumulate(scores.shape[-1] for scores, _ in parts))[:-1]
    sums = [weighted_values(w) for (_, weighted_values), w in zip(parts, mx.split(weights, bounds, axis=-1))]
    return functools.reduce(mx.add, sums).reshape(queries.shape).astype(queries.dtype)


def gathered_decode_attention(
    queries: mx.array, rows: dict[str, mx.array], fp_keys: mx.array, fp_values: mx.array, coded: mx.array,
    full: mx.array, key_codec: Codec, value_codec: Codec, rotation: Rotation, scale: float,
) -> mx.array:  # fmt: skip
    """``decode_attention`` for the sequences of a batched step, each over its own slots: ``rows`` their
    pages' codes and scales gathered (``[sequences, kv_heads, length, width]`` by buffer name),
    ``fp_keys``/``fp_values`` their full-precision rows ``[sequences, kv_heads, rows, head_dim]``,
    ``coded`` ``[sequences, length]`` the slots each reads from codes and ``full`` ``[sequences, rows]``
    the full-precision rows each reads. As ``decode_attention``, in the rotated domain: the queries are
    rotated once and the weighted sum of values rotated back once, not every key and value."""
    batch, q_heads, _, dims = queries.shape
    kv_heads, length = rows["key_codes"].shape[1], rows["key_codes"].shape[2]
    q = queries.astype(mx.float32).reshape(batch, kv_heads, q_heads // kv_heads, dims)
    signs, mixing = _signs(rotation), rotation.mixing_matrix()
    factor, softmax = softmax_for(length)
    keys, key_scales = _decoded_planes(key_codec, rows["key_codes"], rows["key_scales"])
    coded_scores = _with_row_scales(_times_transposed(_rotated(q, signs, mixing), keys), key_scales) * (scale * factor)
    full_scores = (q @ fp_keys.astype(mx.float32).swapaxes(-1, -2)) * (scale * factor)
    weights = softmax(mx.concatenate([mx.where(coded[:, None, None], coded_scores, -mx.inf),
                                      mx.where(full[:, None, None], full_scores, -mx.inf)], axis=-1))  # fmt: skip
    coded_weights, full_weights = weights[..., :length], weights[..., length:]
    values, value_scales = _decoded_planes(value_codec, rows["value_codes"], rows["value_scales"])
    out = _unrotated(_weighted_sum(_with_row_scales(coded_weights, value_scales), values), signs, mixing)
    out = out + full_weights @ fp_values.astype(mx.float32)
    return out.reshape(queries.shape).astype(queries.dtype)


def _coded_part(
    q: mx.array, stored: StoredLayer, first: int, stop: int, slots: list[int], scale: float
) -> tuple[mx.array, Callable[[mx.array], mx.array]]:
    """Scores of the coded slots ``[first, stop)`` (full-precision ones among them masked out), and
    the function from their weights to the weighted sum of their values, rotated back."""
    signs, mixing = _signs(stored.rotation), stored.rotation.mixing_matrix()
    live = slice(first, stop)
    keys, key_scales = _decoded_planes(stored.key_codec, stored.key_codes[:, :, live], stored.key_scales[:, :, live])
    scores = _with_row_scales(_times_transposed(_rotated(q, signs, mixing), keys), key_scales) * scale
    masked = [slot - first for slot in slots if first <= slot < stop]
    if masked:
        scores[..., mx.array(masked)] = -mx.inf

    def weighted_values(weights: mx.array) -> mx.array:
        values, value_scales = _decoded_planes(
            stored.value_codec, stored.value_codes[:, :, live], stored.value_scales[:, :, live]
        )
        return _unrotated(_weighted_sum(_with_row_scales(weights, value_scales), values), signs, mixing)

    return scores, weighted_values


def _full_precision_part(
    q: mx.array, stored: StoredLayer, rows: list[int], scale: float
) -> tuple[mx.array, Callable[[mx.array], mx.array]]:
    """Scores of the full-precision ``rows`` (any order, not empty), and the function from their
    weights to the weighted sum of their values."""
    fp_keys, fp_values = stored.fp_keys, stored.fp_values
    if sorted(rows) != list(range(fp_keys.shape[2])):
        index = mx.array(rows)
        fp_keys, fp_values = mx.take(fp_keys, index, axis=2), mx.take(fp_values, index, axis=2)
    scores = (q @ fp_keys.astype(mx.float32).swapaxes(-1, -2)) * scale
    return scores, lambda weights: weights @ fp_values.astype(mx.float32)


def _coded_span(slots: list[int], length: int) -> tuple[int, int]:
    """The smallest ``[first, stop)`` holding every slot of ``[0, length)`` not in ``slots`` (empty if none is).

    Usually the slots between the sinks and the recent ring, so nothing inside it needs
    masking; found in ``len(slots)`` steps, not ``length``.
    """
    full = set(slots)
    first = next((slot for slot in range(length) if slot not in full), None)
    if first is None:
        return length, length
    last = next(slot for slot in range(length - 1, first - 1, -1) if slot not in full)
    return first, last + 1


# -- dequantize -------------------------------------------------------------------------


def dequantize(stored: StoredLayer, dtype: mx.Dtype) -> tuple[mx.array, mx.array]:
    """Keys and values of slots ``[0, length)`` as ``[batch, kv_heads, length, head_dim]`` in ``dtype``."""
    live, rotation = slice(0, stored.length), stored.rotation
    keys = _dequantized(stored.key_codec, stored.key_codes[:, :, live], stored.key_scales[:, :, live], rotation)
    values = _dequantized(stored.value_codec, stored.value_codes[:, :, live], stored.value_scales[:, :, live], rotation)
    slots, rows = stored.full_precision_slots()
    if slots:
        slots, rows = mx.array(slots), mx.array(rows)
        keys[:, :, slots] = mx.take(stored.fp_keys, rows, axis=2).astype(mx.float32)
        values[:, :, slots] = mx.take(stored.fp_values, rows, axis=2).astype(mx.float32)
    return keys.astype(dtype), values.astype(dtype)


def _dequantized(codec: Codec, codes: mx.array, scales: mx.array, rotation: Rotation) -> mx.array:
    """Coded vectors in the model's domain, float32: ``_unrotated`` with the planes' order folded into ``Mᵀ``."""
    planes, row_scales = _decoded_planes(codec, codes, scales)
    rows = _rows_times(planes, rotation.mixing_matrix().swapaxes(-1, -2)) * _signs(rotation)
    return rows if row_scales is None else rows * row_scales[..., None]
