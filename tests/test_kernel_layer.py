"""The kernel layer: dialect sources for both backends, and Kernel's behaviour here."""

from __future__ import annotations

import math
import re

import mlx.core as mx
import pytest

from butter_core.kernels import (
    CheckResult,
    Kernel,
    KernelCheck,
    KernelUnavailableError,
    default_device_is_gpu,
    gpu_backend,
    mma,
    recorded_builds,
    relative_error,
    split_k,
    tensor_cores_available,
)
from butter_core.kernels import backend as kernel_backend
from butter_core.kernels.dialect import HEADER, MMA_HEADER, PREAMBLE, compact
from butter_core.kernels.kernel import build_key

BACKENDS = ("metal", "cuda")
MACROS = ("BT_SHARED", "BT_SHARED_PTR", "BT_BARRIER", "BT_GLOBAL", "BT_PRIVATE", "BT_FUNC",
          "BT_NEG_INF", "BT_WARP_SIZE")
FUNCTIONS = ("bt_to_float", "bt_from_float", "bt_exp", "bt_exp2", "bt_sqrt", "bt_rint", "bt_max",
             "bt_as_float", "bt_shuffle_xor", "bt_group_sum", "bt_group_max", "bt_warp_sum",
             "bt_warp_max", "bt_load")
LOCALS = {"block_idx", "thread_idx", "block_dim", "grid_dim", "global_idx", "thread_rank",
          "lane_id", "warp_id"}
# Metal appends a thread attribute to the generated signature when its name occurs in
# the kernel source; these are the ones the preamble relies on.
METAL_ATTRIBUTES = ("threadgroup_position_in_grid", "thread_position_in_threadgroup",
                    "threads_per_threadgroup", "threadgroups_per_grid",
                    "thread_position_in_grid", "thread_index_in_threadgroup",
                    "thread_index_in_simdgroup", "simdgroup_index_in_threadgroup")

no_gpu = pytest.mark.skipif(gpu_backend() is not None, reason="this machine has a GPU backend")


def _kernel(name: str, body: str = "out[0] = inp[0];") -> Kernel:
    return Kernel(name, ["inp"], ["out"], body)


@pytest.mark.parametrize("backend", BACKENDS)
def test_preamble_binds_the_same_locals_on_both_backends(backend):
    bound = set(re.findall(r"const [\w ]+? (\w+) =", PREAMBLE[backend]))
    assert bound == LOCALS


@pytest.mark.parametrize("backend", BACKENDS)
def test_source_is_preamble_then_body(backend):
    kernel = _kernel("test_layer_source")
    source = kernel.source(backend)
    assert source.startswith(compact(PREAMBLE[backend]))
    assert source.endswith(compact(kernel.body))


def test_metal_attributes_are_in_the_source_not_the_header():
    kernel = _kernel("test_layer_metal_attributes")
    for attribute in METAL_ATTRIBUTES:
        assert attribute in kernel.source("metal")
        assert attribute not in kernel.header("metal")


@pytest.mark.parametrize("backend", BACKENDS)
def test_header_defines_the_vocabulary(backend):
    header = HEADER[backend]
    for macro in MACROS:
        assert re.search(rf"^#define {macro}\b", header, re.MULTILINE), macro
    for function in FUNCTIONS:
        assert re.search(rf"\b{function}\s*\(", header), function


def test_dynamic_shared_memory_macro_is_cuda_only():
    assert "#define BT_DYNAMIC_SHARED" in HEADER["cuda"]
    assert "BT_DYNAMIC_SHARED" not in HEADER["metal"]


def test_cuda_dialect_avoids_names_cuda_lacks_or_mlx_redefines():
    text = HEADER["cuda"] + PREAMBLE["cuda"]
    assert not re.search(r"\buint\b", text)  # no such type in CUDA
    assert not re.search(r"\binf\b", text)  # a macro in MLX's CUDA header
    for cuda_type in ("float", "__half", "__nv_bfloat16"):
        assert f"bt_to_float({cuda_type} x)" in text


def test_header_appends_kernel_helpers():
    kernel = Kernel("test_layer_helpers", ["inp"], ["out"], "out[0] = twice(inp[0]);",
                    helpers="BT_FUNC float twice(float x) { return 2 * x; }\n")
    for backend in BACKENDS:
        assert kernel.header(backend) == compact(HEADER[backend] + kernel.helpers)


MMA_FUNCTIONS = ("bt_any", "bt_shuffle_u32", "bt_half2_fma", "bt_pack_half2", "bt_byte_perm", "bt_mma_16x8x16",
                 "bt_transpose_8x8")


@pytest.mark.parametrize("backend", BACKENDS)
def test_tensor_core_vocabulary_is_opt_in(backend):
    """Only kernels built with ``mma=True`` get it, so no other kernel's source changes."""
    for function in MMA_FUNCTIONS:
        assert re.search(rf"\b{function}\s*\(", MMA_HEADER[backend]), function
        assert not re.search(rf"\b{function}\s*\(", HEADER[backend]), function
    plain = _kernel("test_layer_plain")
    tensor = Kernel("test_layer_mma", ["inp"], ["out"], "out[0] = inp[0];", helpers="// h\n", mma=True)
    assert plain.header(backend) == compact(HEADER[backend] + plain.helpers)
    assert tensor.header(backend) == compact(HEADER[backend] + MMA_HEADER[backend] + tensor.helpers)


def test_cuda_tensor_core_vocabulary_is_the_documented_instruction():
    text = MMA_HEADER["cuda"]
    assert "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in text
    assert "movmatrix.sync.aligned.m8n8.trans.b16" in text
    assert "fma.rn.f16x2" in text and "cvt.rn.f16x2.f32" in text
    assert not re.search(r"\buint\b", text) and not re.search(r"\binf\b", text)


def test_mma_helpers_are_dialect_only():
    helpers = mma.MMA_SPLIT_K_HELPERS
    assert "#if" not in helpers and "__METAL_VERSION__" not in helpers and "asm" not in helpers
    for name in ("mma_query_fragments(", "mma_softmax(", "mma_write_partials(", "splitk_merge_warps<"):
        assert name in helpers
    assert "splitk_merge_warps(" in split_k.SPLIT_K_HELPERS


def test_mma_max_heads_keeps_shared_state_small():
    with recorded_builds("cuda"):
        assert mma.max_heads(128) == 16 and mma.max_heads(64) == 16 and mma.max_heads(256) == 8
        assert mma.max_heads(128, warps=8) == 8
        for dims in (64, 128, 256):
            for warps in (2, 4, 8):
                assert warps * mma.max_heads(dims, warps) * dims * 4 <= 32 * 1024
    with recorded_builds("metal"):  # accumulators, running max and sum: all of Metal's 32 KiB
        assert mma.max_heads(128) == 15 and mma.max_heads(64) == 16 and mma.max_heads(256) == 7
        for dims in (64, 128, 256):
            for warps in (2, 4, 8):
                assert warps * mma.max_heads(dims, warps) * (dims + 2) * 4 <= 32 * 1024


def test_backend_detection_agrees_with_mlx():
    expected = "metal" if mx.metal.is_available() else "cuda" if mx.cuda.is_available() else None
    assert gpu_backend() == expected
    assert default_device_is_gpu() == (mx.default_device().type == mx.gpu)


@no_gpu
def test_kernel_is_unavailable_without_a_gpu_and_says_why():
    kernel = _kernel("test_layer_unavailable")
    assert not kernel.available()
    with pytest.raises(KernelUnavailableError, match="needs a GPU backend"):
        kernel(inputs=[mx.zeros((4,))], output_shapes=[(1,)], output_dtypes=[mx.float32],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))


@no_gpu
def test_a_call_can_go_to_mlx_past_the_executor():
    """An executor sees a kernel's calls; one made with ``executor=False`` (how an executor
    runs a kernel for real, e.g. a stamped copy) reaches MLX, here its missing CUDA back end."""
    kernel = _kernel("test_layer_past_executor")
    call = dict(inputs=[mx.zeros((4,))], output_shapes=[(1,)], output_dtypes=[mx.float32],
                grid=(1, 1, 1), threadgroup=(1, 1, 1))
    with recorded_builds("cuda") as builds:
        kernel(**call)
        with pytest.raises(RuntimeError, match="CUDA"):
            mx.eval(kernel(**call, executor=False))
    assert [build.kernel for build in builds] == [kernel]


def test_kernel_names_must_be_unique():
    _kernel("test_layer_unique")
    _kernel("test_layer_unique")  # the same definition again is fine
    with pytest.raises(ValueError, match="already used"):
        _kernel("test_layer_unique", body="out[0] = 2 * inp[0];")


def test_kernel_definitions_differ_by_vocabulary():
    Kernel("test_layer_vocab", ["inp"], ["out"], "out[0] = inp[0];")
    with pytest.raises(ValueError, match="already used"):
        Kernel("test_layer_vocab", ["inp"], ["out"], "out[0] = inp[0];", mma=True)


def test_cuda_build_key_follows_the_source_and_every_dtype():
    """MLX keys compiled CUDA kernels (also on disk, across processes) by name and template
    values only; ``Kernel`` adds ``BT_BUILD`` so a changed source or dtype builds anew."""
    key = build_key("src", [mx.float16, mx.uint32], [mx.float32])
    assert key == build_key("src", [mx.float16, mx.uint32], [mx.float32])
    assert 0 <= key < 2**31
    others = {build_key("src2", [mx.float16, mx.uint32], [mx.float32]),
              build_key("src", [mx.bfloat16, mx.uint32], [mx.float32]),
              build_key("src", [mx.float16, mx.uint32], [mx.float16])}
    assert key not in others and len(others) == 3


@pytest.mark.skipif(kernel_backend.gpu_backend() is None, reason="needs a GPU")
def test_one_kernel_serves_several_dtypes_under_one_template():
    """No template names the dtypes here: each call still gets a binary built for its own."""
    kernel = _kernel("test_layer_dtypes", "out[thread_rank] = bt_from_float<float>(bt_to_float(inp[thread_rank]) * 2);")
    for dtype in (mx.float32, mx.float16, mx.bfloat16, mx.float32):
        x = mx.arange(8).astype(dtype)
        (out,) = kernel(inputs=[x], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(8, 1, 1),
                        threadgroup=(8, 1, 1))
        assert out.tolist() == [2.0 * i for i in range(8)], dtype


def test_relative_error_and_check_result():
    ref = mx.array([3.0, 4.0])
    assert relative_error(ref, ref) == 0.0
    assert math.isclose(relative_error(mx.array([3.0, 4.5]), ref), 0.1, rel_tol=1e-6)
    assert math.isnan(relative_error(mx.array([math.nan, 4.0]), ref))
    assert not CheckResult("k", {}, math.nan, 1e-2).passed
    assert CheckResult("k", {}, 1e-3, 1e-2).passed


def test_split_k_helpers_are_dialect_only():
    """One text for both backends: no backend switch, shared pointers through the dialect."""
    helpers = split_k.SPLIT_K_HELPERS
    assert "#if" not in helpers and "__METAL_VERSION__" not in helpers
    assert "BT_SHARED_PTR float* warp_m" in helpers
    for name in ("struct SplitKBlock", "splitk_block(", "splitk_merge_lanes(",
                 "splitk_write_partials("):
        assert name in helpers
    merge = split_k._MERGE
    assert merge.name == "butter_split_k_merge"
    for backend in BACKENDS:
        assert merge.source(backend).endswith(compact(merge.body))


def test_split_k_sizes():
    assert split_k.heads_per_block(4, 4) == 4 and split_k.heads_per_block(12, 4) == 4
    assert split_k.heads_per_block(7, 4) == 1 and split_k.heads_per_block(6, 4) == 3
    assert split_k.num_splits(10, 8, min_keys=64, target_blocks=528) == 1
    assert split_k.num_splits(131072, 8, min_keys=64, target_blocks=528) == 66
    assert split_k.num_splits(1000, 8, min_keys=64, target_blocks=528) == 16


def test_split_k_plan():
    launch = split_k.plan(batch=2, q_heads=24, kv_heads=2, dims=64, length=777, warps=4,
                          max_heads=8, min_keys=64, target_blocks=512)
    # 12 query heads per KV head, served 6 per threadgroup: 2 * 24 / 6 = 8 threadgroups per split.
    assert launch.heads == 6 and launch.n_splits == math.ceil(777 / 64)
    assert launch.grid == (4 * 32 * 8, launch.n_splits, 1)
    assert launch.threadgroup == (128, 1, 1)
    assert launch.output_shapes == ((2, 24, 13, 64), (2, 24, 13), (2, 24, 13))
    assert launch.output_dtypes == (mx.float32,) * 3
    one = split_k.plan(batch=1, q_heads=8, kv_heads=8, dims=128, length=1, warps=8,
                       max_heads=4, min_keys=64, target_blocks=512)
    assert (one.heads, one.n_splits, one.grid) == (1, 1, (256 * 8, 1, 1))
    forced = split_k.plan(batch=2, q_heads=24, kv_heads=2, dims=64, length=777, warps=4,
                          max_heads=8, min_keys=64, target_blocks=512, splits=3)
    assert forced.n_splits == 3 and forced.grid[1] == 3 and forced.output_shapes[0] == (2, 24, 3, 64)


def test_split_k_merges_take_whole_warps_and_a_bounded_split_count():
    """A merge runs whole warps of dimensions in one threadgroup and loops over a bounded
    number of splits: plans stay within ``MAX_MERGE_SPLITS``, and a call outside either
    bound is refused before anything is built."""
    assert split_k.num_splits(10**9, 1, min_keys=1, target_blocks=10**6) == split_k.MAX_MERGE_SPLITS
    split_k.check_merge(split_k.MAX_MERGE_SPLITS, 128)
    with pytest.raises(ValueError, match="1 to 1024 splits; got 1025"):
        split_k.check_merge(split_k.MAX_MERGE_SPLITS + 1, 128)
    with pytest.raises(ValueError, match="whole warps of 32 and at most 1024; got 80 dimensions"):
        split_k.check_merge(4, 80)
    partials = [mx.zeros((1, 2, 1025, 64)), mx.zeros((1, 2, 1025)), mx.zeros((1, 2, 1025))]
    with pytest.raises(ValueError, match="got 1025"):
        split_k.merge_partials(*partials, mx.float32)


def test_split_k_merges_spread_the_splits_over_parts_of_a_threadgroup():
    """A merge runs one thread per dimension per part, with a part for about every
    ``SPLITS_PER_THREAD`` splits, in at most ``MERGE_THREADS`` threads."""
    assert split_k.SPLITS_PER_THREAD == 4 and split_k.MERGE_THREADS == 1024
    assert split_k.merge_threads(1, 128) == 128
    assert split_k.merge_threads(4, 128) == 128
    assert split_k.merge_threads(5, 128) == 256
    assert split_k.merge_threads(33, 128) == 1024  # 9 parts wanted, 8 fit
    assert split_k.merge_threads(49, 64) == 13 * 64
    assert split_k.merge_threads(1024, 256) == 1024
    with pytest.raises(ValueError, match="at most 1024; got 2048 dimensions"):
        split_k.check_merge(4, 2048)


def test_split_k_plan_scales_its_target_to_the_gpu(monkeypatch):
    """``target_blocks`` is tuned on an H200 (132 multiprocessors); on a GPU with another
    count the plan keeps the same threadgroups per multiprocessor."""
    sizes = dict(batch=1, q_heads=32, kv_heads=8, dims=128, length=131072, warps=4, max_heads=4, min_keys=64)
    assert kernel_backend.gpu_shape() == kernel_backend.TUNED_ON  # CPU-only here, or recorded
    assert split_k.plan(**sizes, target_blocks=264).n_splits == 33  # 8 threadgroups per split
    for multiprocessors, splits in ((66, 17), (108, 27), (264, 66)):
        shape = kernel_backend.GpuShape(multiprocessors, 100 * 1024, 65536)
        monkeypatch.setattr(kernel_backend, "gpu_shape", lambda shape=shape: shape)
        assert kernel_backend.scaled_to_gpu(264) == math.ceil(264 * multiprocessors / 132)
        assert split_k.plan(**sizes, target_blocks=264).n_splits == splits


@pytest.mark.skipif(kernel_backend.gpu_backend() != "cuda", reason="asks a CUDA device")
def test_gpu_shape_is_the_cuda_devices():
    """On CUDA the shape comes from the driver: a plausible multiprocessor count, shared
    memory and registers (an H200's are ``TUNED_ON``)."""
    shape = kernel_backend.gpu_shape()
    assert 1 <= shape.multiprocessors <= 1024
    assert 64 * 1024 <= shape.shared_per_multiprocessor <= 1024 * 1024
    assert shape.registers_per_multiprocessor >= 32768


@no_gpu
def test_merge_partials_needs_a_gpu():
    partial_max = mx.zeros((1, 2, 3))
    with pytest.raises(KernelUnavailableError):
        split_k.merge_partials(mx.zeros((1, 2, 3, 64)), partial_max, partial_max, mx.float16)


def test_compact_drops_comments_indentation_and_blank_lines_only():
    source = "  int a = 1;  // one\n\n#define TWICE(x) \\\n    (2 * (x))\n// a whole-line comment\n  return a;\n"
    assert compact(source) == "int a = 1;\n#define TWICE(x) \\\n(2 * (x))\nreturn a;\n"


def test_compact_refuses_a_comment_continued_to_the_next_line():
    """A ``//`` comment ending in a line continuation swallows the next line; dropping the
    comment would compile that line, so ``compact`` refuses it."""
    with pytest.raises(ValueError, match="line continuation"):
        compact("int a = 1;  // one \\\nint b = 2;\n")


@pytest.mark.parametrize(("capability", "runs"), [((7, 5), False), ((8, 0), True), ((9, 0), True), (None, True)])
def test_tensor_core_kernels_need_compute_capability_8_on_cuda(monkeypatch, capability, runs):
    """The device's compute capability decides whether tensor-core kernels, and the checks
    of kernels built with them, run on CUDA (the capability stands in for a device: this
    machine may have none; None: MLX does not report one). Metal emulates the vocabulary."""
    monkeypatch.setattr(kernel_backend, "cuda_compute_capability", lambda: capability)
    plain = _kernel("test_layer_tc_plain")
    tensor = Kernel("test_layer_tc_mma", ["inp"], ["out"], "out[0] = inp[0];", mma=True)
    check = KernelCheck(name="tc", kernel=tensor, reference=lambda **_: None, make_inputs=lambda seed: {}, cases=(),
                        tensor_cores=True)
    with recorded_builds("cuda"):
        assert plain.available()
        assert tensor.available() is runs
        assert tensor_cores_available() is runs
        assert check.runs_on("cuda") is runs
        if not runs:
            assert tensor.unavailable_reason() == (
                "kernel 'test_layer_tc_mma' cannot run here: tensor-core instructions (mma.sync m16n8k16) need "
                "CUDA compute capability 8.0 or newer; this GPU has 7.5")
    with recorded_builds("metal"):
        assert tensor.available() and check.runs_on("metal") and tensor_cores_available()
    assert not KernelCheck(name="tc", kernel=tensor, reference=lambda **_: None, make_inputs=lambda seed: {},
                           cases=(), backends=frozenset({"metal"})).runs_on("cuda")
