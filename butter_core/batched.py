"""Batched storage: many sequences' KV caches in shared pages, and the per-step views layers attend through.

``BatchedCaches`` holds, for every attention layer of a model, one storage of ``num_pages x
page_size`` slots in the layout of the layer's scheme (a batch-1 ``SlotBuffers``, allocated
whole when the caches are made): capacity is counted in tokens, not in batch x context. A
sequence owns pages, taken from a shared free list as it is given room (``reserve``) and
returned when it is released; its position ``p`` lives in slot ``pages[p // page_size] *
page_size + p % page_size`` of every layer.

Sequences are addressed by ``SequenceHandle(slot, generation)``. Releasing a sequence bumps
its slot's generation, so a handle kept past its release — whether or not the slot now
holds another sequence — is refused with ``StaleSequenceError`` naming the slot; it never
reads another sequence's rows.

A forward over some sequences is a ``BatchedStep``: where each new row goes, which slots each
sequence attends to (its pages, gathered), and the mask; computed once and shared by every
layer's ``BatchedLayer`` view, which is what the model's attention calls
(``update_and_attend``, ``absolute_position``: one RoPE offset per sequence). The view writes
the rows with the scheme's ``encode`` (one scatter per buffer for all sequences) and attends
over its ``decode`` of the gathered pages: every ``BufferedSlotCache`` scheme that defines
``encode``/``decode`` runs batched unchanged. (This is the pure-``mx`` path; fused kernels
that read pages in place are the next step.)

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

from butter_core.cache import LayerSpec, attend, check_chunk
from butter_core.errors import ConfigError
from butter_core.slots import BufferedSlotCache, SlotBuffers

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


class BatchedCaches:
    """Every attention layer's paged storage for many sequences (see the module docstring).

    ``prototypes`` holds one cache of each layer's scheme, whose ``encode``/``decode`` (pure
    functions of arrays) this storage uses; their own slots stay empty.
    """

    def __init__(self, specs: Sequence[LayerSpec], prototypes: Sequence[BufferedSlotCache], *,
                 capacity_tokens: int, page_size: int = PAGE_SIZE):  # fmt: skip
        for name, value in (("capacity_tokens", capacity_tokens), ("page_size", page_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {value!r}")
        self.page_size = page_size
        self.num_pages = math.ceil(capacity_tokens / page_size)
        self.capacity_tokens = self.num_pages * page_size
        self.specs = list(specs)
        self.prototypes = list(prototypes)
        self.storage: list[SlotBuffers] = []
        for spec, prototype in zip(self.specs, self.prototypes, strict=True):
            one = attrs.evolve(spec, batch_size=1, max_positions=self.capacity_tokens)
            buffers = SlotBuffers(one, self.capacity_tokens, prototype.slots.layout, row_stacks=prototype.slots.stacks)
            buffers.reserve(self.capacity_tokens, live=0)
            self.storage.append(buffers)
        mx.eval([buffers.read(stacked=True) for buffers in self.storage])
        self._free_pages = list(range(self.num_pages - 1, -1, -1))
        self._sequences: list[_Sequence] = []
        self._free_slots: list[int] = []

    # -- sequences -------------------------------------------------------------

    def open(self) -> SequenceHandle:
        """A new, empty sequence (a released slot is reused under its next generation)."""
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = len(self._sequences)
            self._sequences.append(_Sequence())
        sequence = self._sequences[slot]
        sequence.live = True
        return SequenceHandle(slot, sequence.generation)

    def release(self, handle: SequenceHandle) -> None:
        """Return the sequence's pages; its handle (and every copy) is refused from now on."""
        sequence = self._get(handle)
        self._free_pages.extend(reversed(sequence.pages))
        sequence.pages, sequence.length, sequence.live = [], 0, False
        sequence.generation += 1
        self._free_slots.append(handle.slot)

    def length(self, handle: SequenceHandle) -> int:
        """Positions the sequence holds."""
        return self._get(handle).length

    def reserve(self, handle: SequenceHandle, positions: int) -> None:
        """Give the sequence pages for ``positions`` positions in all, or raise ``OutOfPagesError``
        (nothing taken) when the free pages do not hold them."""
        sequence = self._get(handle)
        needed = math.ceil(positions / self.page_size) - len(sequence.pages)
        if needed <= 0:
            return
        if needed > len(self._free_pages):
            raise OutOfPagesError(
                f"sequence slot {handle.slot} needs {needed} more pages of {self.page_size} positions for "
                f"{positions} positions; {len(self._free_pages)} of {self.num_pages} are free"
            )
        sequence.pages.extend(self._free_pages.pop() for _ in range(needed))

    def pages_for(self, positions: int) -> int:
        """Pages that ``positions`` positions take."""
        return math.ceil(positions / self.page_size)

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

    # -- bytes -------------------------------------------------------------------

    @property
    def nbytes_allocated(self) -> int:
        """Bytes of the pages of every layer (allocated whole at creation)."""
        return sum(array.nbytes for buffers in self.storage for array in buffers.read(stacked=True).values())

    @property
    def live_positions(self) -> int:
        """Positions held by the open sequences, together."""
        return sum(s.length for s in self._sequences if s.live)

    @property
    def nbytes_live(self) -> int:
        """Bytes that encode the live positions of every open sequence, all layers."""
        return sum(prototype.bytes_per_slot for prototype in self.prototypes) * self.live_positions

    # -- a forward ---------------------------------------------------------------

    def step(self, handles: Sequence[SequenceHandle], tokens: int) -> BatchedStep:
        """A forward of ``tokens`` new positions for each of ``handles`` (whose pages must hold them)."""
        return BatchedStep(self, [self._get(h) for h in handles], handles, tokens)

    def views(self, step: BatchedStep) -> list[BatchedLayer]:
        """One view per layer for ``step``: what the model's layers take as caches."""
        return [BatchedLayer(self, index, step) for index in range(len(self.specs))]


class BatchedStep:
    """Where a forward's rows go and what each sequence attends to, shared by every layer."""

    def __init__(self, caches: BatchedCaches, sequences: list[_Sequence], handles: Sequence[SequenceHandle], tokens: int):
        if not sequences:
            raise ConfigError("a batched step needs at least one sequence")
        if len({h.slot for h in handles}) != len(handles):
            raise ConfigError("a batched step takes each sequence once")
        page = caches.page_size
        starts = [s.length for s in sequences]
        ends = [start + tokens for start in starts]
        for handle, sequence, end in zip(handles, sequences, ends):
            if end > len(sequence.pages) * page:
                raise OutOfPagesError(f"sequence slot {handle.slot} holds pages for {len(sequence.pages) * page} "
                                      f"positions, not {end}: reserve them first")  # fmt: skip
        self.caches, self.sequences, self.tokens = caches, sequences, tokens
        self.starts = starts
        writes = [s.pages[p // page] * page + p % page for s, start in zip(sequences, starts) for p in range(start, start + tokens)]
        self.write_slots = mx.array(writes, dtype=mx.int32)
        length = max(ends)
        held = -(-length // page)
        table = mx.array([s.pages[:held] + [s.pages[0]] * (held - min(held, len(s.pages))) for s in sequences], dtype=mx.int32)
        slots = (table[:, :, None] * page + mx.arange(page, dtype=mx.int32)).reshape(len(sequences), -1)
        self.read_index = slots[:, :length]
        if len(sequences) == 1:
            self.mask = "causal" if tokens > 1 else None
        else:
            queries = mx.array(starts, dtype=mx.int32)[:, None] + mx.arange(tokens, dtype=mx.int32)
            self.mask = (mx.arange(length, dtype=mx.int32)[None, None] <= queries[:, :, None])[:, None]
        self.positions = starts[0] if len(sequences) == 1 else mx.array(starts, dtype=mx.int32)

    def advance(self) -> None:
        """Count the step's positions as held (after its forward is built)."""
        for sequence in self.sequences:
            sequence.length += self.tokens


class BatchedLayer:
    """One layer's view of a ``BatchedStep``: the ``AttentionCache`` calls a model's attention makes."""

    def __init__(self, caches: BatchedCaches, index: int, step: BatchedStep):
        self.caches, self.index, self.step = caches, index, step
        self.spec = attrs.evolve(caches.specs[index], batch_size=len(step.sequences))

    @property
    def absolute_position(self) -> int | mx.array:
        """Each sequence's next position (an int for one sequence, else ``[batch]``): RoPE offsets."""
        return self.step.positions

    def update_and_attend(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float) -> mx.array:
        check_chunk(self.spec, keys, values, queries)
        if keys.shape[2] != self.step.tokens:
            raise ConfigError(f"layer {self.spec.layer_index}: {keys.shape[2]} tokens in a step of {self.step.tokens}")
        prototype, storage = self.caches.prototypes[self.index], self.caches.storage[self.index]
        storage.write_at(self.step.write_slots, prototype.encode(keys, values))
        stored_keys, stored_values = prototype.decode(storage.read_at(self.step.read_index))
        return attend(queries, stored_keys, stored_values, scale=scale, mask=self.step.mask)
