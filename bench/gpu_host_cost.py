"""What a custom-kernel call costs the host on CUDA, and how much of it is the kernel's source size.

MLX's CUDA ``custom_kernel`` writes the whole kernel source (its header included) into
every call's primitive and hashes it again when the call is evaluated, to find the
compiled module. Run on the lent H200 (``PYTHONPATH`` with butter and its plugins):

    python3 bench/gpu_host_cost.py

1. A one-line kernel with a header of 0, 8, 32 and 64 KB of comment: host time to build
   a call (``build``: the Python call that returns its output) and to evaluate it
   (``eval``: 400 calls evaluated together, per call), medians of ``gpu_timing.REPEATS``
   rounds (``gpu_timing.amortised``); as ``mx.fast.cuda_kernel`` and as a butter ``Kernel``
   (a binary compiled once per install, ``cuda_binaries``, or with ``BUTTER_CUDA_BINARIES=0``
   through MLX's JIT).
2. A decode step's attention through butter-aura's and butter-affine's kernels (bf16, 16
   query / 8 KV heads, head_dim 128, 4k keys), built and evaluated the same way, against
   MLX's SDPA on raw bf16 of the same shape; each scheme's both as a call built anew and
   as its caches make it on CUDA, a trace replayed (butter-affine's ``ops.kernel_decode``
   from the two stacks, butter-aura's ``attention.traced_decode_attention``); and
   butter-affine's one-token append (``quantize_kv``), built anew and traced
   (``ops.traced_quantize``).
3. A one-line butter ``Kernel`` reading 1, 4, 8 and 12 inputs, built anew and traced: what
   an input adds to a call's host cost; and a one-token slice assignment (an append's write).
4. The source MLX receives from butter for each kernel defined (header and body, CUDA;
   MLX adds its own includes), in KB.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from butter_affine import ops as affine_ops
from butter_affine.kernels import decode_mma, quantize
from butter_affine.kernels.decode import make_inputs as affine_inputs
from butter_affine.packing import BUFFERS, stack
from butter_aura.kernels import attention
from butter_aura.kernels.checks import make_stored
from butter_core.compiled import compile_by_shape
from butter_core.kernels import Kernel, cuda_binaries
from butter_core.kernels import kernel as kernel_module
from butter_core.kernels.dialect import kernel_header, kernel_source
from gpu_timing import amortised

LENGTH, Q_HEADS, KV_HEADS, HEAD_DIM = 4096, 16, 8, 128


def per_call_us(call: Callable[[], mx.array], calls: int = 400) -> tuple[float, float]:
    """(µs to build one call, µs to evaluate one of ``calls`` evaluated together), medians
    over ``gpu_timing.amortised``'s repeats."""
    timing = amortised(lambda: [call() for _ in range(calls)], calls=calls)
    return timing.build_us, timing.us


def header_sizes() -> None:
    x = mx.ones((1024,), mx.float32)
    binaries = "binary compiled once per install" if cuda_binaries.available() else "MLX JIT"
    print("| header | call | build µs/call | eval µs/call |\n|---:|---|---:|---:|")
    for kb in (0, 8, 32, 64):
        line = "// " + "x" * 77 + "\n"
        padding = line * (kb * 1024 // len(line))
        kernel = mx.fast.cuda_kernel(name=f"host_cost_{kb}", input_names=["inp"], output_names=["out"],
                                     source="out[threadIdx.x] = inp[threadIdx.x] + 1.0f;", header=padding)
        ours = Kernel(f"host_cost_butter_{kb}", ["inp"], ["out"], "  out[thread_idx.x] = inp[thread_idx.x] + 1.0f;\n",
                      helpers=padding)
        calls = {"mx.fast.cuda_kernel": lambda: kernel(inputs=[x], output_shapes=[(32,)], output_dtypes=[mx.float32],
                                                        grid=(32, 1, 1), threadgroup=(32, 1, 1))[0],
                 f"butter Kernel ({binaries})": lambda: ours(inputs=[x], output_shapes=[(32,)],
                                                              output_dtypes=[mx.float32], grid=(32, 1, 1),
                                                              threadgroup=(32, 1, 1))[0]}
        for name, call in calls.items():
            build, ev = per_call_us(call)
            print(f"| {kb} KB | {name} | {build:.1f} | {ev:.1f} |")


def input_counts() -> None:
    """A one-line butter ``Kernel`` reading 1 to 12 inputs (one small array each): what each
    input adds to a call's host cost, built anew and as a ``compile_by_shape`` trace replayed,
    beside a one-token slice assignment (an append's write) and MLX's SDPA at 4k."""
    print("\n| call | build µs/call | eval µs/call |\n|---|---:|---:|")
    for n in (1, 4, 8, 12):
        inputs = [mx.full((64,), float(i), mx.float32) for i in range(n)]
        mx.eval(inputs)
        names = [f"in{i}" for i in range(n)]
        body = "  out[thread_idx.x] = " + " + ".join(f"{name}[thread_idx.x]" for name in names) + ";\n"
        kernel = Kernel(f"host_cost_inputs_{n}", names, ["out"], body)

        def call(*arrays, kernel=kernel):
            return kernel(inputs=list(arrays), output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                          threadgroup=(32, 1, 1))[0]

        traced = compile_by_shape(call)
        build, ev = per_call_us(lambda: call(*inputs))
        print(f"| {n} inputs, built anew | {build:.1f} | {ev:.1f} |")
        build, ev = per_call_us(lambda: traced(*inputs))
        print(f"| {n} inputs, traced | {build:.1f} | {ev:.1f} |")
    storage = mx.zeros((1, KV_HEADS, LENGTH + 512, HEAD_DIM), mx.bfloat16)
    row = mx.ones((1, KV_HEADS, 1, HEAD_DIM), mx.bfloat16)
    mx.eval(storage, row)
    slot = [0]

    def assign():
        slot[0] = (slot[0] + 1) % 512
        storage[:, :, LENGTH + slot[0] : LENGTH + slot[0] + 1] = row
        return storage

    build, ev = per_call_us(assign, 200)
    print(f"| one-token slice assignment into a 4k bf16 buffer | {build:.1f} | {ev:.1f} |")


def source_sizes() -> None:
    print("\n| kernel | CUDA source MLX receives |\n|---|---:|")
    for name, (body, helpers, mma) in sorted(kernel_module._DEFINED.items()):
        size = len(kernel_header("cuda", helpers, mma=mma)) + len(kernel_source("cuda", body))
        print(f"| {name} | {size / 1024:.1f} KB |")


def decode_calls() -> None:
    aura = make_stored(0, length=LENGTH, allocated=LENGTH + 256, q_heads=Q_HEADS, kv_heads=KV_HEADS,
                             dtype=mx.bfloat16)
    affine = affine_inputs(0, bits=4, group_size=32, length=LENGTH, allocated=LENGTH + 256, q_heads=Q_HEADS,
                           kv_heads=KV_HEADS, dtype=mx.bfloat16)
    keys, values = (mx.random.normal((1, KV_HEADS, LENGTH, HEAD_DIM)).astype(mx.bfloat16) for _ in range(2))
    affine_stacks = stack({name: affine[name] for name in BUFFERS})
    mx.eval(aura["queries"], aura["stored"].key_codes, [v for v in affine.values() if isinstance(v, mx.array)], keys,
            values, affine_stacks)
    traced = affine_ops.kernel_decode(tensor_cores=True)
    traced_quantize = affine_ops.traced_quantize(4, 32)
    row = mx.random.normal((1, KV_HEADS, 1, HEAD_DIM)).astype(mx.bfloat16)
    paths = {
        "raw bf16, mx.fast.scaled_dot_product_attention": lambda: mx.fast.scaled_dot_product_attention(
            affine["queries"], keys, values, scale=HEAD_DIM**-0.5),
        "aura4v2, attention.decode_attention (2 kernels)": lambda: attention.decode_attention(
            aura["queries"], aura["stored"], aura["scale"]),
        "aura4v2, attention.traced_decode_attention (the same, traced)": lambda: attention.traced_decode_attention(
            aura["queries"], aura["stored"], aura["scale"]),
        "affine4, decode_mma.decode_attention (2 kernels)": lambda: decode_mma.decode_attention(**affine),
        "affine4, ops.kernel_decode (the same, traced)": lambda: traced(
            affine["queries"], affine_stacks, affine["length"], affine["scale"]),
        "affine4 append of one token, quantize.quantize_kv (1 kernel)": lambda: quantize.quantize_kv(
            row, row, bits=4, group_size=32),
        "affine4 append of one token, ops.traced_quantize (the same, traced)": lambda: traced_quantize(row, row),
    }
    print("\n| 4k keys, one query | build µs/call | eval µs/call |\n|---|---:|---:|")
    for name, call in paths.items():
        build, ev = per_call_us(call, 200)
        print(f"| {name} | {build:.1f} | {ev:.1f} |")


if __name__ == "__main__":
    header_sizes()
    decode_calls()
    input_counts()
    source_sizes()  # after the calls, which define the kernels that are made on first use
