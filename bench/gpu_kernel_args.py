"""Per-call kernel values by value (``butter_core.kernels.by_value``) against host arrays.

The decode kernels read their per-call values (live length, ring range, softmax scale)
from the shape of an empty array. This times the same kernels built to read them from
small arrays made on the host for each call, as they did before: affine4's tensor-core
decode and aura4v2's (partials and merge), batch 1, 32 query / 8 KV heads, head_dim 128,
bf16, at 4k, 32k and 128k, side by side (``gpu_timing.side_by_side``, 7 rounds), as
independent calls and chained (each call's output the next call's query).

Usage (on the lent H200, as the other GPU benches): ``python3 bench/gpu_kernel_args.py``
"""

from __future__ import annotations

import butter_core  # noqa: F401 - first (loads the CPU BLAS before MLX)
import mlx.core as mx

import gpu_affine
import gpu_aura
from butter_affine.kernels import decode_mma
from butter_affine.packing import BUFFERS
from butter_aura.kernels import attention, attention_mma
from butter_core.kernels import Kernel
from gpu_timing import CALLS, print_side_by_side, side_by_side

CONTEXTS = (4096, 32768, 131072)


def host_arrays_variant(kernel: Kernel, name: str, count: int) -> Kernel:
    """``kernel`` reading ``args_shape[i]`` from an int32 array ``host_args`` instead."""
    body = kernel.body
    for i in range(count):
        body = body.replace(f"static_cast<uint32_t>(args_shape[{i}])", f"static_cast<uint32_t>(host_args[{i}])")
        body = body.replace(f"args_shape[{i}]", f"host_args[{i}]")
    assert "args_shape" not in body
    names = tuple("host_args" if n == "args" else n for n in kernel.input_names)
    return Kernel(name=name, input_names=names, output_names=kernel.output_names, body=body,
                  helpers=kernel.helpers, shared_memory=kernel.shared_memory, mma=kernel.mma)


class HostArrays:
    """Swaps a module's kernels for their ``host_arrays_variant`` and ``by_value`` for a
    function making the host array, while a build runs."""

    def __init__(self, module, kernels: dict[str, Kernel]):
        self.module, self.kernels = module, kernels

    def __enter__(self):
        names = (*self.kernels, "by_value") if hasattr(self.module, "by_value") else tuple(self.kernels)
        self.saved = {name: getattr(self.module, name) for name in names}
        for name, kernel in self.kernels.items():
            setattr(self.module, name, kernel)
        if "by_value" in self.saved:
            self.module.by_value = lambda *values: mx.array(values, dtype=mx.int32)

    def __exit__(self, *exc):
        for name, value in self.saved.items():
            setattr(self.module, name, value)


def affine_builds(length: int) -> dict:
    q = mx.random.normal((1, gpu_affine.Q_HEADS, 1, gpu_affine.HEAD_DIM)).astype(gpu_affine.DTYPE)
    scale = gpu_affine.HEAD_DIM**-0.5
    sets = gpu_affine.packed_sets(4, 32, length)
    host = HostArrays(decode_mma, {"_PARTIALS": host_arrays_variant(decode_mma._PARTIALS, "bench_affine_host_args", 2)})

    def call(x, buffers):
        return decode_mma.decode_attention(x, *(buffers[n] for n in BUFFERS), length=length, scale=scale)

    def independent():
        return [call(q, sets[i % len(sets)]) for i in range(CALLS)]

    def chain():
        x = q
        for i in range(CALLS):
            x = call(x, sets[i % len(sets)])
        return [x]

    def with_host(build):
        def run():
            with host:
                return build()
        return run

    return {"affine4 by value": independent, "affine4 host arrays": with_host(independent),
            "affine4 by value, chained": chain, "affine4 host arrays, chained": with_host(chain)}


def aura_builds(length: int) -> dict:
    copies = gpu_aura.aura_copies("aura4v2", length)
    partials = attention_mma.partials_kernel
    variants = {}

    def host_partials(shared):
        if shared not in variants:
            variants[shared] = host_arrays_variant(partials(shared), f"bench_aura_host_args_{shared}", 6)
        return variants[shared]

    host = HostArrays(attention, {"_MERGE": host_arrays_variant(attention._MERGE, "bench_aura_merge_host_args", 6)})
    mma_host = HostArrays(attention_mma, {"partials_kernel": host_partials})

    def independent():
        return [attention.decode_attention(**copies[i % len(copies)], method="mma") for i in range(CALLS)]

    def chain():
        x = copies[0]["queries"]
        for i in range(CALLS):
            inputs = copies[i % len(copies)]
            x = attention.decode_attention(x, inputs["stored"], inputs["scale"], method="mma")
        return [x]

    def with_host(build):
        def run():
            with host, mma_host:
                return build()
        return run

    return {"aura4v2 by value": independent, "aura4v2 host arrays": with_host(independent),
            "aura4v2 by value, chained": chain, "aura4v2 host arrays, chained": with_host(chain)}


def main() -> None:
    mx.set_default_device(mx.gpu)
    for length in CONTEXTS:
        for builds in (affine_builds(length), aura_builds(length)):
            names = list(builds)
            for pair in (names[:2], names[2:]):
                (by_value, host) = (builds[pair[0]], builds[pair[1]])
                assert mx.array_equal(by_value()[-1], host()[-1]).item(), pair
                print_side_by_side(side_by_side({pair[0]: by_value, pair[1]: host}), f"{length // 1024}k")
            mx.clear_cache()


if __name__ == "__main__":
    main()
