"""The operations one decode step's graph holds, its blocks traced and op by op, on any machine.

A decode step on MLX's CUDA backend is bound by the host (docs/benchmarks.md, issues 32 and 33),
and the host builds and encodes every operation of a step's graph. Per scheme (``--kv-cache``)
and batch size (``--batch``: 1 is one sequence through ``Engine.forward``, more is
``Engine.run_batched`` over paged storage, the graph a ``BatchGeneration`` decode step evaluates
before sampling), one decode step of a ``--layers``-layer Qwen3-1.7B-shaped model is built with
the blocks' traces (``butter_core.models.traced``) on and off, after enough steps that each way
has traced what it will, and its graph is counted (``host_build.node_kinds``): operations a
step and a layer, and the most frequent kinds; then the host time to build the step, the
median of ``--builds`` (each evaluated before the next is built). The widths are small (the
count does not depend on them) unless ``--full-width``.

Off a GPU the caches take their GPU paths with stand-in kernels, and ``mx.fast``'s RMSNorm, RoPE
and attention stand in as one node each (``host_build``: each stand-in is a ``Depends`` node), so
the count is the one a GPU's host encodes and the build time is this host's share of it; on a
GPU the kernels run and the graph is the one the host encodes there.

Usage: python3 bench/step_nodes.py [--kv-cache raw,aura4v2] [--batch 1 64] [--layers 28] [--kinds 12] [--builds 20]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections import Counter

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx

from butter_core import LoadOptions, parse_kv_cache
from butter_core.batched import capacity_for
from butter_core.engine import Engine
from butter_core.kernels.backend import default_device_is_gpu, standing_in_for_gpu
from butter_core.kernels.kernel import executed_by
from butter_core.models import traced
from gpu_bench import QWEN3_1_7B, random_qwen3
from host_build import fast_ops_as_on_gpu, node_kinds, zeros_for_kernels

CONTEXT = 100
"""Positions each sequence holds before the counted step (a page table of two pages of 64)."""
NARROW = {"hidden_size": 256, "intermediate_size": 512, "vocab_size": 4096}
"""Widths small enough for a CPU; heads and head size stay Qwen3-1.7B's (the kernels' shapes)."""


def stepper(network, kind, batch: int):
    """A function building one more decode step for ``batch`` sequences of ``CONTEXT`` positions
    (each call appends a token), returning its lazy logits."""
    engine = Engine(network, LoadOptions(kv_cache=kind, max_context_length=CONTEXT + 64))
    if batch == 1:
        caches = engine.make_layer_caches()
        mx.eval(engine.forward(mx.zeros((CONTEXT,), dtype=mx.uint32), caches))
        return lambda: engine.forward(mx.zeros((1,), dtype=mx.uint32), caches)
    caches = engine.make_batched_caches(capacity_for([CONTEXT + 64] * batch), max_sequences=batch)
    handles = [caches.open() for _ in range(batch)]
    for handle in handles:
        caches.reserve(handle, CONTEXT + 64)
    mx.eval(engine.run_batched(mx.zeros((batch, CONTEXT), dtype=mx.uint32), caches, handles))
    return lambda: engine.run_batched(mx.zeros((batch, 1), dtype=mx.uint32), caches, handles)


def count(step, on: bool, builds: int) -> tuple[Counter, float]:
    """The kinds of one step's graph with the blocks' traces ``on`` or off, after the steps it
    takes that way to trace (``traced.AFTER``) and to build its kernels, and the median ms to
    build a step of ``builds``."""
    traced.ENABLED = on
    try:
        for _ in range(traced.AFTER + 2):
            mx.eval(step())
        out = step()
        kinds = node_kinds([out])
        mx.eval(out)
        times = []
        for _ in range(builds):
            start = time.perf_counter()
            out = step()
            times.append(time.perf_counter() - start)
            mx.eval(out)
        return kinds, 1e3 * statistics.median(times)
    finally:
        traced.ENABLED = True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kv-cache", default="raw,aura4v2")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--layers", type=int, default=QWEN3_1_7B["num_hidden_layers"])
    parser.add_argument("--kinds", type=int, default=12, help="the most frequent operation kinds to print")
    parser.add_argument("--full-width", action="store_true", help="Qwen3-1.7B's own widths (a GPU's memory)")
    parser.add_argument("--builds", type=int, default=20, help="steps whose build is timed")
    args = parser.parse_args()
    config = QWEN3_1_7B | {"num_hidden_layers": args.layers} | ({} if args.full_width else NARROW)
    on_gpu = default_device_is_gpu()
    with contextlib.ExitStack() as stack:
        if not on_gpu:
            stack.enter_context(standing_in_for_gpu())
            stack.enter_context(executed_by("cuda", zeros_for_kernels))
            stack.enter_context(fast_ops_as_on_gpu())
        network = random_qwen3(config)
        print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}, "
              f"{'GPU graph' if on_gpu else 'CPU, GPU paths with stand-in kernels and mx.fast ops'}; {args.layers} layers, "
              f"{CONTEXT} positions a sequence; operations in one decode step's graph, host ms to build it")  # fmt: skip
        for name in args.kv_cache.split(","):
            for batch in args.batch:
                step = stepper(network, parse_kv_cache(name), batch)
                for on in (True, False):
                    kinds, ms = count(step, on, args.builds)
                    total = sum(kinds.values())
                    common = ", ".join(f"{k} {n}" for k, n in kinds.most_common(args.kinds))
                    print(f"{name:<9} B={batch:<3} {'traced' if on else 'op by op':<8} {total:6d} a step "
                          f"{total / args.layers:6.1f} a layer {ms:6.2f} ms | {common}", flush=True)  # fmt: skip
                mx.clear_cache()


if __name__ == "__main__":
    main()
