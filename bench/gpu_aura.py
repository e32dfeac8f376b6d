"""butter-aura kernels on the GPU: every kernel check first, then timings, in one run.

Run on a machine with a GPU backend (the lent H200, or Apple silicon), from the repo root:

    PYTHONPATH=.:plugins/butter-aura python bench/gpu_aura.py        # or with butter-aura installed

1. **checks** — every ``KERNEL_CHECKS`` case (``encode``; ``decode_attention``, which
   picks the tensor-core partials kernel wherever it serves; ``decode_attention_mma``,
   every configuration that kernel serves; ``dequantize``), then the same kernels at the
   timed shapes: ``decode_attention`` for every scheme at 4k and aura4v2 at 32k/128k,
   through the tensor-core kernel and through the SIMT kernel, ``encode`` of 1 and 512
   tokens, ``dequantize`` of 4k slots. Relative error ‖out − ref‖/‖ref‖ on fresh random
   data against the pure-mx reference (run on the CPU), the kernel's outputs poisoned
   with NaN so an unwritten element fails. Prints one line per case and a summary.
2. **decode attention** — amortised time (50 calls evaluated together, divided by 50;
   median of 5) at batch 1, 32 query heads, 8 KV heads, head_dim 128, bf16, contexts
   4k/32k/128k: AURA's compressed-domain decode with the tensor-core partials kernel
   (``mma``) and with the SIMT one (``simt``, which still serves float32 queries, 3-bit
   codes and per-group scales), each + AURA's merge kernel, for every scheme; against
   ``mx.fast.scaled_dot_product_attention`` on raw bf16 K/V and against the
   ``mx.quantized_matmul`` route over affine4 g64 K/V (mlx-lm's quantized cache).
   Bytes read are the live slots' codes, scales and full-precision rows (the floor any
   kernel must read); TB/s is bytes / time. Consecutive calls read different copies of
   the cache when one copy would fit in L2, as the layers of a decode step do.
   **side-by-side** — raw SDPA, aura4v2 and aura4v4 at 128k timed in turn for 9 rounds;
   each round's ratio to raw's time in that round, and their median: the goal's figure
   (whole runs drift by 5-15%, so ratios across sections of one run are not quoted).
3. **other kernels** — a one-token ``encode`` (the append of a decode step) and
   ``dequantize`` of 4k slots (the prefill path).
4. **tunables** — aura4v2 at 128k through the tensor-core kernel with ``blocks`` (16-key
   blocks per warp step), ``warps``, ``min_keys`` (per split) or ``read_only`` (loads
   through the read-only data path) changed, while the time
   budget lasts.
5. **min-keys** — aura4v2 at every context with ``min_keys`` 128-2048, side by side.
6. **ahead** — at 128k, side by side: the tensor-core kernel's defaults against value
   codes loaded with the values, not a step ahead (``ahead=False``), and against four
   warps per threadgroup, three threadgroups per multiprocessor (``warps=4``); aura4v2 with raw SDPA
   both as independent calls and *chained* (each call's output the next call's query, as
   the layers of a decode step wait on each other), then aura4v4 and aura8v8.

Every section runs in its own try/except, so one failure cannot hide the others
(``--sections`` runs a subset, should a crash of the process itself need working
around). Prints compact tables; with ``OUT`` set writes everything to ``$OUT/aura.json``.
The goal it reports: aura4v2 at 128k at most 0.35x raw SDPA's time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "plugins" / "butter-aura")]

import butter_core  # noqa: E402,F401 - first (loads the CPU BLAS before MLX)
import mlx.core as mx  # noqa: E402

from butter_aura import Aura  # noqa: E402
from butter_core.kernels import KernelCheck, gpu_backend  # noqa: E402
from butter_aura import reference  # noqa: E402
from butter_aura.kernels import KERNEL_CHECKS, attention, checks, dequantize, encode  # noqa: E402
from butter_aura.layout import codecs  # noqa: E402
from gpu_timing import CALLS, amortised, copies_for, print_side_by_side, quantized_matmul_attention, side_by_side  # noqa: E402

CONTEXTS = (4096, 32768, 131072)
Q_HEADS, KV_HEADS, HEAD_DIM, DTYPE = 32, 8, 128, mx.bfloat16
SCHEMES = ("aura4v2", "aura4v4", "aura8v4", "aura8v8")
MAX_COPIES = 32
GOAL = 0.35
METHODS = ("mma", "simt")
TUNABLES = ({"read_only": True}, {"read_only": True, "min_keys": 512}, {"read_only": True, "blocks": 1},
            {"blocks": 1}, {"warps": 4}, {"warps": 8}, {"min_keys": 64}, {"min_keys": 512}, {"min_keys": 384})
TIME_BUDGET_S = 420.0
"""The tunables stop starting new work after this many seconds (a GPU command may run 10 min)."""
START = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - START


def amortised_us(build: Callable[[int], mx.array]) -> float:
    """``gpu_timing.amortised`` of CALLS calls, call i built by ``build(i)``, in µs."""
    return amortised(lambda: [build(i) for i in range(CALLS)]).us


def stored_bytes(stored) -> int:
    """What a decode step must read: live codes and scales, full-precision rows."""
    live = stored.length
    per_slot = sum(a.shape[-1] * a.dtype.size for a in (stored.key_codes, stored.key_scales, stored.value_codes,
                                                       stored.value_scales))
    batch_heads = stored.key_codes.shape[0] * stored.key_codes.shape[1]
    return batch_heads * live * per_slot + stored.fp_keys.nbytes + stored.fp_values.nbytes


def section(name: str, results: dict, run: Callable[[], object]) -> None:
    print(f"\n== {name} ({elapsed():.0f} s)", flush=True)
    try:
        results[name] = run()
    except Exception:  # one failing section must not hide the others
        error = traceback.format_exc(limit=6)
        print(error, flush=True)
        results[name] = {"error": error}


# -- 1. checks -------------------------------------------------------------------------


def check_row(check, case: dict, seed: int) -> dict:
    row = {"kernel": check.name, "case": {k: str(v).replace("mlx.core.", "") for k, v in case.items()}}
    try:
        result = check.check(seed=seed, **case)
        row.update(relative_error=result.relative_error, tolerance=result.tolerance, passed=result.passed)
    except Exception:
        row.update(passed=False, error=traceback.format_exc(limit=4))
    status = "ok  " if row["passed"] else "FAIL"
    detail = f"rel err {row['relative_error']:.2e} (tol {row['tolerance']:.0e})" if "relative_error" in row else row["error"]
    print(f"{status} {check.name:22s} {row['case']}  {detail}", flush=True)
    return row


def _simt_decode_attention(queries, stored, scale):
    return attention.decode_attention(queries, stored, scale, method="simt")


SIMT_CHECK = KernelCheck(
    name="decode_attention[simt]",
    kernel=_simt_decode_attention,
    reference=reference.decode_attention,
    make_inputs=checks.make_stored,
    cases=(),
    rtol=checks.ATTENTION_RTOL,
)
"""The SIMT partials kernel at the timed shapes (``decode_attention`` picks the tensor-core one there)."""


def timed_shape_cases() -> list:
    """decode_attention (tensor cores) for every scheme at 4k and aura4v2 at 32k/128k, the
    SIMT kernel for aura4v2 at every context; encode and dequantize at the bench shapes."""
    by_name = {c.name: c for c in KERNEL_CHECKS}
    cases = []
    for name in SCHEMES:
        kind = Aura.named(name)
        for length in CONTEXTS if name == "aura4v2" else CONTEXTS[:1]:
            kernels = (by_name["decode_attention"], SIMT_CHECK) if name == "aura4v2" else (by_name["decode_attention"],)
            for check in kernels:
                cases.append((check, dict(
                    q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, allocated=length + 256, length=length,
                    dtype=DTYPE, key_bits=kind.key_bits, value_bits=kind.value_bits, encoded=False)))
    cases.append((by_name["encode"], dict(kv_heads=KV_HEADS, tokens=1, head_dim=HEAD_DIM, dtype=DTYPE)))
    cases.append((by_name["encode"], dict(kv_heads=KV_HEADS, tokens=512, head_dim=HEAD_DIM, dtype=DTYPE)))
    cases.append((by_name["dequantize"], dict(kv_heads=KV_HEADS, length=4096, allocated=4352, head_dim=HEAD_DIM,
                                              dtype=DTYPE)))
    return cases


def run_checks() -> dict:
    """Every KERNEL_CHECKS case (each new template compiles, 1.5-5 s), then the timed shapes."""
    every = [check_row(check, case, seed) for seed, (check, case) in
             enumerate((c, case) for c in KERNEL_CHECKS for case in c.cases)]
    timed = [check_row(check, case, 100 + seed) for seed, (check, case) in enumerate(timed_shape_cases())]
    failed = [f"{r['kernel']} {r['case']}" for r in every + timed if not r["passed"]]
    print(f"\nKERNEL_CHECKS: {sum(r['passed'] for r in every)}/{len(every)} passed; at the timed shapes: "
          f"{sum(r['passed'] for r in timed)}/{len(timed)} passed" + (f"; FAILED: {failed}" if failed else ""))
    return {"kernel_checks": every, "timed_shapes": timed}


# -- 2. decode attention -----------------------------------------------------------------


def aura_inputs(name: str, length: int, seed: int) -> dict:
    kind = Aura.named(name)
    key_codec, _ = codecs(kind, HEAD_DIM)
    inputs = checks.make_stored(seed, q_heads=Q_HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, allocated=length,
                                length=length, dtype=DTYPE, key_bits=kind.key_bits, value_bits=kind.value_bits,
                                group=key_codec.group, encoded=False)
    stored = inputs["stored"]
    mx.eval(inputs["queries"], stored.key_codes, stored.key_scales, stored.value_codes, stored.value_scales,
            stored.fp_keys, stored.fp_values, stored.recent_slots)
    return inputs


def aura_copies(name: str, length: int) -> list[dict]:
    """``aura_inputs`` with seeds 0, 1, ...: as many copies as keep consecutive calls out of L2."""
    first = aura_inputs(name, length, 0)
    return [first] + [aura_inputs(name, length, i)
                      for i in range(1, copies_for(stored_bytes(first["stored"]), MAX_COPIES))]


def time_aura(name: str, length: int, method: str = "mma", **tunables) -> dict:
    copies = aura_copies(name, length)
    nbytes = stored_bytes(copies[0]["stored"])
    us = amortised_us(lambda i: attention.decode_attention(**copies[i % len(copies)], method=method, **tunables))
    return {"us": us, "bytes": nbytes, "tbps": nbytes / us / 1e6, "copies": len(copies)}


def raw_inputs(length: int, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    k1, k2, k3 = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((1, Q_HEADS, 1, HEAD_DIM), key=k1).astype(DTYPE)
    k = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=k2).astype(DTYPE)
    v = mx.random.normal((1, KV_HEADS, length, HEAD_DIM), key=k3).astype(DTYPE)
    mx.eval(q, k, v)
    return q, k, v


def raw_copies(length: int) -> list[tuple[mx.array, mx.array, mx.array]]:
    """``raw_inputs`` with seeds 0, 1, ...: as many copies as keep consecutive calls out of L2."""
    return [raw_inputs(length, i) for i in range(copies_for(raw_bytes(length), MAX_COPIES))]


def raw_bytes(length: int) -> int:
    """What raw SDPA reads: bf16 K and V."""
    return 2 * KV_HEADS * length * HEAD_DIM * DTYPE.size


def time_raw_sdpa(length: int) -> dict:
    nbytes = raw_bytes(length)
    copies = raw_copies(length)
    scale = HEAD_DIM**-0.5
    us = amortised_us(lambda i: mx.fast.scaled_dot_product_attention(*copies[i % len(copies)], scale=scale))
    return {"us": us, "bytes": nbytes, "tbps": nbytes / us / 1e6, "copies": len(copies)}


def time_quantized_matmul(length: int) -> dict:
    def make(seed):
        q, k, v = raw_inputs(length, seed)
        quantized = (mx.quantize(k, group_size=64, bits=4), mx.quantize(v, group_size=64, bits=4))
        mx.eval(quantized)
        return q, *quantized

    first = make(0)
    nbytes = sum(a.nbytes for part in first[1:] for a in part)
    copies = [first] + [make(i) for i in range(1, copies_for(nbytes, MAX_COPIES))]
    scale = HEAD_DIM**-0.5
    us = amortised_us(lambda i: quantized_matmul_attention(*copies[i % len(copies)], scale, bits=4, group_size=64))
    return {"us": us, "bytes": nbytes, "tbps": nbytes / us / 1e6, "copies": len(copies)}


def independent_raw(raw: list[tuple[mx.array, mx.array, mx.array]]) -> Callable[[], list[mx.array]]:
    """``CALLS`` independent raw SDPA calls, each on the next of ``raw_copies``."""
    scale = HEAD_DIM**-0.5
    return lambda: [mx.fast.scaled_dot_product_attention(*raw[i % len(raw)], scale=scale) for i in range(CALLS)]


def independent_aura(copies: list[dict], **tunables) -> Callable[[], list[mx.array]]:
    """``CALLS`` independent decode calls through the tensor-core kernel."""
    return lambda: [attention.decode_attention(**copies[i % len(copies)], method="mma", **tunables)
                    for i in range(CALLS)]


SIDE_BY_SIDE_ROUNDS = 9


def run_side_by_side(length: int = 131072) -> dict[str, dict]:
    """The goal's ratio as it must be quoted: raw SDPA, aura4v2 and aura4v4 (tensor-core
    partials) timed in turn for ``SIDE_BY_SIDE_ROUNDS`` rounds, each round's time divided
    by raw's in that round (``gpu_timing.side_by_side``)."""
    builds = {"raw sdpa": independent_raw(raw_copies(length))}
    for name in ("aura4v2", "aura4v4"):
        builds[f"{name} mma"] = independent_aura(aura_copies(name, length))
    rows = side_by_side(builds, rounds=SIDE_BY_SIDE_ROUNDS)
    print_side_by_side(rows, f"side by side {length // 1024}k")
    return rows


def run_decode_timings() -> list[dict]:
    rows = []

    def measure(method: str, length: int, fn: Callable[[], dict]) -> None:
        row = {"method": method, "context": length}
        try:
            row.update(fn())
        except Exception:
            row["error"] = traceback.format_exc(limit=4)
            print(f"{method} at {length}: {row['error']}", flush=True)
        rows.append(row)
        mx.clear_cache()

    for length in CONTEXTS:
        measure("raw sdpa", length, lambda: time_raw_sdpa(length))
        for method in METHODS:
            for name in SCHEMES:
                measure(f"{name} {method}", length, lambda: time_aura(name, length, method))
    # Last: MLX 0.32.4's CUDA quantized_matmul has crashed a process before (8-bit codes,
    # docs/benchmarks.md); 4-bit ran, but nothing after it should depend on that.
    for length in CONTEXTS:
        measure("quantized_matmul affine4 g64", length, lambda: time_quantized_matmul(length))
    rows.sort(key=lambda r: (r["context"], r["method"] != "raw sdpa", r["method"].startswith("quantized")))
    print_decode_table(rows)
    return rows


def print_decode_table(rows: list[dict]) -> None:
    raw = {r["context"]: r.get("us") for r in rows if r["method"] == "raw sdpa"}
    qmm = {r["context"]: r.get("us") for r in rows if r["method"].startswith("quantized_matmul")}
    print("\n| method | context | µs | MB read | TB/s | vs raw SDPA | speed-up vs quantized_matmul |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        if "us" not in r:
            print(f"| {r['method']} | {r['context'] // 1024}k | error | | | | |")
            continue
        ratio = f"{r['us'] / raw[r['context']]:.2f}x" if raw.get(r["context"]) else "-"
        speedup = f"{qmm[r['context']] / r['us']:.1f}x" if qmm.get(r["context"]) else "-"
        print(f"| {r['method']} | {r['context'] // 1024}k | {r['us']:.1f} | {r['bytes'] / 1e6:.1f} | {r['tbps']:.2f} | "
              f"{ratio} | {speedup} |")
    goal = next((r for r in rows if r["method"] == "aura4v2 mma" and r["context"] == CONTEXTS[-1] and "us" in r), None)
    if goal and raw.get(CONTEXTS[-1]):
        ratio = goal["us"] / raw[CONTEXTS[-1]]
        print(f"\ngoal: aura4v2 (tensor cores) at 128k = {ratio:.2f}x raw SDPA (goal <= {GOAL}x): "
              f"{'MET' if ratio <= GOAL else 'MISSED'}")
        if qmm.get(CONTEXTS[-1]):
            print(f"goal: >= 20x faster than quantized_matmul: {qmm[CONTEXTS[-1]] / goal['us']:.1f}x")


# -- 4. tunables -------------------------------------------------------------------------


def run_tunables() -> list[dict]:
    rows = []
    for tunables in ({},) + TUNABLES:
        if elapsed() > TIME_BUDGET_S:
            print(f"skipping {tunables}: past the time budget")
            continue
        row = {"tunables": tunables}
        try:
            row.update(time_aura("aura4v2", CONTEXTS[-1], "mma", **tunables))
            print(f"aura4v2 mma {CONTEXTS[-1] // 1024}k {tunables or 'defaults'}: {row['us']:.1f} µs, "
                  f"{row['tbps']:.2f} TB/s", flush=True)
        except Exception:
            row["error"] = traceback.format_exc(limit=4)
            print(f"{tunables}: {row['error']}", flush=True)
        rows.append(row)
        mx.clear_cache()
    return rows


MIN_KEYS = (128, 256, 512, 1024, 2048)


def run_min_keys() -> list[dict]:
    """aura4v2 through the tensor-core kernel with each ``min_keys`` (keys per split at
    least: fewer, longer splits build fewer look-up tables) at every context, side by
    side with the default (``gpu_timing.side_by_side``, 3 rounds)."""
    rows = []
    for length in CONTEXTS:
        copies = aura_copies("aura4v2", length)
        builds = {keys: independent_aura(copies, min_keys=keys) for keys in MIN_KEYS}
        for keys, row in side_by_side(builds, rounds=3).items():
            rows.append({"context": length, "min_keys": keys, "us": row["median_us"],
                         "vs_first": row.get("median_ratio", 1.0)})
            print(f"aura4v2 mma {length // 1024}k min_keys {keys:5d}: {row['median_us']:6.1f} µs "
                  f"(x{row.get('median_ratio', 1.0):.3f} of min_keys {MIN_KEYS[0]})", flush=True)
        mx.clear_cache()
    return rows


def chained_aura(copies: list[dict], **tunables) -> Callable[[], list[mx.array]]:
    """``CALLS`` decode calls in a chain: each call's output is the next call's query."""
    def build() -> list[mx.array]:
        x = copies[0]["queries"]
        for i in range(CALLS):
            inputs = copies[i % len(copies)]
            x = attention.decode_attention(x, inputs["stored"], inputs["scale"], method="mma", **tunables)
        return [x]
    return build


AHEAD_VARIANTS = {"defaults": {}, "values not ahead": {"ahead": False}, "4 warps, 3 threadgroups per SM": {"warps": 4}}


def run_ahead(length: int = 131072) -> dict:
    """The tensor-core kernel's defaults against ``AHEAD_VARIANTS``, side by side: aura4v2
    with raw SDPA as independent and as chained calls (``gpu_timing.side_by_side``, 7 rounds),
    then aura4v4 and aura8v8 (5 rounds)."""
    raw = raw_copies(length)
    scale = HEAD_DIM**-0.5

    def raw_chained() -> list[mx.array]:
        x = raw[0][0]
        for i in range(CALLS):
            x = mx.fast.scaled_dot_product_attention(x, *raw[i % len(raw)][1:], scale=scale)
        return [x]

    copies = aura_copies("aura4v2", length)
    independent = {"raw sdpa": independent_raw(raw)}
    chained = {"raw sdpa": raw_chained}
    for label, tunables in AHEAD_VARIANTS.items():
        independent[f"aura4v2 {label}"] = independent_aura(copies, **tunables)
        chained[f"aura4v2 {label}"] = chained_aura(copies, **tunables)
    out = {"independent": side_by_side(independent), "chained": side_by_side(chained)}
    print_side_by_side(out["independent"], f"independent {length // 1024}k")
    print_side_by_side(out["chained"], f"chained {length // 1024}k")
    for name in ("aura4v4", "aura8v8"):
        others = aura_copies(name, length)
        out[name] = side_by_side({label: independent_aura(others, **tunables)
                                  for label, tunables in AHEAD_VARIANTS.items()}, rounds=5)
        print_side_by_side(out[name], f"{name} {length // 1024}k")
    return out


# -- 3. encode and dequantize ----------------------------------------------------------


def run_other_kernels() -> dict:
    out = {}
    kind = Aura.named("aura4v2")
    key_codec, value_codec = codecs(kind, HEAD_DIM)
    token = checks.make_encode_inputs(0, kv_heads=KV_HEADS, tokens=1, head_dim=HEAD_DIM, dtype=DTYPE,
                                      key_bits=kind.key_bits, value_bits=kind.value_bits)
    out["encode 1 token (8 heads)"] = amortised_us(lambda i: encode.encode(**token))
    stored = aura_inputs("aura4v2", 4096, 0)["stored"]
    out["dequantize 4k slots"] = amortised_us(lambda i: dequantize.dequantize(stored, DTYPE)[0])
    for name, us in out.items():
        print(f"{name}: {us:.1f} µs", flush=True)
    return out


SECTIONS = ("checks", "decode", "side-by-side", "other", "tunables", "min-keys", "ahead")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", nargs="+", choices=SECTIONS, default=SECTIONS, help="what to run (default: all)")
    sections = set(parser.parse_args().sections)
    backend = gpu_backend()
    print(f"butter-aura GPU bench: backend {backend}, mlx {mx.__version__}, device {mx.default_device()}")
    results: dict = {"backend": backend, "mlx": mx.__version__}
    if backend is None:
        print("no GPU backend in this MLX: nothing to run")
        return
    for key, name, run in (
        ("checks", "kernel checks", run_checks),
        ("decode", "decode attention", run_decode_timings),
        ("side-by-side", "side by side at 128k", run_side_by_side),
        ("other", "other kernels", run_other_kernels),
        ("tunables", "tunables", run_tunables),
        ("min-keys", "keys per split by context", run_min_keys),
        ("ahead", "loads ahead, threadgroups per multiprocessor", run_ahead),
    ):
        if key in sections:
            section(name, results, run)
    results["seconds"] = elapsed()
    print(f"\ndone in {elapsed():.0f} s")
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "aura.json"
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
