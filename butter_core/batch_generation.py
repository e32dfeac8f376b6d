"""``BatchGeneration``: continuous batching — sequences join and leave between steps, decoded together.

::

    caches = model.engine.make_batched_caches(capacity_tokens=65536)
    batch = model.generate_batch(caches)
    first = batch.add(model.encode_prompt("Once upon a time"), max_tokens=64)
    for sequence_id, token in batch:          # tokens of every sequence, as they come
        ...
        if sequence_id == first and token == 13:
            batch.add(model.encode_prompt("A second prompt"))   # joins at the next step

Each ``step``: admit waiting sequences whose prompt and ``max_tokens`` fit the free pages less
those promised to running ones (in the order they were added, while a sequence slot is free),
decode one token for every running sequence in one forward
(``[sequences, 1]``), then prefill the next chunks of the admitted sequences still reading their
prompts, in admission order, as many as fit ``prefill_chunk`` tokens padded to the longest
(``[sequences, tokens]``, each sequence taking its own count: ``BatchedStep``; with recurrent
layers only chunks of one length share a forward).
The tokens a step samples stay on the device: the next step feeds them and queues its own
work before the host reads them (a decode step is host-bound on a GPU otherwise), so a
sequence that reads a stop id has had one more token computed, never yielded. Each sequence has its own sampler, ``max_tokens`` and stop
ids; a stop id ends it unyielded, as in ``Model.generate``. With a ``PrefixCache``, a sequence
that has read its whole prompt leaves a copy of its caches there, and one admitted later starts
from the kept prompt that shares most of its own (``cached_tokens``), prefilling only the rest. A sequence that ends releases its
pages at once (``BatchedCaches.release``).

Demand admission: a sequence is admitted with a liability, the pages its prompt plus
``max_tokens`` need, and takes them as it grows (before each step, the pages its new positions
need). The pages free for admission are the free pages less every running sequence's liability
not yet taken (``promised_pages``), so a running sequence never runs out of room; its
reservation is reconciled with its growth step by step, and one that stops early never takes the
rest. A sequence's tokens do not depend on its
neighbours: rows are independent in every layer, and attention masks each sequence to its own
positions (a padded batch changes the order of floating-point sums only).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator

import attrs
import mlx.core as mx
import numpy as np

from butter_core.batched import BatchedCaches, SequenceHandle
from butter_core.engine import Engine, TokenIds
from butter_core.errors import ConfigError
from butter_core.generation import check_request
from butter_core.prefix_cache import PrefixCache, shared_prefix
from butter_core.sampling import GREEDY, Sampler


@attrs.frozen
class Token:
    """A sampled token on the device: ``array`` itself (a scalar), or its row ``row`` (a decode
    step's greedy tokens are one array, a row per sequence)."""

    array: mx.array
    row: int | None = None


def sample_rows(logits: mx.array, samplers: list[Sampler]) -> list[Token]:
    """The next token of each row of ``logits`` ``[rows, vocab]`` by its sampler: where every one is
    greedy, one argmax over all the rows (one operation a step, not one per sequence), else each
    row's own sampler (seeded samplers draw as they would alone)."""
    if all(sampler.greedy for sampler in samplers):
        tokens = mx.argmax(logits, axis=-1).astype(mx.uint32)
        return [Token(tokens, row) for row in range(len(samplers))]
    return [Token(sampler(logits[row])) for row, sampler in enumerate(samplers)]


def gathered(tokens: list[Token]) -> mx.array:
    """The tokens as one vector: the array they are the rows of, where they are all its rows in
    order (a greedy decode step's, fed back whole and read back whole); else stacked (on a GPU,
    MLX stacks with a copy per token)."""
    whole = tokens[0].array
    if whole.ndim == 1 and whole.shape[0] == len(tokens) and all(
            t.array is whole and t.row == i for i, t in enumerate(tokens)):  # fmt: skip
        return whole
    return mx.stack([t.array if t.row is None else t.array[t.row] for t in tokens])


@attrs.define
class _Request:
    prompt: mx.array
    tokens: np.ndarray
    """The prompt on the host (the prefix cache's keys)."""
    max_tokens: int
    sampler: Sampler
    stop_ids: frozenset[int]
    handle: SequenceHandle | None = None
    fed: int = 0
    """Prompt tokens prefilled so far."""
    sampled: int = 0
    """Tokens sampled so far, the last possibly not yet read."""
    generated: int = 0
    """Tokens read (yielded, or the stop id that ended it)."""
    liability: int = 0
    """Pages its prompt plus ``max_tokens`` need, promised at admission."""
    pending: Token | None = None
    """The last token sampled, on the device, to be fed at the next decode step (None: none to
    feed; the last of ``max_tokens`` is never fed)."""


class BatchGeneration:
    """Many sequences generated together by ``engine`` over ``caches`` (``Engine.make_batched_caches``);
    iterate for ``(sequence_id, token_id)`` pairs until every added sequence has ended.
    ``stop_ids``: a sequence's stop ids unless ``add`` gives its own (``Model.generate_batch``: the
    model's end-of-sequence ids)."""

    def __init__(self, engine: Engine, caches: BatchedCaches, *, stop_ids: Collection[int] = (),
                 prefill_chunk: int | None = None, prefix_cache: PrefixCache | None = None):  # fmt: skip
        self.engine = engine
        self.prefix_cache = prefix_cache
        """Where prompts read whole are kept, and joining sequences start from (None: no reuse)."""
        self.stop_ids = frozenset(stop_ids)
        self.caches = caches
        chunk = self.engine.prefill_chunk if prefill_chunk is None else prefill_chunk
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk <= 0:
            raise ConfigError(f"prefill_chunk must be a positive integer, got {chunk!r}")
        self.prefill_chunk = chunk
        self._waiting: dict[int, _Request] = {}
        self._running: dict[int, _Request] = {}
        self.finish_reasons: dict[int, str] = {}
        """Sequence id -> "stop", "length" or "cancelled", once it has ended."""
        self.cached_tokens: dict[int, int] = {}
        """Sequence id -> prompt tokens it took from the prefix cache, once it is admitted."""
        self._in_flight: tuple[list[int], mx.array | None] = ([], None)
        """The sequences whose tokens the last step sampled, and those tokens (not read yet)."""
        self._next_id = 0

    def add(
        self, prompt_ids: TokenIds, *, max_tokens: int = 256, sampler: Sampler | None = None,
        stop_ids: Collection[int] | None = None,
    ) -> int:  # fmt: skip
        """Queue a sequence; it joins at the next step its pages are free. Returns its id. Refused
        (``ContextLengthError``) where the prompt and ``max_tokens`` pass the context a single
        sequence may hold, as ``Model.generate`` refuses them, or (``ConfigError``) the caches' pages."""
        check_request(prompt_ids, max_tokens)
        prompt = self.engine.token_ids(prompt_ids)
        self.check_fits(prompt.size, max_tokens)
        sequence_id, self._next_id = self._next_id, self._next_id + 1
        self._waiting[sequence_id] = _Request(
            prompt, np.array(prompt, dtype=np.int64), max_tokens, sampler or GREEDY,
            self.stop_ids if stop_ids is None else frozenset(stop_ids),
        )  # fmt: skip
        return sequence_id

    def check_fits(self, prompt_tokens: int, max_tokens: int) -> None:
        """Raise ``ContextLengthError`` where ``prompt_tokens + max_tokens`` pass the context one
        sequence may hold (``BatchedCaches.max_positions``, what ``Model.generate`` refuses too), or
        ``ConfigError`` where they need more pages than the caches have."""
        what = f"the prompt's {prompt_tokens} tokens and max_tokens {max_tokens}"
        limit = self.caches.max_positions
        if limit is not None and prompt_tokens + max_tokens > limit:
            raise self.engine.context_error(prompt_tokens + max_tokens, limit, what)
        needed = self.caches.pages_for(prompt_tokens + max_tokens)
        if needed > self.caches.num_pages:
            raise ConfigError(f"{what} need {needed} pages; the batched caches hold {self.caches.num_pages} "
                              f"(capacity_tokens {self.caches.capacity_tokens})")  # fmt: skip

    def cancel(self, sequence_id: int) -> None:
        """End a waiting or running sequence now (its pages are released)."""
        if sequence_id in self._waiting:
            del self._waiting[sequence_id]
        elif sequence_id in self._running:
            self._end(sequence_id, "cancelled")
            return
        else:
            raise ConfigError(f"sequence {sequence_id} is not waiting or running")
        self.finish_reasons[sequence_id] = "cancelled"

    @property
    def active(self) -> int:
        """Sequences waiting or running."""
        return len(self._waiting) + len(self._running)

    @property
    def promised_pages(self) -> int:
        """Pages running sequences may still take: their liabilities less the pages they hold."""
        return sum(r.liability - self.caches.pages_held(r.handle) for r in self._running.values())

    @property
    def running(self) -> int:
        """Sequences admitted (holding pages), prefilling or decoding."""
        return len(self._running)

    @property
    def decoding(self) -> int:
        """Running sequences past their prompts: the next step's decode batch."""
        return sum(1 for request in self._running.values() if request.pending is not None)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        while self.active:
            yield from self.step()

    def step(self) -> list[tuple[int, int]]:
        """Admit; decode every running sequence one token; prefill one chunk; then read the tokens the
        previous step sampled (the ones returned), so that this step's graph is built and queued on
        the device before the host waits for the previous one."""
        self._admit()
        sampled: list[tuple[int, Token]] = []
        decoding = [i for i, r in self._running.items() if r.pending is not None]
        if decoding:
            requests = [self._running[i] for i in decoding]
            self._grow(requests, [1] * len(requests))
            ids = gathered([r.pending for r in requests])[:, None]
            logits = self.engine.run_batched(ids, self.caches, [r.handle for r in requests])
            sampled += zip(decoding, sample_rows(logits, [r.sampler for r in requests]))
        group = self._prefill_group()
        if group:
            requests = [self._running[i] for i in group]
            counts = [self._chunk(r) for r in requests]
            self._grow(requests, counts)
            width = max(counts)
            ids = mx.stack([mx.pad(r.prompt[r.fed : r.fed + n], (0, width - n)) for r, n in zip(requests, counts)])
            logits = self.engine.run_batched(ids, self.caches, [r.handle for r in requests], counts)
            for row, (sequence_id, request, count) in enumerate(zip(group, requests, counts)):
                request.fed += count
                if request.fed == request.prompt.size:
                    sampled.append((sequence_id, Token(request.sampler(logits[row]))))
                    self._keep_prompt(request)
            if len(sampled) == len(decoding):
                mx.async_eval(logits)
        for sequence_id, token in sampled:
            request = self._running[sequence_id]
            request.sampled += 1
            request.pending = token if request.sampled < request.max_tokens else None
        queued = gathered([token for _, token in sampled]) if sampled else None
        if queued is not None:
            mx.async_eval(queued)
        previous, self._in_flight = self._in_flight, ([i for i, _ in sampled], queued)
        produced: list[tuple[int, int]] = []
        if previous[1] is not None:
            for sequence_id, token in zip(previous[0], previous[1].tolist()):
                if sequence_id in self._running:  # not ended or cancelled since
                    self._emit(sequence_id, token, produced)
        return produced

    def _grow(self, requests: list[_Request], counts: list[int]) -> None:
        """Give each request the pages for its next ``counts`` positions, out of its liability."""
        for request, count in zip(requests, counts):
            self.caches.reserve(request.handle, self.caches.length(request.handle) + count)

    def _chunk(self, request: _Request) -> int:
        """The prompt tokens ``request`` prefills next: at most ``prefill_chunk``."""
        return min(self.prefill_chunk, request.prompt.size - request.fed)

    def _prefill_group(self) -> list[int]:
        """The sequences this step prefills together: admitted ones still reading their prompts, in
        admission order, while their next chunks, each padded to the longest, hold ``prefill_chunk``
        tokens in all (the first one always). Where a layer is recurrent, padding would step its
        state, so only chunks as long as the first one's join it."""
        waiting = [(i, r) for i, r in self._running.items() if r.fed < r.prompt.size]
        if not waiting:
            return []
        if self.caches.has_state_pools:
            size = self._chunk(waiting[0][1])
            same = [i for i, r in waiting if self._chunk(r) == size]
            return same[: max(1, self.prefill_chunk // size)]
        group, width = [], 0
        for sequence_id, request in waiting:
            wider = max(width, self._chunk(request))
            if group and wider * (len(group) + 1) > self.prefill_chunk:
                break
            group.append(sequence_id)
            width = wider
        return group

    def _admit(self) -> None:
        promised = self.promised_pages
        for sequence_id, request in list(self._waiting.items()):
            liability = self.caches.pages_for(request.prompt.size + request.max_tokens)
            if liability > self.caches.free_pages - promised or not self.caches.free_sequences:
                break
            if self._prefix_in_flight(request):
                break
            request.handle, request.liability = self.caches.open(), liability
            hit = None if self.prefix_cache is None else self.prefix_cache.lookup(request.tokens)
            if hit is not None:
                self.caches.reserve(request.handle, hit.positions)
                self.caches.import_sequence(request.handle, hit.snapshot, hit.positions)
                request.fed = hit.positions
            promised += liability - self.caches.pages_held(request.handle)
            self.cached_tokens[sequence_id] = request.fed
            self._running[sequence_id] = self._waiting.pop(sequence_id)

    def _keep_prompt(self, request: _Request) -> None:
        """Keep the prompt ``request`` has just read whole in the prefix cache (unless kept already)."""
        if self.prefix_cache is not None and request.tokens.tolist() not in self.prefix_cache:
            self.prefix_cache.insert(request.tokens.tolist(), self.caches.export_sequence(request.handle))

    def _prefix_in_flight(self, request: _Request) -> bool:
        """Whether a sequence still reading its prompt will keep one that gives ``request`` at least half its
        prompt (and a page) more than the prefix cache gives it now: then ``request`` waits for it, and the
        shared prefix is prefilled once, not by every request that arrived together (FIFO order holds:
        those behind it wait too)."""
        if self.prefix_cache is None:
            return False
        now = self.prefix_cache.positions_for(request.tokens)
        gain = max(self.caches.page_size, request.tokens.size // 2)
        for other in self._running.values():
            if other.fed < other.prompt.size:
                shared = shared_prefix(other.tokens, request.tokens[:-1])
                if (shared == other.tokens.size or self.caches.truncatable(other.tokens.size)) and shared - now >= gain:
                    return True
        return False

    def _emit(self, sequence_id: int, token: int, produced: list[tuple[int, int]]) -> None:
        request = self._running[sequence_id]
        request.generated += 1
        if token in request.stop_ids:
            self._end(sequence_id, "stop")
            return
        produced.append((sequence_id, token))
        if request.generated == request.max_tokens:
            self._end(sequence_id, "length")

    def _end(self, sequence_id: int, reason: str) -> None:
        request = self._running.pop(sequence_id)
        self.caches.release(request.handle)
        self.finish_reasons[sequence_id] = reason
