"""``SequenceState``: what an attention scheme keeps per sequence beside its pages in batched storage.

Most schemes keep nothing but their slot buffers, which ``butter_core.batched`` pages. A scheme
that keeps state beside its slots in its own cache (butter-aura: full-precision copies of the
sinks and the newest positions, which attention reads instead of their codes) returns one of
these from ``BufferedSlotCache.sequence_state``: one row per sequence slot, told what each step
writes (``write``) and asked to amend the rows a step reads back (``read``), so that a sequence
attends in batched storage to what it would attend to alone.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx
import numpy as np

if TYPE_CHECKING:
    from butter_core.slots import SlotBuffers


@attrs.frozen(eq=False)
class Written:
    """The new rows a step writes, as host columns of equal length (int64 arrays, so that a state
    of many sequences takes note of them with array operations, not a loop): each row's sequence
    (its index in the step), its index in the step's flattened rows (``b * tokens + t`` of ``keys``
    ``[sequences, heads, tokens, head_dim]``), the sequence's slot it goes to (its position, or under
    a window ``Window.slot_of``) and its position. In position order per sequence; rows a wrapping
    chunk does not keep are left out."""

    sequence: np.ndarray
    row: np.ndarray
    slot: np.ndarray
    position: np.ndarray

    @classmethod
    def of(cls, entries: Iterable[tuple[int, int, int, int]]) -> Written:
        """From ``(sequence, row, slot, position)`` entries."""
        columns = np.array(list(entries), dtype=np.int64).reshape(-1, 4).T
        return cls(*columns)


class SequenceState:
    """Per-sequence state of one attention layer in batched storage, one row per sequence slot."""

    def reset(self, row: int) -> None:
        """Forget what row ``row`` held: a sequence opens in that slot, or leaves it (its pages are
        released: codes ``defer`` took for it are dropped, never written)."""
        raise NotImplementedError

    def write(self, rows: Sequence[int], written: Written, keys: mx.array, values: mx.array) -> None:
        """Take note of a step's new rows: ``rows[b]`` is the state row of the step's sequence ``b``,
        ``keys``/``values`` ``[sequences, heads, tokens, head_dim]`` as the layer got them."""
        raise NotImplementedError

    def defer(self, rows: Sequence[int], written: Written, slots: np.ndarray, keys: mx.array, values: mx.array,
              storage: SlotBuffers) -> bool:  # fmt: skip
        """Optional: take a step's new rows (as ``write``) and write their codes into ``storage`` later
        (``flush``), where the state can stand in for them until then (butter-aura: a decode step's
        tokens, which attention reads from their full-precision rows while they are in the recent
        ring). ``slots[i]`` is the physical slot of ``written``'s row ``i``. True where it took them:
        the caller then neither encodes nor writes them; False (the default) where it must."""
        return False

    def flush(self, storage: SlotBuffers) -> None:
        """Write into ``storage`` the codes of every row ``defer`` took and has not written: called
        before anything else writes the layer's pages or reads them other than through
        ``paged_decode``."""

    def read(self, rows: Sequence[int], length: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Amend ``keys``/``values`` ``[sequences, heads, length, head_dim]``, each sequence's slots ``[0,
        length)`` decoded from its pages, with what the state holds for them."""
        raise NotImplementedError

    def paged_decode(
        self, queries: mx.array, buffers: Mapping[str, mx.array], table: mx.array, lengths: Sequence[int], page_size: int,
        scale: float, rows: Sequence[int],
    ) -> mx.array | None:  # fmt: skip
        """Optional: ``BufferedSlotCache.paged_decode`` for a scheme with this state (the pages read in
        place, ``buffers`` as there, ``lengths`` each sequence's live slots on the host, ``rows[b]`` its
        state row); None where there is no such kernel here, and the pages are gathered, decoded and
        ``read``."""
        return None

    def export(self, row: int) -> dict[str, mx.array]:
        """What row ``row`` holds, as arrays (``BatchedCaches.export_sequence``: the prefix cache)."""
        raise NotImplementedError

    def restore(self, row: int, arrays: dict[str, mx.array], slots: int) -> None:
        """Make row ``row`` hold an ``export``, of this layer's state, keeping only what describes slots
        ``[0, slots)`` (a prefix of the exported sequence, whose later slots are not restored)."""
        raise NotImplementedError

    def arrays(self) -> list[mx.array]:
        """The arrays it holds (rows for every sequence slot), for byte accounting."""
        return []
