"""Run each 128k decode-attention kernel a few times, for Nsight Compute to profile.

The benchmarks time calls; this gives ``ncu`` (on the lent H200: /usr/local/cuda/bin/ncu)
single calls to look inside: raw bf16 SDPA, the affine tensor-core kernel (affine4,
affine8) and AURA's tensor-core partials (aura4v2, aura4v4), batch 1, 32 query / 8 KV
heads, head_dim 128, bf16, 131072 positions. Each runs three times, evaluated one by
one, on independent buffers.

Run from a folder holding the bench scripts, with the wheels installed (as for
``gpu_affine.py``), for example:

    ncu --clock-control none --kernel-name regex:"partials|sdpa" --launch-count 8 \\
        --set full -o $OUT/prof python3 gpu_profile.py raw affine4 aura4v2
    ncu -i $OUT/prof.ncu-rep --page details > $OUT/details.txt
    ncu -i $OUT/prof.ncu-rep --page source --print-source sass --csv > $OUT/source.csv

``--clock-control none`` leaves the clocks alone (the machine's notes ask for it); ncu
still flushes the caches and replays each kernel, so its durations are those of a cold,
isolated call, not the amortised ones the benchmarks quote.
"""

from __future__ import annotations

import sys

import butter_core  # noqa: F401 - first (loads the CPU BLAS before MLX)
import mlx.core as mx

import gpu_affine
import gpu_aura
from butter_affine.kernels import decode_mma
from butter_affine.packing import BUFFERS
from butter_aura.kernels import attention

LENGTH = 131072
CALLS = 3
CHOICES = ("raw", "affine4", "affine8", "aura4v2", "aura4v4")


def main(names: list[str]) -> None:
    unknown = set(names) - set(CHOICES)
    if not names or unknown:
        raise SystemExit(f"name kernels to run, from {CHOICES}; got {names}")
    mx.set_default_device(mx.gpu)
    q = mx.random.normal((1, gpu_affine.Q_HEADS, 1, gpu_affine.HEAD_DIM)).astype(gpu_affine.DTYPE)
    scale = gpu_affine.HEAD_DIM**-0.5
    if "raw" in names:
        pairs = gpu_affine.raw_pairs(LENGTH)
        for i in range(CALLS):
            mx.eval(mx.fast.scaled_dot_product_attention(q, *pairs[i % len(pairs)], scale=scale))
        del pairs
    for name in ("affine4", "affine8"):
        if name in names:
            sets = gpu_affine.packed_sets(*gpu_affine.SCHEMES[name], LENGTH)
            for i in range(CALLS):
                buffers = sets[i % len(sets)]
                mx.eval(decode_mma.decode_attention(q, *(buffers[n] for n in BUFFERS), length=LENGTH, scale=scale))
            del sets
    for name in ("aura4v2", "aura4v4"):
        if name in names:
            copies = [gpu_aura.aura_inputs(name, LENGTH, seed) for seed in range(2)]
            for i in range(CALLS):
                mx.eval(attention.decode_attention(**copies[i % len(copies)], method="mma"))
            del copies


if __name__ == "__main__":
    main(sys.argv[1:])
