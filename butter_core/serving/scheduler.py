"""``Scheduler``: one model serving many requests, continuously batched on a thread of its own.

The server's request handlers run on an event loop; MLX work runs on the scheduler's thread,
which owns the model's batched caches and one ``BatchGeneration``. Handlers ``submit`` requests
and read each one's ``Ticket`` (an asyncio queue of tokens and a final event); ``cancel`` ends a
request at any stage (queued, prefilling, decoding) and releases what it holds.

Three limits, checked in this order:

- *Session pool*: at most ``max_sessions`` requests hold a sequence at once (the caches' sequence
  slots); the others wait in FIFO order (``BatchGeneration`` admits in the order requests were
  added and never passes one that does not fit).
- *Bounded queue*: at most ``max_sessions + max_queue`` requests are in the scheduler; ``submit``
  refuses one more at once (``QueueFull``: the server answers 429 with ``Retry-After``).
- *Demand admission*: a request is admitted only when the pages free and not promised to
  running requests hold its prompt plus ``max_tokens`` (its liability, in the scheme's own bytes
  per position); it takes them as it grows, so its reservation is reconciled with its growth
  step by step (``BatchGeneration``). A request that could never fit is refused at ``submit``
  (``ConfigError``). The pages a request holds and its promise are released when it ends,
  however it ends; ``ledger`` reports both, so a test can check that nothing leaked.

Under tensor parallelism (``mlx.launch -n N -- butter serve``) every rank holds its share of the
model and a scheduler of its own; rank 0 serves HTTP, and each of its steps first sends the other
ranks what changed (``broadcast_json``: requests added, with their prompt, limits and sampling,
a seed drawn for any that gave none, and sequences cancelled). The other ranks ``follow``:
they add, cancel and step alike, so every rank runs the same forward over the same sequences
and samples the same tokens.

With ``prefix_cache_bytes``, prompts read whole are kept in a ``PrefixCache`` of that many bytes
(in the scheme's encoded form, apart from the pages), and a request whose prompt shares a prefix
with a kept one prefills only the rest; its ``Ticket.cached_tokens`` says how many it reused.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import traceback
from collections.abc import Collection

import attrs
import mlx.core as mx

from butter_core.batch_generation import BatchGeneration
from butter_core.batched import BatchedCaches
from butter_core.distributed import broadcast_json, world
from butter_core.errors import ButterError
from butter_core.model import Model
from butter_core.prefix_cache import PrefixCache
from butter_core.sampling import Sampler


class QueueFull(ButterError):
    """Every session is busy and the waiting queue is full: try again later."""


@attrs.frozen
class Token:
    """One generated token of a request."""

    token_id: int


@attrs.frozen
class Finished:
    """A request's end: ``reason`` is "stop", "length" or "cancelled"; ``error`` the message when the
    engine failed while it ran (its reason is then "error")."""

    reason: str
    error: str | None = None


@attrs.frozen
class Ledger:
    """What the scheduler holds now: requests waiting and running, pages reserved (held or promised)
    and held of all pages, and the bytes reserved and allocated; prompts kept in the prefix cache and their bytes."""

    waiting: int
    running: int
    pages_reserved: int
    """Pages running requests hold or are promised."""
    pages_held: int
    """Pages running requests hold now: their observed growth."""
    pages: int
    bytes_reserved: int
    bytes_total: int
    prefix_cache_entries: int = 0
    prefix_cache_bytes: int = 0


class Ticket:
    """A submitted request: iterate ``events()`` on the event loop that submitted it for ``Token``s,
    then one ``Finished``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, prompt_tokens: int):
        self._loop = loop
        self._queue: asyncio.Queue[Token | Finished] = asyncio.Queue()
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = 0
        """Prompt tokens taken from the prefix cache (set when the request is admitted)."""
        self.sequence_id: int | None = None
        self.finished: Finished | None = None

    def _put(self, event: Token | Finished) -> None:
        """Called on the scheduler's thread."""
        if isinstance(event, Finished):
            self.finished = event
        with contextlib.suppress(RuntimeError):  # its event loop has closed: nobody reads it any more
            self._loop.call_soon_threadsafe(self._queue.put_nowait, event)

    async def events(self):
        while True:
            event = await self._queue.get()
            yield event
            if isinstance(event, Finished):
                return


@attrs.define
class _Submission:
    ticket: Ticket
    prompt: list[int]
    max_tokens: int
    sampler: Sampler
    stop_ids: Collection[int] | None


class Scheduler:
    """Serves ``model`` from batched caches of ``capacity_tokens`` positions and ``max_sessions``
    sequence slots; ``start`` runs its thread, ``close`` stops it (ending every request)."""

    def __init__(self, model: Model, *, capacity_tokens: int, max_sessions: int = 8, max_queue: int = 64,
                 prefill_chunk: int | None = None, prefix_cache_bytes: int | None = None):  # fmt: skip
        self.model = model
        self.max_sessions, self.max_queue = max_sessions, max_queue
        self._capacity_tokens, self._prefill_chunk = capacity_tokens, prefill_chunk
        self._prefix_cache_bytes = prefix_cache_bytes
        self._fresh_batch()
        self._lock = threading.Condition()
        self._publish()
        self._incoming: list[_Submission] = []
        self._cancels: list[Ticket] = []
        self._tickets: dict[int, Ticket] = {}
        self._stopping = False
        self._stopped = threading.Event()
        group = world()
        self._group = group if group.size() > 1 else None
        self._thread = threading.Thread(target=_serve_then_park, args=(self,), name="butter-scheduler", daemon=True)

    def _fresh_batch(self) -> None:
        """New caches, prefix cache and batch (at start, and after a step failed)."""
        self.caches: BatchedCaches = self.model.engine.make_batched_caches(self._capacity_tokens,
                                                                           max_sequences=self.max_sessions)  # fmt: skip
        self.prefix_cache = PrefixCache(self._prefix_cache_bytes) if self._prefix_cache_bytes else None
        self._batch: BatchGeneration = self.model.generate_batch(self.caches, prefill_chunk=self._prefill_chunk,
                                                                 prefix_cache=self.prefix_cache)  # fmt: skip

    # -- the handlers' side (any thread) -------------------------------------------

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """End every request and stop stepping (the thread parks: ``_serve_then_park``)."""
        with self._lock:
            self._stopping = True
            self._lock.notify()
        self._stopped.wait()

    def submit(self, prompt: list[int], *, max_tokens: int, sampler: Sampler,
               stop_ids: Collection[int] | None = None) -> Ticket:  # fmt: skip
        """Queue a request (on the running event loop); raises ``QueueFull`` when ``max_queue``
        requests wait already, ``ConfigError`` when it could never fit (the model's context or the
        caches' pages: ``BatchGeneration.check_fits``)."""
        self._batch.check_fits(len(prompt), max_tokens)
        ticket = Ticket(asyncio.get_running_loop(), len(prompt))
        with self._lock:  # the published count includes requests the thread has taken but not yet added
            if len(self._incoming) + self._published[0] >= self.max_sessions + self.max_queue:
                raise QueueFull(f"{self.max_sessions} sessions are busy and {self.max_queue} requests wait")
            self._incoming.append(_Submission(ticket, prompt, max_tokens, sampler, stop_ids))
            self._lock.notify()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """End ``ticket``'s request wherever it is; nothing happens if it has ended."""
        with self._lock:
            if ticket.finished is None:
                self._cancels.append(ticket)
                self._lock.notify()

    def ledger(self) -> Ledger:
        """What the scheduler's thread last published (``_publish``), with the requests submitted since."""
        with self._lock:
            active, running, held, reserved, prefix_entries, prefix_bytes = self._published
            waiting = len(self._incoming) + active - running
        caches = self.caches
        per_page = caches.bytes_per_position * caches.page_size
        return Ledger(waiting, running, reserved, held, caches.num_pages, reserved * per_page, caches.nbytes_allocated,
                      prefix_entries, prefix_bytes)  # fmt: skip

    def _publish(self, arriving: int = 0) -> None:
        """Record, holding the lock, what ``ledger`` reports: the batch and caches are touched on the
        scheduler's thread only, and a handler reads this copy (``arriving``: requests taken from the
        incoming list and not yet added)."""
        batch, caches, prefix = self._batch, self.caches, self.prefix_cache
        held = caches.num_pages - caches.free_pages
        self._published = (batch.active + arriving, batch.running, held, held + batch.promised_pages,
                           0 if prefix is None else len(prefix), 0 if prefix is None else prefix.nbytes)  # fmt: skip

    # -- the scheduler's thread ----------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._lock:
                while not (self._incoming or self._cancels or self._batch.active or self._stopping):
                    self._lock.wait()
                if self._stopping:
                    break
                incoming, self._incoming = self._incoming, []
                cancels, self._cancels = self._cancels, []
                self._publish(arriving=len(incoming))
            adds = [_request(submission) for submission in incoming]
            for submission, request in zip(incoming, adds):
                self._add(submission, request)
            cancelled = []
            for ticket in cancels:
                if ticket.sequence_id is not None and ticket.finished is None:
                    self._batch.cancel(ticket.sequence_id)
                    self._finish(ticket.sequence_id)
                    cancelled.append(ticket.sequence_id)
            self._tell_followers({"adds": adds, "cancels": cancelled, "stop": False})  # after: adds touch no model
            if self._batch.active:
                self._step()
            with self._lock:
                self._publish()
        self._tell_followers({"adds": [], "cancels": [], "stop": True})
        for sequence_id in list(self._tickets):
            self._batch.cancel(sequence_id)
            self._finish(sequence_id)
        with self._lock:
            self._publish()
        mx.synchronize()

    def _tell_followers(self, plan: dict) -> None:
        """Send the other ranks (tensor parallelism) this step's ``plan``, which ``follow`` applies."""
        if self._group is None:
            return
        try:
            broadcast_json(plan, self._group)
        except Exception as exc:  # a rank is gone: no step can run any more
            self._end_all(f"tensor parallelism lost a rank: {exc}")
            raise

    def follow(self) -> None:
        """A rank other than 0 under tensor parallelism: apply each step of rank 0's scheduler (the
        requests it added, the sequences it cancelled) and step alike, until rank 0 closes."""
        while True:
            plan = broadcast_json(None, self._group)
            if plan["stop"]:
                break
            for request in plan["adds"]:
                with contextlib.suppress(ButterError):  # rank 0 refused it too, and answered its client
                    _add_request(self._batch, request)
            for sequence_id in plan["cancels"]:
                self._batch.cancel(sequence_id)
            if self._batch.active:
                self._advance()
            self._batch.finish_reasons.clear()  # no tickets here to hand them to
            self._batch.cached_tokens.clear()
        mx.synchronize()

    def _add(self, submission: _Submission, request: dict) -> None:
        try:
            sequence_id = _add_request(self._batch, request)
        except ButterError as exc:
            submission.ticket._put(Finished("error", str(exc)))
            return
        submission.ticket.sequence_id = sequence_id
        self._tickets[sequence_id] = submission.ticket

    def _step(self) -> None:
        produced = self._advance()
        if produced is None:
            return
        for sequence_id, ticket in self._tickets.items():
            if sequence_id in self._batch.cached_tokens:
                ticket.cached_tokens = self._batch.cached_tokens.pop(sequence_id)
        for sequence_id, token_id in produced:
            self._tickets[sequence_id]._put(Token(token_id))
        for sequence_id in [i for i in self._tickets if i in self._batch.finish_reasons]:
            self._finish(sequence_id)

    def _advance(self) -> list[tuple[int, int]] | None:
        """One step of the batch: its ``(sequence_id, token_id)`` pairs, or None where the engine
        failed, which ends every request with the error and starts afresh (serving goes on)."""
        try:
            return self._batch.step()
        except Exception as exc:  # noqa: BLE001
            self._end_all(f"{type(exc).__name__}: {exc}")
            self._fresh_batch()
            mx.clear_cache()
            return None

    def _end_all(self, message: str) -> None:
        for ticket in self._tickets.values():
            ticket._put(Finished("error", message))
        self._tickets.clear()

    def _finish(self, sequence_id: int) -> None:
        ticket = self._tickets.pop(sequence_id, None)
        if ticket is not None:
            ticket._put(Finished(self._batch.finish_reasons.pop(sequence_id, "cancelled")))
        self._batch.cached_tokens.pop(sequence_id, None)


def _request(submission: _Submission) -> dict:
    """What every rank needs to add ``submission`` alike (JSON): sampling by seed, one drawn here
    where the request gave none, so that every rank draws the same tokens."""
    sampler = submission.sampler
    seed = sampler.seed if sampler.seed is not None or sampler.greedy else secrets.randbits(63)
    stops = None if submission.stop_ids is None else sorted(submission.stop_ids)
    return {"prompt": list(submission.prompt), "max_tokens": submission.max_tokens, "temperature": sampler.temperature,
            "top_p": sampler.top_p, "seed": seed, "stop_ids": stops}  # fmt: skip


def _add_request(batch: BatchGeneration, request: dict) -> int:
    return batch.add(request["prompt"], max_tokens=request["max_tokens"], stop_ids=request["stop_ids"],
                     sampler=Sampler(request["temperature"], request["top_p"], request["seed"]))  # fmt: skip


_PARKED = threading.Event()
"""Never set: where stopped scheduler threads wait until the process exits."""


def _serve_then_park(scheduler: Scheduler) -> None:
    """A scheduler thread's life: serve until closed, then wait, never returning. MLX keeps its
    compile cache per thread, and a thread that returns destroys it, which takes the GIL; while the
    interpreter finalizes (the process exiting just after ``close``) taking it ends the thread from
    inside that C++ destructor and aborts the process ("terminate called without an active
    exception"). A daemon thread that never returns is simply stopped at exit."""
    try:
        scheduler._run()
    except BaseException:  # noqa: BLE001 - a bug in the loop: say so, and let close() return
        traceback.print_exc()
    finally:
        scheduler._stopped.set()
    del scheduler  # the parked thread holds nothing
    _PARKED.wait()
