"""butter-raw kernels on the GPU: correctness against references, then timings.

Run on a machine with a GPU backend (the lent H200, or Apple silicon):

    PYTHONPATH=.:plugins/butter-raw python bench/gpu_raw_kernels.py

1. Every ``KERNEL_CHECKS`` case, plus ``sdpa_decode`` at the timed shapes: relative error
   ‖out − ref‖/‖ref‖ on fresh random data, kernel outputs poisoned with NaN.
2. Amortised timings (50 calls evaluated together, divided by 50), batch 1, 32 query
   heads, 8 KV heads, head_dim 128, bf16, contexts 4k/32k/128k:
   - ``sdpa_decode`` over a buffer of 2L slots with L live, against
     ``mx.fast.scaled_dot_product_attention`` over the live slice ``k[:, :, :L]`` of that
     buffer and over a contiguous buffer of exactly L;
   - ``sdpa_decode`` again with each of its tunables (``SWEEPS``) changed;
   - a one-token append: the ``kv_cache_update`` kernel against slice assignment
     (donated in place, and with a view of the old buffer still alive, which forces a
     copy of the whole buffer).
   Consecutive calls read different K/V buffers when one would fit in L2, as the
   layers of a decode step do.
Prints a table; with ``OUT`` set, writes everything to ``$OUT/raw_kernels.json``.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import mlx.core as mx

from butter_core.kernels import gpu_backend
from butter_raw import kernels as raw
from gpu_timing import CALLS, amortised, copies_for

CONTEXTS = (4096, 32768, 131072)
Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, mx.bfloat16
SWEEPS = {"_TARGET_BLOCKS": (256, 1024), "_TILE": (2, 8)}
"""Tunables of ``butter_raw.kernels`` retimed one at a time against their defaults."""


def run_checks() -> list[dict]:
    """Every kernel check case, then sdpa_decode at the timed shapes."""
    cases = [(check, case) for check in raw.KERNEL_CHECKS for case in check.cases]
    attention = next(c for c in raw.KERNEL_CHECKS if c.name == "sdpa_decode")
    cases += [
        (attention, dict(q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                         allocated=2 * length, length=length, dtype=DTYPE))
        for length in CONTEXTS
    ]
    results = []
    for seed, (check, case) in enumerate(cases):
        row = {"kernel": check.name, "case": {k: str(v) for k, v in case.items()}}
        try:
            result = check.check(seed=seed, **case)
            row.update(relative_error=result.relative_error, tolerance=result.tolerance,
                       passed=result.passed)
        except Exception:  # a compile error must not hide the other kernels' results
            row.update(passed=False, error=traceback.format_exc(limit=3))
        results.append(row)
        print(f"check {row['kernel']:16s} {'ok  ' if row['passed'] else 'FAIL'} "
              f"rel_err={row.get('relative_error', float('nan')):.2e} {row['case']}")
        if "error" in row:
            print(row["error"])
    return results


def kv_buffers(slots: int, count: int) -> list[tuple[mx.array, mx.array]]:
    shape = (1, KV_HEADS, slots, HEAD_DIM)
    pairs = [(mx.random.normal(shape).astype(DTYPE), mx.random.normal(shape).astype(DTYPE))
             for _ in range(count)]
    mx.eval(pairs)
    return pairs


def time_attention(length: int) -> dict:
    """Our kernel against MLX's SDPA at one context length."""
    live_bytes = 2 * KV_HEADS * length * HEAD_DIM * DTYPE.size
    count = copies_for(live_bytes)
    buffers = kv_buffers(2 * length, count)
    exact = [(k[:, :, :length], v[:, :, :length]) for k, v in buffers]
    exact = [(mx.contiguous(k), mx.contiguous(v)) for k, v in exact]
    mx.eval(exact)
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    scale = HEAD_DIM**-0.5

    def calls(fn, pairs):
        return lambda: [fn(pairs[i % len(pairs)]) for i in range(CALLS)]

    sdpa = mx.fast.scaled_dot_product_attention
    row = {
        "context": length,
        "buffers": count,
        "live_kv_bytes": live_bytes,
        "sdpa_decode_us": amortised(calls(
            lambda kv: raw.sdpa_decode(q, kv[0], kv[1], length, scale), buffers)).us,
        "mlx_sdpa_live_slice_us": amortised(calls(
            lambda kv: sdpa(q, kv[0][:, :, :length], kv[1][:, :, :length], scale=scale),
            buffers)).us,
        "mlx_sdpa_exact_us": amortised(calls(
            lambda kv: sdpa(q, kv[0], kv[1], scale=scale), exact)).us,
    }
    row["sdpa_decode_tb_s"] = live_bytes / row["sdpa_decode_us"] / 1e6
    for name, values in SWEEPS.items():
        default = getattr(raw, name)
        try:
            for value in values:
                setattr(raw, name, value)
                row[f"sdpa_decode_us{name}={value}"] = amortised(calls(
                    lambda kv: raw.sdpa_decode(q, kv[0], kv[1], length, scale), buffers)).us
        finally:
            setattr(raw, name, default)
    return row


def time_append(length: int) -> dict:
    """A one-token append into a buffer of 2L slots at position L."""
    (cache, _), = kv_buffers(2 * length, 1)
    rows = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    mx.eval(rows)

    def kernel_chain():
        buf = cache
        for i in range(CALLS):
            buf = raw.kv_cache_update(buf, rows, length + i)
        return [buf]

    def assign_chain(keep_view: bool):
        def build():
            buf = cache + 0  # a buffer only this chain holds, so the first write may donate
            mx.eval(buf)
            views = []
            for i in range(CALLS):
                if keep_view:  # e.g. attention's k[:, :, :L] still alive at the next write
                    views.append(buf[:, :, :1])
                buf[:, :, length + i:length + i + 1, :] = rows
            return [buf, *views]
        return build

    return {
        "context": length,
        "allocated": 2 * length,
        "kernel_us": amortised(kernel_chain).us,
        "slice_assign_donated_us": amortised(assign_chain(keep_view=False)).us,
        "slice_assign_referenced_us": amortised(assign_chain(keep_view=True)).us,
    }


def print_tables(attention: list[dict], append: list[dict]) -> None:
    print(f"\namortised µs per call ({CALLS} calls per eval), B=1 Hq={Q_HEADS} "
          f"Hkv={KV_HEADS} D={HEAD_DIM} bf16")
    swept = [f"{name}={value}" for name, values in SWEEPS.items() for value in values]
    print(f"{'context':>8} {'ours':>8} {'TB/s':>6} {'sdpa slice':>11} {'sdpa exact':>11} "
          f"{'ours/exact':>10}  ours with " + " / ".join(swept))
    for r in attention:
        sweep = " / ".join(f"{r[f'sdpa_decode_us{s}']:.1f}" for s in swept)
        print(f"{r['context']:>8} {r['sdpa_decode_us']:>8.1f} {r['sdpa_decode_tb_s']:>6.2f} "
              f"{r['mlx_sdpa_live_slice_us']:>11.1f} {r['mlx_sdpa_exact_us']:>11.1f} "
              f"{r['sdpa_decode_us'] / r['mlx_sdpa_exact_us']:>10.2f}  {sweep}")
    print("\none-token append into a 2L-slot buffer, amortised µs per append")
    print(f"{'context':>8} {'kernel':>9} {'assign (donated)':>17} {'assign (referenced)':>20}")
    for r in append:
        print(f"{r['context']:>8} {r['kernel_us']:>9.1f} {r['slice_assign_donated_us']:>17.1f} "
              f"{r['slice_assign_referenced_us']:>20.1f}")


def main() -> int:
    backend = gpu_backend()
    if backend is None:
        print("no GPU backend in this MLX; nothing to run")
        return 1
    mx.set_default_device(mx.gpu)
    report = {"backend": backend, "mlx": mx.__version__, "device": str(mx.default_device())}
    report["checks"] = run_checks()
    if not all(r["passed"] for r in report["checks"]):
        print("checks failed; skipping timings")
        ok = False
    else:
        report["attention"] = [time_attention(length) for length in CONTEXTS]
        report["append"] = [time_append(length) for length in CONTEXTS]
        print_tables(report["attention"], report["append"])
        ok = True
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "raw_kernels.json"), "w") as f:
            json.dump(report, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
