"""Compiling, before a generation, what it will run: ``warm_up`` (one sequence) and
``warm_up_batched`` (``BatchGeneration``, as ``butter serve`` runs).

MLX compiles a GPU kernel the first time a process calls it with given template values:
butter's custom kernels (NVRTC on CUDA, the Metal compiler on Apple silicon), and MLX's own
JIT-built kernels (fused elementwise graphs of ``mx.compile`` among them). A generation
first calls its prefill kernels at its first chunk and its decode kernels at its first
decode step, so a process's first request pays seconds of compilation between tokens.
A scheme may also choose a kernel variant by a cache's allocation or live length
(butter-affine's tensor-core decode takes longer key steps from about 64k on an H200),
which a later, longer request would then compile in its turn.

``warm_up`` runs, on throwaway caches, what generations up to ``context`` positions run:
a prompt of one full prefill chunk and a short one, then a few decode steps (as many as
the caches' ``warm_up_steps``: AURA encodes its deferred recent tokens at step 33), through
the whole model (every layer type's cache), and then, per distinct attention cache, one decode
step at each probe length (``probe_lengths``: powers of two up to ``context``, and
``context``): every allocation a generation can make lies within a factor of two of a
probe, and a variant chosen by a threshold in the allocation or the live length is met
on both sides of it. Compiled kernels stay for the process (what carries over to later
processes: docs/architecture.md, "Across processes, and warming up").
"""

from __future__ import annotations

import time

import attrs
import mlx.core as mx

from butter_core.batched import PAGE_SIZE, capacity_for
from butter_core.batch_generation import BatchGeneration
from butter_core.cache import AttentionCache, LayerSpec
from butter_core.engine import Engine
from butter_core.generation import Generation
from butter_core.models import traced
from butter_core.window import WindowCache


def decode_steps() -> int:
    """Tokens a warm-up generates after its prompt at the least: the first decode steps, which
    build what every later step replays, a block's traced step among them (``traced.AFTER`` as
    it stands when the warm-up runs; more where a cache's ``warm_up_steps`` asks)."""
    return traced.AFTER


FIRST_PROBE = 4096
"""The shortest probe length: shorter allocations share the warm-up prompt's kernels."""


@attrs.frozen
class WarmUp:
    """What a warm-up ran and how long it took (wall clock, evaluated)."""

    seconds: float
    prompt_tokens: int
    decode_steps: int
    probe_lengths: tuple[int, ...]
    """Positions each distinct attention cache was probed at (one decode step each)."""


def probe_lengths(context: int, start: int = FIRST_PROBE) -> tuple[int, ...]:
    """Powers of two from ``start`` below ``context``, then ``context`` itself (nothing
    where ``context`` is shorter than ``start``)."""
    lengths, length = [], start
    while length < context:
        lengths.append(length)
        length *= 2
    return (*lengths, context) if context >= start else ()


def warm_up(engine: Engine, context: int | None = None) -> WarmUp:
    """Run what ``engine``'s generations of up to ``context`` positions (default: the caches'
    capacity) compile, on caches made for it and dropped after. Deterministic (fixed token
    ids, greedy), so every rank of a tensor-parallel group runs it alike."""
    start = time.perf_counter()
    context = engine.max_context if context is None else min(context, engine.max_context)
    caches = engine.make_layer_caches()
    steps = max(decode_steps(), *(cache.warm_up_steps for cache in caches))
    prompt = _prompt_tokens(engine, context, steps)
    for _ in Generation(engine, _token_ids(engine, prompt), caches, max_tokens=steps):
        pass
    del caches
    lengths = _probe(engine, context, prompt + steps)
    mx.clear_cache()
    return WarmUp(time.perf_counter() - start, prompt, steps, lengths)


def warm_up_batched(engine: Engine, *, page_size: int = PAGE_SIZE) -> float:
    """Run what ``BatchGeneration`` compiles (paged decode kernels, ragged prefill chunks) on
    batched caches made for it and dropped after: two sequences, one prompt of a full chunk
    and one short, prefilled together and decoded together. Returns the seconds it took."""
    start = time.perf_counter()
    steps = decode_steps()
    long_prompt = _prompt_tokens(engine, engine.max_context, steps)
    short_prompt = max(1, min(page_size + 3, long_prompt // 2))
    capacity = capacity_for([long_prompt + steps, short_prompt + steps], page_size)
    caches = engine.make_batched_caches(capacity, page_size=page_size, max_sequences=2)
    batch = BatchGeneration(engine, caches)
    for length in (long_prompt, short_prompt):
        batch.add(_token_ids(engine, length), max_tokens=steps)
    for _ in batch:
        pass
    del batch, caches
    mx.clear_cache()
    return time.perf_counter() - start


def _prompt_tokens(engine: Engine, context: int, steps: int) -> int:
    """A warm-up prompt: one full prefill chunk and a short one, with room left in ``context``
    for ``steps`` decode steps."""
    return max(1, min(engine.prefill_chunk + 8, context - steps))


def _token_ids(engine: Engine, count: int) -> mx.array:
    return (mx.arange(count, dtype=mx.uint32) * 7919) % engine.network.args.vocab_size


def _probe(engine: Engine, context: int, shortest: int) -> tuple[int, ...]:
    """One decode step of each distinct attention cache of ``engine`` (by type, spec up to the
    layer index, and the positions it can hold) at each of its probe lengths above ``shortest``,
    on fresh caches filled with zeros; returns the lengths probed."""
    picks: dict[tuple, int] = {}
    for index, cache in enumerate(engine.make_layer_caches()):
        if isinstance(cache, AttentionCache):
            held = min(context, cache.window.max_size if isinstance(cache, WindowCache) else cache.capacity or context)
            picks.setdefault((type(cache), attrs.evolve(cache.spec, layer_index=0), held), index)
    probed = set()
    for (_, _, held), index in picks.items():
        for length in probe_lengths(held):
            if length > shortest:
                _decode_at(engine, engine.make_layer_caches()[index], length)
                probed.add(length)
    return tuple(sorted(probed))


def _decode_at(engine: Engine, cache: AttentionCache, length: int) -> None:
    """``cache`` filled with ``length - 1`` zero positions, a chunk at a time, then one decode step."""
    spec: LayerSpec = cache.spec
    args = engine.network.args
    chunk = engine.prefill_chunk
    cache.reserve(length)
    rows = mx.zeros((spec.batch_size, spec.n_kv_heads, chunk, spec.head_dim), spec.dtype)
    for filled in range(0, length - 1, chunk):
        part = rows[:, :, : min(chunk, length - 1 - filled)]
        cache.append(part, part)
        mx.eval(cache.state)
    heads = spec.n_kv_heads * args.num_attention_heads // args.num_key_value_heads
    queries = mx.zeros((spec.batch_size, heads, 1, spec.head_dim), spec.dtype)
    token = rows[:, :, :1]
    mx.eval(cache.update_and_attend(queries, token, token, scale=spec.head_dim**-0.5))
