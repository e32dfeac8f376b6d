"""Where a whole-model decode step's time goes, per scheme, after a real prefill: host build, and the GPU's wait.

For each ``--kv-cache`` scheme: a Qwen3-1.7B-shaped model (random bf16 weights, as
``decode_step.py``'s end-to-end rows), warmed up, prefills ``--context`` random tokens
through ``Engine.run`` (the engine's prefill chunks), then times ``--steps`` decode steps
one at a time: ``build`` (``engine.run`` for one token + argmax, on the host), ``wait``
(``mx.eval`` after it). Then, on the same caches, every layer's attention alone
(``update_and_attend`` with the model's query heads, all layers built and evaluated as
one step), and the same on fresh caches filled by ``append`` (``decode_step.py``'s per-layer
method): a gap between the two says the prefilled caches decode differently.

Usage: python3 bench/diag_decode_e2e.py [--context 131072] [--kv-cache raw,affine4,aura4v2]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=131072)
    parser.add_argument("--kv-cache", type=lambda t: t.split(","), default=["raw", "affine4", "aura4v2"])
    parser.add_argument("--steps", type=int, default=48)
    args = parser.parse_args()
    config = QWEN3_1_7B | {"max_position_embeddings": args.context + 1024}
    network = build_model(config, Path("qwen3-shaped (random weights)"))
    network.set_dtype(mx.bfloat16)
    mx.eval(network.parameters())
    prompt = mx.random.randint(0, config["vocab_size"], (args.context,), key=mx.random.key(0)).astype(mx.uint32)
    print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}, {time.strftime('%Y-%m-%d')}; context {args.context}")
    print("| scheme | prefill s | peak GiB | build ms | wait ms | step ms | attention, prefilled caches ms | "
          "attention, appended caches ms |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name in args.kv_cache:
        engine = Engine(network, LoadOptions(kv_cache=parse_kv_cache(name), max_context_length=args.context + 2 * args.steps + 64))
        warm_up(engine)
        caches = engine.make_layer_caches()
        engine.make_room(caches, args.context + 2 * args.steps + 8, "the benchmark")
        mx.synchronize()
        mx.reset_peak_memory()
        start = time.perf_counter()
        token = mx.argmax(engine.run(prompt, caches), axis=-1)
        mx.eval(token)
        prefill = time.perf_counter() - start
        peak = mx.get_peak_memory() / 2**30
        build, wait, whole = [], [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            token = mx.argmax(engine.run(token, caches), axis=-1)
            built = time.perf_counter()
            mx.eval(token)
            done = time.perf_counter()
            build.append(built - start), wait.append(done - built), whole.append(done - start)
        prefilled = attention_step_ms(caches, config["num_attention_heads"], args.steps)
        del caches
        mx.clear_cache()
        fresh = make_layer_caches(parse_kv_cache(name), engine.layer_specs())
        rows = mx.random.normal((1, fresh[0].spec.n_kv_heads, 8192, fresh[0].spec.head_dim)).astype(mx.bfloat16)
        for start in range(0, args.context, 8192):
            for cache in fresh:
                cache.append(rows[:, :, : args.context - start], rows[:, :, : args.context - start])
            mx.eval([cache.state() for cache in fresh])
        appended = attention_step_ms(fresh, config["num_attention_heads"], args.steps)
        del fresh
        mx.clear_cache()
        print(f"| {name} | {prefill:.2f} | {peak:.1f} | {median_ms(build):.2f} | {median_ms(wait):.2f} | {median_ms(whole):.2f} | "
              f"{prefilled:.2f} | {appended:.2f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
