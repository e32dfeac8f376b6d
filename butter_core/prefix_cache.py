"""``PrefixCache``: prompts' caches kept across requests, in each scheme's own encoded form.

When a sequence of a ``BatchGeneration`` has read its whole prompt, its contents are copied out of
the pages (``BatchedCaches.export_sequence``: aura codes, affine codes, raw rows, recurrent states),
keyed by the prompt's token ids. A later sequence whose prompt shares a prefix with a kept one
starts from it (``import_sequence``) and prefills only the rest; the prompt's last token is always
fed, for its logits. A kept prompt that is longer than the shared prefix is cut to it where that is
exact (``SequenceSnapshot.truncatable``: attention layers only, no window wrapped; butter-aura then
keeps the full-precision copies of the prefix's rows it has, as ``AuraCache.trim`` does); where it is
not (recurrent states, a wrapped window) only a kept prompt that the new one extends is used.

Kept bytes are bounded (``max_bytes``), least recently used evicted first. The copies live apart from
the pages: a running sequence never shares a page with the cache, so releasing either is simple.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import attrs
import numpy as np

from butter_core.batched import SequenceSnapshot
from butter_core.errors import ConfigError


@attrs.frozen
class PrefixHit:
    """A kept prompt's snapshot and how many of its positions a new prompt reuses."""

    snapshot: SequenceSnapshot
    positions: int


class PrefixCache:
    """Snapshots of prompts by token ids, at most ``max_bytes`` of them, least recently used evicted."""

    def __init__(self, max_bytes: int):
        if not isinstance(max_bytes, int) or isinstance(max_bytes, bool) or max_bytes <= 0:
            raise ConfigError(f"the prefix cache's max_bytes must be a positive integer, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, ...], SequenceSnapshot] = OrderedDict()
        self._arrays: dict[tuple[int, ...], np.ndarray] = {}
        """Each kept prompt's tokens as an array, made once: what every lookup compares."""
        self.nbytes = 0
        """Bytes of the kept snapshots."""
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, prompt: Sequence[int]) -> PrefixHit | None:
        """The kept snapshot that gives ``prompt`` the most positions (at most all but its last token),
        marked as recently used and counted as a hit; None (a miss) where none shares a usable prefix."""
        best = self._best(np.asarray(prompt, dtype=np.int64))
        if best is None:
            self.misses += 1
            return None
        self.hits += 1
        self._entries.move_to_end(best[0])
        return best[1]

    def positions_for(self, prompt: Sequence[int]) -> int:
        """The positions ``lookup`` would give ``prompt`` now (0: none), without using the cache."""
        best = self._best(np.asarray(prompt, dtype=np.int64))
        return 0 if best is None else best[1].positions

    def _best(self, tokens: np.ndarray) -> tuple[tuple[int, ...], PrefixHit] | None:
        best = None
        for key, snapshot in self._entries.items():
            shared = shared_prefix(self._arrays[key], tokens[:-1])
            if shared and snapshot.usable(shared) and (best is None or shared > best[1].positions):
                best = key, PrefixHit(snapshot, shared)
        return best

    def __contains__(self, prompt: Sequence[int]) -> bool:
        """Whether a kept snapshot holds ``prompt`` whole: its own, or a truncatable one of a longer prompt."""
        key = tuple(int(t) for t in prompt)
        tokens = np.asarray(key, dtype=np.int64)
        return key in self._entries or any(
            len(k) > len(key) and s.truncatable and shared_prefix(self._arrays[k], tokens) == len(key)
            for k, s in self._entries.items()
        )

    def insert(self, prompt: Sequence[int], snapshot: SequenceSnapshot) -> None:
        """Keep ``snapshot`` of a sequence holding exactly ``prompt``, evicting the least recently used
        until it fits (one larger than ``max_bytes`` is not kept). Kept prompts it makes redundant, its
        own prefixes where it is truncatable, are dropped."""
        key = tuple(int(t) for t in prompt)
        if len(key) != snapshot.length:
            raise ConfigError(f"a snapshot of {snapshot.length} positions kept for a prompt of {len(key)} tokens")
        if key in self:
            return
        if snapshot.nbytes > self.max_bytes:
            return
        if snapshot.truncatable:
            for other in [k for k in self._entries if len(k) < len(key) and key[: len(k)] == k]:
                self._drop(other)
        while self._entries and self.nbytes + snapshot.nbytes > self.max_bytes:
            self._drop(next(iter(self._entries)))
        self._entries[key] = snapshot
        self._arrays[key] = np.asarray(key, dtype=np.int64)
        self.nbytes += snapshot.nbytes

    def _drop(self, key: tuple[int, ...]) -> None:
        del self._arrays[key]
        self.nbytes -= self._entries.pop(key).nbytes


def shared_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(a.size, b.size)
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n
