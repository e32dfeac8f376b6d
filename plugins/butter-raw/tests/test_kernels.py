"""butter-raw kernels against their references, and the references against numpy."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from butter_core.kernels import gpu_backend, relative_error, split_k
from butter_core.kernels.checks import DEFAULT_RTOL
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available, emulated_metal
from butter_core.testing import on_the_cpu  # noqa: F401 - a fixture
from butter_raw import kernels
from butter_raw.kernels import (
    KERNEL_CHECKS,
    kv_cache_update_reference,
    make_attention_inputs,
    make_update_inputs,
    sdpa_decode_reference,
)

CASES = [
    pytest.param(check, case, id=f"{check.name}-{i}")
    for check in KERNEL_CHECKS
    for i, case in enumerate(check.cases)
]
DTYPES = [mx.float32, mx.float16, mx.bfloat16]


def _float64(x: mx.array) -> np.ndarray:
    return np.asarray(x.astype(mx.float32), dtype=np.float64)


def numpy_attention(queries, keys, values, length, scale) -> np.ndarray:
    """Single-query GQA attention over the live slice, in float64."""
    q, k, v = _float64(queries), _float64(keys)[:, :, :length], _float64(values)[:, :, :length]
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.skipif(gpu_backend() is None, reason="no GPU backend (Metal or CUDA) in this MLX")
@pytest.mark.parametrize(("check", "case"), CASES)
def test_kernel_matches_reference(check, case):
    result = check.check(seed=7, **case)
    assert result.passed, result


@pytest.mark.parametrize(("check", "case"), CASES)
def test_check_cases_are_valid_reference_inputs(check, case):
    out = check.run_reference(check.inputs(0, **case))
    assert out.dtype == case.get("dtype", mx.bfloat16)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (8, 2), (12, 2), (32, 8)])
@pytest.mark.parametrize(("length", "allocated"), [(1, 8), (37, 64), (200, 256), (256, 256)])
def test_attention_reference_matches_numpy(dtype, q_heads, kv_heads, length, allocated):
    """On the CPU stream, as ``KernelCheck`` runs references: a GPU's float32 matmuls need
    not be exact to 1e-5 (on the H200 the float32 cases failed at 3.5e-4)."""
    inputs = make_attention_inputs(3, q_heads=q_heads, kv_heads=kv_heads, head_dim=64,
                                   allocated=allocated, length=length, dtype=dtype)
    out = sdpa_decode_reference(**inputs)
    assert out.shape == inputs["queries"].shape and out.dtype == dtype
    expected = mx.array(numpy_attention(**inputs).astype(np.float32))
    assert relative_error(out, expected) <= DEFAULT_RTOL[dtype]


@pytest.mark.usefixtures("on_the_cpu")  # as above
def test_attention_reference_batches_independently():
    inputs = make_attention_inputs(5, batch=2, length=40, allocated=48, dtype=mx.float32)
    out = sdpa_decode_reference(**inputs)
    expected = mx.array(numpy_attention(**inputs).astype(np.float32))
    assert relative_error(out, expected) <= DEFAULT_RTOL[mx.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n_rows", "offset"), [(1, 0), (1, 63), (5, 30)])
def test_update_reference_matches_numpy(dtype, n_rows, offset):
    inputs = make_update_inputs(1, heads=3, allocated=64, n_rows=n_rows, offset=offset,
                                dtype=dtype)
    expected = _float64(inputs["cache"])
    expected[:, :, offset:offset + n_rows] = _float64(inputs["rows"])
    out = kv_cache_update_reference(**inputs)
    assert out.dtype == dtype
    np.testing.assert_array_equal(_float64(out), expected)


@pytest.mark.parametrize(
    "bad",
    [
        {"length": 0},
        {"length": 65},
        {"keys": mx.zeros((1, 3, 64, 128)), "values": mx.zeros((1, 3, 64, 128))},
    ],
    ids=["empty", "past-the-end", "heads-not-a-multiple"],
)
def test_attention_rejects_bad_arguments(bad):
    inputs = make_attention_inputs(0, allocated=64, length=10, dtype=mx.float32)
    with pytest.raises(ValueError):
        sdpa_decode_reference(**{**inputs, **bad})


def test_update_rejects_rows_past_the_end():
    inputs = make_update_inputs(0, allocated=8, n_rows=2, offset=6)
    inputs["offset"] = 7
    with pytest.raises(ValueError, match="overrun"):
        kv_cache_update_reference(**inputs)


def test_sdpa_decode_uses_the_shared_split_k_pieces():
    """The partials kernel takes its merges from butter_core's split_k (the merge kernel is
    split_k's too); no backend switch of its own."""
    assert kernels._SDPA_PARTIALS.helpers == split_k.SPLIT_K_HELPERS
    for name in ("splitk_block<HEADS>", "splitk_merge_lanes<", "splitk_write_partials<"):
        assert name in kernels._SDPA_PARTIALS.body
    assert "#if" not in kernels._SDPA_PARTIALS.body
    launch = split_k.plan(batch=1, q_heads=32, kv_heads=8, dims=128, length=131072,
                          warps=kernels._WARPS, max_heads=kernels._MAX_HEADS_PER_BLOCK,
                          min_keys=kernels._MIN_KEYS_PER_SPLIT,
                          target_blocks=kernels._TARGET_BLOCKS)
    # What sdpa_decode launched before the move: 4 query heads per block, 64 splits.
    assert (launch.heads, launch.n_splits) == (4, 64)
    assert launch.grid == (128 * 8, 64, 1) and launch.threadgroup == (128, 1, 1)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize("page_size", [8, 16])
def test_paged_reference_is_each_sequence_alone(page_size):
    """The paged reference attends each sequence over its own positions only, whatever the other
    pages hold: against float64 attention over that sequence's rows, gathered by hand."""
    lengths = (1, 40, 33)
    inputs = kernels.make_paged_inputs(3, lengths=lengths, page_size=page_size, dtype=mx.float32)
    out = np.asarray(kernels.paged_sdpa_decode_reference(**inputs))
    table = np.asarray(inputs["table"])
    for b, n in enumerate(lengths):
        slots = [int(table[b, p // page_size]) * page_size + p % page_size for p in range(n)]
        keys, values = inputs["keys"][:, :, slots], inputs["values"][:, :, slots]
        expected = numpy_attention(inputs["queries"][b : b + 1], keys, values, n, inputs["scale"])
        np.testing.assert_allclose(out[b : b + 1], expected, rtol=1e-5, atol=1e-6)


PAGED_CHECK = next(c for c in kernels.KERNEL_CHECKS if c.name == "paged_sdpa_decode")


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
@pytest.mark.parametrize("emulated", [emulated_metal, emulated_cuda], ids=["metal", "cuda"])
def test_paged_decode_matches_reference_under_the_emulators(emulated):
    """The paged kernel's Metal and CUDA builds, run on the CPU (every case: ``python -m
    butter_core.kernels.cuda_emulator raw paged_sdpa_decode``, likewise ``metal_emulator``)."""
    with emulated():
        result = PAGED_CHECK.check(seed=11, **PAGED_CHECK.cases[1])
    assert result.passed, result
