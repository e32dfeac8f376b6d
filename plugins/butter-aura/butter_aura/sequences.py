"""``FullPrecisionRows``: an AURA layer's full-precision rows for many sequences in batched storage.

The pages (``butter_core.batched``) hold every sequence's codes; this holds, per sequence slot,
what ``AuraCache`` keeps beside its codes: 16-bit copies of the sinks and of the newest
positions (``layout.FullPrecisionBudget``), and which slot each recent row holds, so a sequence
attends in batched storage to the vectors it would attend to alone. On a GPU a decode step reads
every sequence's codes in place (``kernels.paged``); elsewhere the pages are gathered and decoded,
and ``read`` puts the rows in.
"""

from __future__ import annotations

from collections.abc import Sequence

import mlx.core as mx
import numpy as np

from typing import TYPE_CHECKING

from butter_core.plugin_api import SequenceState, Written, gather_pages

from butter_aura import cpu
from butter_aura.kernels import GPU_OPS
from butter_aura.kernels.paged import PagedStored, paged_decode_attention
from butter_aura.layout import FullPrecisionBudget

if TYPE_CHECKING:
    from butter_aura.cache import AuraCache


class FullPrecisionRows(SequenceState):
    """``budget.rows`` full-precision rows per sequence slot, ``[sequences * rows, kv_heads, head_dim]``
    for keys and for values (one flat index per row, so a step writes and reads them with one
    scatter and one gather), and each slot's ``recent_slots``/``recent_positions`` on the host
    (``[sequences, ring]`` integer arrays), as ``AuraCache`` keeps them."""

    def __init__(self, cache: AuraCache, budget: FullPrecisionBudget, sequences: int):
        """For the layer of ``cache`` (its codecs, rotation and full-precision dtype; its kernels where
        its ``ops`` are the GPU's)."""
        self.cache, self.budget = cache, budget
        kv_heads, head_dim, dtype = cache.spec.n_kv_heads, cache.spec.head_dim, cache.fp_dtype
        shape = (sequences * budget.rows, kv_heads, head_dim)
        self.keys, self.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        mx.eval(self.keys, self.values)
        self.recent = np.full((sequences, budget.ring), -1, dtype=np.int64)
        self.recent_positions = np.full((sequences, budget.ring), -1, dtype=np.int64)

    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]

    def reset(self, row: int) -> None:
        self.recent[row] = -1
        self.recent_positions[row] = -1

    def export(self, row: int) -> dict[str, mx.array]:
        rows = slice(row * self.budget.rows, (row + 1) * self.budget.rows)
        return {"keys": self.keys[rows], "values": self.values[rows],
                "recent": mx.array(self.recent[row], dtype=mx.int32),
                "recent_positions": mx.array(self.recent_positions[row], dtype=mx.int32)}  # fmt: skip

    def restore(self, row: int, arrays: dict[str, mx.array], slots: int) -> None:
        """As ``AuraCache.truncate`` keeps them: a recent row whose slot is past ``slots`` is free."""
        rows = slice(row * self.budget.rows, (row + 1) * self.budget.rows)
        self.keys[rows], self.values[rows] = arrays["keys"], arrays["values"]
        recent = np.array(arrays["recent"])
        kept = recent < slots
        self.recent[row] = np.where(kept, recent, -1)
        self.recent_positions[row] = np.where(kept, np.array(arrays["recent_positions"]), -1)

    def write(self, rows: Sequence[int], written: Written, keys: mx.array, values: mx.array) -> None:
        """Copy the written sinks, and the rows that are now the newest position of their recent row
        (of two positions whose slots share a row, the newer keeps it): array operations over the
        step's rows, so that a step of many sequences costs the host a few operations a layer."""
        budget = self.budget
        state_rows = np.asarray(rows, dtype=np.int64)[written.sequence]
        fp_rows = budget.rows_of(written.slot)
        ringed = fp_rows >= budget.sinks
        index = np.where(ringed, fp_rows - budget.sinks, 0)
        older = ringed & (written.position < self.recent_positions[state_rows, index])
        taken = np.flatnonzero((fp_rows >= 0) & ~older)
        targets = state_rows[taken] * budget.rows + fp_rows[taken]
        _, last = np.unique(targets[::-1], return_index=True)  # a later write of the same row replaces it
        if not len(last):
            return
        kept = np.sort(len(taken) - 1 - last)
        taken, targets = taken[kept], mx.array(targets[kept], dtype=mx.int32)
        ring = taken[ringed[taken]]
        self.recent[state_rows[ring], index[ring]] = written.slot[ring]
        self.recent_positions[state_rows[ring], index[ring]] = written.position[ring]
        sources = written.row[taken]
        every_row = len(sources) == keys.shape[0] * keys.shape[2] and bool((sources == np.arange(len(sources))).all())
        gather = None if every_row else mx.array(sources, dtype=mx.int32)  # a decode step's: none
        for name, new in (("keys", keys), ("values", values)):  # as [sequences * tokens, heads, D]
            flat = new.squeeze(2) if new.shape[2] == 1 else new.swapaxes(1, 2).reshape(-1, new.shape[1], new.shape[3])
            flat = flat if gather is None else flat[gather]
            getattr(self, name)[targets] = flat.astype(self.keys.dtype)

    def paged_decode(self, queries, buffers, table, lengths, page_size, scale, rows):
        """``kernels.paged.paged_decode_attention`` where the cache runs AURA's kernels, else
        ``cpu.gathered_decode_attention`` over the gathered pages."""
        if self.cache.ops is not GPU_OPS:
            return self._gathered_decode(queries, buffers, table, lengths, page_size, scale, rows)
        paged = PagedStored(
            key_codes=buffers["key_codes"], key_scales=buffers["key_scales"], value_codes=buffers["value_codes"],
            value_scales=buffers["value_scales"], fp_keys=self.keys, fp_values=self.values,
            recent=self.recent[np.asarray(rows)], sequence_rows=mx.array(rows, dtype=mx.int32), table=table,
            lengths=lengths, page_size=page_size, budget=self.budget, key_codec=self.cache.key_codec,
            value_codec=self.cache.value_codec, rotation=self.cache.rotation,
        )  # fmt: skip
        return paged_decode_attention(queries, paged, scale)

    def _gathered_decode(self, queries, buffers, table, lengths, page_size, scale, rows):
        """Each sequence's codes gathered from its pages and read in the rotated domain, its full-precision
        rows beside them (``cpu.gathered_decode_attention``)."""
        budget, length = self.budget, max(lengths)
        gathered = {name: gather_pages(array, table, page_size, length) for name, array in buffers.items()}
        recent = mx.array(self.recent[np.asarray(rows)], dtype=mx.int32)
        live = mx.array(lengths, dtype=mx.int32)[:, None]
        member, _ = budget.membership(recent, length)
        coded = ~member & (mx.arange(length, dtype=mx.int32)[None] < live)
        full = mx.concatenate([mx.arange(budget.sinks, dtype=mx.int32)[None] < live, (recent >= 0) & (recent < live)], axis=1)
        fp_keys, fp_values = self._full_precision(rows, mx.arange(budget.rows, dtype=mx.int32))
        return cpu.gathered_decode_attention(queries, gathered, fp_keys, fp_values, coded, full, self.cache.key_codec,
                                             self.cache.value_codec, self.cache.rotation, scale)  # fmt: skip

    def read(self, rows: Sequence[int], length: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Each sequence's full-precision rows in place of the decoded codes of the slots they hold."""
        member, fp_row = self.budget.membership(mx.array(self.recent[np.asarray(rows)], dtype=mx.int32), length)
        fp_keys, fp_values = self._full_precision(rows, fp_row)
        member = member[:, None, :, None]
        return (mx.where(member, fp_keys.astype(keys.dtype), keys),
                mx.where(member, fp_values.astype(values.dtype), values))  # fmt: skip

    def _full_precision(self, rows: Sequence[int], within: mx.array) -> tuple[mx.array, mx.array]:
        """Rows ``within`` (``[n]``, each a row of ``budget.rows``) of each state row in ``rows``, as keys
        and values ``[sequences, heads, n, head_dim]``."""
        index = mx.array(rows, dtype=mx.int32)[:, None] * self.budget.rows + within[None]
        return self.keys[index].transpose(0, 2, 1, 3), self.values[index].transpose(0, 2, 1, 3)
