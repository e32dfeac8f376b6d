"""How the GPU benchmarks time a kernel (amortised, side by side) and the baseline they share.

Shared by ``gpu_affine.py``, ``gpu_aura.py``, ``gpu_bench.py`` and ``gpu_raw_kernels.py``
(each runs as a script from ``bench/``, so this imports as ``gpu_timing``).

* ``amortised``: CALLS calls evaluated together, divided by CALLS (GPU-NOTES: what a
  kernel costs inside a decode step, where all layers are one graph); only the
  evaluation is timed, the host's time building the calls' graphs is reported apart
  (MLX spends tens of µs of host time per custom-kernel call, which a decode loop
  overlaps with the previous step's GPU work).
* ``side_by_side``: paths timed in turn, round after round, and each round's ratio to
  the first path — the figure to quote for "x times raw", since the H200's clocks and
  neighbours move every path's time by 5-15% between runs (docs/benchmarks.md).
* ``copies_for``: how many independent input sets keep consecutive calls from finding
  their inputs in L2, as the layers of a decode step would not.
* ``quantized_matmul_attention``: mlx-lm's quantized-cache attention, the route the
  issues' "x times faster than ``mx.quantized_matmul``" goals measure against.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from typing import NamedTuple

import mlx.core as mx

CALLS = 50
REPEATS = 5
L2_DEFEAT_BYTES = 256 * 2**20
"""Bytes of distinct inputs a run of calls cycles through (the H200's L2 holds 60 MB)."""


class Timing(NamedTuple):
    """Medians over the repeats, per call, in µs."""

    us: float
    """Evaluating the calls."""
    build_us: float
    """The host building the calls' graphs (not in ``us``)."""


def amortised(build: Callable[[], list[mx.array]], *, calls: int = CALLS, repeats: int = REPEATS) -> Timing:
    """Time ``build`` (which builds ``calls`` calls and returns their outputs): once to
    compile and warm up, then ``repeats`` times, each evaluated as one graph. MLX's buffer
    cache is emptied first: a buffer the host has read (a check's output) has its
    unified-memory pages on the host, and handed to a timed kernel's output it faults on
    the GPU's first writes (bench/gpu_timeline.py's ``_READ``; docs/benchmarks.md)."""
    mx.clear_cache()
    mx.eval(build())
    samples, builds = [], []
    outs = None
    for _ in range(repeats):
        outs = None  # drop the last results first: a live reference to a buffer stops donation
        start = time.perf_counter()
        outs = build()
        builds.append((time.perf_counter() - start) / calls * 1e6)
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(outs)
        mx.synchronize()
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return Timing(statistics.median(samples), statistics.median(builds))


def side_by_side(builds: dict[str, Callable[[], list[mx.array]]], *, rounds: int = 7,
                 calls: int = CALLS) -> dict[str, dict]:
    """Each path of ``builds`` timed by ``amortised`` once per round, in turn, for
    ``rounds`` rounds. Per path: the rounds' µs and their median; for every path but the
    first, also each round's ratio to the first path's time in that round, and the
    median, least and greatest of those ratios."""
    times: dict[str, list[float]] = {name: [] for name in builds}
    for _ in range(rounds):
        for name, build in builds.items():
            times[name].append(amortised(build, calls=calls).us)
    baseline = times[next(iter(builds))]
    out = {}
    for name, samples in times.items():
        row = {"us": samples, "median_us": statistics.median(samples)}
        if samples is not baseline:
            ratios = [t / b for t, b in zip(samples, baseline)]
            row.update(ratios=ratios, median_ratio=statistics.median(ratios), min_ratio=min(ratios),
                       max_ratio=max(ratios))
        out[name] = row
    return out


def print_side_by_side(rows: dict[str, dict], prefix: str) -> None:
    """One line per path of a ``side_by_side`` result: median µs and, but for the first,
    the median ratio and the rounds' range."""
    width = max(len(path) for path in rows)
    for path, row in rows.items():
        ratios = (f"  x first: median {row['median_ratio']:.3f} (rounds {row['min_ratio']:.3f}-{row['max_ratio']:.3f})"
                  if "ratios" in row else "")
        print(f"{prefix} {path:{width}s} median {row['median_us']:7.1f} µs{ratios}", flush=True)


def copies_for(nbytes: int, most: int = CALLS) -> int:
    """Independent input sets of ``nbytes`` each to cycle through (at most ``most``)."""
    return max(1, min(most, math.ceil(L2_DEFEAT_BYTES / max(nbytes, 1))))


def quantized_matmul_attention(queries: mx.array, keys: tuple, values: tuple, scale: float, *, bits: int,
                               group_size: int) -> mx.array:
    """The baseline the quantized kernels are timed against: single-token attention over
    ``mx.quantize``d K and V (each a (codes, scales, biases) triple) through
    ``mx.quantized_matmul``, as mlx-lm's quantized KV cache computes it (query heads of a
    KV head as a batch axis, the codes broadcast over it; softmax ``precise``).

    The form with the query heads as matrix rows instead (what butter-affine's CPU path
    uses for the values: fewer reads of the codes there) crashed MLX 0.32.4's CUDA
    backend on 8-bit codes; this one runs there."""
    batch, q_heads, tokens, dims = queries.shape
    kv_heads = keys[0].shape[1]
    q = (queries * scale).reshape(batch, kv_heads, q_heads // kv_heads, tokens, dims)
    keys = [x[:, :, None] for x in keys]
    values = [x[:, :, None] for x in values]
    scores = mx.quantized_matmul(q, *keys, transpose=True, group_size=group_size, bits=bits)
    weights = mx.softmax(scores, axis=-1, precise=True)
    out = mx.quantized_matmul(weights, *values, transpose=False, group_size=group_size, bits=bits)
    return out.reshape(batch, q_heads, tokens, dims)
