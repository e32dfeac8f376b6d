"""Decode attention and end-to-end decode speed of every installed scheme, on a GPU.

Made for the lent NVIDIA H200 (MLX's CUDA backend); runs on any MLX backend.

1. Decode attention, batch 1, 32 query heads, 8 KV heads, head_dim 128, bf16, at each
   context: every requested scheme's own decode path (``cache.attention`` for one query
   over a cache filled through the scheme's append, i.e. its fused kernel where it has
   one), against ``mx.fast.scaled_dot_product_attention`` on raw bf16 and against
   attention through ``mx.quantized_matmul`` on ``mx.quantize``d keys and values (how
   mlx-lm's quantized cache attends). Times are amortised: ``--calls`` calls evaluated
   together, divided by ``--calls``. Bytes read: what the path must read (the cache's
   live bytes plus the query); bandwidth against ``--copy-tbs`` (the machine's
   measured copy bandwidth).
2. End to end: decode tok/s of a Qwen3-1.7B-shaped model with random bf16 weights at
   each ``--e2e-context``, per scheme, through butter's own engine (chunked prefill,
   then two untimed steps (the first, reported as ``first_step_s``, compiles the decode
   kernels), then ``--decode-tokens`` greedy tokens through ``Generation`` (the loop of
   ``butter generate``, which builds step n+1's graph while step n evaluates): decode
   tok/s, the median of ``--e2e-rounds`` such runs. Then ``SYNC_STEPS`` steps one at a
   time, each split into building the step's graph on the host (``step_build_ms``) and
   evaluating it (``step_eval_ms``).

Usage: python3 bench/gpu_bench.py [--kv-cache raw,affine4,...] [--json PATH]
Each section catches its own errors so one failure does not hide the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
import traceback
from datetime import date
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn

from butter_core import LayerSpec, LoadOptions, get_plugin_host, make_layer_caches
from butter_core.engine import Engine
from butter_core.generation import Generation
from butter_core.models import build_model
from gpu_timing import amortised, quantized_matmul_attention

Q_HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
DEFAULT_SCHEMES = "raw,affine8,affine6,affine4,aura8v8,aura8v4,aura4v4,aura4v2,fp8"
SYNC_STEPS = 8
"""Unpipelined decode steps timed for the build/eval split."""
QWEN3_1_7B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "vocab_size": 151936,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": True,
}
SMALL_MODEL = QWEN3_1_7B | {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4,
                            "num_key_value_heads": 2, "head_dim": 64, "num_hidden_layers": 4, "vocab_size": 4096}  # fmt: skip
"""``QWEN3_1_7B``'s family, small enough that a bench's ``--small`` checks it on a CPU."""


def amortised_us(fn, calls: int) -> float:
    """``gpu_timing.amortised`` of ``calls`` calls of ``fn``, in µs: only the evaluation is
    timed (building a custom kernel's call costs tens of µs of host time in MLX, which a
    decode loop overlaps with the previous step's GPU work; counted here it would hide the
    kernels' own time, as it did in the first version of this script). The end-to-end
    section reports host time."""
    return amortised(lambda: [fn() for _ in range(calls)], calls=calls).us


def filled_cache(kind, context: int, key):
    """A one-layer cache of ``kind`` holding ``context`` random positions, appended in chunks."""
    (cache,) = make_layer_caches(kind, [LayerSpec(KV_HEADS, HEAD_DIM, context + 16, mx.bfloat16)])
    for start in range(0, context, 8192):
        n = min(8192, context - start)
        key, k1, k2 = mx.random.split(key, 3)
        cache.append(
            mx.random.normal((1, KV_HEADS, n, HEAD_DIM), key=k1).astype(mx.bfloat16),
            mx.random.normal((1, KV_HEADS, n, HEAD_DIM), key=k2).astype(mx.bfloat16),
        )
        mx.eval(cache.state())
    return cache


def attention_section(args, rows):
    host = get_plugin_host()
    scale = HEAD_DIM**-0.5
    key = mx.random.key(0)
    for context in args.context:
        q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
        k = mx.random.normal((1, KV_HEADS, context, HEAD_DIM)).astype(mx.bfloat16)
        v = mx.random.normal((1, KV_HEADS, context, HEAD_DIM)).astype(mx.bfloat16)
        mx.eval(q, k, v)
        raw_us = amortised_us(lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale), args.calls)
        raw_bytes = k.nbytes + v.nbytes + q.nbytes
        rows.append(row("mx.fast.sdpa raw bf16", context, raw_us, raw_bytes, raw_us, args))
        for bits in (4, 8):
            kq, vq = mx.quantize(k, 64, bits), mx.quantize(v, 64, bits)
            mx.eval(kq, vq)
            us = amortised_us(lambda: quantized_matmul_attention(q, kq, vq, scale, bits=bits, group_size=64), args.calls)
            nbytes = sum(x.nbytes for x in (*kq, *vq)) + q.nbytes
            rows.append(row(f"mx.quantized_matmul {bits}-bit g64", context, us, nbytes, raw_us, args))
        k = v = None  # freed (not del: a lambda above reads the names)
        for name in args.kv_cache:
            try:
                kind = host.parse_kv_cache(name)
            except Exception as exc:  # noqa: BLE001 - a scheme not installed here is reported, not fatal
                print(f"skip {name}: {exc}")
                continue
            try:
                cache = filled_cache(kind, context, key)
                us = amortised_us(lambda: cache.attention(q, scale=scale, mask=None), args.calls)
                rows.append(row(f"butter {name}", context, us, cache.nbytes_live + q.nbytes, raw_us, args))
                cache = None  # freed (not del: the lambda above reads the name)
            except Exception:  # noqa: BLE001
                print(f"FAILED attention {name} @ {context}:\n{traceback.format_exc()}")


def row(path, context, us, nbytes, raw_us, args):
    return {
        "path": path,
        "context": context,
        "us": round(us, 2),
        "bytes_read": nbytes,
        "tb_s": round(nbytes / us / 1e6, 3),
        "fraction_of_copy_bw": round(nbytes / us / 1e6 / args.copy_tbs, 3),
        "time_vs_raw_sdpa": round(us / raw_us, 3),
    }


def random_qwen3(config: dict = QWEN3_1_7B) -> nn.Module:
    """A model of ``config`` (Qwen3-shaped) with random bf16 weights, evaluated."""
    model = build_model(config, Path("qwen3-shaped (random weights)"))
    model.set_dtype(mx.bfloat16)
    mx.eval(model.parameters())
    return model


def e2e_section(args, rows):
    host = get_plugin_host()
    model = random_qwen3()
    for context in args.e2e_context:
        prompt = mx.random.randint(0, QWEN3_1_7B["vocab_size"], (context,)).astype(mx.uint32)
        for name in args.kv_cache:
            try:
                kind = host.parse_kv_cache(name)
            except Exception:  # noqa: BLE001
                continue
            mx.clear_cache()
            try:
                positions = context + (args.decode_tokens + 1) * args.e2e_rounds + SYNC_STEPS + 8
                engine = Engine(model, LoadOptions(kv_cache=kind, max_context_length=positions))
                caches = engine.make_layer_caches()
                mx.reset_peak_memory()
                start = time.perf_counter()
                token = mx.argmax(engine.forward(prompt, caches)).item()
                prefill_s = time.perf_counter() - start
                start = time.perf_counter()
                token = engine.forward_sample(token, caches[0].absolute_position, caches)
                first_step_s = time.perf_counter() - start  # includes compiling the decode kernels
                token = engine.forward_sample(token, caches[0].absolute_position, caches)
                peak = mx.get_peak_memory()  # Generation resets the peak
                rates = []
                for _ in range(args.e2e_rounds):
                    generation = Generation(engine, [token], caches, max_tokens=args.decode_tokens + 1)
                    for token in generation:
                        pass
                    rates.append(generation.stats.decode_tps)
                build_s = eval_s = 0.0
                for _ in range(SYNC_STEPS):
                    start = time.perf_counter()
                    logits = engine.forward([token], caches)
                    built = time.perf_counter()
                    token = mx.argmax(logits).item()
                    build_s += built - start
                    eval_s += time.perf_counter() - built
                rows.append(
                    {
                        "scheme": name,
                        "context": context,
                        "prefill_tok_s": round(context / prefill_s, 1),
                        "first_step_s": round(first_step_s, 3),
                        "decode_tok_s": round(statistics.median(rates), 2),
                        "decode_tok_s_rounds": [round(r, 2) for r in rates],
                        "step_build_ms": round(1e3 * build_s / SYNC_STEPS, 2),
                        "step_eval_ms": round(1e3 * eval_s / SYNC_STEPS, 2),
                        "kv_bytes_live": sum(c.nbytes_live for c in caches),
                        "peak_memory_bytes": max(peak, mx.get_peak_memory()),
                    }
                )
                del caches, generation, logits  # the generation holds the caches: free them before the next scheme
            except Exception:  # noqa: BLE001
                print(f"FAILED e2e {name} @ {context}:\n{traceback.format_exc()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    parser.add_argument("--kv-cache", type=lambda t: t.split(","), default=DEFAULT_SCHEMES.split(","))
    parser.add_argument("--context", type=ints, default=[4096, 32768, 131072])
    parser.add_argument("--e2e-context", type=ints, default=[4096, 32768])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--copy-tbs", type=float, default=4.1, help="measured copy bandwidth, TB/s (GPU-NOTES)")
    parser.add_argument("--e2e-rounds", type=int, default=1, help="decode runs per scheme and context (median)")
    parser.add_argument("--skip-attention", action="store_true")
    parser.add_argument("--skip-e2e", action="store_true")
    parser.add_argument("--json", type=Path, default=Path(os.environ["OUT"]) / "gpu_bench.json" if "OUT" in os.environ else None)
    args = parser.parse_args()

    meta = {"date": str(date.today()), "mlx": mx.__version__, "device": str(mx.default_device()), "host": platform.node()}
    print(meta)
    attention, e2e = [], []
    for section, rows in ((attention_section, attention), (e2e_section, e2e)):
        if (section is e2e_section and args.skip_e2e) or (section is attention_section and args.skip_attention):
            continue
        try:
            section(args, rows)
        except Exception:  # noqa: BLE001
            print(f"FAILED {section.__name__}:\n{traceback.format_exc()}")
    print(f"\ndecode attention, B=1 Hq={Q_HEADS} Hkv={KV_HEADS} D={HEAD_DIM}, amortised over {args.calls} calls")
    print(f"{'path':34s} {'context':>8s} {'us':>9s} {'MB read':>9s} {'TB/s':>7s} {'of copy':>8s} {'vs raw':>7s}")
    for r in attention:
        print(
            f"{r['path']:34s} {r['context']:8d} {r['us']:9.1f} {r['bytes_read'] / 1e6:9.1f} {r['tb_s']:7.2f} "
            f"{r['fraction_of_copy_bw']:8.2f} {r['time_vs_raw_sdpa']:7.2f}"
        )
    if e2e:
        print("\nend to end, Qwen3-1.7B-shaped, random bf16 weights")
        print(f"{'scheme':10s} {'context':>8s} {'prefill tok/s':>14s} {'1st step s':>11s} {'decode tok/s':>13s} "
              f"{'build ms':>9s} {'eval ms':>8s} {'KV MB':>8s} {'peak GB':>8s}")
        for r in e2e:
            print(
                f"{r['scheme']:10s} {r['context']:8d} {r['prefill_tok_s']:14.1f} {r['first_step_s']:11.3f} "
                f"{r['decode_tok_s']:13.2f} {r['step_build_ms']:9.2f} {r['step_eval_ms']:8.2f} "
                f"{r['kv_bytes_live'] / 1e6:8.1f} {r['peak_memory_bytes'] / 1e9:8.2f}"
            )
    if args.json:
        args.json.write_text(json.dumps({"meta": meta, "attention": attention, "e2e": e2e}, indent=2))


if __name__ == "__main__":
    main()
