"""What a decode kernel's per-call parameters cost, by where MLX puts them (CUDA).

butter-affine's and butter-aura's decode kernels read a few numbers per call: the live
length, the softmax scale, AURA's ring range. Made per call with ``mx.array([...])``,
MLX's CUDA allocator puts an array of 8 bytes or less in a pool of host memory the GPU
reads across the bus, and a larger one made from host data in managed memory that
migrates on first touch; ``butter_core.kernels.kernel_params`` makes each distinct tuple
once, in device memory, shared by the layers of a step. This times both forms in a chain
of 28 layers (each call's output the next call's query, as a decode step's layers wait on
each other), bf16, 16 query / 8 KV heads, head_dim 128, affine4 and aura4v2, alternating
the forms in each round; µs per layer, host build and evaluation (``gpu_timing.amortised``).
The same for MLX's ``mx.fast.rope`` on a decode step's queries (1 x 32 heads x 1 x 128,
bf16), which turns an int offset into an array of its own per call: 56 chained calls (the
queries and keys of 28 layers), the offset as an int or through ``kernel_params``.

Usage, on the lent H200 as the other GPU benches: ``python3 bench/gpu_kernel_params.py
[context ...]`` (default 4096 131072).
"""

from __future__ import annotations

import sys

import mlx.core as mx

from butter_affine.kernels import decode_mma
from butter_affine.kernels.decode import make_inputs as affine_inputs
from butter_affine.packing import BUFFERS
from butter_aura.kernels import attention
from butter_aura.kernels.checks import make_stored
from butter_core.kernels import kernel_params
from gpu_timing import amortised

LAYERS, ROUNDS, Q_HEADS, KV_HEADS, HEAD_DIM = 28, 3, 16, 8, 128
FORMS = ("made per call", "kernel_params")


def affine_step(inputs: dict, length: int, form: str):
    buffers = [inputs[name] for name in BUFFERS]
    scale = inputs["scale"]

    def step(q: mx.array) -> mx.array:
        if form == "made per call":
            live, scale_array = mx.array([length], dtype=mx.int32), mx.array([scale], dtype=mx.float32)
        else:
            live, scale_array = kernel_params((length,), mx.int32), kernel_params((scale,), mx.float32)
        return decode_mma.decode_attention_live(q, *buffers, live=live, scale=scale_array)

    return step


def aura_step(inputs: dict, form: str):
    stored, scale = inputs["stored"], inputs["scale"]
    lo, hi = stored.recent_range()
    values = (stored.length, stored.sinks, stored.ring, lo, hi)

    def step(q: mx.array) -> mx.array:
        if form == "made per call":
            params, scale_array = mx.array(values, dtype=mx.int32), mx.array([scale], dtype=mx.float32)
        else:
            params, scale_array = kernel_params(values, mx.int32), kernel_params((scale,), mx.float32)
        return attention.decode_attention_live(q, stored, params, scale_array)

    return step


def rope_step(offset: int, form: str):
    def step(x: mx.array) -> mx.array:
        at = offset if form == "made per call" else kernel_params((offset,), mx.int32).reshape(())
        return mx.fast.rope(x, HEAD_DIM, traditional=False, base=1e6, scale=1.0, offset=at)

    return step


def chain(step, query: mx.array, layers: int = LAYERS):
    def build() -> list[mx.array]:
        q = query
        for _ in range(layers):
            q = step(q)
        return [q]

    return build


def time_rope(offset: int = 4096) -> None:
    x = mx.random.normal((1, 32, 1, HEAD_DIM)).astype(mx.bfloat16)
    chains = {form: chain(rope_step(offset, form), x, 2 * LAYERS) for form in FORMS}
    assert mx.array_equal(*(chains[form]()[0] for form in FORMS)).item(), "rope: the two forms disagree"
    print(f"\n{2 * LAYERS} chained mx.fast.rope calls, µs per call (host build / evaluation)")
    print("| round | form | rope |\n|---:|---|---:|")
    for r in range(ROUNDS):
        for form in FORMS:
            t = amortised(chains[form], calls=2 * LAYERS)
            print(f"| {r + 1} | {form} | {t.build_us:.1f} / {t.us:.1f} |", flush=True)


def main(contexts: list[int]) -> None:
    time_rope()
    for length in contexts:
        sizes = dict(length=length, allocated=length + 256, q_heads=Q_HEADS, kv_heads=KV_HEADS, dtype=mx.bfloat16)
        affine = affine_inputs(0, bits=4, group_size=32, **sizes)
        aura = make_stored(0, **sizes)
        mx.eval([v for v in affine.values() if isinstance(v, mx.array)], aura["queries"], aura["stored"].key_codes)
        chains = {form: {"affine4": chain(affine_step(affine, length, form), affine["queries"]),
                         "aura4v2": chain(aura_step(aura, form), aura["queries"])} for form in FORMS}
        for scheme in ("affine4", "aura4v2"):
            outs = [chains[form][scheme]()[0] for form in FORMS]
            assert mx.array_equal(*outs).item(), f"{scheme}: the two forms disagree"
        print(f"\n{LAYERS} chained layers at {length} keys, µs per layer (host build / evaluation)")
        print("| round | form | affine4 | aura4v2 |\n|---:|---|---:|---:|")
        for r in range(ROUNDS):
            for form in FORMS:
                times = [amortised(chains[form][scheme], calls=LAYERS) for scheme in ("affine4", "aura4v2")]
                print(f"| {r + 1} | {form} | " + " | ".join(f"{t.build_us:.1f} / {t.us:.1f}" for t in times) + " |",
                      flush=True)


if __name__ == "__main__":
    main([int(arg) for arg in sys.argv[1:]] or [4096, 131072])
