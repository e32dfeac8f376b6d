"""AURA decode attention over batched storage: many sequences' codes in shared pages, each sequence's
full-precision rows and recent ring its own (``butter_aura.sequences.FullPrecisionRows``).

``paged_decode_attention`` runs ``attention``'s partials kernel (the tensor-core one of
``attention_mma`` wherever it serves on CUDA, else the SIMT one) and merge with each sequence's
expressions (its ``params`` row, ring, page table and full-precision rows) in place of one cache's,
so a batched decode step reads every sequence's codes where they lie: one partials launch and one
merge per layer for all sequences. ``paged_decode_attention_reference`` computes the same one
sequence at a time with ``reference.decode_attention`` over that sequence's pages, gathered.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import attrs
import mlx.core as mx
import numpy as np

from butter_core.plugin_api import compile_by_shape, gather_pages, gpu_backend, kernel_params

from butter_aura import reference
from butter_aura.codec import Codec
from butter_aura.kernels import attention
from butter_aura.layout import FullPrecisionBudget
from butter_aura.rotation import Rotation, TracedRotation
from butter_aura.stored import StoredLayer


@attrs.frozen(eq=False)
class PagedStored:
    """What batched decode attention reads for ``B`` sequences: the pages' code and scale arrays
    ``[1, kv_heads, slots, width]`` (sequence ``b``'s slot ``s`` in storage slot ``table[b, s //
    page_size] * page_size + s % page_size``), the full-precision rows of every sequence slot
    ``[sequence slots * budget.rows, kv_heads, head_dim]`` (sequence ``b``'s row ``r`` at
    ``sequence_rows[b] * budget.rows + r``), each sequence's ring on the host (``recent``, ``[B, ring]``,
    -1 for a free row) and its live slots (``lengths``)."""

    key_codes: mx.array
    key_scales: mx.array
    value_codes: mx.array
    value_scales: mx.array
    fp_keys: mx.array
    fp_values: mx.array
    recent: np.ndarray = attrs.field(converter=lambda rings: np.asarray(rings, dtype=np.int64))
    sequence_rows: mx.array
    table: mx.array
    lengths: Sequence[int]
    page_size: int
    budget: FullPrecisionBudget
    key_codec: Codec
    value_codec: Codec
    rotation: Rotation
    recent_slots: mx.array = attrs.field(
        default=attrs.Factory(lambda self: mx.array(self.recent, dtype=mx.int32), takes_self=True))
    """``recent`` as the kernels read it, ``[B, ring]`` int32 (made once: both launches read it)."""
    params: mx.array = attrs.field(
        default=attrs.Factory(lambda self: ring_params(self.recent, self.lengths, self.budget), takes_self=True))
    """``ring_params`` of ``recent`` and ``lengths`` (made once: both launches read it)."""

    @property
    def length(self) -> int:
        """The longest sequence's live slots: what the splits are planned for."""
        return max(self.lengths)


def ring_params(recent: np.ndarray, lengths: Sequence[int], budget: FullPrecisionBudget) -> mx.array:
    """``attention.live_params`` per sequence, ``[B, 7]``, from its ring ``recent`` (``[B, ring]`` on the
    host, -1 for a free row) and its live slots: its live slots, the budget's sinks and period, the
    smallest and largest slot its ring holds (1 and 0 for an empty ring), the budget's base and tail."""
    held = recent >= 0
    any_held = held.any(axis=1)
    lo = np.where(any_held, np.where(held, recent, np.iinfo(np.int64).max).min(axis=1), 1)
    hi = np.where(any_held, recent.max(axis=1), 0)
    sinks, period, base, tail = budget.params()
    rows = np.empty((len(lengths), 7), dtype=np.int64)
    rows[:, 0], rows[:, 1:3], rows[:, 3], rows[:, 4], rows[:, 5:] = lengths, (sinks, period), lo, hi, (base, tail)
    return kernel_params(rows.ravel().tolist(), mx.int32).reshape(len(lengths), 7)


def paged_decode_attention(queries: mx.array, paged: PagedStored, scale: float, *, method: str | None = None,
                           splits: int | None = None) -> mx.array:
    """One query token per sequence (``queries`` ``[B, q_heads, 1, head_dim]``) over its pages, on the
    GPU; the queries' dtype. ``method`` and ``splits`` as ``attention.paged_decode_attention_live``.

    On CUDA, unless ``method`` or ``splits`` is forced (or the rotation permutes coordinates, which
    the trace does not carry), the two launches are a trace replayed
    (``compile_by_shape``, as a single cache's ``attention.traced_decode_attention``): a batched
    step is bound by the host, and this spares it building both kernel calls per layer. A trace is
    planned for every slot the page tables hold (their width, not the longest sequence), so it
    serves every step until the tables widen or the batch changes."""
    _check(queries, paged)
    scale_array = kernel_params((scale,), mx.float32)
    if gpu_backend() == "cuda" and method is None and splits is None and paged.rotation.permutation is None:
        traced = _traced(paged.key_codec.fields, paged.value_codec.fields, paged.budget, paged.page_size)
        return traced(queries, paged.rotation.signs, paged.key_codes, paged.key_scales, paged.value_codes,
                      paged.value_scales, paged.fp_keys, paged.fp_values, paged.recent_slots, paged.sequence_rows,
                      paged.table, paged.params, scale_array)  # fmt: skip
    return attention.paged_decode_attention_live(queries, paged, paged.params, scale_array, method=method,
                                                 splits=splits)  # fmt: skip


@functools.cache
def _traced(key_fields: tuple, value_fields: tuple, budget: FullPrecisionBudget, page_size: int) -> Callable:
    """``attention.paged_decode_attention_live`` over a step's arrays, traced per shape, for one pair
    of codecs, full-precision budget and page size (every layer of a model shares it)."""
    key_codec, value_codec = Codec(*key_fields), Codec(*value_fields)

    def graph(queries, signs, key_codes, key_scales, value_codes, value_scales, fp_keys, fp_values, recent_slots,
              sequence_rows, table, params, scale):
        batch, pages = table.shape
        paged = PagedStored(
            key_codes=key_codes, key_scales=key_scales, value_codes=value_codes, value_scales=value_scales,
            fp_keys=fp_keys, fp_values=fp_values, recent=np.full((batch, budget.ring), -1),
            recent_slots=recent_slots, params=params, sequence_rows=sequence_rows, table=table,
            lengths=[pages * page_size] * batch, page_size=page_size, budget=budget, key_codec=key_codec,
            value_codec=value_codec, rotation=TracedRotation(signs),
        )  # the lengths plan the splits; each sequence's own is in params
        return attention.paged_decode_attention_live(queries, paged, params, scale)

    return compile_by_shape(graph)


def paged_decode_attention_reference(queries: mx.array, paged: PagedStored, scale: float) -> mx.array:
    """The same, one sequence at a time: its pages gathered into a ``StoredLayer`` with its own
    full-precision rows and ring, then ``reference.decode_attention``."""
    _check(queries, paged)
    rows = np.asarray(paged.sequence_rows).tolist()
    out = []
    for b, (length, ring) in enumerate(zip(paged.lengths, paged.recent)):
        codes = {name: gather_pages(getattr(paged, name), paged.table[b : b + 1], paged.page_size, length)
                 for name in ("key_codes", "key_scales", "value_codes", "value_scales")}  # fmt: skip
        fp = mx.arange(paged.budget.rows) + rows[b] * paged.budget.rows
        stored = StoredLayer(
            **codes,
            fp_keys=paged.fp_keys[fp].transpose(1, 0, 2)[None], fp_values=paged.fp_values[fp].transpose(1, 0, 2)[None],
            recent_slots=mx.array(ring, dtype=mx.int32), length=length, budget=paged.budget,
            key_codec=paged.key_codec, value_codec=paged.value_codec, rotation=paged.rotation,
        )  # fmt: skip
        out.append(reference.decode_attention(queries[b : b + 1], stored, scale))
    return mx.concatenate(out, axis=0)


def _check(queries: mx.array, paged: PagedStored) -> None:
    batch = queries.shape[0]
    if not (len(paged.lengths) == len(paged.recent) == paged.table.shape[0] == paged.sequence_rows.shape[0] == batch):
        raise ValueError(f"{batch} queries need as many lengths, rings, page tables and sequence rows")
    if paged.key_codes.shape[0] != 1 or min(paged.lengths) < 1:
        raise ValueError("paged storage is [1, kv_heads, slots, width] and every sequence holds a slot")
    if max(paged.lengths) > paged.table.shape[1] * paged.page_size:
        raise ValueError(f"a length of {max(paged.lengths)} overruns the tables' {paged.table.shape[1]} pages")
