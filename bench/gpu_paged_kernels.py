"""Each scheme's paged decode kernel alone, on the machine's GPU: one layer's call for B sequences of
L live slots each (pages of 64 scattered through the storage), built and evaluated, wall clock (and
the part of it spent building the call on the host), against the bytes it must read. A diagnosis of
batched decode (``gpu_batched.py``), not a result.

Inputs come from each plugin's ``KERNEL_CHECKS`` (``make_inputs``); aura's codes are random words
(``encoded=False``). ``--splits`` forces the tensor-core kernels' split counts besides their own plan.

Usage: python bench/gpu_paged_kernels.py [--shape 64x4096 16x32768] [--splits 1 4 16] [--reps 10]
"""

from __future__ import annotations

import argparse
import statistics
import time

import butter_core  # noqa: F401 - before mlx.core
import mlx.core as mx
from butter_affine.kernels import KERNEL_CHECKS as AFFINE
from butter_aura.kernels.checks import KERNEL_CHECKS as AURA
from butter_raw.kernels import KERNEL_CHECKS as RAW

HEADS = {"q_heads": 32, "kv_heads": 8, "head_dim": 128, "page_size": 64}


def checks():
    pick = lambda table, name: next(c for c in table if c.name == name)  # noqa: E731
    yield "raw", pick(RAW, "paged_sdpa_decode"), {}
    yield "affine4 simt", pick(AFFINE, "paged_decode_attention"), {"bits": 4, "group_size": 64}
    yield "affine4 mma", pick(AFFINE, "paged_decode_attention_mma"), {"bits": 4, "group_size": 64}
    yield "aura4v2 simt", pick(AURA, "paged_decode_attention"), {"encoded": False}
    yield "aura4v2 mma", pick(AURA, "paged_decode_attention_mma"), {"encoded": False}


def timed(call, reps: int) -> tuple[float, float]:
    """Median seconds of a call built and evaluated, and of building it alone (the host's part)."""
    for _ in range(2):
        mx.eval(call())
    times, builds = [], []
    for _ in range(reps):
        mx.synchronize()
        start = time.perf_counter()
        out = call()
        built = time.perf_counter()
        mx.eval(out)
        mx.synchronize()
        times.append(time.perf_counter() - start)
        builds.append(built - start)
    return statistics.median(times), statistics.median(builds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", default=["64x4096", "16x32768"])
    parser.add_argument("--splits", type=int, nargs="*", default=[])
    parser.add_argument("--reps", type=int, default=10)
    args = parser.parse_args()
    print(f"MLX {mx.__version__}, {mx.device_info().get('device_name', '')}; 32 q / 8 kv heads, D 128, bf16, pages of 64")
    print("| B x L | kernel | splits | ms | of which building the call | GB/s of its bytes |\n|---|---|---|---:|---:|---:|")
    for shape in args.shape:
        batch, length = map(int, shape.split("x"))
        for name, check, sizes in checks():
            extra = {"batch": batch} if "batch" in check.make_inputs.__kwdefaults__ else {}
            inputs = check.inputs(0, lengths=(length,) * batch, **HEADS, **extra, **sizes)
            mx.eval([v for v in inputs.values() if isinstance(v, mx.array)])
            paged = inputs.get("paged")
            arrays = ([paged.key_codes, paged.key_scales, paged.value_codes, paged.value_scales] if paged is not None
                      else [v for k, v in inputs.items() if k not in ("queries", "table", "lengths")
                            and isinstance(v, mx.array)])  # fmt: skip
            slots = arrays[0].shape[2]
            read = sum(a.nbytes for a in arrays) * batch * length / slots
            for splits in [None, *(args.splits if "mma" in name else [])]:
                options = {} if splits is None else {"splits": splits}
                try:
                    call = lambda inputs=inputs, options=options: check.kernel(**inputs, **options)  # noqa: E731
                    seconds, build = timed(call, args.reps)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    print(f"| {shape} | {name} | {splits or 'plan'} | {type(exc).__name__}: {str(exc)[:80]} | |")
                    continue
                print(f"| {shape} | {name} | {splits or 'plan'} | {seconds * 1e3:.3f} | {build * 1e3:.3f} | "
                      f"{read / seconds / 1e9:.0f} |",
                      flush=True)  # fmt: skip
            del inputs, paged, arrays
            mx.clear_cache()


if __name__ == "__main__":
    main()
