"""Recording kernel builds for a backend, and the Metal front-end check built on it."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest

from butter_core.kernels import Kernel, KernelCheck, KernelUnavailableError, gpu_backend, recorded_builds
from butter_core.kernels.metal_check import metal_builds, metal_errors, translation_unit

# A helper that names the device address space for its input: right for a large input,
# a Metal compile error for one of fewer than 8 elements (MLX passes it as constant).
NAMED_SPACE = """
template <typename T> BT_FUNC float first_of(const BT_GLOBAL T* p) { return bt_to_float(p[0]); }
"""
DEDUCED_SPACE = """
template <typename In> BT_FUNC float first_of(In p) { return bt_to_float(p[0]); }
"""
BODY = """
  if (thread_rank == 0) {
    out[0] = bt_from_float<T>(first_of(scale) * bt_to_float(inp[block_idx.x]));
  }
"""
NAMED = Kernel("test_metal_check_named", ["inp", "scale"], ["out"], BODY, helpers=NAMED_SPACE)
DEDUCED = Kernel("test_metal_check_deduced", ["inp", "scale"], ["out"], BODY, helpers=DEDUCED_SPACE)
SHARED = Kernel("test_metal_check_shared", ["inp"], ["out"], "out[0] = inp[0];", shared_memory=1024)


def scaled(kernel: Kernel, x: mx.array, scale: mx.array) -> mx.array:
    return kernel(inputs=[x, scale], output_shapes=[(1,)], output_dtypes=[x.dtype], grid=(32, 1, 1),
                  threadgroup=(32, 1, 1), template=[("T", x.dtype)])[0]


def check_of(kernel: Kernel) -> KernelCheck:
    return KernelCheck(
        name=kernel.name,
        kernel=lambda x, scale: scaled(kernel, x, scale),
        reference=lambda x, scale: (x[:1] * scale).astype(x.dtype),
        make_inputs=lambda seed, n, dtype=mx.float32: {"x": mx.ones((n,), dtype), "scale": mx.array([2.0], dtype)},
        cases=({"n": 64}, {"n": 64, "dtype": mx.bfloat16}),
    )


def test_recorded_builds_stand_in_for_a_backend_and_run_nothing():
    with recorded_builds("metal") as builds:
        assert gpu_backend() == "metal"
        out = scaled(DEDUCED, mx.ones((64,), mx.float16), mx.array([2.0], mx.float16))
    assert gpu_backend() != "metal" or mx.metal.is_available()
    assert out.tolist() == [0.0]  # nothing ran: zero-filled
    (build,) = builds
    assert (build.kernel, build.backend, build.template) == (DEDUCED, "metal", (("T", mx.float16),))
    assert build.input_shapes == ((64,), (1,)) and build.output_dtypes == (mx.float16,)


def test_recording_a_kernel_the_backend_cannot_build_raises_as_it_would_there():
    with recorded_builds("metal"), pytest.raises(KernelUnavailableError, match="dynamic shared memory"):
        SHARED(inputs=[mx.zeros((8,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
               threadgroup=(1, 1, 1))
    with recorded_builds("cuda") as builds:
        SHARED(inputs=[mx.zeros((8,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
               threadgroup=(1, 1, 1))
    assert len(builds) == 1


def test_translation_unit_passes_small_inputs_as_constant():
    (build, _) = metal_builds([check_of(DEDUCED)])
    source = translation_unit(build)
    assert "const device float* inp" in source and "const constant float* scale" in source
    assert "using T = float;" in source and "bt_shim_attribute<uint3>()" in source
    assert "const constant float* inp" in translation_unit(build, all_constant=True)
    with recorded_builds("cuda") as cuda_builds:
        scaled(DEDUCED, mx.ones((64,)), mx.array([2.0]))
    with pytest.raises(ValueError, match="not metal"):
        translation_unit(cuda_builds[0])


def test_checks_only_the_backends_a_check_is_built_for():
    assert metal_builds([attrs.evolve(check_of(SHARED), backends=frozenset({"cuda"}))]) == []


def test_metal_front_end_finds_an_input_address_space_mismatch():
    pytest.importorskip("clang.cindex", reason="libclang (pip install libclang) runs the Metal front-end check")
    builds = metal_builds([check_of(NAMED)])
    assert len(builds) == 2  # float32 and bfloat16
    errors = metal_errors(builds[0])
    assert errors and all("test_metal_check_named" in e for e in errors)
    assert "no matching function for call to 'first_of'" in errors[0] and "first_of(scale)" in errors[0]
    assert "__global" in errors[0] and "__constant" in errors[0]  # the note: which spaces clash
    assert all(metal_errors(build) == [] for build in metal_builds([check_of(DEDUCED)]))


def test_metal_front_end_finds_threadgroup_memory_beyond_32_kib():
    pytest.importorskip("clang.cindex", reason="libclang (pip install libclang) runs the Metal front-end check")
    body = """
  BT_SHARED float partial[N];
  partial[thread_rank] = bt_to_float(inp[thread_rank]);
  BT_BARRIER;
  out[0] = bt_from_float<T>(partial[0]);
"""
    kernel = Kernel("test_metal_check_big_shared", ["inp"], ["out"], body)
    sizes = {}
    for n in (8192, 8193):  # 32 KiB of floats, then one more
        with recorded_builds("metal") as builds:
            kernel(inputs=[mx.ones((64,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                   threadgroup=(32, 1, 1), template=[("T", mx.float32), ("N", n)])
        sizes[n] = metal_errors(builds[0])
    assert sizes[8192] == []
    assert len(sizes[8193]) == 2 and "32772 bytes of threadgroup memory, more than Metal's 32768" in sizes[8193][0]
