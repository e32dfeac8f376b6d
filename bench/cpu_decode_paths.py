"""Where a quantized cache's CPU decode step goes: append and single-token attention, per path.

30 layers shaped like the default model's (3 KV heads, 9 query heads, head_dim 64,
float32), each cache holding ``--context`` random positions. Times one token's append
for all layers, one query's attention for all layers, and both (``update_and_attend``),
medians of 20, each evaluated as one graph. For butter-affine it also times the other
two single-token paths on the same caches: the reference dequantize + SDPA, and
``mx.dequantize`` + SDPA; for raw, MLX's ``mx.fast.scaled_dot_product_attention`` on the
same keys and values in place of ``butter_core.cpu_attention``. Schemes alternate twice
(this machine is noisy).

Usage: ``python bench/cpu_decode_paths.py [--context 1024] [--kv-cache raw,affine8]``
"""

from __future__ import annotations

import argparse
import time

import butter_core  # noqa: F401 - preloads OpenBLAS before MLX, as for any user
import attrs
import mlx.core as mx

from butter_core import LayerSpec, make_layer_caches, parse_kv_cache

LAYERS, KV_HEADS, Q_HEADS, HEAD_DIM = 30, 3, 9, 64


def median_ms(fn, reps: int = 20) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[reps // 2] * 1e3


def filled(name: str, context: int):
    specs = [LayerSpec(KV_HEADS, HEAD_DIM, context + 64, mx.float32, layer_index=i) for i in range(LAYERS)]
    caches = make_layer_caches(parse_kv_cache(name), specs)
    keys, values = mx.random.normal((1, KV_HEADS, context, HEAD_DIM)), mx.random.normal((1, KV_HEADS, context, HEAD_DIM))
    for cache in caches:
        cache.append(keys, values)
    mx.eval([cache.buffers() for cache in caches])
    # MLX's CPU allocator keeps at most 32 MB of freed buffers and never evicts one to make
    # room; the fill's leave it full of sizes a step cannot reuse, and then the step's own
    # temporaries are mapped afresh every time (affine8 at 1k: 23-27 ms a token instead of
    # 11-12). Emptied, the timings measure the ops, not that state.
    mx.clear_cache()
    return caches


def mx_dequantize_sdpa(cache, q, scale):
    live = {name: array[:, :, : cache.length] for name, array in cache.slots.read().items()}
    group, bits = cache.format.group_size, cache.format.bits
    keys = mx.dequantize(live["key_codes"], live["key_scales"], live["key_biases"], group_size=group, bits=bits)
    values = mx.dequantize(live["value_codes"], live["value_scales"], live["value_biases"], group_size=group, bits=bits)
    return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--kv-cache", default="raw,affine8")
    args = parser.parse_args()
    scale = HEAD_DIM**-0.5
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM))
    row = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM))
    mx.eval(q, row)
    print(f"{LAYERS} layers, context {args.context}, float32, ms per token (median of 20)")
    for name in args.kv_cache.split(",") * 2:
        caches = filled(name, args.context)
        append = median_ms(lambda: mx.eval([(c.append(row, row), c.buffers())[1] for c in caches]))
        attend = median_ms(lambda: mx.eval([c.attention(q, scale=scale, mask=None) for c in caches]))
        both = median_ms(lambda: mx.eval([c.update_and_attend(q, row, row, scale=scale) for c in caches]))
        line = f"{name:10s} append {append:6.2f}  attention {attend:6.2f}  update_and_attend {both:6.2f}"
        if hasattr(caches[0], "format") and caches[0].ops.decode is not None:
            dequant = median_ms(lambda: mx.eval([mx_dequantize_sdpa(c, q, scale) for c in caches]))
            for cache in caches:
                cache.ops = attrs.evolve(cache.ops, decode=None)
            reference = median_ms(lambda: mx.eval([c.attention(q, scale=scale, mask=None) for c in caches]))
            line += f"  | attention by reference dequantize+SDPA {reference:6.2f}, mx.dequantize+SDPA {dequant:6.2f}"
        elif name == "raw":
            loaded = [c.load(c.length) for c in caches]
            sdpa = median_ms(lambda: mx.eval([mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)
                                              for k, v in loaded]))
            line += f"  | attention by mx.fast.scaled_dot_product_attention {sdpa:6.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
