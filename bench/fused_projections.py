"""Two ways of building a decode step, step by step in one process: by default fused projections
against separate ones (q/k/v and gate/up as one matmul each, ``butter_core.models.fused``, or as
five); with ``--switch traced`` each block's two traced calls (``butter_core.models.traced``)
against its operations built one by one.

A decode step on MLX's CUDA backend is bound by host time, which a lent machine's neighbours
make drift by tens of percent from one process to the next (docs/benchmarks.md); alternating
the two ways step by step over the same caches puts both under the same drift. A
Qwen3-1.7B-shaped model with random bf16 weights (``gpu_bench.QWEN3_1_7B``, ``--small`` for a
CPU check), per scheme (``--kv-cache``):

- batched, per ``--batch`` B: B prompts of ``--context`` random tokens through
  ``BatchGeneration``; once every sequence decodes, ``--steps`` steps, each alone (the device
  idle before it), fused and separate in turn: the time ``step()`` takes to build and launch
  (host) and the time to the end of its work (total);
- one sequence (``--single``): a prompt of ``--context`` tokens, then ``--steps`` greedy decode
  steps through ``Engine.forward``, each built, then evaluated, in turn the same way.

``--default-model`` runs the single sequence on butter's default model (``Model.load()``: the
README's, on the CPU) instead. Prints medians in ms and off / on (>1: the switch's way is faster).

Usage: python3 bench/fused_projections.py [--switch fused|traced] [--batch 8 64] [--single] [--context 4096]
           [--steps 40] [--kv-cache raw,aura4v2] [--small | --default-model]
"""

from __future__ import annotations

import argparse
import statistics
import time

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx

from butter_core import LoadOptions, parse_kv_cache
from butter_core.batch_generation import BatchGeneration
from butter_core.batched import capacity_for
from butter_core.engine import Engine
from butter_core.model import Model
from butter_core.models import traced
from butter_core.models.fused import fused
from gpu_bench import QWEN3_1_7B, SMALL_MODEL, random_qwen3


def fusion_switch(network):
    """``switch(on)``: the network's fused projections used (True) or each layer run alone (False)."""
    owners = [(m, fused(m)) for m in network.modules() if fused(m) is not None]

    def switch(on: bool) -> None:
        for module, fusion in owners:
            object.__setattr__(module, "_fusion", fusion if on else None)

    return switch


def traced_switch(network):
    """``switch(on)``: every block's decode step through its traces (True) or op by op (False)."""

    def switch(on: bool) -> None:
        traced.ENABLED = on

    return switch


SWITCHES = {"fused": fusion_switch, "traced": traced_switch}


def alternate(steps: int, switch, step) -> dict[bool, list[tuple[float, float]]]:
    """``steps`` calls of ``step()`` (returning the lazy result, its host part done), the switch on and
    off in turn, each after the device is idle: ``{on: [(host s, total s), ...]}``."""
    times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
    for n in range(steps):
        on = n % 2 == 0
        switch(on)
        mx.synchronize()
        start = time.perf_counter()
        out = step()
        built = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        times[on].append((built - start, time.perf_counter() - start))
    switch(True)
    return times


def batched(network, kind, batch: int, context: int, steps: int, vocab: int, switch):
    engine = Engine(network, LoadOptions(kv_cache=kind))
    caches = engine.make_batched_caches(capacity_for([context + 2 * steps + 64] * batch), max_sequences=batch)
    generation = BatchGeneration(engine, caches, prefill_chunk=min(8 * context, 16384))
    prompts = mx.random.randint(0, vocab, (batch, context), key=mx.random.key(batch)).astype(mx.uint32)
    for prompt in prompts:
        generation.add(prompt, max_tokens=2 * steps + 32, stop_ids=())
    started: set[int] = set()
    while len(started) < batch:  # until every sequence has its first token: all decode from here
        started.update(sequence for sequence, _ in generation.step())
    for _ in range(4):  # the decode kernels built before timing
        generation.step()
    return alternate(steps, switch, lambda: generation.step())


def single(network, kind, context: int, steps: int, vocab: int, switch):
    engine = Engine(network, LoadOptions(kv_cache=kind, max_context_length=context + steps + 16))
    caches = engine.make_layer_caches()
    prompt = mx.random.randint(0, vocab, (context,), key=mx.random.key(1)).astype(mx.uint32)
    token = [mx.argmax(engine.forward(prompt, caches))]
    mx.eval(token[0])

    def step():
        token[0] = mx.argmax(engine.forward(token[0].reshape(1), caches))
        return token[0]

    for _ in range(4):
        mx.eval(step())
    return alternate(steps, switch, step)


def report(label: str, times, switch: str) -> None:
    def medians(on):
        return [statistics.median(t[i] for t in times[on]) * 1e3 for i in (0, 1)]

    (fh, ft), (sh, st) = medians(True), medians(False)
    print(f"{label:<28} {switch} on: host {fh:6.2f} total {ft:6.2f} ms | off: host {sh:6.2f} total {st:6.2f} ms"
          f" | off / on: host {sh / fh:5.3f}x total {st / ft:5.3f}x", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="*", default=[8, 64])
    parser.add_argument("--single", action="store_true", help="also one sequence through Engine.forward")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--kv-cache", default="raw,aura4v2")
    parser.add_argument("--switch", choices=sorted(SWITCHES), default="fused")
    parser.add_argument("--small", action="store_true", help="a small model: a CPU check of the script")
    parser.add_argument("--default-model", action="store_true", help="one sequence on butter's default model")
    args = parser.parse_args()
    if args.default_model:
        network = Model.load().network
        vocab, batches, args.single = network.args.vocab_size, [], True
    else:
        config = SMALL_MODEL if args.small else QWEN3_1_7B
        network, vocab, batches = random_qwen3(config), config["vocab_size"], args.batch
    switch = SWITCHES[args.switch](network)
    print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}; context {args.context}, "
          f"{args.steps} steps alternating {args.switch} on / off; medians")  # fmt: skip
    for name in args.kv_cache.split(","):
        kind = parse_kv_cache(name)
        if args.single:
            report(f"{name} single", single(network, kind, args.context, args.steps, vocab, switch), args.switch)
        for batch in batches:
            report(f"{name} B={batch}", batched(network, kind, batch, args.context, args.steps, vocab, switch), args.switch)
            mx.clear_cache()


if __name__ == "__main__":
    main()
