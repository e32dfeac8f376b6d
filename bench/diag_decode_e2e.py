"""Where a whole-model decode step's time goes, per scheme, after a real prefill: host build, and the GPU's wait.

For each ``--kv-cache`` scheme: a Qwen3-1.7B-shaped model (random bf16 weights, as
``decode_step.py``'s end-to-end rows), warmed up, prefills ``--context`` random tokens
through ``Engine.run`` (the engine's prefill chunks), then times ``--steps`` decode steps
one at a time: ``build`` (``engine.run`` for one token + argmax, on the host), ``wait``
(``mx.eval`` after it): medians, the mean step (work done every few steps, such as AURA's
deferred encode, counts there) and the slowest step; and as many steps pipelined as
``Generation`` runs them (``pipelined_steps``: each built while the previous runs): a build
that takes longer there than alone waits on the GPU, and a ``read`` near zero means the host
sets the pace. Then, on the same caches, every layer's attention alone
(``update_and_attend`` with the model's query heads, all layers built and evaluated as
one step), and the same on fresh caches filled by ``append`` (``decode_step.py``'s per-layer
method): a gap between the two says the prefilled caches decode differently. ``host probe``
times a fixed pure-Python loop before and after the decode steps: a virtual machine's CPU
can run at half its speed for seconds at a time, and a decode step the host sets the pace
of slows with it (``--instances``: each scheme that many times over, on fresh caches).

Usage: python3 bench/diag_decode_e2e.py [--context 131072] [--kv-cache raw,affine4,aura4v2] [--steps 48]
       [--instances 1] [--slow-steps]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import butter_core  # noqa: F401 - before mlx.core (CPU BLAS selection)
import mlx.core as mx

from butter_core import LoadOptions, parse_kv_cache
from butter_core.engine import Engine
from butter_core.layer_caches import make_layer_caches
from butter_core.loading.weights import build_model
from butter_core.warm_up import warm_up
from gpu_bench import QWEN3_1_7B


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def attention_step_ms(caches, q_heads: int, steps: int) -> float:
    spec = caches[0].spec
    q = mx.random.normal((1, q_heads, 1, spec.head_dim)).astype(mx.bfloat16)
    k = mx.random.normal((1, spec.n_kv_heads, 1, spec.head_dim)).astype(mx.bfloat16)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval([c.update_and_attend(q, k, k, scale=spec.head_dim**-0.5) for c in caches])
        times.append(time.perf_counter() - start)
    return median_ms(times[steps // 4:])


def host_probe_ms() -> float:
    """Milliseconds a fixed pure-Python loop takes here now (median of 9): the host's speed."""
    times = []
    for _ in range(9):
        start = time.perf_counter()
        sum(i * i for i in range(50_000))
        times.append(time.perf_counter() - start)
    return median_ms(times)


PIPELINED = ("build", "encode", "read", "step")


def pipelined_steps(engine, caches, token: mx.array, steps: int) -> dict[str, list[float]]:
    """``steps`` decode steps as ``Generation`` runs them, each built and queued (``mx.async_eval``)
    before the previous one's token is read: per step, seconds to build it (the previous one on
    the GPU meanwhile), to queue it (``encode``), to read the previous token (``read``: the host
    waiting on the GPU) and all three."""
    parts = {part: [] for part in PIPELINED}
    pending = mx.argmax(engine.run(token, caches), axis=-1)
    mx.async_eval(pending)
    for _ in range(steps):
        start = time.perf_counter()
        following = mx.argmax(engine.run(pending, caches), axis=-1)
        built = time.perf_counter()
        mx.async_eval(following)
        encoded = time.perf_counter()
        pending.item()
        done = time.perf_counter()
        for part, seconds in zip(PIPELINED, (built - start, encoded - built, done - encoded, done - start)):
            parts[part].append(seconds)
        pending = following
    mx.eval(pending)
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--kv-cache", type=lambda t: t.split(","), default=["raw", "affine4", "aura4v2"])
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--instances", type=int, default=1, help="each scheme this many times, on fresh caches")
    parser.add_argument("--slow-steps", action="store_true", help="also list the steps over 1.5x the median")
    args = parser.parse_args()
    config = QWEN3_1_7B | {"max_position_embeddings": args.context + 1024}
    network = build_model(config, Path("qwen3-shaped (random weights)"))
    network.set_dtype(mx.bfloat16)
    mx.eval(network.parameters())
    prompt = mx.random.randint(0, config["vocab_size"], (args.context,), key=mx.random.key(0)).astype(mx.uint32)
    print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}, {time.strftime('%Y-%m-%d')}; context {args.context}")
    print("| scheme | prefill s | peak GiB | build ms | wait ms | step ms | mean step ms | slowest step: which, build + wait ms "
          "| attention, prefilled caches ms | attention, appended caches ms | host probe ms, before / after |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|")
    piped_rows = []
    for name in [name for name in args.kv_cache for _ in range(args.instances)]:
        engine = Engine(network, LoadOptions(kv_cache=parse_kv_cache(name), max_context_length=args.context + 3 * args.steps + 64))
        warm_up(engine)
        caches = engine.make_layer_caches()
        engine.make_room(caches, args.context + 3 * args.steps + 8, "the benchmark")
        mx.synchronize()
        mx.reset_peak_memory()
        start = time.perf_counter()
        token = mx.argmax(engine.run(prompt, caches), axis=-1)
        mx.eval(token)
        prefill = time.perf_counter() - start
        peak = mx.get_peak_memory() / 2**30
        probe_before = host_probe_ms()
        build, wait, whole = [], [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            token = mx.argmax(engine.run(token, caches), axis=-1)
            built = time.perf_counter()
            mx.eval(token)
            done = time.perf_counter()
            build.append(built - start), wait.append(done - built), whole.append(done - start)
        piped = pipelined_steps(engine, caches, token, args.steps)
        probe_after = host_probe_ms()
        prefilled = attention_step_ms(caches, config["num_attention_heads"], args.steps)
        del caches
        mx.clear_cache()
        piped_rows.append(f"| {name} | " + " | ".join(f"{median_ms(piped[part]):.2f}" for part in PIPELINED)
                          + f" | {1e3 * statistics.fmean(piped['step']):.2f} |")
        fresh = make_layer_caches(parse_kv_cache(name), engine.layer_specs())
        rows = mx.random.normal((1, fresh[0].spec.n_kv_heads, 8192, fresh[0].spec.head_dim)).astype(mx.bfloat16)
        for start in range(0, args.context, 8192):
            for cache in fresh:
                cache.append(rows[:, :, : args.context - start], rows[:, :, : args.context - start])
            mx.eval([cache.state() for cache in fresh])
        appended = attention_step_ms(fresh, config["num_attention_heads"], args.steps)
        del fresh
        mx.clear_cache()
        slowest = max(range(args.steps), key=whole.__getitem__)
        if args.slow_steps:
            slow = [f"{n + 1}: {1e3 * build[n]:.1f} + {1e3 * wait[n]:.1f}" for n in range(args.steps)
                    if whole[n] > 1.5 * statistics.median(whole)]  # fmt: skip
            print(f"<!-- {name}: steps over 1.5x the median, build + wait ms: {', '.join(slow)} -->")
        print(f"| {name} | {prefill:.2f} | {peak:.1f} | {median_ms(build):.2f} | {median_ms(wait):.2f} | {median_ms(whole):.2f} | "
              f"{1e3 * statistics.fmean(whole):.2f} | {slowest + 1}, {1e3 * build[slowest]:.2f} + {1e3 * wait[slowest]:.2f} | "
              f"{prefilled:.2f} | {appended:.2f} | {probe_before:.2f} / {probe_after:.2f} |", flush=True)  # fmt: skip

    print("\nPipelined, as `Generation` decodes (medians, ms):\n")
    print("| scheme | build | encode | read | step | mean step |")
    print("|---|---:|---:|---:|---:|---:|")
    print("\n".join(piped_rows), flush=True)


if __name__ == "__main__":
    main()
