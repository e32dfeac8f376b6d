"""butter-affine kernels on the GPU: correctness against references, then timings.

Run on a machine with a GPU backend (the lent H200, or Apple silicon), with butter-core,
butter-raw and butter-affine installed:

    python bench/gpu_affine.py            # everything
    python bench/gpu_affine.py --no-sweep # without the tunables sweep
    python bench/gpu_affine.py --no-checks # timings only
    python bench/gpu_affine.py --only-attention # checks, then single-token attention only
    python bench/gpu_affine.py --only-sweep # checks, then the tunables sweep only

1. Every ``KERNEL_CHECKS`` case (the tensor-core ``decode_attention_mma`` among them),
   plus ``decode_attention`` and ``decode_attention_mma`` at the timed shapes (4k and 32k;
   4/6/8 bits and 4/8 bits; the float32 reference on the CPU makes 128k slow to check):
   relative error ‖out − ref‖/‖ref‖ on fresh random data, kernel outputs poisoned with
   NaN, each printed ok/FAIL as it finishes. A failed check is reported and its kernel
   still timed.
2. Amortised timings (50 calls evaluated together, divided by 50; GPU-NOTES), batch 1,
   32 query heads, 8 KV heads, head_dim 128, bf16, contexts 4k/32k/128k, of single-token
   attention by five paths: MLX's SDPA on raw bf16 K/V; the fused float32 kernel
   (``decode``) on affine4/6/8 codes; the tensor-core kernel (``decode_mma``) on affine4/8
   codes (partials kernel, then merge kernel); dequantize kernel + SDPA; mlx-lm's
   ``mx.quantized_matmul`` path on the same codes. Each with the bytes it must move and
   the rate that makes (against 4.1 TB/s, the copy rate measured on the H200), and the
   host's time building the calls' graph per call (not in the amortised time).
   Consecutive calls read different buffers when one set would fit in L2, as the layers
   of a decode step do. Raw SDPA and the tensor-core kernel are also timed *chained*: each
   call's query is the previous call's output, so calls cannot overlap on the GPU, as a
   decode step's layers cannot.
   First (the figure to quote), raw SDPA and the tensor-core kernel on affine4 and affine8
   at 128k *side by side*: timed in turn for 9 rounds, each round's ratio to raw's time
   in that round, and their median (``gpu_timing.side_by_side``; whole runs drift by
   5-15%). ``mx.quantized_matmul`` runs in mlx-lm's form (``gpu_timing``), which MLX
   0.32.4's CUDA backend runs on 8-bit codes too; the form with the query heads as matrix
   rows crashed it there ("an illegal memory access", 2026-11-30).
3. A one-token append (quantize kernel + six slice assignments) into a cache holding L
   positions, against butter-raw's append.
4. The working set of a 30-layer chunked-prefill step over 32k positions (dequantize per
   layer), against a 5-layer one, with the caches' ``PrefillPipeline`` off and on: one
   layer's dequantized K/V, or all layers'.
5. The kernels' tunables (``butter_affine.kernels.decode``, then ``decode_mma`` for
   affine4 and affine8), one at a time, at 128k, side by side with the defaults.
Prints compact tables; with ``OUT`` set, writes everything to ``$OUT/affine.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import mlx.core as mx

from butter_core import LayerSpec, make_layer_caches
from butter_core.kernels import gpu_backend
from butter_core.slots import unstack
from butter_affine import Affine
from butter_raw import Raw
from butter_affine.kernels import KERNEL_CHECKS, decode, decode_mma, dequantize, quantize
from gpu_timing import CALLS, amortised, copies_for, print_side_by_side, quantized_matmul_attention, side_by_side
from butter_affine.packing import BUFFERS, STACKS, PackedFormat

CONTEXTS = (4096, 32768, 131072)
CHECK_CONTEXTS = (4096, 32768)
"""Contexts at which the decode kernels are also checked at the timed shapes."""
Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, mx.bfloat16
SCHEMES = {"affine4": (4, 32), "affine6": (6, 32), "affine8": (8, 64)}
COPY_TB_S = 4.1
SWEEPS = (
    {"TILE": {4: 2, 6: 4, 8: 2}},
    {"PREFETCH": False},
    {"TILE": {4: 8, 6: 4, 8: 2}, "PREFETCH": False},
    {"WARPS": 8},
    {"TARGET_BLOCKS": 264},
    {"TARGET_BLOCKS": 1056},
    {"ELEMS": 8},
)
"""Overrides of ``butter_affine.kernels.decode``'s tunables, each timed alone for affine4 at 128k."""
TENSOR_CORE_SWEEPS = (
    {"READ_ONLY_LOADS": False},
    {"SCORE_CHAINS": {4: 1, 6: 1, 8: 1}},
    {"SCORE_CHAINS": {4: 2, 6: 2, 8: 2}},
    {"TARGET_BLOCKS": 132},
    {"TARGET_BLOCKS": 396},
    {"TARGET_BLOCKS": 528},
    {"KEY_BLOCKS": 1, "TARGET_BLOCKS": 528},
    {"KEY_BLOCKS": 4},
    {"PREFETCH": True},
    {"PREFETCH": True, "TARGET_BLOCKS": 396},
)
"""Overrides of ``butter_affine.kernels.decode_mma``'s tunables, each timed alone for affine4
and affine8 at 128k. Registers decide threadgroups per multiprocessor (nvcc 13.0, sm_90a,
bf16, head_dim 128, 4 heads, 4 / 8 bits: ``KEY_BLOCKS`` 1: 122 / 125 -> 4 per
multiprocessor, so 528 = one wave on 132; ``KEY_BLOCKS`` 2: 148 / 167 with the read-only loads and
chains {4: 1, 8: 2} (145 / 168 without) -> 3 / 3, with ``PREFETCH`` 158 / 196 -> 3 / 2; ``KEY_BLOCKS`` 4: 235 / 255, 8 bits spilling 4 bytes), so
``TARGET_BLOCKS`` moves with them. The defaults (``KEY_BLOCKS=2``, no prefetch, read-only
loads, score chains {4: 1, 8: 2}, 264 threadgroups) won the H200 sweeps of 2026-11-30
(docs/benchmarks.md); these try around them."""


def tensor_core(bits: int, group: int) -> bool:
    """Whether the tensor-core kernel takes this scheme at the timed shapes."""
    return decode_mma.supports(PackedFormat(bits, group, HEAD_DIM, DTYPE), DTYPE)

REPORT: dict = {}


@contextlib.contextmanager
def overridden(module, **values):
    """Module attributes (a kernel's tunables, read per call) set to ``values`` within the block."""
    saved = {name: getattr(module, name) for name in values}
    try:
        for name, value in values.items():
            setattr(module, name, value)
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def save() -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "affine.json"), "w") as f:
            json.dump(REPORT, f, indent=2, default=str)


def chained(query: mx.array, step: Callable[[mx.array, object], mx.array],
            buffers: list) -> Callable[[], list[mx.array]]:
    """A ``build`` for ``amortised``: CALLS calls of ``step(query, buffers[i])`` in a chain, each
    call's output the next call's query, as the layers of a decode step wait on each other
    (independent calls can overlap on the GPU; chained ones cannot)."""

    def build() -> list[mx.array]:
        x = query
        for i in range(CALLS):
            x = step(x, buffers[i % len(buffers)])
        return [x]

    return build


def run_checks() -> list[dict]:
    cases = [(check, case) for check in KERNEL_CHECKS for case in check.cases]
    attention = next(c for c in KERNEL_CHECKS if c.name == "decode_attention")
    attention_mma = next(c for c in KERNEL_CHECKS if c.name == "decode_attention_mma")
    cases += [
        (check, dict(bits=bits, group_size=group, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                     allocated=length + 256, length=length, dtype=DTYPE))
        for length in CHECK_CONTEXTS for bits, group in SCHEMES.values()
        for check in (attention, *((attention_mma,) if tensor_core(bits, group) else ()))
    ]
    results = []
    for seed, (check, case) in enumerate(cases):
        row = {"kernel": check.name, "case": {k: str(v) for k, v in case.items()}}
        try:
            result = check.check(seed=100 + seed, **case)
            row.update(relative_error=result.relative_error, tolerance=result.tolerance, passed=result.passed)
        except Exception:  # a compile error must not hide the other kernels' results
            row.update(passed=False, error=traceback.format_exc(limit=4))
        results.append(row)
        print(f"check {row['kernel']:20s} {'ok  ' if row['passed'] else 'FAIL'} "
              f"rel_err={row.get('relative_error', float('nan')):.2e} {row['case']}", flush=True)
        if "error" in row:
            print(row["error"], flush=True)
    return results


def raw_bytes(length: int) -> int:
    """What raw SDPA reads: bf16 K and V."""
    return 2 * KV_HEADS * length * HEAD_DIM * DTYPE.size


def packed_bytes(bits: int, group: int, length: int) -> int:
    """What a fused decode reads: K and V codes, scales and biases."""
    return 2 * KV_HEADS * length * PackedFormat(bits, group, HEAD_DIM, DTYPE).row_bytes


def raw_pairs(length: int) -> list[tuple[mx.array, mx.array]]:
    """Independent bf16 K/V pairs of ``length`` positions, as many as keep consecutive calls out of L2."""
    pairs = [tuple(mx.random.normal((1, KV_HEADS, length, HEAD_DIM)).astype(DTYPE) for _ in range(2))
             for _ in range(copies_for(raw_bytes(length)))]
    mx.eval(pairs)
    return pairs


def packed_sets(bits: int, group: int, length: int) -> list[dict[str, mx.array]]:
    """Independent packed K/V buffers of ``length`` slots (quantized by the kernel), as many
    as keep consecutive calls out of L2."""
    sets = []
    for _ in range(copies_for(packed_bytes(bits, group, length))):
        keys, values = (mx.random.normal((1, KV_HEADS, length, HEAD_DIM)).astype(DTYPE) for _ in range(2))
        sets.append(unstack(quantize.quantize_kv(keys, values, bits=bits, group_size=group), STACKS))
        mx.eval(sets[-1])
    return sets


def time_attention(length: int) -> list[dict]:
    """Single-token attention by every path at one context length."""
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    scale = HEAD_DIM**-0.5
    sdpa = mx.fast.scaled_dot_product_attention
    raw = raw_bytes(length)
    rows = []

    def add(path, us, moved, build_us=float("nan")):
        rows.append({"context": length, "path": path, "us": us, "bytes": moved, "build_us": build_us,
                     "tb_s": moved / us / 1e6, "of_copy_rate": moved / us / 1e6 / COPY_TB_S})
        print(f"  {length:>7} {path:28s} {us:9.1f} µs  {moved / 1e6:8.1f} MB  {moved / us / 1e6:5.2f} TB/s  "
              f"(graph building {build_us:5.1f} µs per call)", flush=True)

    pairs = raw_pairs(length)
    us, build_us = amortised(lambda: [sdpa(q, *pairs[i % len(pairs)], scale=scale) for i in range(CALLS)])
    add("raw bf16, MLX SDPA", us, raw, build_us)
    us, build_us = amortised(chained(q, lambda x, kv: sdpa(x, *kv, scale=scale), pairs))
    add("raw bf16, MLX SDPA chained", us, raw, build_us)
    pairs = None  # freed before the next path (a closure above reads the name, so not del)
    gc.collect()

    for name, (bits, group) in SCHEMES.items():
        packed = packed_bytes(bits, group, length)
        sets = packed_sets(bits, group, length)

        def fused(b):
            return decode.decode_attention(q, *(b[n] for n in BUFFERS), length=length, scale=scale)

        def tensor_core_fused(b, query=q):
            return decode_mma.decode_attention(query, *(b[n] for n in BUFFERS), length=length, scale=scale)

        def dequant_sdpa(b):
            keys, values = dequantize.dequantize_kv(*(b[n] for n in BUFFERS), length=length, bits=bits, dtype=DTYPE)
            return sdpa(q, keys, values, scale=scale)

        def matmul(b):
            return quantized_matmul_attention(q, (b["key_codes"], b["key_scales"], b["key_biases"]),
                                              (b["value_codes"], b["value_scales"], b["value_biases"]),
                                              scale, bits=bits, group_size=group)

        def independent(fn):
            """A ``build`` for ``amortised``: CALLS calls of ``fn``, each on the next buffer set."""
            return lambda: [fn(sets[i % len(sets)]) for i in range(CALLS)]

        paths = [(f"{name} fused kernel", independent(fused), packed)]
        if tensor_core(bits, group):  # chained: each call's query is the previous call's output
            paths.append((f"{name} tensor-core kernel", independent(tensor_core_fused), packed))
            paths.append((f"{name} tensor-core chained", chained(q, lambda x, b: tensor_core_fused(b, x), sets),
                          packed))
        paths.append((f"{name} dequantize + SDPA", independent(dequant_sdpa), packed + 2 * raw))
        paths.append((f"{name} mx.quantized_matmul", independent(matmul), packed))
        for path, build, moved in paths:
            try:
                us, build_us = amortised(build)
                add(path, us, moved, build_us)
            except Exception:  # e.g. a kernel that fails to compile: time the other paths
                print(f"  {length:>7} {path:28s} FAILED\n{traceback.format_exc(limit=4)}", flush=True)
        sets = None  # freed (not del: closures above read the name)
        gc.collect()
    return rows


SIDE_BY_SIDE_ROUNDS = 9


def time_side_by_side(length: int = 131072) -> dict[str, dict]:
    """The goal's ratio, measured as it must be quoted: raw SDPA and the tensor-core kernel
    on affine4, affine6 and affine8 timed in turn for ``SIDE_BY_SIDE_ROUNDS`` rounds, each round's
    kernel time divided by raw's in that round (``gpu_timing.side_by_side``)."""
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(DTYPE)
    scale = HEAD_DIM**-0.5
    pairs = raw_pairs(length)
    builds = {"raw bf16, MLX SDPA": lambda: [mx.fast.scaled_dot_product_attention(
        q, *pairs[i % len(pairs)], scale=scale) for i in range(CALLS)]}
    for name in ("affine4", "affine6", "affine8"):
        bits, group = SCHEMES[name]
        sets = packed_sets(bits, group, length)
        builds[f"{name} tensor-core kernel"] = lambda sets=sets: [decode_mma.decode_attention(
            q, *(sets[i % len(sets)][n] for n in BUFFERS), length=length, scale=scale) for i in range(CALLS)]
    rows = side_by_side(builds, rounds=SIDE_BY_SIDE_ROUNDS)
    print_side_by_side(rows, f"  side by side {length:>7}")
    return rows


def time_append(length: int) -> list[dict]:
    """One-token appends into a cache holding ``length`` positions (room for CALLS more)."""
    spec = LayerSpec(n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_positions=length + 512, dtype=DTYPE)
    rows = [mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)).astype(DTYPE) for _ in range(CALLS)]
    filler = mx.random.normal((1, KV_HEADS, length + 240, HEAD_DIM)).astype(DTYPE)
    mx.eval(rows, filler)
    out = []
    for label, kind in (("raw", Raw()), *((name, Affine(b, g)) for name, (b, g) in SCHEMES.items())):
        (cache,) = make_layer_caches(kind, [spec])
        cache.append(filler, filler)  # length + 256 slots allocated, then back to length live
        cache.trim(240)
        mx.eval(cache.buffers())

        def chain():
            cache.trim(cache.length - length)
            for i in range(CALLS):
                cache.append(rows[i], rows[i])
            return cache.buffers()

        us = amortised(chain).us
        out.append({"context": length, "cache": label, "append_us": us})
        print(f"  {length:>7} {label:8s} one-token append {us:7.1f} µs", flush=True)
        cache = None  # freed (not del: the closure above reads the name)
        gc.collect()
    return out


def prefill_working_set(layers: int, pipelined: bool, length: int = 32768, chunk: int = 16) -> dict:
    """A ``chunk``-token step through ``layers`` affine4 layers of ``length`` positions,
    evaluated as one graph (as ``Engine.forward`` does per chunk): the peak bytes in use
    beyond what is held afterwards, and the step's wall time. ``pipelined``: the caches'
    shared ``PrefillPipeline`` is on (the default), else removed."""
    specs = [LayerSpec(n_kv_heads=KV_HEADS, head_dim=HEAD_DIM, max_positions=length + 256, dtype=DTYPE,
                       layer_index=i) for i in range(layers)]
    caches = make_layer_caches(Affine(4), specs)
    filler = mx.random.normal((1, KV_HEADS, length + 240, HEAD_DIM)).astype(DTYPE)
    for cache in caches:
        cache.append(filler, filler)  # room for the chunk: no buffer grows during the step
        cache.trim(240)
        mx.eval(cache.buffers())
        if not pipelined:
            cache.pipeline = None
    del filler
    h = mx.random.normal((1, Q_HEADS, chunk, HEAD_DIM)).astype(DTYPE)
    mx.eval(h)
    gc.collect()
    mx.synchronize()
    mx.reset_peak_memory()
    start = time.perf_counter()
    for cache in caches:
        h = h + cache.update_and_attend(h, h[:, :KV_HEADS], h[:, KV_HEADS:2 * KV_HEADS], scale=HEAD_DIM**-0.5)
    mx.eval(h, [cache.buffers() for cache in caches])
    mx.synchronize()
    seconds = time.perf_counter() - start
    return {"layers": layers, "pipelined": pipelined, "working_set": mx.get_peak_memory() - mx.get_active_memory(),
            "step_ms": seconds * 1e3}


SWEEP_ROUNDS = 3


def sweep(length: int = 131072) -> list[dict]:
    """Each kernel's tunables one at a time, side by side with its defaults
    (``SWEEP_ROUNDS`` rounds; each variant's median time and median ratio to the defaults
    in the same round): the float32 kernel on affine4, the tensor-core kernel on affine4
    and affine8. A variant that fails (e.g. does not compile) is reported and left out."""
    rows = []
    for module, scheme, overrides_list in ((decode, "affine4", SWEEPS),
                                           (decode_mma, "affine4", TENSOR_CORE_SWEEPS),
                                           (decode_mma, "affine8", TENSOR_CORE_SWEEPS)):
        kernel = module.__name__.rsplit(".", 1)[-1]
        bits, group = SCHEMES[scheme]
        q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM)).astype(DTYPE)
        sets = packed_sets(bits, group, length)

        def build(overrides):
            def calls():
                with overridden(module, **overrides):
                    return [module.decode_attention(q, *(sets[i % len(sets)][n] for n in BUFFERS), length=length,
                                                    scale=HEAD_DIM**-0.5) for i in range(CALLS)]
            return calls

        builds = {}
        for overrides in ({}, *overrides_list):
            label = str(overrides or "defaults")
            try:
                mx.eval(build(overrides)()[:1])  # compiles it
                builds[label] = build(overrides)
            except Exception:
                rows.append({"kernel": kernel, "scheme": scheme, "override": label,
                             "error": traceback.format_exc(limit=3)})
                print(f"  sweep {rows[-1]}", flush=True)
        for label, timed in side_by_side(builds, rounds=SWEEP_ROUNDS).items():
            rows.append({"kernel": kernel, "scheme": scheme, "override": label, "us": timed["median_us"],
                         "vs_defaults": timed.get("median_ratio", 1.0)})
            print(f"  sweep {rows[-1]}", flush=True)
        sets = None  # freed (not del: closures above read the name)
        gc.collect()
    return rows


def print_tables() -> None:
    attention = REPORT.get("attention", [])
    raw = {r["context"]: r["us"] for r in attention if r["path"] == "raw bf16, MLX SDPA"}
    chained_raw = {r["context"]: r["us"] for r in attention if r["path"] == "raw bf16, MLX SDPA chained"}
    print(f"\nsingle-token attention, amortised µs per call ({CALLS} calls per eval), "
          f"B=1 Hq={Q_HEADS} Hkv={KV_HEADS} D={HEAD_DIM} bf16")
    print(f"{'context':>8} {'path':28s} {'µs':>9} {'MB moved':>9} {'TB/s':>6} {'of 4.1':>7} {'vs raw':>7}")
    for r in attention:
        print(f"{r['context']:>8} {r['path']:28s} {r['us']:>9.1f} {r['bytes'] / 1e6:>9.1f} {r['tb_s']:>6.2f} "
              f"{r['of_copy_rate']:>7.0%} "
              f"{r['us'] / (chained_raw if r['path'].endswith('chained') else raw)[r['context']]:>7.2f}")
    by = {(r["context"], r["path"]): r["us"] for r in attention}
    if (131072, "affine4 fused kernel") in by:
        fused = by[(131072, "affine4 fused kernel")]
        print(f"goal at 128k: fused affine4 / raw SDPA = {fused / raw[131072]:.2f} (goal <= 0.5); "
              f"quantized_matmul / fused = {by[(131072, 'affine4 mx.quantized_matmul')] / fused:.1f}x (goal >= 20)")
    for name in SCHEMES:
        if (131072, f"{name} tensor-core kernel") in by:
            tc = by[(131072, f"{name} tensor-core kernel")]
            print(f"at 128k: tensor-core {name} / raw SDPA = {tc / raw[131072]:.2f} (goal <= 0.5); "
                  f"/ fused {name} = {tc / by[(131072, f'{name} fused kernel')]:.2f}")
    for path, row in REPORT.get("side_by_side", {}).items():
        if "ratios" in row:
            print(f"side by side at 128k: {path} / raw SDPA: median {row['median_ratio']:.3f} over "
                  f"{len(row['ratios'])} rounds ({row['min_ratio']:.3f}-{row['max_ratio']:.3f}; goal <= 0.5 for affine4)")
    if REPORT.get("append"):
        print("\none-token append, amortised µs")
        for r in REPORT["append"]:
            print(f"{r['context']:>8} {r['cache']:8s} {r['append_us']:7.1f}")
    if REPORT.get("memory"):
        one = 2 * KV_HEADS * (32768 + 16) * HEAD_DIM * DTYPE.size
        print(f"\nprefill working set: affine4, 32k positions, one 16-token chunk through N layers as one graph; "
              f"one layer's dequantized K/V = {one / 2**20:.0f} MiB")
        for r in REPORT["memory"]:
            print(f"  {r['layers']:>3} layers  {'PrefillPipeline' if r['pipelined'] else 'one graph      '}  "
                  f"{r['working_set'] / 2**20:7.0f} MiB = {r['working_set'] / one:5.1f} layers   step {r['step_ms']:7.1f} ms")
    if REPORT.get("sweep"):
        print("\nkernels at 128k, tunables one at a time (µs)")
        for r in REPORT["sweep"]:
            print(f"  {r.get('kernel', 'decode'):10s} {r.get('scheme', 'affine4')}  {r.get('us', float('nan')):7.1f}  "
                  f"x{r.get('vs_defaults', float('nan')):5.3f}  {r['override']}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument("--no-checks", action="store_true", help="skip the kernel checks (timings only)")
    parser.add_argument("--only-memory", action="store_true", help="only the prefill working set")
    parser.add_argument("--only-attention", action="store_true",
                        help="the checks (unless --no-checks) and the attention timings only")
    parser.add_argument("--only-sweep", action="store_true",
                        help="the checks (unless --no-checks) and the tunables sweep only")
    args = parser.parse_args()
    backend = gpu_backend()
    if backend is None:
        print("no GPU backend in this MLX; nothing to run")
        return 1
    mx.set_default_device(mx.gpu)
    REPORT.update(backend=backend, mlx=mx.__version__, device=str(mx.default_device()),
                  date=time.strftime("%Y-%m-%d"))
    start = time.time()
    REPORT["checks"] = [] if args.no_checks or args.only_memory else run_checks()
    save()
    if not (args.only_memory or args.only_sweep):
        print(f"[{time.time() - start:.0f} s] timings", flush=True)
        REPORT["side_by_side"] = time_side_by_side()
        save()
        print(f"[{time.time() - start:.0f} s] every path", flush=True)
        REPORT["attention"] = [row for length in CONTEXTS for row in time_attention(length)]
        save()
    if not (args.only_memory or args.only_attention or args.only_sweep):
        print(f"[{time.time() - start:.0f} s] appends", flush=True)
        REPORT["append"] = [row for length in (4096, 131072) for row in time_append(length)]
        save()
    if not (args.only_attention or args.only_sweep):
        print(f"[{time.time() - start:.0f} s] prefill working set", flush=True)
        prefill_working_set(1, False, length=1024)  # compiles the kernels outside the timed steps
        REPORT["memory"] = [prefill_working_set(layers, pipelined) for pipelined in (False, True)
                            for layers in (30, 5)]
        save()
    if not (args.no_sweep or args.only_memory or args.only_attention):
        print(f"[{time.time() - start:.0f} s] sweep", flush=True)
        REPORT["sweep"] = sweep()
        save()
    print(f"[{time.time() - start:.0f} s] done", flush=True)
    print_tables()
    failed = [r for r in REPORT["checks"] if not r["passed"]]
    print(f"\n{len(REPORT['checks']) - len(failed)}/{len(REPORT['checks'])} kernel checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
