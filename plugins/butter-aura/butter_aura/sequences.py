"""``FullPrecisionRows``: an AURA layer's full-precision rows for many sequences in batched storage.

The pages (``butter_core.batched``) hold every sequence's codes; this holds, per sequence slot,
what ``AuraCache`` keeps beside its codes: 16-bit copies of the sinks and of the newest
positions (``layout.FullPrecisionBudget``), and which slot each recent row holds, so a sequence
attends in batched storage to the vectors it would attend to alone. On a GPU a decode step reads
every sequence's codes in place (``kernels.paged``); elsewhere the pages are gathered and decoded,
and ``read`` puts the rows in. A decode step's tokens are written to their full-precision rows
only, and their codes later, many steps' at once (``defer``, ``flush``).
"""

from __future__ import annotations

from collections.abc import Sequence

from typing import TYPE_CHECKING

import attrs
import mlx.core as mx
import numpy as np

from butter_core.plugin_api import SequenceState, Written, gather_pages

from butter_aura import cpu
from butter_aura.kernels import GPU_OPS
from butter_aura.kernels.paged import PagedStored, paged_decode_attention, ring_params
from butter_aura.layout import FullPrecisionBudget

if TYPE_CHECKING:
    from butter_aura.cache import AuraCache


class RecentRings:
    """Which slot each recent row holds, per sequence slot (``recent``, ``[sequences, ring]``, -1 for
    a free row) and that slot's position (``recent_positions``), on the host: the single cache's
    bookkeeping, one ring per sequence. It depends only on the slots and positions a step writes,
    which every layer under one window shares, so those layers' ``FullPrecisionRows`` keep one
    ``RecentRings`` (``AuraCache.sequence_state``'s ``shared``), and what a step derives from it, the
    rows each layer copies (``note``) and the arrays its kernels read (``for_step``), is made by the
    first layer and reused by the others, not made once a layer."""

    def __init__(self, budget: FullPrecisionBudget, sequences: int):
        self.budget = budget
        self.recent = np.full((sequences, budget.ring), -1, dtype=np.int64)
        self.recent_positions = np.full((sequences, budget.ring), -1, dtype=np.int64)
        self.version = 0
        """Counts the changes to the rings: ``for_step`` remakes its arrays after one."""
        self._noted: tuple = (None, None, None)  # (written, rows, copies)
        self._step: tuple = (None, None, None, None)  # (version, rows, lengths, StepRings)
        self.layers = 0
        """The ``FullPrecisionRows`` sharing these rings: each applies every ``Deferred`` batch."""
        self.pending: dict[int, tuple[int, int]] = {}
        """Rows whose codes are not written (``defer``): physical slot -> (state row, full-precision row)."""
        self._pending_rows: set[int] = set()
        self._pending_of: dict[int, set[int]] = {}  # state row -> its pending slots
        self.sealed: list[Deferred] = []
        """Batches of deferred rows to write, each layer in turn (``seal``), oldest first."""
        self.sealed_count = 0
        self._deferred: tuple = (None, False)  # (written, whether its rows were deferred)

    def reset(self, row: int) -> None:
        self.recent[row] = -1
        self.recent_positions[row] = -1
        self.version += 1
        self._drop(row)

    def _drop(self, row: int) -> None:
        """Forget the deferred rows of state row ``row`` (its sequence left: its pages may be another's)."""
        for slot in self._pending_of.pop(row, ()):
            self._pending_rows.discard(self.pending.pop(slot)[1])
        if self.sealed:
            self.sealed = [batch.without(row) for batch in self.sealed]

    def defer(self, rows: Sequence[int], written: Written, slots: np.ndarray, step_rows: int) -> tuple[Copies | None, bool]:
        """``note`` a step's rows, and whether their codes may wait (``FullPrecisionRows.defer``): where
        every row takes a full-precision row of its own, in order (a decode step's tokens), they are kept
        as pending (``slots`` their physical slots), after sealing the pending rows whose full-precision
        rows this step takes over. Once per step, as ``note``."""
        if self._deferred[0] is written:
            return self._noted[2], self._deferred[1]
        copies = self.note(rows, written, step_rows)
        deferred = copies is not None and copies.sources is None and len(copies.rows) == len(slots)
        if deferred:
            if self._pending_rows.intersection(copies.rows.tolist()):
                self.seal()
            owners = np.asarray(rows, dtype=np.int64)[written.sequence]
            for slot, owner, row in zip(slots.tolist(), owners.tolist(), copies.rows.tolist()):
                if slot in self.pending:
                    previous, previous_row = self.pending[slot]
                    self._pending_rows.discard(previous_row)
                    self._pending_of[previous].discard(slot)
                self.pending[slot] = (owner, row)
                self._pending_rows.add(row)
                self._pending_of.setdefault(owner, set()).add(slot)
        self._deferred = (written, deferred)
        return copies, deferred

    def seal(self) -> None:
        """Make the pending rows a batch that every layer writes in turn (``FullPrecisionRows.flush``)."""
        if not self.pending:
            return
        slots = list(self.pending)
        owners, rows = zip(*self.pending.values())
        self.sealed_count += 1
        self.sealed.append(Deferred(self.sealed_count, np.array(owners), np.array(slots), np.array(rows), self.layers))
        self.pending, self._pending_rows, self._pending_of = {}, set(), {}

    def applied(self, batch: Deferred) -> None:
        """One layer wrote ``batch``; once all have, it is gone."""
        batch.remaining -= 1
        if batch.remaining <= 0:
            self.sealed.remove(batch)

    def restore(self, row: int, recent: np.ndarray, recent_positions: np.ndarray, slots: int) -> None:
        """As ``AuraCache.truncate`` keeps them: a recent row whose slot is past ``slots`` is free."""
        kept = recent < slots
        self.recent[row] = np.where(kept, recent, -1)
        self.recent_positions[row] = np.where(kept, recent_positions, -1)
        self.version += 1

    def note(self, rows: Sequence[int], written: Written, step_rows: int) -> Copies | None:
        """Take note of a step's rows (``written``, of ``step_rows`` flattened rows; ``rows[b]`` the state
        row of its sequence ``b``): the sinks, and the rows that are now the newest position of their
        recent row (of two positions whose slots share a row, the newer keeps it), and which rows each
        layer copies where (None: none). Once per step: the layers after the first get the same copies."""
        if self._noted[0] is written and self._noted[1] is rows:
            return self._noted[2]
        budget = self.budget
        state_rows = np.asarray(rows, dtype=np.int64)[written.sequence]
        fp_rows = budget.rows_of(written.slot)
        ringed = fp_rows >= budget.sinks
        index = np.where(ringed, fp_rows - budget.sinks, 0)
        older = ringed & (written.position < self.recent_positions[state_rows, index])
        taken = np.flatnonzero((fp_rows >= 0) & ~older)
        targets = state_rows[taken] * budget.rows + fp_rows[taken]
        _, last = np.unique(targets[::-1], return_index=True)  # a later write of the same row replaces it
        copies = None
        if len(last):
            kept = np.sort(len(taken) - 1 - last)
            taken, targets = taken[kept], targets[kept]
            ring = taken[ringed[taken]]
            self.recent[state_rows[ring], index[ring]] = written.slot[ring]
            self.recent_positions[state_rows[ring], index[ring]] = written.position[ring]
            self.version += 1
            sources = written.row[taken]
            every_row = len(sources) == step_rows and bool((sources == np.arange(len(sources))).all())
            copies = Copies(mx.array(targets, dtype=mx.int32),
                            None if every_row else mx.array(sources, dtype=mx.int32), targets)  # fmt: skip
        self._noted = (written, rows, copies)
        return copies

    def for_step(self, rows: Sequence[int], lengths: Sequence[int]) -> StepRings:
        """The rings of a step's sequences (``rows[b]`` the state row of sequence ``b``, ``lengths[b]`` its
        live slots) as the paged kernels read them: made once while the rings, ``rows`` and
        ``lengths`` stay the same (the same objects: a step's layers pass the step's)."""
        version, seen_rows, seen_lengths, made = self._step
        if version == self.version and seen_rows is rows and seen_lengths is lengths:
            return made
        recent = self.recent[np.asarray(rows)]
        made = StepRings(recent, mx.array(recent, dtype=mx.int32), mx.array(rows, dtype=mx.int32),
                         ring_params(recent, lengths, self.budget))  # fmt: skip
        self._step = (self.version, rows, lengths, made)
        return made


@attrs.frozen(eq=False)
class Copies:
    """The rows a step's layers copy into their full-precision arrays: to flat rows ``targets``, from
    the step's flattened rows ``sources`` (None: every row, in order: a decode step's)."""

    targets: mx.array
    sources: mx.array | None
    rows: np.ndarray
    """``targets`` on the host."""


@attrs.define(eq=False)
class Deferred:
    """Rows a decode step left without codes (``RecentRings.defer``), sealed for the layers to write:
    their state rows, physical slots and full-precision rows (host), ``remaining`` layers to write them;
    the slots and rows also as the int32 arrays every layer's write reads (made once a batch)."""

    number: int
    owners: np.ndarray
    slots: np.ndarray
    rows: np.ndarray
    remaining: int
    slot_index: mx.array = attrs.field(init=False)
    row_index: mx.array = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self.slot_index = mx.array(self.slots, dtype=mx.int32)
        self.row_index = mx.array(self.rows, dtype=mx.int32)

    def without(self, row: int) -> Deferred:
        """This batch less the rows of state row ``row`` (itself where it holds none: a release resets
        the shared rings once per layer, and only the first finds the row's)."""
        keep = self.owners != row
        if keep.all():
            return self
        return Deferred(self.number, self.owners[keep], self.slots[keep], self.rows[keep], self.remaining)


@attrs.frozen(eq=False)
class StepRings:
    """A step's sequences' rings as ``kernels.paged.PagedStored`` takes them: on the host ``[B, ring]``,
    as int32 for the kernels, the sequences' state rows, and ``paged.ring_params``."""

    recent: np.ndarray
    recent_slots: mx.array
    sequence_rows: mx.array
    params: mx.array


class FullPrecisionRows(SequenceState):
    """``budget.rows`` full-precision rows per sequence slot, ``[sequences * rows, kv_heads, head_dim]``
    for keys and for values (one flat index per row, so a step writes and reads them with one
    scatter and one gather), and the rings that say which slot each recent row holds
    (``RecentRings``, shared with the other layers under the same window), as ``AuraCache`` keeps them."""

    def __init__(self, cache: AuraCache, rings: RecentRings):
        """For the layer of ``cache`` (its codecs, rotation and full-precision dtype; its kernels where
        its ``ops`` are the GPU's)."""
        self.cache, self.rings, self.budget = cache, rings, rings.budget
        kv_heads, head_dim, dtype = cache.spec.n_kv_heads, cache.spec.head_dim, cache.fp_dtype
        shape = (rings.recent.shape[0] * rings.budget.rows, kv_heads, head_dim)
        self.keys, self.values = mx.zeros(shape, dtype), mx.zeros(shape, dtype)
        mx.eval(self.keys, self.values)
        rings.layers += 1
        self.written_batches = rings.sealed_count
        """The last ``Deferred`` batch this layer wrote (they are numbered in order)."""

    def arrays(self) -> list[mx.array]:
        return [self.keys, self.values]

    def reset(self, row: int) -> None:
        self.rings.reset(row)

    def export(self, row: int) -> dict[str, mx.array]:
        rows = slice(row * self.budget.rows, (row + 1) * self.budget.rows)
        return {"keys": self.keys[rows], "values": self.values[rows],
                "recent": mx.array(self.rings.recent[row], dtype=mx.int32),
                "recent_positions": mx.array(self.rings.recent_positions[row], dtype=mx.int32)}  # fmt: skip

    def restore(self, row: int, arrays: dict[str, mx.array], slots: int) -> None:
        rows = slice(row * self.budget.rows, (row + 1) * self.budget.rows)
        self.keys[rows], self.values[rows] = arrays["keys"], arrays["values"]
        self.rings.restore(row, np.array(arrays["recent"]), np.array(arrays["recent_positions"]), slots)

    def write(self, rows: Sequence[int], written: Written, keys: mx.array, values: mx.array) -> None:
        """Copy the rows the rings keep (``RecentRings.note``): one scatter per side a layer."""
        self._copy(self.rings.note(rows, written, keys.shape[0] * keys.shape[2]), keys, values)

    def defer(self, rows, written, slots, keys, values, storage) -> bool:
        """A decode step's tokens, each now its sequence's newest recent row, are copied into their
        full-precision rows only: attention reads them there (``paged_decode``, ``read``) until a later
        token takes the row, and their codes are written then, for every sequence and up to a ring of
        steps at once (``flush``: one encode and one write of the pages where each step made one
        of each). Tokens in the ring's dtype or float32 only (coded from their 16-bit copies, as
        ``AuraCache.store`` codes a single cache's)."""
        if keys.shape[2] != 1 or keys.dtype not in (self.keys.dtype, mx.float32):
            return False
        copies, deferred = self.rings.defer(rows, written, slots, keys.shape[0] * keys.shape[2])
        if not deferred:
            return False
        self._write_sealed(storage)
        self._copy(copies, keys, values)
        return True

    def flush(self, storage) -> None:
        self.rings.seal()
        self._write_sealed(storage)

    def _write_sealed(self, storage) -> None:
        """Write the codes of the sealed batches of deferred rows this layer has not written: encoded
        from their full-precision rows, one encode and one write of the pages a batch."""
        for batch in list(self.rings.sealed):
            if batch.number <= self.written_batches:
                continue
            if len(batch.slots):
                keys, values = (array[batch.row_index].transpose(1, 0, 2)[None] for array in (self.keys, self.values))
                storage.write_at(batch.slot_index, self.cache.encode(keys, values))
            self.written_batches = batch.number
            self.rings.applied(batch)

    def _copy(self, copies: Copies | None, keys: mx.array, values: mx.array) -> None:
        """Scatter the rows ``copies`` names into the full-precision rows."""
        if copies is None:
            return
        for name, new in (("keys", keys), ("values", values)):  # as [sequences * tokens, heads, D]
            flat = new.squeeze(2) if new.shape[2] == 1 else new.swapaxes(1, 2).reshape(-1, new.shape[1], new.shape[3])
            flat = flat if copies.sources is None else flat[copies.sources]
            getattr(self, name)[copies.targets] = flat.astype(self.keys.dtype)

    def paged_decode(self, queries, buffers, table, lengths, page_size, scale, rows):
        """``kernels.paged.paged_decode_attention`` where the cache runs AURA's kernels, else
        ``cpu.gathered_decode_attention`` over the gathered pages."""
        if self.cache.ops is not GPU_OPS:
            return self._gathered_decode(queries, buffers, table, lengths, page_size, scale, rows)
        step = self.rings.for_step(rows, lengths)
        paged = PagedStored(
            key_codes=buffers["key_codes"], key_scales=buffers["key_scales"], value_codes=buffers["value_codes"],
            value_scales=buffers["value_scales"], fp_keys=self.keys, fp_values=self.values, recent=step.recent,
            recent_slots=step.recent_slots, params=step.params, sequence_rows=step.sequence_rows, table=table,
            lengths=lengths, page_size=page_size, budget=self.budget, key_codec=self.cache.key_codec,
            value_codec=self.cache.value_codec, rotation=self.cache.rotation,
        )  # fmt: skip
        return paged_decode_attention(queries, paged, scale)

    def _gathered_decode(self, queries, buffers, table, lengths, page_size, scale, rows):
        """Each sequence's codes gathered from its pages and read in the rotated domain, its full-precision
        rows beside them (``cpu.gathered_decode_attention``)."""
        budget, length = self.budget, max(lengths)
        gathered = {name: gather_pages(buffers[name], table, page_size, length) for name in self.cache.slots.layout}
        recent = mx.array(self.rings.recent[np.asarray(rows)], dtype=mx.int32)
        live = mx.array(lengths, dtype=mx.int32)[:, None]
        member, _ = budget.membership(recent, length)
        coded = ~member & (mx.arange(length, dtype=mx.int32)[None] < live)
        full = mx.concatenate([mx.arange(budget.sinks, dtype=mx.int32)[None] < live, (recent >= 0) & (recent < live)], axis=1)
        fp_keys, fp_values = self._full_precision(rows, mx.arange(budget.rows, dtype=mx.int32))
        return cpu.gathered_decode_attention(queries, gathered, fp_keys, fp_values, coded, full, self.cache.key_codec,
                                             self.cache.value_codec, self.cache.rotation, scale)  # fmt: skip

    def read(self, rows: Sequence[int], length: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Each sequence's full-precision rows in place of the decoded codes of the slots they hold."""
        member, fp_row = self.budget.membership(mx.array(self.rings.recent[np.asarray(rows)], dtype=mx.int32), length)
        fp_keys, fp_values = self._full_precision(rows, fp_row)
        member = member[:, None, :, None]
        return (mx.where(member, fp_keys.astype(keys.dtype), keys),
                mx.where(member, fp_values.astype(values.dtype), values))  # fmt: skip

    def _full_precision(self, rows: Sequence[int], within: mx.array) -> tuple[mx.array, mx.array]:
        """Rows ``within`` (``[n]``, each a row of ``budget.rows``) of each state row in ``rows``, as keys
        and values ``[sequences, heads, n, head_dim]``."""
        index = mx.array(rows, dtype=mx.int32)[:, None] * self.budget.rows + within[None]
        return self.keys[index].transpose(0, 2, 1, 3), self.values[index].transpose(0, 2, 1, 3)
