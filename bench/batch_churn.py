"""How often a churning batch traces its decoder blocks: requests that join and leave
``BatchGeneration`` at staggered steps, under each policy of ``butter_core.models.traced``.

A block's decode step is traced per batch size (``traced.KEEP`` sizes kept, a size traced at its
``traced.AFTER``-th step), and under continuous batching the decode batch's size moves whenever
a sequence joins or leaves. ``--requests`` requests arrive at random steps within
``--arrivals`` steps, each with a random prompt (16-63 tokens) and ``max_tokens`` (8-47), the
same plan (``--seed``) for every policy in ``--policies`` (``KEEP:AFTER``, comma-separated;
``8:1`` is the policy before ``AFTER`` existed). Per policy: the steps, the decode batch sizes
met, the traces made per block half (``compile_by_shape``'s ``made``, those dropped and made
again included), and the wall time of the whole run with its median and slowest step.

Runs on butter's default model (``Model.load()``, the README's); on a CPU the steps are bound
by compute, so the wall times say little there: the trace counts are the point, and tracing a
28-layer Qwen3-1.7B-shaped model's blocks costs about 15 ms of host time per size
(docs/benchmarks.md).

Usage: python3 bench/batch_churn.py [--requests 24] [--arrivals 60] [--policies 8:1,64:3] [--kv-cache raw]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import Counter

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx
import numpy as np

from butter_core import LoadOptions, parse_kv_cache
from butter_core.batch_generation import BatchGeneration
from butter_core.batched import capacity_for
from butter_core.engine import Engine
from butter_core.model import Model
from butter_core.models import traced


def run(network, kind, plan, vocab: int) -> dict:
    """The plan's requests through one ``BatchGeneration``: per step the decode batch's size and the
    step's wall time."""
    engine = Engine(network, LoadOptions(kv_cache=kind))
    capacity = capacity_for([prompt + tokens for _, prompt, tokens in plan])
    caches = engine.make_batched_caches(capacity_tokens=capacity, max_sequences=len(plan))
    generation = BatchGeneration(engine, caches)
    waiting, rng = sorted(plan), np.random.default_rng(1)
    sizes, times, step = [], [], 0
    start = time.perf_counter()
    while waiting or generation.active:
        while waiting and waiting[0][0] <= step:
            _, prompt, tokens = waiting.pop(0)
            generation.add(mx.array(rng.integers(0, vocab, prompt), dtype=mx.uint32), max_tokens=tokens, stop_ids=())
        before = time.perf_counter()
        generation.step()
        times.append(time.perf_counter() - before)
        step += 1
        sizes.append(generation.decoding)
    return {"seconds": time.perf_counter() - start, "sizes": sizes, "times": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--arrivals", type=int, default=60, help="requests arrive at random steps below this")
    parser.add_argument("--policies", default="8:1,64:3", help="KEEP:AFTER pairs, comma-separated")
    parser.add_argument("--kv-cache", default="raw")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    network = Model.load().network
    vocab, rng = network.args.vocab_size, np.random.default_rng(args.seed)
    plan = [(int(rng.integers(0, args.arrivals)), int(rng.integers(16, 64)), int(rng.integers(8, 48)))
            for _ in range(args.requests)]  # fmt: skip
    print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}; default model, {args.kv_cache}; "
          f"{args.requests} requests arriving within {args.arrivals} steps")  # fmt: skip
    for policy in args.policies.split(","):
        traced.KEEP, traced.AFTER = (int(n) for n in policy.split(":"))
        for block in network.layers:
            block.drop_traced_step()  # each policy traces from nothing
        result = run(network, parse_kv_cache(args.kv_cache), plan, vocab)
        made = sum(step.before.made + step.after.made for step in (block.traced_step for block in network.layers)
                   if step is not None)  # fmt: skip
        sizes = Counter(size for size in result["sizes"] if size)
        short = sum(1 for count in sizes.values() if count < traced.AFTER)
        print(f"KEEP {traced.KEEP:>3} AFTER {traced.AFTER}: {len(result['times'])} steps, {len(sizes)} decode batch sizes "
              f"({short} lasting under {traced.AFTER} steps), traces made per block half {made / (2 * len(network.layers)):.0f}; "
              f"{result['seconds']:.2f} s, median step {statistics.median(result['times']) * 1e3:.1f} ms, "
              f"slowest {max(result['times']) * 1e3:.1f} ms", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
