"""A timeline of butter's own kernels on a CUDA GPU, stamped by the kernels themselves.

Nsight Systems is not on the lent H200, and Nsight Compute times each kernel alone
(serialised, replayed), so neither says what a kernel takes *among* calls, nor what lies
between two kernels, nor how much of a benchmark's wall time the GPU spends working.
Here every butter kernel call goes through an executor (``butter_core.kernels.executed_by``)
that runs the same kernel with one more output: each threadgroup's first thread writes
``%globaltimer`` and ``%smid`` when it starts, and lane 0 of every warp writes
``%globaltimer`` as it leaves the body (a destructor, so early returns are stamped too).
The extra work is a few stores per warp. MLX's own kernels (SDPA, copies) are not
stamped; two stamped copies around a run of calls (markers) time them too.

Per path (raw SDPA and, by default, affine4 and aura4v2 decode; ``--paths`` names any of
``gpu_decode_parts.PATHS``: every affine and AURA scheme, and mlx-lm's attention through
``mx.quantized_matmul``, against which each scheme's speed-up is printed too; batch 1,
32 query / 8 KV heads, head_dim 128, bf16) and round, CALLS calls chained (each call's
query the previous call's output, as a decode step's layers) and CALLS independent calls:

- **GPU**: a gate kernel holds the GPU for ``GATE_NS`` while the host encodes everything
  after it, then ``--warm`` calls (the clocks ramp up over the first few hundred µs of work),
  a marker, the calls, a marker: µs per call from the first marker's end to the second's
  start. No host time is in it; this is what a GPU-bound decode step pays.
- **wall**: ``gpu_timing.amortised`` on the same calls (one evaluation, host included).
  MLX launches a CUDA graph once it holds 100 nodes or 1000M input elements (H200;
  ``MLX_MAX_OPS_PER_BUFFER``, ``MLX_MAX_MB_PER_BUFFER``), so here the GPU waits while the
  host encodes our calls, whose inputs are small, for up to ~40 of them at 128k.
- **stamped kernels** (our paths): each kernel's median span (first start to last end),
  threadgroup time, the gap before it, and how many launches of the run took over 1.5x
  their kernel's median (none, unless a kernel's output buffer faults: see ``_READ``).

``python3 bench/gpu_timeline.py [context] [--rounds N] [--warm N] [--save FILE.npz]``
from ``bench/`` on the lent H200 (as the other GPU benches); ``--save`` keeps every
launch's stamps. Figures: docs/benchmarks.md, "What the GPU does among calls".
"""

from __future__ import annotations

import argparse
import statistics

import mlx.core as mx
import numpy as np

import gpu_decode_parts
from butter_core.kernels.kernel import Kernel, Launch, executed_by
from gpu_affine import chained
from gpu_timing import CALLS, amortised

STAMP_HELPER = r"""
// One threadgroup's timeline stamps: [start, SM, end of warp 0, end of warp 1, ...].
template <typename U>
struct BtTimelineStamp {
  U* row;
  unsigned lane_warp;
  __device__ static unsigned long long now() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ explicit BtTimelineStamp(U* stamps) {
    unsigned threads = blockDim.x * blockDim.y * blockDim.z;
    unsigned block = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
    unsigned thread = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
    row = stamps + block * (2 + (threads + 31) / 32);
    lane_warp = thread;
    if (thread == 0) {
      unsigned sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      row[0] = now();
      row[1] = sm;
    }
  }
  __device__ ~BtTimelineStamp() {
    if (lane_warp % 32 == 0) row[2 + lane_warp / 32] = now();
  }
};
"""

_TIMED: dict[str, Kernel] = {}
_READ: list[mx.array] = []
"""Every stamps array read on the host, kept for the process's life. Reading a buffer on
the host moves its unified-memory pages there; freed, MLX's buffer cache hands it to a
later kernel's output, whose first writes from the GPU then fault page by page: with the
stamps freed, 4-17% of the timed kernels took 1.5-6x their median (docs/benchmarks.md)."""


def timed(kernel: Kernel) -> Kernel:
    """``kernel`` with the stamps as one more output (``bt_stamps``, uint64)."""
    if kernel.name not in _TIMED:
        _TIMED[kernel.name] = Kernel(
            name=f"{kernel.name}_timeline",
            input_names=kernel.input_names,
            output_names=(*kernel.output_names, "bt_stamps"),
            body="BtTimelineStamp bt_timeline_stamp(bt_stamps);\n" + kernel.body,
            helpers=kernel.helpers + STAMP_HELPER,
            shared_memory=kernel.shared_memory,
            mma=kernel.mma,
        )
    return _TIMED[kernel.name]


class Timeline:
    """An executor: runs each kernel call stamped and keeps (kernel name, stamps, blocks)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, mx.array, int, int]] = []

    def __call__(self, launch: Launch) -> list[mx.array]:
        blocks = 1
        for g, t in zip(launch.grid, launch.threadgroup):
            blocks *= -(-g // t)
        threads = launch.threadgroup[0] * launch.threadgroup[1] * launch.threadgroup[2]
        stride = 2 + -(-threads // 32)
        outs = timed(launch.build.kernel)(
            inputs=launch.inputs,
            output_shapes=[*launch.output_shapes, (blocks * stride,)],
            output_dtypes=[*launch.build.output_dtypes, mx.uint64],
            grid=launch.grid, threadgroup=launch.threadgroup, template=launch.build.template,
            init_value=launch.init_value, executor=False,
        )
        self.records.append((launch.build.kernel.name, outs[-1], blocks, stride))
        return outs[:-1]

    def launches(self) -> list[dict]:
        """Each recorded launch's stamps, in µs from the first launch's first start."""
        rows = []
        for name, stamps, blocks, stride in self.records:
            s = np.array(stamps).reshape(blocks, stride)
            rows.append({"name": name, "start": s[:, 0].astype(np.int64), "sm": s[:, 1].astype(np.int64),
                         "end": s[:, 2:].max(axis=1).astype(np.int64)})
        _READ.extend(stamps for _, stamps, _, _ in self.records)
        t0 = min(int(r["start"].min()) for r in rows)
        for r in rows:
            r["start"] = (r["start"] - t0) / 1e3
            r["end"] = (r["end"] - t0) / 1e3
        return rows


def record(build) -> list[dict]:
    """Run ``build`` (a list of outputs) once, stamped; its launches in order."""
    timeline = Timeline()
    with executed_by("cuda", timeline):
        outs = build()
    mx.eval(outs, [r[1] for r in timeline.records])
    return timeline.launches()


def short(name: str) -> str:
    return name.replace("butter_", "").replace("_decode", "").replace("_partials", " partials")


def kernel_table(launches: list[dict]) -> dict[str, dict[str, float]]:
    """Per kernel name over ``launches`` (one run, in order): medians of span, threadgroup
    time and gap after the previous launch, the launch count, and how many spans exceed
    1.5x their median."""
    kinds: dict[str, dict[str, list[float]]] = {}
    previous_end = None
    for r in launches:
        d = kinds.setdefault(r["name"], {"span": [], "block": [], "gap": []})
        d["span"].append(float(r["end"].max() - r["start"].min()))
        d["block"].append(float(np.median(r["end"] - r["start"])))
        if previous_end is not None:
            d["gap"].append(float(r["start"].min() - previous_end))
        previous_end = r["end"].max()
    table = {}
    for name, d in kinds.items():
        span = statistics.median(d["span"])
        table[name] = {"span": span, "block": statistics.median(d["block"]),
                       "gap": statistics.median(d["gap"]) if d["gap"] else 0.0,
                       "launches": len(d["span"]), "slow": sum(x > 1.5 * span for x in d["span"])}
    return table


_HOLD = Kernel(
    name="butter_bench_timeline_hold",
    input_names=("x",),
    output_names=("y",),
    body="""
  if (global_idx.x == 0 && DELAY_NS > 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    do {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    } while (t - t0 < DELAY_NS);
  }
  if (global_idx.x < N) y[global_idx.x] = x[global_idx.x];
""",
)
"""A copy of the value passing between calls, made after holding the GPU for DELAY_NS:
with a delay, a gate (the host encodes everything after it meanwhile, so what follows
runs back to back, as a GPU-bound decode step runs); without, a stamped point in a run."""

GATE_NS = 20_000_000


def hold(x: mx.array, ns: int) -> mx.array:
    n = x.size
    (y,) = _HOLD(inputs=[x], output_shapes=[x.shape], output_dtypes=[x.dtype], grid=(-(-n // 256) * 256, 1, 1),
                 threadgroup=(256, 1, 1), template=[("N", n), ("DELAY_NS", ns)])
    return y


def gpu_per_call(step, query: mx.array, *, chain: bool, calls: int = CALLS,
                 warm: int = 10) -> tuple[float, list[dict], list[dict]]:
    """µs of GPU time per call: a gate (the host encodes all that follows while it holds
    the GPU, so the GPU never waits on the host below), ``warm`` chained calls (the clocks
    ramp up over the first few hundred µs of work), a marker, ``calls`` calls (chained, or
    independent and then concatenated), a marker; the time from the first marker's end to
    the second's start, per call. Also every launch, and the stamped ones between the markers."""

    def build() -> list[mx.array]:
        x = hold(query, GATE_NS)
        for i in range(warm):
            x = step(x, calls + i)
        x = hold(x, 0)
        if chain:
            for i in range(calls):
                x = step(x, i)
        else:
            x = mx.concatenate([step(x, i) for i in range(calls)], axis=0)
        return [hold(x, 0)]

    launches = record(build)
    _, first, second = [i for i, r in enumerate(launches) if r["name"] == _HOLD.name]
    us = (launches[second]["start"].min() - launches[first]["end"].max()) / calls
    return us, launches, launches[first + 1:second]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("context", type=int, nargs="?", default=131072)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--warm", type=int, default=10, help="calls run before the first marker")
    parser.add_argument("--save", help="an .npz file for every launch's stamps")
    parser.add_argument("--paths", nargs="+", default=["raw SDPA", "affine4", "aura4v2"],
                        help="gpu_decode_parts.PATHS: raw SDPA first, then any scheme (or affine4's and aura4v2's partials only)")
    args = parser.parse_args()
    if args.paths[0] != "raw SDPA" or not set(args.paths) <= set(gpu_decode_parts.PATHS):
        parser.error(f"--paths: 'raw SDPA' first, then any of {list(gpu_decode_parts.PATHS)}")
    query, paths = gpu_decode_parts.steps(args.context, tuple(args.paths))
    labels = [(name, chain) for name in args.paths for chain in (True, False)]
    gpu: dict[str, list[float]] = {}
    wall: dict[str, list[float]] = {}
    tables: dict[str, list[dict]] = {}
    saved = {}
    for name, chain in labels:  # compile, at the shapes timed (the concatenation's too)
        gpu_per_call(paths[name], query, chain=chain, warm=1)
    for n in range(args.rounds):
        for name, chain in labels:
            label = f"{name} {'chained' if chain else 'independent'}"
            us, launches, between = gpu_per_call(paths[name], query, chain=chain, warm=args.warm)
            gpu.setdefault(label, []).append(us)
            if between:
                tables.setdefault(label, []).append(kernel_table(between))
            build = (chained(query, paths[name], list(range(CALLS))) if chain
                     else (lambda step=paths[name]: [step(query, i) for i in range(CALLS)]))
            wall.setdefault(label, []).append(amortised(build, repeats=3).us)
            for j, r in enumerate(launches):
                for key in ("start", "end", "sm"):
                    saved[f"{label}|{n}|{j}|{r['name']}|{key}"] = r[key]
    k = f"{args.context // 1024}k"
    print(f"{k}, {args.rounds} rounds, µs per call (medians; ratios to raw SDPA in the same round and mode, "
          "median and range)")
    for label in gpu:
        line = f"{k} {label:22s} GPU {statistics.median(gpu[label]):6.1f}  wall {statistics.median(wall[label]):6.1f}"
        if not label.startswith("raw"):
            base = "raw SDPA " + label.split()[-1]
            for what, times in (("GPU", gpu), ("wall", wall)):
                r = [a / b for a, b in zip(times[label], times[base])]
                line += f"  {what} x raw {statistics.median(r):.3f} ({min(r):.3f}-{max(r):.3f})"
        print(line, flush=True)
    baselines = [name for name in args.paths if name in gpu_decode_parts.QUANTIZED_MATMUL]
    for base in baselines:  # how many times faster than mlx-lm's quantized_matmul attention, same rounds
        for name in args.paths:
            if name == "raw SDPA" or name in gpu_decode_parts.QUANTIZED_MATMUL:
                continue
            for mode in ("chained", "independent"):
                r = [b / a for a, b in zip(gpu[f"{name} {mode}"], gpu[f"{base} {mode}"])]
                print(f"{k} {name} {mode}: {base} takes {statistics.median(r):.1f}x its GPU time "
                      f"({min(r):.1f}-{max(r):.1f})", flush=True)
    for label, rounds in tables.items():
        for name in rounds[0]:
            rows = [t[name] for t in rounds]
            med = {key: statistics.median(row[key] for row in rows) for key in ("span", "block", "gap")}
            slow = sum(row["slow"] for row in rows)
            total = sum(row["launches"] for row in rows)
            print(f"{k} {label:22s} {short(name):28s} span {med['span']:6.1f}  threadgroup {med['block']:6.1f}  "
                  f"gap before {med['gap']:6.1f}  over 1.5x median: {slow} of {total}", flush=True)
    if args.save:
        np.savez_compressed(args.save, **saved)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
