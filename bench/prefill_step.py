"""A prefill chunk per layer as a user meets it: every layer's chunk stored and attended, butter against mlx-lm in one process.

Wall clock, host included, like ``decode_step.py``'s per-layer section, for a chunk of
``--chunk`` query tokens (a prefill chunk after the first) at ``--offset`` positions already
held: ``--layers`` independent layer caches per path, 16 query / 8 KV heads (Qwen3-1.7B's),
head_dim 128, bf16, random keys and values. One step = every layer's chunk built and
evaluated; µs per layer, the median of ``--steps`` steps after ``WARMUP`` (each step ends
with the chunk trimmed off again, outside the timing). Paths:

- ``mlx-lm KVCache``: ``update_and_fetch`` + ``mlx_lm.models.base.scaled_dot_product_attention``
  under the causal mask (what mlx-lm's model runs per layer and chunk);
- ``butter <scheme>``: each ``--kv-cache`` scheme's ``update_and_attend``;
- and, per butter scheme, its parts alone: ``encode`` (the chunk's rows as the slots keep
  them), ``load`` (the held positions decoded to keys and values), and ``sdpa`` (MLX's
  attention of the chunk over held + chunk positions in full precision): where a scheme's
  prefill time goes.

Usage (on the lent GPU, ``PYTHONPATH`` with butter, its plugins and mlx-lm):

    python3 bench/prefill_step.py [--offset 2048 16384 65536] [--chunk 2048] [--kv-cache raw,affine4,aura4v2]
"""

from __future__ import annotations

import argparse
import statistics
import time

import butter_core  # noqa: F401 - before mlx.core (CPU BLAS selection)
import mlx.core as mx

from butter_core import parse_kv_cache
from butter_core.cache import LayerSpec
from butter_core.layer_caches import make_layer_caches
from gpu_batched import mlx_lm_module

WARMUP = 3
Q_HEADS, KV_HEADS, HEAD_DIM = 16, 8, 128
SCALE = HEAD_DIM**-0.5


def random_rows(tokens: int, seed: int) -> mx.array:
    return mx.random.normal((1, KV_HEADS, tokens, HEAD_DIM), key=mx.random.key(seed)).astype(mx.bfloat16)


def timed(step, undo, steps: int, layers: int) -> float:
    """µs per layer: the median over ``steps`` of building and evaluating ``step()``; ``undo()`` after each, untimed."""
    times = []
    for n in range(WARMUP + steps):
        start = time.perf_counter()
        mx.eval(step())
        times.append(time.perf_counter() - start)
        undo()
    return 1e6 * statistics.median(times[WARMUP:]) / layers


def paths(args, offset: int, queries: mx.array, keys: mx.array, values: mx.array):
    """name -> (step, undo) at ``offset`` held positions."""
    held = [random_rows(min(args.chunk, offset - start), start) for start in range(0, offset, args.chunk)]
    mx.eval(held)
    cache_module, base = mlx_lm_module("models.cache"), mlx_lm_module("models.base")
    caches = [cache_module.KVCache() for _ in range(args.layers)]
    for rows in held:
        for cache in caches:
            cache.update_and_fetch(rows, rows)
        mx.eval([cache.state for cache in caches])

    def mlx_lm_step():
        outs = []
        for cache in caches:
            k, v = cache.update_and_fetch(keys, values)
            outs.append(base.scaled_dot_product_attention(queries, k, v, cache=cache, scale=SCALE, mask="causal"))
        return outs

    def mlx_lm_undo():
        for cache in caches:
            cache.offset -= args.chunk

    yield "mlx-lm KVCache", mlx_lm_step, mlx_lm_undo
    caches = None  # frees the arrays before the next path fills its own
    for name in args.kv_cache:
        spec = LayerSpec(KV_HEADS, HEAD_DIM, offset + args.chunk, mx.bfloat16)
        layers = make_layer_caches(parse_kv_cache(name), [spec] * args.layers)
        for rows in held:
            for cache in layers:
                cache.append(rows, rows)
            mx.eval([cache.state() for cache in layers])
        yield (f"butter {name}", lambda: [c.update_and_attend(queries, keys, values, scale=SCALE) for c in layers],
               lambda: [c.trim(args.chunk) for c in layers])  # fmt: skip
        yield f"  {name}: encode", lambda: [c.encode(keys, values) for c in layers], lambda: None
        yield f"  {name}: load", lambda: [c.load(offset) for c in layers], lambda: None
        past = layers[0].load(offset)
        whole_k, whole_v = mx.concatenate([past[0], keys], axis=2), mx.concatenate([past[1], values], axis=2)
        mx.eval(whole_k, whole_v)
        yield (f"  {name}: sdpa", lambda: [mx.fast.scaled_dot_product_attention(queries, whole_k, whole_v, scale=SCALE,
                                                                                  mask="causal") for _ in layers],
               lambda: None)  # fmt: skip
        layers = past = whole_k = whole_v = None
        mx.clear_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--offset", type=int, nargs="+", default=[2048, 16384, 65536])
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--kv-cache", type=lambda t: t.split(","), default=["raw", "affine4", "aura4v2"])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    print(f"MLX {mx.__version__}, {mx.default_device()}, {mx.device_info().get('device_name', '')}, {time.strftime('%Y-%m-%d')}")
    print(f"\n## A prefill chunk per layer: {args.chunk} tokens, {args.layers} layers, {Q_HEADS} q / {KV_HEADS} kv heads, "
          f"D {HEAD_DIM}, bf16; µs per layer, medians of {args.steps} steps\n")  # fmt: skip
    print("| offset | path | µs per layer | / mlx-lm |")
    print("|---:|---|---:|---:|")
    queries = mx.random.normal((1, Q_HEADS, args.chunk, HEAD_DIM), key=mx.random.key(1)).astype(mx.bfloat16)
    keys, values = random_rows(args.chunk, 2), random_rows(args.chunk, 3)
    mx.eval(queries, keys, values)
    for offset in args.offset:
        reference = None
        for name, step, undo in paths(args, offset, queries, keys, values):
            us = timed(step, undo, args.steps, args.layers)
            reference = reference or us
            print(f"| {offset} | {name} | {us:.1f} | {us / reference:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
