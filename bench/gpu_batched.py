"""Batched decode on a GPU: butter's ``BatchGeneration`` over paged caches against mlx-lm's ``BatchKVCache``.

A Qwen3-1.7B-shaped model with random bf16 weights (``gpu_bench.QWEN3_1_7B``); both engines
hold the same weights (mlx-lm's ``qwen3.Model`` loads butter's parameters, whose names it
shares). For each batch size B (``--batch``): B prompts of ``--context`` random tokens,
``--decode-tokens`` greedy tokens each, no stop token.

- butter, per scheme (``--kv-cache``): ``make_batched_caches`` with exactly the pages the run
  needs, ``BatchGeneration`` prefilling up to 8 whole prompts and at most ``--prefill-tokens``
  tokens per step (so the prefill's peak is bounded by that budget, not by B); decode tok/s is
  the aggregate over the steps in which all B sequences decode (``benchmark.decode_together``:
  each sequence gets as many more tokens as there are prefill steps, so the first ones to start
  are still decoding when the last one starts).
- mlx-lm 0.32.2: the core of its batched decode restated (importing ``mlx_lm.generate`` needs
  transformers, which the GPU machine lacks): ``BatchKVCache`` per layer, all B prompts
  prefilled together in chunks of ``--mlx-lm-prefill-chunk`` (default 2048, its default step;
  its peak memory is the chunk's logits, B x chunk x vocab: at B=64 and 2048 that is 40 GB of
  the 109 GB it needs, so a smaller chunk fits it on an 80 GB card and leaves its decode steps
  as they are), then one ``[B, 1]`` forward per
  step, each step's graph built while the previous evaluates (``mx.async_eval``), as its
  ``GenerationBatch`` does; decode tok/s = B * (steps - 1) / time between first and last.

"median step" is the median time between the steps in which every sequence got a token
(mlx-lm: between steps), a check on the aggregate rate's window against stalls.
``--split-steps N`` times N more butter steps one at a time after the window (``split_steps``):
the host's part of a step and the device's remainder, which tell a host-bound step from a
device-bound one; ``--profile N`` prints a cProfile of N more steps, each alone (where the host's
part goes). Peak memory is MLX's, reset before each run (the weights are not in it: they were
allocated before), and split into the KV storage allocated at the end of the run (butter's pages and
per-sequence rows; mlx-lm's batch caches) and the rest (activations, prefill transients).
``--page-size`` runs each butter scheme at each page size (``scheme@pN``; default
``batched.PAGE_SIZE``). ``--capacity-factor F`` allocates F times the pages the run needs (a
step whose time grows with F copies its storage). "floor" is the aggregate tok/s a
step would reach if it only read the model's weights once and every sequence's live KV
bytes once, at the read bandwidth measured at start (a sum over a large array): issue 33's
"how far each is from its floor". ``--small`` shrinks the model to check the script on a CPU.
Usage:

    python3 bench/gpu_batched.py [--batch 1 8 32 64] [--context 4096] [--decode-tokens 64]
        [--kv-cache raw,affine4,aura4v2] [--page-size 16 64 256] [--prefill-tokens 16384] [--capacity-factor 1]
        [--once] [--no-mlx-lm] [--mlx-lm-prefill-chunk 2048] [--split-steps N] [--profile N] [--small]
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import importlib
import itertools
import importlib.util
import math
import pstats
import statistics
import sys
import time
import types
from collections.abc import Iterator

import mlx.core as mx
from mlx.utils import tree_flatten

from butter_core import LoadOptions, parse_kv_cache
from butter_core.batch_generation import BatchGeneration
from butter_core.batched import PAGE_SIZE, capacity_for
from butter_core.benchmark import decode_budget, decode_together
from butter_core.engine import Engine
from butter_core.models.fused import fuse_projections
from gpu_bench import QWEN3_1_7B, SMALL_MODEL, random_qwen3

PREFILL_SEQUENCES = 8


def mlx_lm_module(name: str):
    """``mlx_lm.<name>`` without running ``mlx_lm/__init__.py`` (which imports transformers)."""
    if "mlx_lm" not in sys.modules:
        package = types.ModuleType("mlx_lm")
        package.__path__ = list(importlib.util.find_spec("mlx_lm").submodule_search_locations)
        sys.modules["mlx_lm"] = package
    return importlib.import_module(f"mlx_lm.{name}")


def read_bandwidth(gib: float) -> float:
    """Bytes per second a sum over a ``gib``-GiB bfloat16 array reads at, the best of five."""
    x = mx.ones((int(gib * 2**29),), mx.bfloat16)
    mx.eval(x)
    times = []
    for _ in range(5):
        start = time.perf_counter()
        mx.eval(x.sum())
        times.append(time.perf_counter() - start)
    return x.nbytes / min(times)


def run_butter(network, kind, prompts: mx.array, decode: int, page_size: int, prefill: int, spare: int,
               split: int, profile: int = 0) -> dict:
    engine = Engine(network, LoadOptions(kv_cache=kind))
    batch, context = prompts.shape
    chunk = min(PREFILL_SEQUENCES * context, prefill)
    positions = context + decode_budget([context] * batch, chunk, decode) + split + profile
    caches = engine.make_batched_caches(capacity_tokens=spare * capacity_for([positions] * batch, page_size), page_size=page_size,
                                        max_sequences=batch)  # fmt: skip
    generation = BatchGeneration(engine, caches, prefill_chunk=chunk)
    mx.synchronize()
    mx.reset_peak_memory()
    ends = []
    first, rate = decode_together(generation, list(prompts), decode, extra=split + profile,
                                  on_step=lambda got: ends.append((time.perf_counter(), len(got))))  # fmt: skip
    steps = [b - a for (a, _), (b, n) in itertools.pairwise(ends) if n == batch]
    return {"first_s": first, "tok_s": rate, "step_ms": statistics.median(steps) * 1e3 if steps else math.nan,
            **split_steps(generation, split), **profiled_steps(generation, profile),
            "peak_gib": mx.get_peak_memory() / 2**30,
            "kv_gib": caches.nbytes_allocated / 2**30, "bytes_per_position": caches.bytes_per_position}  # fmt: skip


def split_steps(generation: BatchGeneration, steps: int) -> dict:
    """``steps`` decode steps of every sequence, each alone: the device idle before it, the time
    ``generation.step()`` takes (building the step's graph and encoding its kernels: the host's
    part) and the time until the device has run it (the rest); medians in ms. Empty for 0 steps."""
    if not steps:
        return {}
    host, rest = [], []
    for _ in range(steps):
        mx.synchronize()
        start = time.perf_counter()
        generation.step()
        built = time.perf_counter()
        mx.synchronize()
        host.append(built - start)
        rest.append(time.perf_counter() - built)
    return {"split_host_ms": statistics.median(host) * 1e3, "split_rest_ms": statistics.median(rest) * 1e3}


def profiled_steps(generation: BatchGeneration, steps: int, lines: int = 30) -> dict:
    """A cProfile of ``steps`` more decode steps, each alone (the host's part: building and
    encoding), as text; empty for 0 steps."""
    if not steps:
        return {}
    profile = cProfile.Profile()
    for _ in range(steps):
        mx.synchronize()
        profile.enable()
        generation.step()
        profile.disable()
    mx.synchronize()
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("tottime").print_stats(lines)
    return {"profile": text.getvalue()}


def run_mlx_lm(model, prompts: mx.array, decode: int, chunk: int) -> dict:
    cache_module = mlx_lm_module("models.cache")
    batch, context = prompts.shape
    caches = [cache_module.BatchKVCache([0] * batch) for _ in model.layers]
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for offset in range(0, context - 1, chunk):
        model(prompts[:, offset : min(offset + chunk, context - 1)], cache=caches)
        mx.eval([c.state for c in caches])
        mx.clear_cache()

    def step(tokens):
        return mx.argmax(model(tokens[:, None], cache=caches)[:, -1], axis=-1)

    times = [time.perf_counter() - start for _ in pipelined_decode(step, prompts[:, -1], decode)]
    args = model.args
    return {"first_s": times[0], "tok_s": batch * (decode - 1) / (times[-1] - times[0]),
            "step_ms": statistics.median(b - a for a, b in itertools.pairwise(times)) * 1e3,
            "peak_gib": mx.get_peak_memory() / 2**30, "kv_gib": sum(c.nbytes for c in caches) / 2**30,
            "bytes_per_position": args.num_hidden_layers * 2 * args.num_key_value_heads * args.head_dim * 2}  # fmt: skip


def pipelined_decode(step, tokens: mx.array, decode: int) -> Iterator[list]:
    """mlx-lm's decode loop: ``decode`` steps of ``step``, each built and queued (``mx.async_eval``)
    before the previous one's tokens are read; yields each step's tokens as they arrive."""
    y = step(tokens)
    mx.async_eval(y)
    for n in range(decode):
        following = step(y) if n + 1 < decode else None
        if following is not None:
            mx.async_eval(following)
        yield y.tolist()
        y = following


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--kv-cache", default="raw,affine4,aura4v2")
    parser.add_argument("--page-size", type=int, nargs="+", default=[PAGE_SIZE])
    parser.add_argument("--prefill-tokens", type=int, default=16384, help="butter's prefill budget per step")
    parser.add_argument("--capacity-factor", type=int, default=1,
                        help="allocate butter's storage this many times what the run needs: a step whose time grows "
                             "with it copies its storage")  # fmt: skip
    parser.add_argument("--once", action="store_true",
                        help="one run per engine, not a compiling run first (long contexts: the prefill kernels "
                             "compile before the decode window opens)")  # fmt: skip
    parser.add_argument("--no-mlx-lm", action="store_true", help="butter's schemes only")
    parser.add_argument("--mlx-lm-prefill-chunk", type=int, default=2048,
                        help="mlx-lm's prefill chunk (its default step is 2048; 512 fits B=64 at 4k on an 80 GB card)")
    parser.add_argument("--split-steps", type=int, default=0,
                        help="after the window, time this many butter steps one at a time: the host's part "
                             "(building and encoding) and the rest (the device finishing)")  # fmt: skip
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after the window, print a cProfile of N butter steps, each alone (the host's part)")
    parser.add_argument("--small", action="store_true", help="a small model: a CPU check of the script")
    args = parser.parse_args()
    config = SMALL_MODEL if args.small else QWEN3_1_7B
    network = random_qwen3(config)
    qwen3 = mlx_lm_module("models.qwen3")
    reference = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    fuse_projections(network)  # as butter's engine does, so that mlx-lm's model shares its (viewed) weights
    reference.load_weights(tree_flatten(network.parameters()))
    mx.eval(reference.parameters())
    weights = sum(v.nbytes for _, v in tree_flatten(network.parameters()))
    bandwidth = read_bandwidth(0.0625 if args.small else 2.0)
    kinds = [parse_kv_cache(name) for name in args.kv_cache.split(",")]
    print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}; {'small' if args.small else 'Qwen3-1.7B'}"
          f"-shaped bf16 ({weights / 2**30:.2f} GiB of weights), context {args.context}, {args.decode_tokens} decode "
          f"tokens per sequence; aggregate decode tok/s; read bandwidth {bandwidth / 1e9:.0f} GB/s")  # fmt: skip
    for batch in args.batch:
        prompts = mx.random.randint(0, config["vocab_size"], (batch, args.context), key=mx.random.key(batch)).astype(mx.uint32)
        results = {}
        engines = [] if args.no_mlx_lm else [("mlx-lm", lambda: run_mlx_lm(reference, prompts, args.decode_tokens, args.mlx_lm_prefill_chunk))]
        for kind, page in itertools.product(kinds, args.page_size):
            label = str(kind) if args.page_size == [PAGE_SIZE] else f"{kind}@p{page}"
            measure = functools.partial(run_butter, network, kind, prompts, args.decode_tokens, page,
                                        args.prefill_tokens, args.capacity_factor, args.split_steps, args.profile)  # fmt: skip
            engines.append((label, measure))
        for name, run in engines:
            try:
                if not args.once:
                    run()  # the first run of each compiles its kernels
                results[name] = run()
            except Exception as exc:  # noqa: BLE001 - report and go on (out of memory at large B)
                results[name] = {"error": f"{type(exc).__name__}: {str(exc)[:120]}"}
            mx.clear_cache()
        base = results.get("mlx-lm", {}).get("tok_s")
        for name, r in results.items():
            if "error" in r:
                print(f"B={batch:<3} {name:<9} {r['error']}", flush=True)
                continue
            ratio = f"{r['tok_s'] / base:.2f}x mlx-lm" if base else ""
            step_bytes = weights + batch * (args.context + args.decode_tokens / 2) * r["bytes_per_position"]
            floor = batch * bandwidth / step_bytes
            print(f"B={batch:<3} {name:<13} {r['tok_s']:9.1f} tok/s  median step {r['step_ms']:6.2f} ms  all first tokens {r['first_s']:6.2f} s  "
                  f"peak {r['peak_gib']:6.2f} GiB (KV {r['kv_gib']:.2f}, the rest {r['peak_gib'] - r['kv_gib']:.2f})  "
                  f"floor {floor:8.0f} tok/s ({r['tok_s'] / floor:.2f} of it)  {ratio}", flush=True)  # fmt: skip
            if "split_host_ms" in r:
                print(f"      {name}: a step alone: host {r['split_host_ms']:.2f} ms, then the device "
                      f"{r['split_rest_ms']:.2f} ms", flush=True)  # fmt: skip
            if "profile" in r:
                print(f"\n{name}: cProfile of {args.profile} steps, each alone\n```\n{r['profile']}```\n", flush=True)


if __name__ == "__main__":
    main()
