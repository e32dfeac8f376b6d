"""One decode-attention call in parts: the partials kernel, the merge, chained calls, host or GPU.

At one context (default 128k; batch 1, 32 query / 8 KV heads, head_dim 128, bf16), side
by side with raw SDPA (``gpu_timing.side_by_side``, ``ROUNDS`` rounds, each round's ratio
to raw's independent calls):

- raw SDPA, affine4's tensor-core decode (``decode_mma``) and aura4v2's
  (``attention.decode_attention``), each as ``CALLS`` independent calls;
- the same two with their partials kernel only (``decode_mma.partials``,
  ``attention_mma.partials``): what the merge adds among independent calls, where it
  partly overlaps the next call's partials;
- all three *chained*, each call's query the previous call's output, as a decode step's
  layers run: the merge and every launch on the critical path.

Then, for the three independent paths, the host's share: the calls built, then
``mx.async_eval`` timed (it returns once every kernel is encoded and launched) and the
wait after it, per call. Where encoding is well under the total, the GPU sets the pace.

Run on the lent H200 as the other GPU benches (``PYTHONPATH`` with butter and its
plugins, from ``bench/``): ``python3 bench/gpu_decode_parts.py [context]``. Figures:
docs/benchmarks.md, "Host or GPU at 128k, kernel by kernel, and merges spread over their
threadgroup".
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable

import gpu_affine
import gpu_aura
import mlx.core as mx

from butter_affine.kernels import decode_mma
from butter_affine.packing import BUFFERS
from butter_aura.kernels import attention, attention_mma
from butter_core.kernels import kernel_params
from gpu_timing import CALLS, copies_for, print_side_by_side, quantized_matmul_attention, side_by_side

ROUNDS = 5
HEAD_DIM = 128
Step = Callable[[mx.array, int], mx.array]
"""One call: (query, call index) to its output; the index picks the input copy."""


AFFINE_FORMATS = {"affine4": (4, 32), "affine6": (6, 32), "affine8": (8, 64)}
"""butter-affine's schemes as bits and group size (their defaults)."""
AURA_SCHEMES = ("aura4v2", "aura4v4", "aura8v4", "aura8v8")
QUANTIZED_MATMUL = {"quantized_matmul 4-bit": 4, "quantized_matmul 8-bit": 8}
"""The baseline of the issues' "x times faster than ``mx.quantized_matmul``" goals:
mlx-lm's quantized-cache attention (``gpu_timing.quantized_matmul_attention``) on
``mx.quantize``d K and V, groups of 64."""
PATHS = ("raw SDPA", *AFFINE_FORMATS, *AURA_SCHEMES, *QUANTIZED_MATMUL, "affine4 partials only",
         "aura4v2 partials only")
"""Every path ``steps`` can build."""


def steps(length: int, names: tuple[str, ...] = ("raw SDPA", "affine4", "aura4v2")) -> tuple[mx.array, dict[str, Step]]:
    """A query and the call of each path in ``names`` (of ``PATHS``), on inputs enough copies
    deep to keep consecutive calls out of L2; only those paths' inputs are made."""
    unknown = set(names) - set(PATHS)
    if unknown:
        raise ValueError(f"unknown paths {sorted(unknown)}; known: {list(PATHS)}")
    scale = HEAD_DIM**-0.5
    raw = gpu_aura.raw_copies(length)
    live, scale_array = kernel_params((length,), mx.int32), kernel_params((scale,), mx.float32)
    made: dict[str, Step] = {}

    def affine(name: str, *, partials: bool = False) -> Step:
        sets = gpu_affine.packed_sets(*AFFINE_FORMATS[name], length)

        def buffers(i: int) -> list[mx.array]:
            return [sets[i % len(sets)][buffer] for buffer in BUFFERS]

        if partials:
            return lambda q, i: decode_mma.partials(q, *buffers(i), live=live, scale=scale_array)[0]
        return lambda q, i: decode_mma.decode_attention(q, *buffers(i), length=length, scale=scale)

    def aura(name: str, *, partials: bool = False) -> Step:
        copies = gpu_aura.aura_copies(name, length)

        def stored(i: int):
            return copies[i % len(copies)]["stored"]

        if partials:
            return lambda q, i: attention_mma.partials(q, stored(i), attention.live_params(stored(i)), scale_array)[0]
        return lambda q, i: attention.decode_attention(q, stored(i), scale, method="mma")

    def quantized_matmul(bits: int) -> Step:
        def one() -> tuple:
            k, v = (mx.random.normal((1, gpu_affine.KV_HEADS, length, HEAD_DIM)).astype(gpu_affine.DTYPE) for _ in range(2))
            pair = (mx.quantize(k, 64, bits), mx.quantize(v, 64, bits))
            mx.eval(pair)
            return pair

        first = one()
        sets = [first] + [one() for _ in range(1, copies_for(sum(x.nbytes for triple in first for x in triple)))]
        return lambda q, i: quantized_matmul_attention(q, *sets[i % len(sets)], scale, bits=bits, group_size=64)

    for name in names:
        if name == "raw SDPA":
            made[name] = lambda q, i: mx.fast.scaled_dot_product_attention(q, *raw[i % len(raw)][1:], scale=scale)
        elif name in QUANTIZED_MATMUL:
            made[name] = quantized_matmul(QUANTIZED_MATMUL[name])
        elif name.endswith(" partials only"):
            scheme = name.split()[0]
            made[name] = (affine if scheme in AFFINE_FORMATS else aura)(scheme, partials=True)
        else:
            made[name] = (affine if name in AFFINE_FORMATS else aura)(name)
    return raw[0][0], made


def independent(query: mx.array, step: Step) -> Callable[[], list[mx.array]]:
    return lambda: [step(query, i) for i in range(CALLS)]


def encode_and_wait(build: Callable[[], list[mx.array]], repeats: int = 5) -> tuple[float, float]:
    """(µs per call the host takes to encode and launch ``build``'s calls, µs per call
    until they are done), medians of ``repeats``."""
    mx.eval(build())
    encode, total = [], []
    for _ in range(repeats):
        outs = build()
        mx.synchronize()
        start = time.perf_counter()
        mx.async_eval(outs)
        encoded = time.perf_counter()
        mx.synchronize()
        done = time.perf_counter()
        encode.append((encoded - start) / CALLS * 1e6)
        total.append((done - start) / CALLS * 1e6)
        outs = None
    return statistics.median(encode), statistics.median(total)


def main() -> int:
    length = int(sys.argv[1]) if len(sys.argv) > 1 else 131072
    query, paths = steps(length, ("raw SDPA", "affine4", "aura4v2", "affine4 partials only", "aura4v2 partials only"))
    builds = {name: independent(query, step) for name, step in paths.items()}
    for name in ("raw SDPA", "affine4", "aura4v2"):
        builds[f"{name} chained"] = gpu_affine.chained(query, paths[name], list(range(CALLS)))
    print_side_by_side(side_by_side(builds, rounds=ROUNDS), f"{length // 1024}k")
    for name in ("raw SDPA", "affine4", "aura4v2"):
        encode, total = encode_and_wait(builds[name])
        print(f"{length // 1024}k {name:8s} host encodes {encode:6.1f} µs a call of {total:6.1f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
