"""The kernel emulators run the dialect's per-backend code on the CPU: reductions, shared memory, the
tensor-core vocabulary (Metal's shuffle emulation; on CUDA, the software stand-in for its PTX).
Where the machine has a GPU the same checks run on it too (on CUDA, the PTX itself)."""

from __future__ import annotations

import contextlib
import subprocess

import mlx.core as mx
import numpy as np
import pytest

from butter_core.kernels import Kernel, gpu_backend, metal_emulator, split_k
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available, emulated_metal


NEEDS_COMPILER = pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
EMULATORS = pytest.mark.parametrize("emulated", [
    pytest.param(emulated_metal, id="metal", marks=NEEDS_COMPILER),
    pytest.param(emulated_cuda, id="cuda", marks=NEEDS_COMPILER),
    pytest.param(contextlib.nullcontext, id="gpu", marks=pytest.mark.skipif(gpu_backend() is None, reason="no GPU")),
])

REDUCE = Kernel(
    "test_kernel_emulators_reduce",
    ["x"],
    ["out"],
    """
  // Two simdgroups per threadgroup: each sums its 32 values (simd_sum on Metal) and finds
  // the largest of each 8 (butterfly shuffles); the first thread adds the two sums.
  BT_SHARED float sums[2];
  const float v = bt_to_float(x[global_idx.x]);
  const float total = bt_warp_sum(v);
  const float top = bt_group_max<8>(v);
  if (lane_id == 0) {
    sums[warp_id] = total;
  }
  BT_BARRIER;
  if (lane_id % 8 == 0) {
    out[2 * global_idx.x / 8 + 1] = bt_from_float<T>(top);
  }
  if (thread_rank == 0) {
    out[2 * global_idx.x / 8] = bt_from_float<T>(sums[0] + sums[1]);
  }
""",
)

MMA = Kernel(
    "test_kernel_emulators_mma",
    ["a_fragments", "b_fragments"],
    ["out"],
    """
  uint32_t a[4], b[2];
  for (int i = 0; i < 4; ++i) a[i] = a_fragments[lane_id * 4 + i];
  for (int i = 0; i < 2; ++i) b[i] = b_fragments[lane_id * 2 + i];
  float c[4] = {1.0f, 1.0f, 1.0f, 1.0f};
  bt_mma_16x8x16(c, a, b, lane_id);
  for (int i = 0; i < 4; ++i) out[lane_id * 4 + i] = c[i];
""",
    mma=True,
)

TRANSPOSE = Kernel(
    "test_kernel_emulators_transpose",
    ["m"],
    ["out"],
    "out[lane_id] = bt_transpose_8x8(m[lane_id], lane_id);",
    mma=True,
)

DIVERGENT = Kernel(
    "test_kernel_emulators_divergent",
    ["x"],
    ["out"],
    """
  // Half a warp sums while the other half waits at the threadgroup's barrier: neither completes.
  float v = x[global_idx.x];
  if (lane_id < 16) {
    v = bt_warp_sum(v);
  }
  BT_BARRIER;
  out[global_idx.x] = v;
""",
)

DEEP = Kernel(
    "test_kernel_emulators_deep",
    ["x"],
    ["out"],
    """
  // 320 KB of locals: more than an emulated thread's stack (a GPU would spill them to local memory).
  volatile float big[81920];
  big[global_idx.x] = x[global_idx.x];
  out[global_idx.x] = big[global_idx.x];
""",
)


@EMULATORS
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_emulated_warp_reductions_and_shared_memory(emulated, dtype):
    x = mx.random.normal((128,), key=mx.random.key(0)).astype(dtype)
    with emulated():
        (out,) = REDUCE(inputs=[x], output_shapes=[(32,)], output_dtypes=[dtype], grid=(128, 1, 1),
                        threadgroup=(64, 1, 1), template=[("T", dtype)])
    x32 = x.astype(mx.float32)
    expected_sums = x32.reshape(2, 64).sum(axis=1)
    expected_tops = x32.reshape(16, 8).max(axis=1)
    tol = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}[dtype]
    assert mx.allclose(out.astype(mx.float32)[1::2], expected_tops, rtol=tol).item()
    assert mx.allclose(out.astype(mx.float32)[[0, 16]], expected_sums, rtol=tol, atol=tol).item()


@pytest.mark.parametrize("emulated", [pytest.param(emulated_metal, id="metal"), pytest.param(emulated_cuda, id="cuda")])
@NEEDS_COMPILER
def test_an_emulated_kernel_whose_threads_wait_at_barriers_no_thread_completes_fails_not_hangs(emulated):
    """A warp reduction in a branch half the warp skips: the emulator says so and exits."""
    with emulated(), pytest.raises(RuntimeError, match="wait at barriers no other thread will reach"):
        DIVERGENT(inputs=[mx.ones((32,))], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                  threadgroup=(32, 1, 1))



@pytest.mark.parametrize("emulated", [pytest.param(emulated_metal, id="metal"), pytest.param(emulated_cuda, id="cuda")])
@NEEDS_COMPILER
def test_an_emulated_thread_past_its_stack_faults_and_says_so(emulated):
    """Each emulated thread's stack has an inaccessible page below it: a thread whose locals
    outgrow it faults there (the build probes large frames page by page) rather than writing
    over another thread's stack."""
    with emulated(), pytest.raises(RuntimeError, match="past its 256 KB stack"):
        DEEP(inputs=[mx.ones((32,))], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
             threadgroup=(32, 1, 1))


def _skip_without_tensor_cores(emulated) -> None:
    """On a real GPU the tensor-core vocabulary needs CUDA compute capability 8.0 or Metal."""
    if emulated is contextlib.nullcontext and not MMA.available():
        pytest.skip(MMA.unavailable_reason())


def _half2(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    return lo.view(np.uint16).astype(np.uint32) | (hi.view(np.uint16).astype(np.uint32) << 16)


@EMULATORS
def test_emulated_tensor_core_vocabulary_is_the_documented_matrix_product(emulated):
    """``bt_mma_16x8x16`` (Metal's simd_shuffle emulation; the CUDA emulator's stand-in for
    ``mma.sync``) against D = A B + C, with the per-lane fragment layout the dialect documents."""
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((16, 16)).astype(np.float16), rng.standard_normal((16, 8)).astype(np.float16)
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    a_fragments = np.stack([_half2(a[g, 2 * q], a[g, 2 * q + 1]), _half2(a[g + 8, 2 * q], a[g + 8, 2 * q + 1]),
                            _half2(a[g, 2 * q + 8], a[g, 2 * q + 9]), _half2(a[g + 8, 2 * q + 8], a[g + 8, 2 * q + 9])], 1)
    b_fragments = np.stack([_half2(b[2 * q, g], b[2 * q + 1, g]), _half2(b[2 * q + 8, g], b[2 * q + 9, g])], 1)
    _skip_without_tensor_cores(emulated)
    with emulated():
        (out,) = MMA(inputs=[mx.array(a_fragments.reshape(-1)), mx.array(b_fragments.reshape(-1))],
                     output_shapes=[(128,)], output_dtypes=[mx.float32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    d = a.astype(np.float64) @ b.astype(np.float64) + 1.0
    expected = np.stack([d[g, 2 * q], d[g, 2 * q + 1], d[g + 8, 2 * q], d[g + 8, 2 * q + 1]], 1).reshape(-1)
    assert np.allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)


@EMULATORS
def test_emulated_transpose_is_the_documented_transpose(emulated):
    """``bt_transpose_8x8`` (two shuffles and a byte permute; on a CUDA GPU ``movmatrix``):
    lane (g, q) holds M[g][2q, 2q+1] and gets M[2q][g], M[2q+1][g]."""
    m = np.arange(64, dtype=np.float16).reshape(8, 8) - 20
    lanes = np.arange(32)
    g, q = lanes // 4, lanes % 4
    _skip_without_tensor_cores(emulated)
    with emulated():
        (out,) = TRANSPOSE(inputs=[mx.array(_half2(m[g, 2 * q], m[g, 2 * q + 1]))], output_shapes=[(32,)],
                           output_dtypes=[mx.uint32], grid=(32, 1, 1), threadgroup=(32, 1, 1))
    assert np.array_equal(np.array(out), _half2(m[2 * q, g], m[2 * q + 1, g]))


@EMULATORS
@pytest.mark.parametrize("n_splits, dims", [(1, 32), (9, 32), (14, 64), (70, 128)])
def test_emulated_split_k_merge_folds_its_parts_like_the_softmax_merge(emulated, n_splits, dims):
    """``split_k.merge_partials`` (one thread per dimension for each part: 1, 3, 4 and 8
    parts here; with 8, a thread folds its 9 splits in three loaded batches, the last one
    short) against the merge written out: every split's sums and accumulators
    rescaled to the largest max, splits that saw no key (max -inf) adding nothing."""
    rng = np.random.default_rng(n_splits)
    heads = 2
    maxes = rng.normal(size=(1, heads, n_splits)).astype(np.float32) * 4
    sums = rng.uniform(0.5, 3.0, size=(1, heads, n_splits)).astype(np.float32)
    acc = rng.normal(size=(1, heads, n_splits, dims)).astype(np.float32)
    for empty in {s for s in (1, n_splits - 1) if 0 < s < n_splits}:  # splits that saw no key
        maxes[:, :, empty], sums[:, :, empty], acc[:, :, empty] = -np.inf, 0.0, 0.0
    with emulated():
        out = split_k.merge_partials(mx.array(acc), mx.array(maxes), mx.array(sums), mx.float32)
    weights = np.where(np.isinf(maxes), 0.0, np.exp2(maxes - maxes.max(axis=-1, keepdims=True)))
    expected = (weights[..., None] * acc).sum(axis=2) / (weights * sums).sum(axis=-1)[..., None]
    parts = min(split_k.MERGE_THREADS // dims, -(-n_splits // split_k.SPLITS_PER_THREAD))
    assert split_k.merge_threads(n_splits, dims) == dims * parts
    assert np.allclose(np.array(out).reshape(1, heads, dims), expected, rtol=1e-5, atol=1e-6)


@NEEDS_COMPILER
def test_emulator_builds_are_keyed_by_their_headers_too(tmp_path, monkeypatch):
    """The program names its headers by path; a changed header must not reuse an old build."""
    monkeypatch.setattr(metal_emulator, "butter_cache_dir", lambda: tmp_path)
    header = tmp_path / "headers" / "probe.h"
    header.parent.mkdir()
    monkeypatch.setattr(metal_emulator, "HEADER", header)
    source = f'#include "{header}"\nint main() {{ return VALUE; }}\n'
    header.write_text("#define VALUE 3\n")
    first = metal_emulator.compiled(source)
    header.write_text("#define VALUE 4\n")
    second = metal_emulator.compiled(source)
    assert first != second
    assert subprocess.run([str(second)]).returncode == 4


def test_traces_run_eagerly_under_an_emulator_and_compile_again_after():
    """An emulated kernel evaluates its inputs, which a trace's placeholders cannot be: within an
    emulator (nested or not) a compiled function runs its Python each call; after the outermost
    block closes, it replays its trace again."""
    calls = []

    def body(x):
        calls.append(1)
        return x + 1

    f = mx.compile(body)
    f(mx.ones(2)), f(mx.ones(2))
    assert len(calls) == 1
    with emulated_cuda():
        with emulated_metal():
            f(mx.ones(2))
        f(mx.ones(2))
    assert len(calls) == 3
    assert mx.array_equal(f(mx.ones(2)), mx.full(2, 2.0)) and len(calls) == 3
