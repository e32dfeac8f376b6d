"""``SlotBuffers``: a scheme's named per-slot arrays, grown in whole steps, never per token.

Every scheme stores a few arrays that share one slot axis (raw: keys and values;
quantized schemes: codes, scales, biases); this is that bookkeeping, written once.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import mlx.core as mx

from butter_core.cache import LayerSpec, SlotCache
from butter_core.errors import ConfigError
from butter_core.sequence_state import SequenceState

GROWTH_STEP = 256
"""Buffers are allocated in whole steps of this many positions, up to capacity."""

GROWTH_FACTOR = 1.25
"""Growing on demand allocates at least this times the slots held before, so a long
prompt appended chunk by chunk copies each position a bounded number of times (about
``1 / (GROWTH_FACTOR - 1)``) instead of once per step. 1.25 keeps at most a fifth of an
allocation past what was asked for: GPU decode kernels plan their splits over allocated
slots, and memory is what this engine is for."""

Layout = dict[str, tuple[int, mx.Dtype]]
"""Buffer name -> (row width, dtype); every buffer is ``[batch, n_kv_heads, slots, width]``."""

Stacks = dict[str, tuple[str, ...]]
"""Stack name -> buffers of one width and dtype kept in one array ``[n, batch, n_kv_heads,
slots, width]`` (member ``i`` at index ``i``), so that rows an encoder emits together are
written with one slice assignment instead of one per buffer."""


def slot_update(buffer: mx.array, rows: mx.array, slot: mx.array, axis: int) -> mx.array:
    """``buffer`` with ``rows`` (one slot's: size 1 on ``axis``) at slot ``slot[0]`` of ``axis``
    (``slot`` a one-element int32 array, so a trace serves every slot): the write inside a
    scheme's traced decode step (``SlotCache.step_call``). Through ``mx.put_along_axis``,
    one scatter kernel on CUDA, where ``mx.slice_update`` at an array's slot launches two (the
    offset, then the copy); either updates in place when ``buffer`` is donated (its holder has
    let go of it: ``SlotBuffers.replace``)."""
    return mx.put_along_axis(buffer, slot.reshape((1,) * buffer.ndim), rows, axis=axis)


class SlotBuffers:
    """Arrays ``[batch, n_kv_heads, allocated, width]`` sharing one slot axis.

    Memory: buffers start at one ``GROWTH_STEP`` (a short chat on a long-context model
    holds kilobytes, not the whole context) and grow by ``GROWTH_FACTOR``, so filling
    ``n`` slots copies O(n) rows in all; a first ``reserve`` allocates what the caller knows
    it needs at once (the engine does, for prompt + max_tokens), and nothing is copied.
    Writes use MLX slice assignment, which updates in place when the buffer is donated.

    ``stacks`` keeps some buffers in one array each (``Stacks``). Every slice assignment
    is a graph node and a kernel launch per token and layer, so a decode step that writes
    six buffers pays for six where a stacked layout pays for two (measurements:
    docs/benchmarks.md, "butter_core/slots.py"). A stacked buffer is a view of its stack:
    take views afresh after each write (``read``), since a view kept alive
    keeps the stack from being updated in place.
    """

    def __init__(self, spec: LayerSpec, capacity: int, layout: Layout, step: int = GROWTH_STEP,
                 stacks: Stacks | None = None):
        self.spec = spec
        self.capacity = capacity
        self.layout = layout
        self.step = step
        self.stacks = dict(stacks or {})
        self._home: dict[str, tuple[str, int]] = {}
        """Stacked buffer -> (its stack, its index there)."""
        for stack, members in self.stacks.items():
            if stack in layout or not members or any(name not in layout for name in members):
                raise ConfigError(f"stack {stack!r} must name buffers of the layout {sorted(layout)} and "
                                  f"not be one itself; got {members}")
            if len({layout[name] for name in members}) != 1:
                raise ConfigError(f"stack {stack!r} holds buffers of different widths or dtypes: "
                                  f"{ {name: layout[name] for name in members} }")
            for i, name in enumerate(members):
                if name in self._home:
                    raise ConfigError(f"buffer {name!r} is in two stacks: {self._home[name][0]!r} and {stack!r}")
                self._home[name] = (stack, i)
        self._storage: dict[str, mx.array] = {}
        """Stack name -> ``[n, batch, heads, slots, width]``; unstacked buffer name -> ``[batch, heads, slots, width]``."""
        self._views: dict[str, mx.array] | None = None
        """``read()``'s views of every allocated slot, kept until the storage changes: a decode
        step that writes no codes (AURA's deferred encode) then reads them without building
        a ``Split`` and a ``Squeeze`` per member again. Dropped before any write, so that no
        kept view holds a buffer that an in-place update would otherwise reuse."""
        self._written_keys: set[str] = set()
        """The keys of the last rows ``write`` checked (a decode step writes the same ones each time)."""

    @property
    def allocated(self) -> int:
        """Slots allocated now (0 before the first write)."""
        return next(iter(self._storage.values())).shape[-2] if self._storage else 0

    def _storage_layout(self) -> dict[str, tuple[tuple[int, ...], int, mx.Dtype]]:
        """Storage key -> (leading stack axis or (), row width, dtype)."""
        keys = {}
        for name, (width, dtype) in self.layout.items():
            stack = self._home.get(name, (None, 0))[0]
            if stack is None:
                keys[name] = ((), width, dtype)
            elif stack not in keys:
                keys[stack] = ((len(self.stacks[stack]),), width, dtype)
        return keys

    def _empty(self, slots: int) -> dict[str, mx.array]:
        s = self.spec
        return {
            key: mx.zeros((*lead, s.batch_size, s.n_kv_heads, slots, width), dtype)
            for key, (lead, width, dtype) in self._storage_layout().items()
        }

    def reserve(self, slots: int, live: int) -> None:
        """Make at least ``slots`` slots allocated (at most the capacity in whole steps:
        ``_whole_steps``), keeping the contents of ``[0, live)``: ``slots`` rounded up to a
        ``GROWTH_STEP``, and when buffers are already allocated, at least ``GROWTH_FACTOR``
        times what they hold."""
        if slots <= self.allocated:
            return
        self._views = None
        slots = max(slots, math.ceil(self.allocated * GROWTH_FACTOR))
        grown = self._empty(min(self._whole_steps(self.capacity), -(-slots // self.step) * self.step))
        if live:
            for key, array in self._storage.items():
                grown[key][..., :live, :] = array[..., :live, :]
        self._storage = grown

    def _whole_steps(self, slots: int) -> int:
        """``slots`` rounded up to whole steps; a capacity below one step stays as it is.

        Past the capacity too (by less than a step): MLX's CUDA SDPA decodes one query with
        cuDNN, several times faster at long contexts than its vector kernel, only over a
        slice of a buffer whose slot count is a multiple of 256 (mlx-lm's step), so a
        capacity of 131,144 positions allocates 131,328 slots (docs/benchmarks.md, "Issue 32
        on an H100"). Writes past the capacity are refused all the same (``SlotCache.write``)."""
        return slots if slots < self.step else -(-slots // self.step) * self.step

    def write(self, start: int, rows: dict[str, mx.array], live: int) -> None:
        """Write ``rows`` (``tokens`` slots each) at ``[start, start + tokens)``: one array per
        buffer, or per stack (``[n, batch, heads, tokens, width]``) for its members at once."""
        if rows.keys() != self._written_keys:
            named = [name for key in rows for name in self.stacks.get(key, (key,))]
            if sorted(named) != sorted(self.layout):
                raise ConfigError(f"slot rows must name each of {sorted(self.layout)} once, alone or through "
                                  f"its stack ({sorted(self.stacks)}); got {sorted(rows)}")
            self._written_keys = set(rows)
        tokens = next(iter(rows.values())).shape[-2]
        self._views = None
        self.reserve(start + tokens, live)
        end = start + tokens
        for key, array in rows.items():  # slots: axis 2 of a buffer, 3 of a stack (explicit axes index faster than ...)
            if key in self.stacks:
                self._storage[key][:, :, :, start:end] = array.astype(self.layout[self.stacks[key][0]][1])
            elif key in self._home:
                stack, i = self._home[key]
                self._storage[stack][i : i + 1, :, :, start:end] = array.astype(self.layout[key][1])[None]
            else:
                self._storage[key][:, :, start:end] = array.astype(self.layout[key][1])

    def read(self, length: int | None = None, *, stacked: bool = False) -> dict[str, mx.array]:
        """Views of slots ``[0, length)`` (None: every allocated slot, the shape a traced kernel
        keeps between writes) of every buffer by name; with ``stacked``, of the arrays that
        hold them, by key: each stack whole (``[n, batch, heads, slots, width]``) under its
        name, each unstacked buffer under its own — a kernel reading a stack takes one input,
        not several. Before the first write, arrays of no slots."""
        storage = self._storage if self._storage and length != 0 else self._empty(0)
        if stacked:
            return {key: a if length is None else a[..., :length, :] for key, a in storage.items()}
        if length is None and storage is self._storage:
            if self._views is None:
                self._views = unstack(storage, self.stacks)
            return dict(self._views)
        return unstack(storage, self.stacks, length if storage is self._storage else None)

    def replace(self, storage: dict[str, mx.array]) -> None:
        """Take ``storage`` as the buffers: what ``read(stacked=True)`` gave, after a function wrote
        rows into it (a scheme's ``SlotCache.step_call``), each array its old shape and dtype (the keys
        are checked; shapes are the caller's, on a decode step's host path). The
        arrays given before are no longer this storage's, so a write into them updated in place."""
        if storage.keys() != self._storage.keys():
            raise ConfigError(f"replacement storage must hold {sorted(self._storage)}; got {sorted(storage)}")
        self._storage, self._views = dict(storage), None

    def clear(self) -> None:
        """Release every buffer."""
        self._storage, self._views = {}, None

    def write_at(self, slots: mx.array, rows: dict[str, mx.array], *, take: mx.array | None = None) -> None:
        """Scatter ``rows`` into arbitrary slots of a batch-1 storage: ``rows`` by this storage's keys
        (its stacks ``[n, batch, heads, tokens, width]`` and unstacked buffers) or by buffer name
        (stacked here), each ``[batch, heads, tokens, width]``; row ``(b, t)`` (flat index ``b *
        tokens + t``) to slot ``slots[b * tokens + t]``; with ``take``, only those flat rows, row
        ``take[i]`` to ``slots[i]``. Slots allocated and distinct. What a paged store
        writes with, one call per layer for every sequence of a step: one scatter per stored array
        (two for butter-affine's six buffers, kept in two stacks)."""
        if self.spec.batch_size != 1:
            raise ConfigError("write_at writes into a batch-1 storage (paged storage)")
        self._views = None
        column = slots[:, None]  # broadcast over every leading axis
        for key, array in self._as_stored(rows).items():
            *lead, batch, heads, tokens, width = array.shape
            array = array.astype(self._storage[key].dtype)
            # [..., 1, heads, batch * tokens, width]; one token each is a view (ScatterAxis reads strided updates)
            flat = (array.swapaxes(-4, -2) if tokens == 1 else
                    array.swapaxes(-4, -3).reshape(*lead, 1, heads, batch * tokens, width))  # fmt: skip
            flat = flat if take is None else mx.take(flat, take, axis=-2)
            where = mx.broadcast_to(column, flat.shape)
            self._storage[key] = mx.put_along_axis(self._storage[key], where, flat, axis=-2)

    def _as_stored(self, rows: dict[str, mx.array]) -> dict[str, mx.array]:
        """``rows`` by this storage's keys: as they come where they match them (an encoder of the same
        stacks: no operation), else by buffer name, stacked as this storage keeps them."""
        if rows.keys() == self._storage.keys():
            return rows
        stored = {key: mx.stack([rows[name] for name in members]) for key, members in self.stacks.items()}
        return stored | {name: array for name, array in rows.items() if name not in self._home}

    def read_at(self, index: mx.array) -> dict[str, mx.array]:
        """The rows of slots ``index`` (``[batch, length]``) of a batch-1 storage, by buffer name, each
        ``[batch, heads, length, width]``: one sequence's pages per batch row, gathered (``gather_rows``)."""
        return {name: gather_rows(array, index) for name, array in self.read().items()}


def gather_rows(storage: mx.array, index: mx.array) -> mx.array:
    """The rows of slots ``index`` (``[batch, length]``) of one batch-1 storage array ``[1, heads, slots,
    width]``, as ``[batch, heads, length, width]``. (``squeeze``, not ``storage[0]``: MLX gathers from
    that strided view by first copying the whole storage, which made a batched decode step's cost
    grow with the storage's capacity, docs/benchmarks.md.)"""
    return storage.squeeze(0)[:, index].transpose(1, 0, 2, 3)


def unstack(arrays: dict[str, mx.array], stacks: Stacks, length: int | None = None) -> dict[str, mx.array]:
    """Arrays keyed by stack (``[n, batch, heads, slots, width]``) or buffer name -> every
    buffer by name, as views (slots ``[0, length)`` when ``length`` is given).

    A stack's members come from one ``mx.split`` (``stack[i]`` would gather a copy), then
    a squeeze each. A decode step takes these views once per layer, so their host cost
    counts: this way takes less than half the time of per-member slicing (measurements:
    docs/benchmarks.md, "butter_core/slots.py")."""
    out = {}
    for key, array in arrays.items():
        if length is not None:  # slots are the second-to-last axis, stacked or not
            array = array[:, :, :length] if array.ndim == 4 else array[..., :length, :]
        members = stacks.get(key)
        if members is None:
            out[key] = array
        else:
            out.update(zip(members, (part.squeeze(0) for part in mx.split(array, len(members), axis=0))))
    return out


class KernelBuffers(Mapping):
    """A storage's arrays as a kernel that reads them in place is handed them: each stack whole
    under its key, and every buffer under its name, its stack member's view taken
    (``SlotBuffers.read``, kept there until the next write) only when first asked for. A kernel
    that reads the stacks whole then puts no view in a step, nor their host cost (an ``unstack``
    of butter-affine's two stacks is ~12 µs a layer on a 2-core x86 CPU)."""

    def __init__(self, buffers: SlotBuffers):
        self._buffers, self._kept, self._named = buffers, buffers.read(stacked=True), None

    def __getitem__(self, key: str) -> mx.array:
        if key in self._kept:
            return self._kept[key]
        if self._named is None:
            self._named = self._buffers.read()
        return self._named[key]

    def __iter__(self) -> Iterator[str]:
        return iter([*self._buffers.layout, *self._buffers.stacks])

    def __len__(self) -> int:
        return len(self._buffers.layout) + len(self._buffers.stacks)


class BufferedSlotCache(SlotCache):
    """A ``SlotCache`` whose storage is one ``SlotBuffers``: a scheme writes ``encode`` and ``decode``.

    ``encode(keys, values)`` turns rows into the buffers' rows, ``decode(rows)`` turns buffer
    rows (by name, any batch and slot count) back into keys and values: pure functions of
    their arrays, so the same code serves this cache's own slots (``store``, ``load``) and
    any other storage of the layout — the pages of ``butter_core.batched``. A scheme may
    still override ``store`` and ``load`` (a faster path over its whole buffers, state kept
    beside the slots). The buffers' layout gives state export/import, byte accounting and
    the list of allocated arrays.
    """

    def __init__(self, spec: LayerSpec, layout: Layout, stacks: Stacks | None = None):
        super().__init__(spec)
        self.slots = SlotBuffers(spec, self.capacity, layout, stacks=stacks)

    def encode(self, keys: mx.array, values: mx.array) -> dict[str, mx.array]:
        """Rows for the buffers (by name, or by stack ``[n, ...]``), each ``[batch, heads, tokens, width]``."""
        raise NotImplementedError(f"{type(self).__name__} does not define encode")

    def decode(self, rows: dict[str, mx.array]) -> tuple[mx.array, mx.array]:
        """Keys and values ``[batch, heads, slots, head_dim]`` (floats) of ``rows`` by buffer name."""
        raise NotImplementedError(f"{type(self).__name__} does not define decode")

    def paged_decode(
        self, queries: mx.array, buffers: Mapping[str, mx.array], table: mx.array, lengths: mx.array,
        page_size: int, length: int, scale: float,
    ) -> mx.array | None:  # fmt: skip
        """Optional: one query token per sequence attending over its pages of shared storage, read in
        place (``buffers``, a ``KernelBuffers``: every buffer by name, each ``[1, heads, slots,
        width]``, and each stack whole, ``[n, 1, heads, slots, width]``, under its key; a kernel that
        reads a stack whole puts no view of its members in the step; sequence ``b``'s
        position ``p`` in slot ``table[b, p // page_size] * page_size + p % page_size``, its live
        positions ``lengths[b]``, at most ``length``), in the queries' dtype; None where this scheme
        has no such kernel here, and batched storage gathers the pages and calls ``decode`` instead."""
        return None

    def sequence_state(self, sequences: int, capacity: int, ring_start: int | None,
                       shared: dict) -> SequenceState | None:  # fmt: skip
        """Optional: the state this scheme keeps per sequence beside its pages in batched storage
        (``butter_core.sequence_state``), ``sequences`` rows, each sequence holding at most ``capacity``
        slots, reused in turn from ``ring_start`` under a window (None: none); None where the slots are
        all (most schemes). A scheme with one decodes through ``SequenceState.paged_decode`` (not this
        class's ``paged_decode``), and a chunk attends to its own rows as they came.

        ``shared`` is one dict for every layer of the storage: the layers under one window see the
        same positions written to the same slots, so bookkeeping that depends on nothing else (which
        slot a row holds) can be kept once for all of them, under a key of the scheme's own, and
        what a step derives from it made once a step, not once a layer."""
        return None

    def store(self, start, keys, values, position):
        self.slots.write(start, self.encode(keys, values), live=self.length)

    def load(self, length):
        return self.decode(self.slots.read(length))

    def reserve(self, positions):
        self.slots.reserve(min(positions, self.capacity), live=self._length)

    def export_slots(self, length):
        return self.slots.read(length)

    def import_slots(self, arrays, length):
        if set(arrays) != set(self.slots.layout):
            raise ConfigError(
                f"{type(self).__name__} state holds {sorted(self.slots.layout)}; got {sorted(arrays)}: "
                "it was exported by another kind of cache"
            )
        self.slots.clear()
        if length:
            self.slots.write(0, {name: array[:, :, :length] for name, array in arrays.items()}, live=0)

    def buffers(self):
        return list(self.slots.read(stacked=True).values()) if self.slots.allocated else []

    @property
    def bytes_per_slot(self):
        s = self.spec
        row = sum(width * dtype.size for width, dtype in self.slots.layout.values())
        return s.batch_size * s.n_kv_heads * row
