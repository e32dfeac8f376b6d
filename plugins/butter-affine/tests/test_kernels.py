"""butter-affine kernels against their references (GPU only), and the references themselves."""

from __future__ import annotations

import attrs
import mlx.core as mx
import numpy as np
import pytest

from butter_core.compiled import traced
from butter_core.cpu_attention import softmax_for
from butter_core.kernels import backend, gpu_backend, recorded_builds, relative_error, split_k
from butter_core.kernels.backend import standing_in_for_gpu
from butter_core.plugin_api import LayerSpec
from butter_core import Window, make_layer_caches
from butter_core.kernels.checks import DEFAULT_RTOL
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available, emulated_metal
from butter_core.kernels.dialect import compact
from butter_core.slots import unstack
from butter_core.testing import on_the_cpu  # noqa: F401 - a fixture
from butter_core.testing.reference import random_chunk

from butter_affine import codec
from butter_affine import ops
from butter_affine.cache import AffineCache
from butter_affine.kind import Affine
from butter_affine.kernels import KERNEL_CHECKS, decode, decode_mma, dequantize, quantize
from butter_affine.ops import float32_decode
from butter_affine.packing import BUFFERS, STACKS, PackedFormat, stack

CASES = [
    pytest.param(check, case, id=f"{check.name}-{i}")
    for check in KERNEL_CHECKS
    for i, case in enumerate(check.cases)
]


@pytest.mark.skipif(gpu_backend() is None, reason="no GPU backend (Metal or CUDA) in this MLX")
@pytest.mark.parametrize(("check", "case"), CASES)
def test_kernel_matches_reference(check, case):
    result = check.check(seed=11, **case)
    assert result.passed, result


@pytest.mark.parametrize(("check", "case"), CASES)
def test_check_cases_are_valid_reference_inputs(check, case):
    out = check.run_reference(check.inputs(0, **case))
    assert not mx.any(mx.isnan(out)).item()


def numpy_attention(queries, keys, values, scale) -> np.ndarray:
    """Single-query GQA attention in float64."""
    q, k, v = (np.asarray(x.astype(mx.float32), dtype=np.float64) for x in (queries, keys, values))
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scores = q @ k.transpose(0, 1, 3, 2) * scale
    weights = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return (weights / weights.sum(axis=-1, keepdims=True)) @ v


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize(("bits", "group_size"), [(4, 32), (6, 32), (8, 64)])
@pytest.mark.parametrize(("q_heads", "kv_heads", "length"), [(4, 4, 1), (8, 2, 37), (12, 2, 200)])
def test_decode_reference_matches_numpy(dtype, bits, group_size, q_heads, kv_heads, length):
    inputs = decode.make_inputs(3, bits=bits, group_size=group_size, q_heads=q_heads, kv_heads=kv_heads,
                                head_dim=64, allocated=256, length=length, dtype=dtype)
    out = decode.decode_attention_reference(**inputs)
    assert out.shape == inputs["queries"].shape and out.dtype == dtype
    live = {name: inputs[name][:, :, :length] for name in BUFFERS}
    keys = codec.dequantize(live["key_codes"], live["key_scales"], live["key_biases"], bits, mx.float32)
    values = codec.dequantize(live["value_codes"], live["value_scales"], live["value_biases"], bits, mx.float32)
    expected = mx.array(numpy_attention(inputs["queries"], keys, values, inputs["scale"]).astype(np.float32))
    assert relative_error(out, expected) <= DEFAULT_RTOL[dtype]


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize(("bits", "group_size", "allocated", "length"),
                         [(4, 32, 300, 257), (6, 32, 300, 257), (8, 64, 300, 257), (4, 128, 300, 257),
                          (4, 32, 700, 600), (6, 32, 512, 512)])
def test_float32_decode_matches_reference(bits, group_size, allocated, length):
    """The CPU decode path (dequantized keys, ``mx.quantized_matmul`` values, over every
    allocated slot: the stale ones hold ±1e3 and weigh 0) against the reference, both on
    the CPU stream, with each of ``softmax_for``'s softmaxes: MLX's CUDA quantized_matmul
    has no float32 kernel for these shapes, and a GPU's float32 matmuls need not be exact
    to 1e-5 (on the H200 this test failed with the reference on the GPU)."""
    inputs = decode.make_inputs(5, bits=bits, group_size=group_size, q_heads=8, kv_heads=2, head_dim=128,
                                allocated=allocated, length=length, dtype=mx.float32)
    stacks = stack({name: inputs[name] for name in BUFFERS})
    out = float32_decode(inputs["queries"], stacks, inputs["length"], inputs["scale"], bits=bits,
                         group_size=group_size)
    expected = decode.decode_attention_reference(**inputs)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize(("group_size", "head_dim", "allocated", "length"),
                         [(64, 64, 300, 257), (128, 128, 300, 257), (64, 64, 700, 600), (64, 64, 512, 512)])
def test_one_group_decode_matches_reference(group_size, head_dim, allocated, length):
    """The CPU path for 8-bit codes with one group per row (codes cast, scales and biases
    applied to the products, over every allocated slot: the stale ones hold 1e3 and weigh
    0) against the reference, on the CPU stream, with each of ``softmax_for``'s softmaxes."""
    inputs = decode.make_inputs(6, bits=8, group_size=group_size, q_heads=9, kv_heads=3, head_dim=head_dim,
                                allocated=allocated, length=length, dtype=mx.float32)
    stacks = stack({name: inputs[name] for name in BUFFERS})
    out = ops.one_group_decode(inputs["queries"], stacks, inputs["length"], inputs["scale"])
    expected = decode.decode_attention_reference(**inputs)
    assert relative_error(out, expected) <= 1e-5


@pytest.mark.usefixtures("on_the_cpu")
def test_one_group_decode_replays_one_trace_while_the_buffers_keep_their_shape():
    """Decode steps, each one slot longer, replay one traced call (the length reaches it as
    an array, not as a shape), and each step still attends to its own live slots only."""
    inputs = decode.make_inputs(7, bits=8, group_size=64, q_heads=9, kv_heads=3, head_dim=64, allocated=700,
                                length=600, dtype=mx.float32)
    stacks = stack({name: inputs[name] for name in BUFFERS})
    factor, softmax = softmax_for(600)
    traced = ops._traced_step(inputs["scale"] * factor, softmax, ops._one_group_scores, 8, 64)
    traced.clear()  # shared with the other tests' calls
    for length in (600, 601, 650):
        out = ops.one_group_decode(inputs["queries"], stacks, length, inputs["scale"])
        expected = decode.decode_attention_reference(**{**inputs, "length": length})
        assert relative_error(out, expected) <= 1e-5
    assert len(traced.traces) == 1


@pytest.mark.parametrize(("bits", "group_size", "head_dim", "one_group"),
                         [(8, 64, 64, True), (8, 64, 128, False), (4, 64, 64, False)])
def test_cpu_ops_take_the_one_group_path_for_byte_codes_in_one_group(monkeypatch, bits, group_size, head_dim,
                                                                     one_group):
    monkeypatch.setattr(ops, "default_device_is_gpu", lambda: False)
    chosen = ops.select_ops(PackedFormat(bits, group_size, head_dim, mx.float32))
    assert (chosen.decode is ops.one_group_decode) is one_group
    assert ops.select_ops(PackedFormat(bits, group_size, head_dim, mx.bfloat16)).decode is None


def test_dequantize_reference_reads_only_the_live_slots():
    inputs = decode.make_inputs(1, allocated=64, length=10, dtype=mx.float32)
    keys, values = dequantize.dequantize_kv_reference(*(inputs[n] for n in BUFFERS), length=10, bits=4,
                                                      dtype=mx.float32)
    assert keys.shape == values.shape == (1, 2, 10, 128)
    assert mx.max(mx.abs(keys)).item() < 100  # slots past the live length hold 1e3


def test_quantize_reference_is_codec_quantize():
    keys, values = (mx.random.normal((1, 2, 3, 64), key=mx.random.key(i)) for i in range(2))
    stacked = quantize.quantize_kv_reference(keys, values, bits=6, group_size=32)
    assert list(stacked) == list(STACKS)
    rows = unstack(stacked, STACKS)
    assert sorted(rows) == sorted(BUFFERS)
    expected = dict(zip(BUFFERS, codec.quantize(keys, 6, 32) + codec.quantize(values, 6, 32)))
    assert all(mx.array_equal(rows[name], expected[name]).item() for name in BUFFERS)


@pytest.mark.parametrize(
    "bad",
    [{"length": 0}, {"length": 257},
     {"queries": mx.zeros((1, 3, 1, 128))},
     {"queries": mx.zeros((1, 8, 2, 128))}],
    ids=["empty", "past-the-end", "heads-not-a-multiple", "two-query-tokens"],
)
def test_decode_rejects_bad_arguments(bad):
    inputs = decode.make_inputs(0, allocated=256, length=10, dtype=mx.float32)
    with pytest.raises(ValueError):
        decode.decode_attention_reference(**{**inputs, **bad})


def test_kernel_bodies_are_one_source_for_both_backends():
    """Each kernel's body and helpers are the same text on Metal and CUDA, with no backend
    switch of their own; only the dialect's preamble and header differ."""
    for kernel in (quantize._QUANTIZE, dequantize._DEQUANTIZE, decode._PARTIALS, decode_mma._PARTIALS):
        metal, cuda = kernel.source("metal"), kernel.source("cuda")
        body, helpers = compact(kernel.body), compact(kernel.helpers)
        assert metal.endswith(body) and cuda.endswith(body)
        assert kernel.header("metal").endswith(helpers) and kernel.header("cuda").endswith(helpers)
        assert "#if" not in kernel.body + kernel.helpers


def test_decode_uses_the_shared_split_k_pieces():
    assert split_k.SPLIT_K_HELPERS in decode._PARTIALS.helpers
    launch = split_k.plan(batch=1, q_heads=32, kv_heads=8, dims=128, length=131072, warps=decode.WARPS,
                          max_heads=decode.MAX_HEADS, min_keys=decode.MIN_KEYS_PER_SPLIT,
                          target_blocks=decode.TARGET_BLOCKS)
    assert (launch.heads, launch.n_splits) == (4, 66)


def test_tensor_core_decode_uses_the_shared_pieces():
    from butter_core.kernels import mma

    helpers = decode_mma._PARTIALS.helpers
    assert decode_mma._PARTIALS.mma
    assert split_k.SPLIT_K_HELPERS in helpers and mma.MMA_SPLIT_K_HELPERS in helpers


def test_tensor_core_decode_launches_partials_then_the_merge(monkeypatch):
    from butter_core.kernels import Kernel

    calls = []

    def record(kernel, *, inputs, output_shapes, output_dtypes, init_value=None, **kwargs):
        """Stands in for Kernel.__call__: records the launch, returns zero outputs."""
        calls.append((kernel.name, tuple(map(tuple, output_shapes)), init_value))
        return [mx.zeros(shape, dtype) for shape, dtype in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(Kernel, "__call__", record)
    monkeypatch.setattr(Kernel, "unavailable_reason", lambda self: None)
    inputs = decode.make_inputs(0, q_heads=8, kv_heads=2, length=300, allocated=320)
    out = decode_mma.decode_attention(**inputs, splits=3)
    assert out.shape == (1, 8, 1, 128) and out.dtype == mx.bfloat16
    assert [name for name, _, _ in calls] == ["butter_affine_decode_mma_partials", "butter_split_k_merge"]
    assert calls[0][1] == ((1, 8, 3, 128), (1, 8, 3), (1, 8, 3)) and calls[0][2] is None


def test_tensor_core_checks_cover_every_supported_format():
    """A case per bits x head_dim x dtype the kernel takes, GQA groups of one and two
    column tiles, lengths off the 16-key blocks, splits without keys, and long splits."""
    check = next(c for c in KERNEL_CHECKS if c.name == "decode_attention_mma")
    defaults = {"bits": 4, "head_dim": 128, "dtype": mx.bfloat16, "q_heads": 8, "kv_heads": 2}
    cases = [{**defaults, **case} for case in check.cases]
    covered = {(c["bits"], c["head_dim"], c["dtype"]) for c in cases}
    assert covered == {(b, d, t) for b in decode_mma.SUPPORTED_BITS for d in decode_mma.SUPPORTED_HEAD_DIMS
                       for t in decode_mma.SUPPORTED_DTYPES if decode_mma.supports(PackedFormat(b, 32, d, t), t)}
    groups = {c["q_heads"] // c["kv_heads"] for c in cases}
    assert {1, 4, 7, 8, 12, 16, 40} <= groups
    assert any(c["length"] % 16 for c in cases)
    for c in cases:
        if "splits" in c:  # some forced split count must leave a split with no key
            chunk = -(-c["length"] // c["splits"])
            if chunk * (c["splits"] - 1) >= c["length"]:
                break
    else:
        raise AssertionError("no case has a split without keys")
    assert any(c.get("splits") == 1 and c["length"] > 16 * decode_mma.WARPS * 20 for c in cases)


@pytest.mark.parametrize(
    ("bits", "head_dim", "dtype", "expected"),
    [(4, 128, mx.bfloat16, True), (8, 64, mx.float16, True), (8, 256, mx.bfloat16, True),
     (6, 128, mx.bfloat16, True), (6, 256, mx.float16, True), (6, 64, mx.bfloat16, False),
     (4, 128, mx.float32, False), (4, 96, mx.float16, False)],
)
def test_tensor_core_decode_supports(bits, head_dim, dtype, expected):
    assert decode_mma.supports(PackedFormat(bits, 32, head_dim, dtype), dtype) is expected


@pytest.mark.parametrize(
    ("bits", "head_dim", "dtype", "capability", "tensor_cores"),
    [(4, 128, mx.bfloat16, (9, 0), True), (8, 128, mx.float16, (8, 0), True), (6, 128, mx.bfloat16, None, True),
     (6, 64, mx.bfloat16, (9, 0), False), (4, 128, mx.float32, (9, 0), False), (4, 128, mx.bfloat16, (7, 5), False)],
)
def test_cuda_ops_choose_the_tensor_core_kernel_where_it_applies(monkeypatch, bits, head_dim, dtype, capability,
                                                                  tensor_cores):
    """The tensor-core kernel where it takes the format and the device has the instructions
    (compute capability 8.0; MLX's CUDA wheels also run on 7.5), else the float32 fused
    kernel. ``recorded_builds`` answers "cuda" without a device; the capability and the
    default device stand in for one."""
    monkeypatch.setattr(ops, "default_device_is_gpu", lambda: True)
    monkeypatch.setattr(backend, "cuda_compute_capability", lambda: capability)
    with recorded_builds("cuda"):
        chosen = ops.select_ops(PackedFormat(bits, 32, head_dim, dtype))
    assert chosen.decode is ops.shared_kernel_decode(tensor_cores)


def test_kernel_decode_keeps_float32_queries_on_the_float32_kernel(monkeypatch):
    """Which kernel a traced decode calls, by query dtype (each kernel stood in for by a
    function that records its call; a fresh ``kernel_decode``, so no trace of these
    stand-ins outlives the test)."""
    calls = []

    def stand_in(name, arrays):
        def attend(queries, *buffers, live, scale):
            calls.append(name)
            assert len(buffers) == arrays  # the six buffers' views, or the two stacks read in place
            return queries * scale
        return attend

    monkeypatch.setattr(decode, "decode_attention_live", stand_in("fused", 6))
    monkeypatch.setattr(decode_mma, "decode_attention_stacks", stand_in("mma", 2))
    stacks = stack({name: mx.zeros((1, 1, 16, 1), mx.bfloat16) for name in BUFFERS})
    attend = ops.kernel_decode(tensor_cores=True)
    attend(mx.zeros((1, 1, 1, 128), mx.float32), stacks, 4, 0.1)
    attend(mx.zeros((1, 1, 1, 128), mx.bfloat16), stacks, 4, 0.1)
    assert calls == ["fused", "mma"]
    with pytest.raises(ValueError, match="length 17 outside 1..16"):
        attend(mx.zeros((1, 1, 1, 128), mx.bfloat16), stacks, 17, 0.1)


@pytest.mark.skipif(gpu_backend() != "cuda", reason="the CUDA ops' decode (needs MLX's CUDA backend)")
@pytest.mark.parametrize(("bits", "dtype", "tensor_cores"),
                         [(4, mx.bfloat16, True), (8, mx.float16, True), (4, mx.float32, True), (6, mx.bfloat16, False)])
def test_kernel_decode_serves_every_live_length_from_one_trace(bits, dtype, tensor_cores):
    """The traced decode against the reference at live lengths from 1 to every allocated
    slot of one buffer (the slots past each length hold other keys, which must not
    count), all from one trace; then from a grown buffer, a second. The reference runs
    on the CPU stream (a GPU's float32 matmuls need not be exact to 1e-5)."""

    def reference(length):
        with mx.stream(mx.cpu):
            return decode.decode_attention_reference(**{**inputs, "length": length})

    inputs = decode.make_inputs(7, bits=bits, group_size=32, q_heads=8, kv_heads=2, head_dim=128,
                                allocated=512, length=512, dtype=dtype)
    buffers = {name: inputs[name] for name in BUFFERS}
    attend = ops.kernel_decode(tensor_cores=tensor_cores)
    for length in (1, 17, 300, 512):
        out = attend(inputs["queries"], stack(buffers), length, inputs["scale"])
        assert relative_error(out, reference(length)) <= DEFAULT_RTOL[dtype], length
    assert len(attend.traces) == 1
    grown = {name: mx.concatenate([array, mx.zeros_like(array)], axis=2) for name, array in buffers.items()}
    out = attend(inputs["queries"], stack(grown), 300, inputs["scale"])
    assert relative_error(out, reference(300)) <= DEFAULT_RTOL[dtype]
    assert len(attend.traces) == 2


def test_tensor_core_decode_rejects_formats_it_does_not_take():
    inputs = decode.make_inputs(0, bits=6, head_dim=64, allocated=64, length=10)
    with pytest.raises(ValueError, match="tensor-core"):
        decode_mma.decode_attention(**inputs)


def test_cuda_appends_replay_one_trace_shared_by_every_layer(monkeypatch):
    """On CUDA every layer's cache appends through the same traced ``quantize_kv``, which
    builds its kernel call once per row shape (``recorded_builds`` answers "cuda" and
    records each build; a fresh trace, so none made with these stand-ins outlives the test)."""
    monkeypatch.setattr(ops, "default_device_is_gpu", lambda: True)
    fmt = PackedFormat(4, 32, 128, mx.bfloat16)
    with recorded_builds("cuda") as builds:
        assert ops.select_ops(fmt).quantize is ops.select_ops(fmt).quantize is ops.traced_quantize(4, 32)
        traced = ops.traced_quantize.__wrapped__(4, 32)
        rows = mx.ones((1, 2, 1, 128), mx.bfloat16)
        for _ in range(3):
            out = traced(rows, rows)
            mx.eval(out)
        assert len(builds) == 1 and builds[0].kernel is quantize._QUANTIZE
        traced(mx.ones((1, 2, 4, 128), mx.bfloat16), mx.ones((1, 2, 4, 128), mx.bfloat16))
        assert len(builds) == 2
    assert sorted(out) == sorted(STACKS) and out["codes"].shape == (2, 1, 2, 1, 16)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize(("bits", "group_size"), [(8, 64), (6, 32), (4, 32), (4, 64)])
def test_cpu_float32_append_is_the_reference_stacked(bits, group_size):
    """The CPU's float32 append (one ``mx.quantize`` over keys and values) gives the
    reference's stacks exactly: the same codes, scales and biases, in ``STACKS`` order."""
    keys, values = (mx.random.normal((1, 3, 5, 64), key=mx.random.key(seed)) * 2 for seed in (bits, group_size))
    ours = ops.select_ops(PackedFormat(bits, group_size, 64, mx.float32)).quantize(keys, values)
    reference = quantize.quantize_kv_reference(keys, values, bits=bits, group_size=group_size)
    assert sorted(ours) == sorted(STACKS)
    assert all(mx.array_equal(ours[name], reference[name]).item() for name in STACKS)


@pytest.mark.usefixtures("on_the_cpu")
@pytest.mark.parametrize(("bits", "group_size", "page_size"), [(4, 32, 8), (8, 64, 16)])
def test_paged_reference_is_each_sequence_alone(bits, group_size, page_size):
    """The paged reference attends each sequence over its own positions only, whatever the other
    pages hold: against the dense reference over that sequence's rows, gathered by hand."""
    lengths = (1, 40, 33)
    inputs = decode.make_paged_inputs(3, bits=bits, group_size=group_size, lengths=lengths, page_size=page_size,
                                      dtype=mx.float32)  # fmt: skip
    out = decode.paged_decode_attention_reference(**inputs)
    table = np.asarray(inputs["table"])
    for b, n in enumerate(lengths):
        slots = mx.array([int(table[b, p // page_size]) * page_size + p % page_size for p in range(n)])
        buffers = [inputs[name][:, :, slots] for name in BUFFERS]
        expected = decode.decode_attention_reference(inputs["queries"][b : b + 1], *buffers, length=n,
                                                     scale=inputs["scale"])  # fmt: skip
        assert relative_error(out[b : b + 1], expected) < 1e-6


PAGED_CHECK = next(c for c in KERNEL_CHECKS if c.name == "paged_decode_attention")


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
@pytest.mark.parametrize("emulated", [emulated_metal, emulated_cuda], ids=["metal", "cuda"])
def test_paged_decode_matches_reference_under_the_emulators(emulated):
    """The paged kernel's Metal and CUDA builds, run on the CPU (every case: ``python -m
    butter_core.kernels.cuda_emulator affine paged_decode_attention``, likewise ``metal_emulator``)."""
    with emulated():
        result = PAGED_CHECK.check(seed=11, **PAGED_CHECK.cases[1])
    assert result.passed, result


PAGED_MMA_CHECK = next(c for c in KERNEL_CHECKS if c.name == "paged_decode_attention_mma")


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
@pytest.mark.parametrize(("emulated", "case"), [(emulated_cuda, 1), (emulated_cuda, 4), (emulated_metal, 1)],
                         ids=["cuda-one-sequence", "cuda-pages-of-16-split", "metal-one-sequence"])
def test_paged_tensor_core_decode_matches_reference_under_the_emulators(emulated, case):
    """The paged tensor-core kernel's CUDA (PTX replaced by software) and Metal builds, run on the
    CPU: one sequence of 5 keys, and two sequences of 2000 and 1 keys in pages of 16 over forced
    splits (every case: ``python -m butter_core.kernels.cuda_emulator affine paged_decode_attention_mma``)."""
    with emulated():
        result = PAGED_MMA_CHECK.check(seed=12, **PAGED_MMA_CHECK.cases[case])
    assert result.passed, result


def test_batched_storage_decodes_on_tensor_cores_where_one_sequence_does():
    """``AffineCache.paged_decode`` takes the paged tensor-core kernel where a single cache takes the
    tensor-core kernel (CUDA, a format it serves), reading the storage's stacks whole, and the SIMT
    paged kernel elsewhere, through views of their members."""
    inputs = decode.make_paged_inputs(0)
    named = {name: inputs[name] for name in BUFFERS}
    buffers = named | stack(named)  # as batched storage hands them: by name and each stack whole
    cache = AffineCache(LayerSpec(2, 128, 64, mx.bfloat16), Affine(bits=4, group_size=32))
    for gpu, expected, codes_shape in (("cuda", "butter_affine_paged_decode_mma_partials", buffers["codes"].shape),
                                       ("metal", "butter_affine_paged_decode_partials", inputs["key_codes"].shape)):
        with standing_in_for_gpu(), recorded_builds(gpu) as builds:
            cache.paged_decode(inputs["queries"], buffers, inputs["table"], inputs["lengths"], inputs["page_size"],
                               inputs["length"], inputs["scale"])
        assert (builds[0].kernel.name, builds[0].input_shapes[1]) == (expected, codes_shape)


STACKED_MMA_CHECK = next(c for c in KERNEL_CHECKS if c.name == "stacked_decode_attention_mma")


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
def test_stacked_tensor_core_decode_matches_reference_under_the_cuda_emulator():
    """The tensor-core kernel reading a cache's stacks in place (a traced decode step's), two
    sequences of a batch so the member offsets span both (every case: ``python -m
    butter_core.kernels.cuda_emulator affine stacked_decode_attention_mma``)."""
    with emulated_cuda():
        result = STACKED_MMA_CHECK.check(seed=13, **STACKED_MMA_CHECK.cases[3])
    assert result.passed, result


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float32], ids=["tensor-cores", "simt"])
def test_a_decode_step_writes_and_attends_in_one_call_as_the_calls_it_replaces(dtype):
    """On CUDA a single cache's decode step is one traced call (``ops.kernel_decode_step``: the
    token quantized, written into the stacks by ``slot_update``, attended to). Under the
    emulator its outputs and buffers equal those of the four calls it replaces, through the
    buffers' growth past 256 slots and a window's overwrites (the ring wraps at 260)."""
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=512, dtype=dtype)
    scale = spec.head_dim**-0.5

    with standing_in_for_gpu(), emulated_cuda():
        fused, plain = (make_layer_caches(Affine(4), [spec], Window(max_size=260, keep=4))[0] for _ in range(2))
        assert fused.inner.ops.decode_step is not None
        plain.inner.ops = attrs.evolve(plain.inner.ops, decode_step=None)
        queries, keys, values = random_chunk(spec, 252, 4, mx.random.key(0))
        for cache in (fused, plain):
            cache.update_and_attend(queries, keys, values, scale=scale)
        for step in range(10):  # slot 256 grows the buffers, positions 260 and 261 overwrite slots 4 and 5
            queries, keys, values = random_chunk(spec, 1, 4, mx.random.key(10 + step))
            out_fused, out_plain = (c.update_and_attend(queries, keys, values, scale=scale) for c in (fused, plain))
            assert out_fused.dtype == dtype
            assert mx.array_equal(out_fused, out_plain).item(), step
        assert fused.inner.slots.allocated > 256
        assert traced(fused.inner.ops.decode_step).traces  # the steps took it
        stored_fused, stored_plain = (c.inner.slots.read(stacked=True) for c in (fused, plain))
        for name in STACKS:
            assert mx.array_equal(stored_fused[name], stored_plain[name]).item(), name
