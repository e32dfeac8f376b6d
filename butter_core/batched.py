"""Batched storage: many sequences' KV caches in shared pages, and the per-step views layers attend through.

``BatchedCaches`` holds, for every attention layer of a model, one storage of ``num_pages x
page_size`` slots in the layout of the layer's scheme (a batch-1 ``SlotBuffers``, allocated
whole when the caches are made): capacity is counted in tokens, not in batch x context. A
sequence owns pages, taken from a shared free list as it is given room (``reserve``) and
returned when it is released; its position ``p`` lives in slot ``pages[p // page_size] *
page_size + p % page_size`` of every layer.

An attention layer under a window (``windows``: ``--kv-window-size``, or the family's sliding
window) keeps each sequence's sinks and ring in that sequence's pages, position ``p`` in slot
``keep + (p - keep) % ring`` as ``butter_core.window`` places it; a sequence then needs pages
for ``max_size`` slots at most (``pages_for``).

Sequences are addressed by ``SequenceHandle(slot, generation)``. Releasing a sequence bumps
its slot's generation, so a handle kept past its release — whether or not the slot now
holds another sequence — is refused with ``StaleSequenceError`` naming the slot; it never
reads another sequence's rows.

Recurrent layers keep no pages: each has a ``StatePool``, one row of convolution inputs and
state per sequence slot (``max_sequences`` rows), zeroed when a sequence opens; a step gathers
its sequences' rows, runs the state scheme's ``mix`` (its kernels, where it has them) and
writes them back (``BatchedStateLayer``).

A forward over some sequences is a ``BatchedStep``; where each new row goes, which slots each
sequence attends to and the mask are its ``Placement`` for a window (or none), computed once
and shared by every layer's ``BatchedLayer`` view, which is what the model's attention calls
(``update_and_attend``, ``absolute_position``: one RoPE offset per sequence). The view writes
the rows with the scheme's ``encode`` (one scatter per buffer for all sequences) and, for a
decode step, attends through the scheme's ``paged_decode`` kernel where it has one (pages
read in place: butter-raw, butter-affine and, through its ``SequenceState``, butter-aura on a
GPU), else over its ``decode`` of the gathered pages: every ``BufferedSlotCache`` scheme that
defines ``encode``/``decode`` runs batched unchanged.

Release and computations in flight: MLX arrays are values. A step's reads hold the storage
arrays they read, and a write makes a new array unless nothing else holds the old one, so a
page released and handed to another sequence can never be overwritten under a computation
still queued against it: its release needs no waiting.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import mlx.core as mx
import numpy as np

from butter_core.cache import LayerSpec, attend, check_chunk
from butter_core.config import Window
from butter_core.errors import ConfigError
from butter_core.recurrent import StateCache, StateSpec
from butter_core.sequence_state import SequenceState, Written
from butter_core.slots import BufferedSlotCache, KernelBuffers, SlotBuffers, gather_rows, unstack

DEFAULT_MAX_SEQUENCES = 64
"""Sequence slots of a model with recurrent layers when ``max_sequences`` is not given (at most
one per page): what sizes its state pools (Qwen3-Next-80B: 2 MiB per layer and sequence). A
model of attention layers alone gets one slot per page, which costs nothing."""
PAGE_SIZE = 64
"""Positions per page. A sequence holds at most one partly used page, so allocated bytes stay
within one page per sequence of live ones; the gathered path reads slot by slot, so the page
size does not change its speed."""


class StaleSequenceError(ConfigError):
    """A ``SequenceHandle`` used after its sequence was released."""


class OutOfPagesError(ConfigError):
    """More positions asked for than the free pages hold."""


@attrs.frozen
class SequenceHandle:
    """A sequence in ``BatchedCaches``: its slot and the slot's generation when it was opened."""

    slot: int
    generation: int


@attrs.define
class _Sequence:
    generation: int = 0
    live: bool = False
    pages: list[int] = attrs.Factory(list)
    length: int = 0


@attrs.frozen(eq=False)
class SequenceSnapshot:
    """One sequence's contents at ``length`` positions, copied out of batched storage in each layer's own
    encoded form (``BatchedCaches.export_sequence``): an attention layer's slots by buffer name, each
    ``[1, heads, slots, width]``, with its ``SequenceState``'s row under ``state.<name>``; a recurrent
    layer's ``conv`` and ``state`` rows."""

    length: int
    layers: list[dict[str, mx.array]]
    truncatable: bool
    """Whether a prefix of it may be imported too: no recurrent layer, and no window has wrapped (a
    recurrent state, or a ring past its first turn, holds its positions only all together)."""

    @property
    def nbytes(self) -> int:
        return sum(array.nbytes for layer in self.layers for array in layer.values())

    def usable(self, positions: int) -> bool:
        """Whether ``import_sequence`` can take its first ``positions`` positions."""
        return positions == self.length or (self.truncatable and 0 < positions < self.length)


class BatchedCaches:
    """Every attention layer's paged storage for many sequences (see the module docstring).

    ``prototypes`` holds one cache of each layer's scheme, whose ``encode``/``decode`` (pure
    functions of arrays) this storage uses; their own slots stay empty.
    """

    def __init__(self, specs: Sequence[LayerSpec | StateSpec], prototypes: Sequence[BufferedSlotCache | StateCache], *,
                 capacity_tokens: int, page_size: int = PAGE_SIZE, max_sequences: int | None = None,
                 windows: Sequence[Window | None] | None = None):  # fmt: skip
        for name, value in (("capacity_tokens", capacity_tokens), ("page_size", page_size), ("max_sequences", max_sequences)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.page_size = page_size
        self.num_pages = math.ceil(capacity_tokens / page_size)
        self.capacity_tokens = self.num_pages * page_size
        self.has_state_pools = any(isinstance(spec, StateSpec) for spec in specs)
        """Whether some layer is recurrent: its state would step through padding, so a step's sequences
        must then all take ``tokens`` positions."""
        default = min(self.num_pages, DEFAULT_MAX_SEQUENCES) if self.has_state_pools else self.num_pages
        self.max_sequences = max_sequences or default
        self.specs = list(specs)
        self.prototypes = list(prototypes)
        self._sized_specs: dict[tuple[int, int], LayerSpec | StateSpec] = {}
        self.windows = list(windows or [None] * len(self.specs))
        """Per layer, the window its attention is bounded by (None: every position)."""
        self._bounds = {None if w is None else w.max_size for s, w in zip(self.specs, self.windows) if isinstance(s, LayerSpec)}
        """The attention layers' slot bounds (None: unbounded), for ``slots_for``."""
        self.storage: list[SlotBuffers | StatePool] = []
        self.states: dict[int, SequenceState | None] = {}
        """Per attention layer, what its scheme keeps per sequence beside the pages (None: nothing)."""
        shared: dict = {}  # the layers' ``sequence_state(..., shared)``: what they keep once for all
        for spec, prototype, window in zip(self.specs, self.prototypes, self.windows, strict=True):
            if isinstance(spec, StateSpec):
                self.storage.append(StatePool(spec, prototype.state_dtype, self.max_sequences))
                continue
            one = attrs.evolve(spec, batch_size=1, max_positions=self.capacity_tokens)
            buffers = SlotBuffers(one, self.capacity_tokens, prototype.slots.layout, stacks=prototype.slots.stacks)
            buffers.reserve(self.capacity_tokens, live=0)
            self.storage.append(buffers)
            self.states[len(self.storage) - 1] = prototype.sequence_state(
                self.max_sequences, self.capacity_tokens if window is None else window.max_size,
                None if window is None else window.keep, shared,
            )
        mx.eval([storage.arrays() if isinstance(storage, StatePool) else storage.read(stacked=True)
                 for storage in self.storage])  # fmt: skip
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._sequences: list[_Sequence] = []
        self._free_slots: list[int] = []

    # -- sequences -------------------------------------------------------------

    def open(self) -> SequenceHandle:
        """A new, empty sequence (a released slot is reused under its next generation; its
        recurrent states, if the model has any, start from zero)."""
        if self._free_slots:
            slot = self._free_slots.pop()
        elif len(self._sequences) < self.max_sequences:
            slot = len(self._sequences)
            self._sequences.append(_Sequence())
        else:
            raise OutOfPagesError(f"all {self.max_sequences} sequence slots are open (max_sequences)")
        for storage in self.storage:
            if isinstance(storage, StatePool):
                storage.reset(slot)
        for state in self.states.values():
            if state is not None:
                state.reset(slot)
        sequence = self._sequences[slot]
        sequence.live = True
        return SequenceHandle(slot, sequence.generation)

    @property
    def free_sequences(self) -> int:
        """Sequences that can still be opened."""
        return self.max_sequences - len(self._sequences) + len(self._free_slots)

    def release(self, handle: SequenceHandle) -> None:
        """Return the sequence's pages; its handle (and every copy) is refused from now on."""
        sequence = self._get(handle)
        for state in self.states.values():
            if state is not None:
                state.reset(handle.slot)  # before its pages can be another sequence's
        self._free_pages.extend(reversed(sequence.pages))
        sequence.pages, sequence.length, sequence.live = [], 0, False
        sequence.generation += 1
        self._free_slots.append(handle.slot)

    def length(self, handle: SequenceHandle) -> int:
        """Positions the sequence holds."""
        return self._get(handle).length

    def pages_held(self, handle: SequenceHandle) -> int:
        """Pages the sequence holds."""
        return len(self._get(handle).pages)

    def reserve(self, handle: SequenceHandle, positions: int) -> None:
        """Give the sequence pages for ``positions`` positions in all, or raise ``OutOfPagesError``
        (nothing taken) when the free pages do not hold them."""
        sequence = self._get(handle)
        needed = self.pages_for(positions) - len(sequence.pages)
        if needed <= 0:
            return
        if needed > len(self._free_pages):
            raise OutOfPagesError(
                f"sequence slot {handle.slot} needs {needed} more pages of {self.page_size} positions for "
                f"{positions} positions; {len(self._free_pages)} of {self.num_pages} are free"
            )
        sequence.pages.extend(self._free_pages.pop() for _ in range(needed))

    def pages_for(self, positions: int) -> int:
        """Pages that a sequence of ``positions`` positions takes: a layer under a window holds at most
        its ``max_size`` of them, so where every attention layer has one, fewer pages than positions."""
        return math.ceil(self.slots_for(positions) / self.page_size)

    def slots_for(self, positions: int) -> int:
        """Slots a sequence of ``positions`` positions uses in the layer that needs most."""
        return max((positions if bound is None else min(positions, bound) for bound in self._bounds), default=0)

    @property
    def free_pages(self) -> int:
        return len(self._free_pages)

    def _get(self, handle: SequenceHandle) -> _Sequence:
        if not isinstance(handle, SequenceHandle) or not 0 <= handle.slot < len(self._sequences):
            raise StaleSequenceError(f"{handle!r} is not a sequence of these caches")
        sequence = self._sequences[handle.slot]
        if sequence.generation != handle.generation or not sequence.live:
            now = f"; the slot now holds generation {sequence.generation}" if sequence.live else ""
            raise StaleSequenceError(
                f"sequence slot {handle.slot} (generation {handle.generation}) was released{now}: its handle is stale"
            )
        return sequence

    # -- snapshots ----------------------------------------------------------------

    def export_sequence(self, handle: SequenceHandle) -> SequenceSnapshot:
        """A copy of the sequence's contents now (evaluated, so that it holds no reference to the pages,
        which the next write would otherwise have to copy whole)."""
        sequence = self._get(handle)
        table = mx.array([sequence.pages], dtype=mx.int32)
        layers = []
        for index, storage in enumerate(self.storage):
            if isinstance(storage, StatePool):
                layers.append({"conv": storage.conv[handle.slot], "state": storage.state[handle.slot]})
                continue
            state = self.states[index]
            if state is not None:
                state.flush(storage)
            layer = storage.read_at(page_slots(table, self.page_size, self._slots_of(index, sequence.length)))
            if state is not None:
                layer.update({f"state.{name}": array for name, array in state.export(handle.slot).items()})
            layers.append(layer)
        mx.eval(layers)
        return SequenceSnapshot(sequence.length, layers, self.truncatable(sequence.length))

    def truncatable(self, positions: int) -> bool:
        """Whether the first positions of a sequence of ``positions`` are what a sequence holding only them
        would hold: no recurrent layer, and no window wrapped (``SequenceSnapshot.truncatable``)."""
        return not self.has_state_pools and all(w is None or positions <= w.max_size for w in self.windows)

    def import_sequence(self, handle: SequenceHandle, snapshot: SequenceSnapshot, positions: int) -> None:
        """Make an empty sequence, whose pages hold ``positions`` positions (``reserve``), hold the first
        ``positions`` of ``snapshot`` (``SequenceSnapshot.usable``), taken of a sequence of these caches."""
        sequence = self._get(handle)
        if sequence.length:
            raise ConfigError(f"sequence slot {handle.slot} holds {sequence.length} positions: import into an empty one")
        if not snapshot.usable(positions) or len(snapshot.layers) != len(self.storage):
            raise ConfigError(f"this snapshot of {snapshot.length} positions cannot give its first {positions} "
                              f"(a prefix of it is usable: {snapshot.truncatable})")  # fmt: skip
        if self.slots_for(positions) > len(sequence.pages) * self.page_size:
            raise OutOfPagesError(f"sequence slot {handle.slot} holds pages for {len(sequence.pages) * self.page_size} "
                                  f"slots, not {self.slots_for(positions)}: reserve them first")  # fmt: skip
        table = mx.array([sequence.pages], dtype=mx.int32)
        for index, (storage, layer) in enumerate(zip(self.storage, snapshot.layers)):
            if isinstance(storage, StatePool):
                storage.conv[handle.slot], storage.state[handle.slot] = layer["conv"], layer["state"]
                continue
            slots = self._slots_of(index, positions)
            rows = {name: array[:, :, :slots] for name, array in layer.items() if not name.startswith("state.")}
            storage.write_at(page_slots(table, self.page_size, slots).reshape(-1), rows)
            state = self.states[index]
            if state is not None:
                state.restore(handle.slot, {n[len("state."):]: a for n, a in layer.items() if n.startswith("state.")}, slots)
        sequence.length = positions

    def _slots_of(self, index: int, positions: int) -> int:
        """Slots a sequence of ``positions`` positions uses in attention layer ``index``."""
        window = self.windows[index]
        return positions if window is None else min(positions, window.max_size)

    # -- bytes -------------------------------------------------------------------

    @property
    def nbytes_allocated(self) -> int:
        """Bytes of the pages of every attention layer (allocated whole at creation) and of what their
        schemes keep per sequence beside them (``SequenceState``, ``max_sequences`` rows each)."""
        pages = sum(a.nbytes for s in self.storage if isinstance(s, SlotBuffers) for a in s.read(stacked=True).values())
        return pages + self.sequence_state_bytes

    @property
    def bytes_per_position(self) -> int:
        """Bytes one position takes in the pages of every attention layer (the schemes' own layouts)."""
        return sum(p.bytes_per_slot for p in self.prototypes if isinstance(p, BufferedSlotCache))

    @property
    def sequence_state_bytes(self) -> int:
        """Bytes of what the attention schemes keep per sequence beside the pages (``SequenceState``,
        ``max_sequences`` rows each)."""
        return sum(a.nbytes for state in self.states.values() if state is not None for a in state.arrays())

    @property
    def state_bytes(self) -> int:
        """Bytes of the recurrent layers' state pools (``max_sequences`` rows each)."""
        return sum(a.nbytes for s in self.storage if isinstance(s, StatePool) for a in s.arrays())

    @property
    def live_positions(self) -> int:
        """Positions held by the open sequences, together."""
        return sum(s.length for s in self._sequences if s.live)

    @property
    def nbytes_live(self) -> int:
        """Bytes that encode the live positions of every open sequence, all attention layers (a layer
        under a window holds at most its ``max_size`` of them), and the open sequences' rows of the
        schemes' ``SequenceState``s."""
        lengths = [s.length for s in self._sequences if s.live]
        pages = sum(p.bytes_per_slot * sum(self._slots_of(index, n) for n in lengths)
                    for index, p in enumerate(self.prototypes) if isinstance(p, BufferedSlotCache))  # fmt: skip
        return pages + self.sequence_state_bytes * len(lengths) // self.max_sequences

    # -- a forward ---------------------------------------------------------------

    def step(self, handles: Sequence[SequenceHandle], tokens: int, counts: Sequence[int] | None = None) -> BatchedStep:
        """A forward of ``tokens`` new positions for each of ``handles`` (whose pages must hold them), or
        of ``counts[b]`` for sequence ``b``, padded to ``tokens`` (``BatchedStep``)."""
        return BatchedStep(self, [self._get(h) for h in handles], handles, tokens, counts)

    @property
    def max_positions(self) -> int | None:
        """Positions one sequence may hold: the least of the attention layers' own capacity (the
        context a single cache holds) where no window bounds them; None where every layer is bounded
        or recurrent."""
        limits = [p.capacity for p, w in zip(self.prototypes, self.windows)
                  if isinstance(p, BufferedSlotCache) and w is None and p.capacity is not None]  # fmt: skip
        return min(limits, default=None)

    def spec_for(self, index: int, sequences: int) -> LayerSpec | StateSpec:
        """Layer ``index``'s spec sized for a step of ``sequences`` (made once per size: a decode step's
        host time is what it builds, and every step of the same batch asks for the same specs)."""
        key = (index, sequences)
        if key not in self._sized_specs:
            self._sized_specs[key] = attrs.evolve(self.specs[index], batch_size=sequences)
        return self._sized_specs[key]

    def views(self, step: BatchedStep) -> list[BatchedLayer | BatchedStateLayer]:
        """One view per layer for ``step``: what the model's layers take as caches."""
        return [(BatchedStateLayer if isinstance(spec, StateSpec) else BatchedLayer)(self, index, step)
                for index, spec in enumerate(self.specs)]  # fmt: skip


def capacity_for(positions: Sequence[int], page_size: int = PAGE_SIZE) -> int:
    """The ``capacity_tokens`` (whole pages) that hold sequences of ``positions`` positions each, one
    page table per sequence: what ``make_batched_caches`` takes to fit exactly those sequences."""
    return sum(-(-n // page_size) for n in positions) * page_size


def page_slots(table: mx.array, page_size: int, length: int) -> mx.array:
    """The slots of each sequence's first ``length`` positions ``[sequences, length]``, from its page
    table ``[sequences, pages]``: position ``p`` in slot ``table[b, p // page_size] * page_size + p %
    page_size``: where batched storage reads each sequence's positions (``Placement.read_index``)."""
    slots = table[:, :, None] * page_size + mx.arange(page_size, dtype=mx.int32)
    return slots.reshape(table.shape[0], -1)[:, :length]


def gather_pages(storage: mx.array, table: mx.array, page_size: int, length: int) -> mx.array:
    """Each sequence's first ``length`` positions of one paged storage array ``[1, heads, slots, width]``,
    ``[sequences, heads, length, width]``, through its page table: what a paged kernel's reference
    reads (``page_slots``, then ``slots.gather_rows``, as batched storage reads its pages)."""
    return gather_rows(storage, page_slots(table, page_size, length))


def live_mask(lengths: mx.array, length: int) -> mx.array:
    """``[sequences, 1, 1, length]``: which of ``length`` gathered positions each sequence attends to
    (its first ``lengths[b]``), as a single query token's attention mask."""
    return (mx.arange(length, dtype=mx.int32)[None] < lengths[:, None])[:, None, None]


class BatchedStep:
    """A forward over some sequences, ``tokens`` new positions each, shared by every layer: the
    sequences' positions and rows, and, per window, where rows go and what each attends to
    (``placement``).

    With ``counts``, sequence ``b`` takes only its first ``counts[b]`` positions (prompts of
    different lengths prefilled together): its rows past them are padding, never written, never
    attended to by a real row (their keys lie after every real query), and its next-token logits
    are those of row ``counts[b] - 1``. Not where a layer is recurrent (``has_state_pools``)."""

    def __init__(self, caches: BatchedCaches, sequences: list[_Sequence], handles: Sequence[SequenceHandle], tokens: int,
                 counts: Sequence[int] | None = None):  # fmt: skip
        if not sequences:
            raise ConfigError("a batched step needs at least one sequence")
        if len({h.slot for h in handles}) != len(handles):
            raise ConfigError("a batched step takes each sequence once")
        counts = [tokens] * len(sequences) if counts is None else list(counts)
        if len(counts) != len(sequences) or not all(0 < n <= tokens for n in counts):
            raise ConfigError(f"counts must give each of the {len(sequences)} sequences 1..{tokens} positions; got {counts}")
        if caches.has_state_pools and min(counts) < tokens:
            raise ConfigError("a step over recurrent layers takes every sequence's tokens whole (counts == tokens): "
                              "a recurrent state would step through the padding")  # fmt: skip
        starts = [s.length for s in sequences]
        for handle, sequence, start, count in zip(handles, sequences, starts, counts):
            held, needed = len(sequence.pages) * caches.page_size, caches.slots_for(start + count)
            if needed > held:
                raise OutOfPagesError(f"sequence slot {handle.slot} holds pages for {held} slots, not {needed}: "
                                      "reserve them first")  # fmt: skip
        self.caches, self.sequences, self.tokens, self.starts = caches, sequences, tokens, starts
        self.counts = counts
        """Each sequence's new positions (``tokens`` unless the step is ragged)."""
        self.ragged = min(counts) < tokens
        self.positions = starts[0] if len(sequences) == 1 else mx.array(starts, dtype=mx.int32)
        self.slots = [h.slot for h in handles]
        """Each sequence's slot: its row in the recurrent layers' state pools and in ``SequenceState``s."""
        self.rows = mx.array(self.slots, dtype=mx.int32)
        self._placements: dict[tuple[Window | None, bool], Placement] = {}

    def placement(self, window: Window | None, *, fresh: bool = False) -> Placement:
        """Where this step's rows go and what each sequence attends to, in a layer under ``window``;
        with ``fresh``, a chunk attends to its own rows as they came (``Placement``)."""
        key = (window, fresh and self.tokens > 1)
        if key not in self._placements:
            self._placements[key] = Placement(self, window, fresh=key[1])
        return self._placements[key]

    def advance(self) -> None:
        """Count the step's positions as held (after its forward is built)."""
        for sequence, count in zip(self.sequences, self.counts):
            sequence.length += count


class Placement:
    """A step's slots in the layers under one window (None: slot ``p`` holds position ``p``).

    Under a window of ``max_size`` with ``keep`` sinks, position ``p >= keep`` lives in slot
    ``keep + (p - keep) % ring`` (``butter_core.window``). A step whose chunk makes some
    sequence's ring wrap (``wraps``) attends over the stored slots plus the chunk's own rows
    under a mask of absolute positions, then writes only the rows that survive, as
    ``WindowCache`` does; so does any chunk of a ``fresh`` placement (a scheme with a
    ``SequenceState``: butter-aura attends to a chunk as it came, not decoded from its codes).
    Any other step writes every row, then attends over the live slots.
    """

    def __init__(self, step: BatchedStep, window: Window | None, *, fresh: bool = False):
        page, tokens, starts, counts = step.caches.page_size, step.tokens, step.starts, step.counts

        def slot(p: int) -> int:
            return p if window is None else window.slot_of(p)

        def physical(sequence: _Sequence, s: int) -> int:
            return sequence.pages[s // page] * page + s % page

        cap = math.inf if window is None else window.max_size
        self.wrapping = [tokens > 1 and start + n > cap for start, n in zip(starts, counts)]
        """Which sequences' chunks wrap their rings in this step."""
        self.wraps = any(self.wrapping)
        self.fresh = fresh or self.wraps
        """Whether the chunk attends to the stored slots plus its own rows (read before the write)."""
        kept = (range(start, start + n) if not self.wraps else window.survivors(start, start + n)
                for start, n in zip(starts, counts))  # fmt: skip
        entries = [(b, b * tokens + p - start, slot(p), p)
                   for b, (start, positions) in enumerate(zip(starts, kept)) for p in positions]  # fmt: skip
        self.written = Written.of(entries)
        """The rows this step writes, in position order per sequence (``SequenceState.write``)."""
        self.physical = np.array([physical(step.sequences[b], s) for b, _, s, _ in entries], dtype=np.int64)
        """The physical slot of each row written (``written``'s order), on the host."""
        self.write_slots = mx.array(self.physical, dtype=mx.int32)
        self.write_rows = mx.array(self.written.row, dtype=mx.int32) if self.wraps or step.ragged else None
        """The rows of the step written (None: all), when some are not: a wrapping chunk's or padding."""
        live = [min(start if self.fresh else start + n, cap) for start, n in zip(starts, counts)]
        self.length = max(max(live), 1)
        held = -(-self.length // page)
        self.table = mx.array([s.pages[:held] + [s.pages[0]] * (held - min(held, len(s.pages))) for s in step.sequences],
                              dtype=mx.int32)  # fmt: skip
        """Each sequence's pages ``[sequences, pages]`` (padded with its first), for paged kernels."""
        self.live = live
        """Each sequence's slots to attend to (host ints)."""
        self.lengths = mx.array(live, dtype=mx.int32)
        self.read_index = page_slots(self.table, page, self.length)
        queries = mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(tokens, dtype=mx.int32)  # [B, T]
        self.in_order = self.fresh and len(starts) == 1 and not step.ragged and starts[0] + tokens <= cap
        """A fresh chunk of one sequence whose slots ``[0, live)`` hold its positions in order (no ring
        has wrapped): it attends to them and its own rows under MLX's causal mask, which its fused
        attention applies without a mask array (one of ``[tokens, live + tokens]`` bytes would be
        made, and where no fused kernel serves it, a score matrix as large: issue 33's prefill peak)."""
        if self.in_order:
            self.mask = "causal"
        elif self.fresh:
            held_positions = [
                [s if start <= cap or s < window.keep else window.ring_position(s, start - 1) for s in range(n)]
                + [2**30] * (self.length - n)
                for start, n in zip(starts, live)
            ]  # fmt: skip
            keys = mx.concatenate([mx.array(held_positions, dtype=mx.int32), queries], axis=1)[:, None]  # [B, 1, S+T]
            visible = keys <= queries[:, :, None] if window is None else window.visible(keys, queries[:, :, None])
            self.mask = visible[:, None]
        elif len(starts) == 1 and not step.ragged:
            self.mask = "causal" if tokens > 1 else None
        else:
            key_slots = mx.arange(self.length, dtype=mx.int32)[None, None]
            visible = (key_slots <= queries[:, :, None]) & (key_slots < self.lengths[:, None, None])
            self.mask = visible[:, None]


class StepView:
    """One layer's view of a ``BatchedStep``, sized for its sequences."""

    def __init__(self, caches: BatchedCaches, index: int, step: BatchedStep):
        self.caches, self.index, self.step = caches, index, step
        self.spec = caches.spec_for(index, len(step.sequences))

    @property
    def absolute_position(self) -> int | mx.array:
        """Each sequence's next position (an int for one sequence, else ``[batch]``): RoPE offsets."""
        return self.step.positions


class BatchedLayer(StepView):
    """An attention layer's view: the ``AttentionCache`` call a model's attention makes."""

    def update_and_attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float) -> mx.array:
        check_chunk(self.spec, keys, values, queries)
        if keys.shape[2] != self.step.tokens:
            raise ConfigError(f"layer {self.spec.layer_index}: {keys.shape[2]} tokens in a step of {self.step.tokens}")
        prototype, storage = self.caches.prototypes[self.index], self.caches.storage[self.index]
        state = self.caches.states[self.index]
        place = self.step.placement(self.caches.windows[self.index], fresh=state is not None)
        if place.fresh:
            rows = prototype.encode(keys, values)
            # A wrapping chunk overwrites slots it must first read; any other writes no slot it reads, and
            # writes first, as a single cache does, so that its rows take their place in the sequence state.
            if not place.wraps:
                self._write(place, keys, values, rows)
            stored_keys, stored_values = self._stored(place)
            if place.in_order:  # the causal mask sees every stored slot: only the live ones
                live = place.live[0]
                stored_keys, stored_values = stored_keys[:, :, :live], stored_values[:, :, :live]
            chunk_keys, chunk_values = self._chunk_rows(place, rows, keys, values)
            out = attend(queries, mx.concatenate([stored_keys, chunk_keys.astype(stored_keys.dtype)], axis=2),
                         mx.concatenate([stored_values, chunk_values.astype(stored_values.dtype)], axis=2),
                         scale=scale, mask=place.mask)  # fmt: skip
            if place.wraps:
                self._write(place, keys, values, rows)
            return out
        self._write(place, keys, values)
        if self.step.tokens == 1:
            page = self.caches.page_size
            buffers = KernelBuffers(storage)
            out = (prototype.paged_decode(queries, buffers, place.table, place.lengths, page, place.length, scale)
                   if state is None else
                   state.paged_decode(queries, buffers, place.table, place.live, page, scale, self.step.slots))  # fmt: skip
            if out is not None:
                return out.astype(queries.dtype)
        stored_keys, stored_values = self._stored(place)
        return attend(queries, stored_keys, stored_values, scale=scale, mask=place.mask)

    def _chunk_rows(self, place: Placement, rows: dict[str, mx.array], keys: mx.array,
                    values: mx.array) -> tuple[mx.array, mx.array]:  # fmt: skip
        """The chunk's own keys and values as a fresh placement attends to them: as they came where the
        chunk wraps its sequence's ring or the layer has a sequence state (as a single cache attends),
        else as written and read back (``decode`` of their encoded ``rows``), as a single cache that
        wrote them first reads."""
        if self.caches.states[self.index] is not None or all(place.wrapping):
            return keys, values
        prototype = self.caches.prototypes[self.index]
        coded_keys, coded_values = prototype.decode(unstack(rows, prototype.slots.stacks))
        wrapping = mx.array(place.wrapping)[:, None, None, None]
        return (mx.where(wrapping, keys.astype(coded_keys.dtype), coded_keys),
                mx.where(wrapping, values.astype(coded_values.dtype), coded_values))  # fmt: skip

    def _write(self, place: Placement, keys: mx.array, values: mx.array, rows: dict[str, mx.array] | None = None) -> None:
        """Scatter the step's rows, encoded (``rows`` where the caller has them), into the pages, and tell
        the sequence state of the keys and values they encode; or leave them to the state, where it
        takes them (``SequenceState.defer``), after writing any it took before otherwise."""
        storage, state = self.caches.storage[self.index], self.caches.states[self.index]
        if state is not None:
            if state.defer(self.step.slots, place.written, place.physical, keys, values, storage):
                return
            state.flush(storage)
        rows = self.caches.prototypes[self.index].encode(keys, values) if rows is None else rows
        storage.write_at(place.write_slots, rows, take=place.write_rows)
        if state is not None:
            state.write(self.step.slots, place.written, keys, values)

    def _stored(self, place: Placement) -> tuple[mx.array, mx.array]:
        """Each sequence's first ``place.length`` slots, gathered from its pages and decoded (then
        amended by the sequence state)."""
        state = self.caches.states[self.index]
        if state is not None:
            state.flush(self.caches.storage[self.index])
        keys, values = self.caches.prototypes[self.index].decode(self.caches.storage[self.index].read_at(place.read_index))
        return (keys, values) if state is None else state.read(self.step.slots, place.length, keys, values)


class StatePool:
    """A recurrent layer's states for many sequences: the convolution's last inputs
    ``[rows, K - 1, conv_dim]`` and the state ``[rows, *state_shape]``, one row per sequence slot."""

    def __init__(self, spec: StateSpec, state_dtype: mx.Dtype, rows: int):
        self.conv = mx.zeros((rows, spec.conv_kernel - 1, spec.conv_dim), dtype=spec.dtype)
        self.state = mx.zeros((rows, *spec.state_shape), dtype=state_dtype)

    def arrays(self) -> list[mx.array]:
        return [self.conv, self.state]

    def reset(self, row: int) -> None:
        """Zero a row: where a new sequence starts."""
        self.conv[row] = 0
        self.state[row] = 0


class BatchedStateLayer(StepView):
    """A recurrent layer's view: the ``StateCache`` call a mixer makes. The step's rows of the pool
    are gathered, run through the scheme's ``mix`` (its kernels where it has them) and written back."""

    def update_and_mix(self, mixer, *inputs: mx.array) -> mx.array:
        prototype, pool, rows = self.caches.prototypes[self.index], self.caches.storage[self.index], self.step.rows
        StateCache.check_inputs(self, mixer, inputs[0])
        out, conv, state = prototype.mix(mixer, pool.conv[rows], pool.state[rows], *inputs)
        pool.conv[rows] = conv.astype(pool.conv.dtype)
        pool.state[rows] = state.astype(pool.state.dtype)
        return out
