"""Streaming generation with statistics: prompt and decode speed, KV bytes, peak memory.

The decode loop queues step ``n + 1`` (``mx.async_eval``) before it reads step ``n``'s
token into Python, so graph building overlaps computation. A consequence worth
knowing for multi-turn use: when generation ends, the caches hold the prompt and every
sampled token, the stop token included; the next turn continues at
``caches[0].absolute_position``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Literal

import attrs
import mlx.core as mx

from butter_core.cache import AttentionCache, LayerCache
from butter_core.engine import Engine, TokenIds
from butter_core.errors import ConfigError
from butter_core.sampling import GREEDY, Sampler


def format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB, whichever reads best."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.2f} GiB"


@attrs.define
class GenerationStats:
    """What one generation did and cost; filled in as it runs."""

    prompt_tokens: int = 0
    """Prompt tokens fed (not those the caches held already)."""
    held_tokens: int = 0
    """Positions the caches held before the prompt: an earlier turn, or a prompt cache's prefix."""
    prompt_seconds: float = 0.0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    kv_bytes_allocated: int = 0
    kv_bytes_live: int = 0
    state_bytes: int = 0
    """Recurrent layers' caches (convolution inputs and state): constant in the context length."""
    peak_memory: int = 0
    finish_reason: Literal["stop", "length"] | None = None

    @property
    def prompt_tps(self) -> float:
        """Prompt tokens per second, first sampled token included in the time."""
        return self.prompt_tokens / self.prompt_seconds if self.prompt_seconds else 0.0

    @property
    def decode_tps(self) -> float:
        """Tokens per second after the first one."""
        return (self.generated_tokens - 1) / self.decode_seconds if self.decode_seconds else 0.0

    def summary(self) -> str:
        """One line for a terminal."""
        return (
            f"prompt: {self.prompt_tokens} tokens"
            + (f" after {self.held_tokens} held" if self.held_tokens else "")
            + f", {self.prompt_tps:.1f} tok/s | "
            f"decode: {self.generated_tokens} tokens, {self.decode_tps:.1f} tok/s | "
            f"KV: {format_bytes(self.kv_bytes_allocated)} allocated, {format_bytes(self.kv_bytes_live)} live | "
            + (f"state: {format_bytes(self.state_bytes)} | " if self.state_bytes else "")
            + f"peak memory: {format_bytes(self.peak_memory)}"
        )


def check_request(prompt_ids: TokenIds, max_tokens: int) -> None:
    """Raise ConfigError unless ``max_tokens`` is a positive integer and the prompt has a token."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens <= 0:
        raise ConfigError(f"max_tokens (--max-tokens) must be a positive integer, got {max_tokens!r}")
    if (prompt_ids.size if isinstance(prompt_ids, mx.array) else len(prompt_ids)) == 0:
        raise ConfigError("the prompt is empty: generation needs at least one prompt token")


class Generation:
    """Iterate to receive generated token ids as they are produced (a stop token ends it, unyielded).

    Iterate once; ``stats`` is complete when the iteration ends.
    """

    def __init__(
        self,
        engine: Engine,
        prompt_ids: TokenIds,
        caches: Sequence[LayerCache],
        *,
        sampler: Sampler | None = None,
        max_tokens: int = 256,
        stop_ids: Collection[int] = (),
        prefill_progress: Callable[[int, int], None] | None = None,
        prefilled: Callable[[Sequence[LayerCache]], None] | None = None,
    ):
        """``prefilled(caches)`` is called once the prompt is in the caches, before the first
        generated token is: where ``butter generate --prompt-cache`` saves them."""
        check_request(prompt_ids, max_tokens)
        self.engine = engine
        self.prompt_ids = engine.token_ids(prompt_ids)
        engine.check_caches(caches)
        prompt = self.prompt_ids.size
        engine.make_room(caches, prompt + max_tokens, f"the prompt's {prompt} tokens and --max-tokens {max_tokens}")
        self.caches = caches
        self.sampler = sampler or GREEDY
        self.max_tokens = max_tokens
        self.stop_ids = frozenset(stop_ids)
        self.prefill_progress = prefill_progress
        self.prefilled = prefilled
        held = caches[0].absolute_position if caches else 0
        self.stats = GenerationStats(prompt_tokens=prompt, held_tokens=held)
        self._started = False

    def __iter__(self) -> Iterator[int]:
        if self._started:
            raise RuntimeError("a Generation can be iterated only once")
        self._started = True
        engine, stats, sample = self.engine, self.stats, self.sampler
        mx.reset_peak_memory()
        start = time.perf_counter()
        token = sample(engine.run(self.prompt_ids, self.caches, progress=self.prefill_progress))
        if self.prefilled is not None:
            mx.eval(token)
            self.prefilled(self.caches)
        first_token_at, pending = start, token
        try:
            for count in range(1, self.max_tokens + 1):
                pending = sample(engine.run(token, self.caches))
                mx.async_eval(pending)
                token_id = token.item()
                now = time.perf_counter()
                if count == 1:
                    stats.prompt_seconds, first_token_at = now - start, now
                stats.decode_seconds, stats.generated_tokens = now - first_token_at, count
                if token_id in self.stop_ids:
                    stats.finish_reason = "stop"
                    return
                yield token_id
                token = pending
            stats.finish_reason = "length"
        finally:
            mx.eval(pending)
            attention = [cache for cache in self.caches if isinstance(cache, AttentionCache)]
            stats.kv_bytes_allocated = sum(cache.nbytes_allocated for cache in attention)
            stats.kv_bytes_live = sum(cache.nbytes_live for cache in attention)
            stats.state_bytes = sum(c.nbytes_allocated for c in self.caches if not isinstance(c, AttentionCache))
            stats.peak_memory = mx.get_peak_memory()
