"""butter-aura's kernels against their references (GPU only), and the references themselves (everywhere)."""

from __future__ import annotations

import types

import attrs
import mlx.core as mx
import pytest

from butter_core import LayerSpec, Window, make_layer_caches
from butter_core.cache import reference_attention
from butter_core.compiled import traced
from butter_core.kernels import backend, executed_by, gpu_backend, recorded_builds, relative_error, standing_in_for_gpu
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available, emulated_metal
from butter_core.testing import on_the_cpu  # noqa: F401 - a fixture
from butter_core.testing.reference import random_chunk

from butter_aura import Aura, cpu, reference
from butter_aura.kernels import GPU_OPS, KERNEL_CHECKS, attention, attention_mma, checks, encode, ops_for, paged
from butter_aura.kernels.checks import make_paged_inputs

CASES = [pytest.param(check, case, id=f"{check.name}-{i}") for check in KERNEL_CHECKS for i, case in enumerate(check.cases)]


@pytest.mark.skipif(gpu_backend() is None, reason="no GPU backend (Metal or CUDA) in this MLX")
@pytest.mark.parametrize(("check", "case"), CASES)
def test_kernel_matches_reference(check, case):
    if gpu_backend() not in check.backends:
        pytest.skip(f"{check.name} is built for {sorted(check.backends)} only")
    result = check.check(seed=11, **case)
    assert result.passed, result


MMA_CHECK = next(c for c in KERNEL_CHECKS if c.name == "decode_attention_mma")


@pytest.mark.skipif(not compiler_available(), reason="the CUDA emulator needs g++ 12+ (_Float16)")
@pytest.mark.parametrize("index", [2, 5, 9, 14])  # one case of each bit pair, a few seconds each
def test_tensor_core_decode_matches_reference_under_the_cuda_emulator(index):
    """The tensor-core kernel is CUDA only; the emulator runs its CUDA build here, so a
    change to it is checked on every machine (every case: ``python -m
    butter_core.kernels.cuda_emulator aura decode_attention_mma``)."""
    with emulated_cuda():
        result = MMA_CHECK.check(seed=11, **MMA_CHECK.cases[index])
    assert result.passed, result


PAGED_CHECK = next(c for c in KERNEL_CHECKS if c.name == "paged_decode_attention")


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
@pytest.mark.parametrize("emulated", [emulated_metal, emulated_cuda], ids=["metal", "cuda"])
def test_paged_decode_matches_reference_under_the_emulators(emulated):
    """Each sequence's codes through its page table, its own ring and full-precision rows (every case:
    ``python -m butter_core.kernels.cuda_emulator aura paged_decode_attention``, likewise ``metal_emulator``)."""
    with emulated():
        result = PAGED_CHECK.check(seed=11, **PAGED_CHECK.cases[1])
    assert result.passed, result


DECODE_STEP_CHECK = next(c for c in KERNEL_CHECKS if c.name == "decode_step")


@pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
@pytest.mark.parametrize("emulated", [emulated_metal, emulated_cuda], ids=["metal", "cuda"])
@pytest.mark.parametrize("index", [0, 2, 5])  # float16 rows from float16 and float32 tokens; a window's ring
def test_a_decode_steps_merge_writes_its_token_as_the_row_write_it_replaces(emulated, index):
    """``decode_step_attention``'s merge kernel returns the full-precision rows with the token in its row,
    equal to the slice assignment it replaces, and attends as the reference does after that write
    (every case: ``python -m butter_core.kernels.cuda_emulator aura decode_step``, likewise
    ``metal_emulator``)."""
    case = DECODE_STEP_CHECK.cases[index]
    inputs = checks.make_decode_step_inputs(11, **case)
    with emulated():
        _, fp_keys, fp_values = attention.decode_step_attention(**inputs)
        result = DECODE_STEP_CHECK.check(seed=11, **case)
    expected_keys, expected_values = checks.written_rows(inputs["keys"], inputs["values"], inputs["row"], inputs["stored"])
    assert mx.array_equal(fp_keys, expected_keys).item() and mx.array_equal(fp_values, expected_values).item()
    assert result.passed, result


PAGED_MMA_CHECK = next(c for c in KERNEL_CHECKS if c.name == "paged_decode_attention_mma")


@pytest.mark.skipif(not compiler_available(), reason="the CUDA emulator needs g++ 12+ (_Float16)")
@pytest.mark.parametrize("index", [1, 4])  # one sequence of 5 keys at head_dim 64; 8/8 bits over forced splits
def test_paged_tensor_core_decode_matches_reference_under_the_cuda_emulator(index):
    """The tensor-core kernel over pages, each sequence's ring and full-precision rows its own (every
    case: ``python -m butter_core.kernels.cuda_emulator aura paged_decode_attention_mma``)."""
    with emulated_cuda():
        result = PAGED_MMA_CHECK.check(seed=11, **PAGED_MMA_CHECK.cases[index])
    assert result.passed, result


def test_batched_decode_takes_the_tensor_core_kernel_where_one_cache_does():
    """Without a method, paged decode takes the tensor-core partials on CUDA where they serve, the SIMT
    partials on Metal and for configurations they do not serve (float32 queries)."""
    for gpu, dtype, expected in (("cuda", mx.bfloat16, "butter_aura_paged_decode_mma_partials"),
                                 ("metal", mx.bfloat16, "butter_aura_paged_decode_partials"),
                                 ("cuda", mx.float32, "butter_aura_paged_decode_partials")):
        inputs = make_paged_inputs(0, dtype=dtype)
        with standing_in_for_gpu(), recorded_builds(gpu) as builds:
            paged.paged_decode_attention(**inputs)
        assert builds[0].kernel.name.startswith(expected), (gpu, dtype, builds[0].kernel.name)


@pytest.mark.parametrize(("check", "case"), CASES)
def test_check_cases_are_valid_reference_inputs(check, case):
    out = check.run_reference(check.inputs(0, **case))
    assert not mx.any(mx.isnan(out)).item()
    if check.name != "encode":
        assert out.dtype == case.get("dtype", mx.bfloat16)


@pytest.mark.usefixtures("on_the_cpu")  # float32 held to 1e-5: a GPU's float32 matmuls need not be exact
@pytest.mark.parametrize("case", [c for c in KERNEL_CHECKS if c.name == "decode_attention"][0].cases[:5])
def test_attention_reference_is_attention_over_dequantized_slots(case):
    """The two references agree: decode attention on the codes == attention over ``dequantize``."""
    inputs = checks.make_stored(4, **{**case, "dtype": mx.float32})
    keys, values = reference.dequantize(inputs["stored"], mx.float32)
    expected = reference_attention(inputs["queries"], keys, values, scale=inputs["scale"])
    assert relative_error(reference.decode_attention(**inputs), expected) < 1e-5


@pytest.mark.usefixtures("on_the_cpu")  # as above
def test_full_precision_rows_are_read_instead_of_codes():
    """With every live slot in the budget, decode attention is exact attention over the rows."""
    inputs = checks.make_stored(5, length=20, allocated=32, dtype=mx.float32, key_bits=2, value_bits=2, recent=32)
    # Slots 4..19 in ring rows 0..15 (make_stored leaves a stale and an empty entry).
    stored = attrs.evolve(inputs["stored"], recent_slots=mx.array(list(range(4, 20)) + [-1] * 16, dtype=mx.int32))
    inputs["stored"] = stored
    member, row = stored.full_precision_map()
    assert member.tolist() == [True] * 20
    expected = reference_attention(
        inputs["queries"], mx.take(stored.fp_keys, row, axis=2), mx.take(stored.fp_values, row, axis=2), scale=inputs["scale"]
    )
    assert relative_error(reference.decode_attention(**inputs), expected) < 1e-5


def test_caches_without_a_kernel_use_the_cpu_path():
    if gpu_backend() is None or mx.default_device().type != mx.gpu:
        assert ops_for(LayerSpec(n_kv_heads=2, head_dim=128, max_positions=16)) is cpu
    assert ops_for(LayerSpec(n_kv_heads=2, head_dim=96, max_positions=16)) is cpu


def test_kernel_wrappers_reject_what_they_do_not_serve():
    inputs = checks.make_stored(0, head_dim=64, length=10, allocated=16, group=4)
    with pytest.raises(ValueError, match="scale groups"):
        GPU_OPS.decode_attention(**inputs)
    with pytest.raises(ValueError, match="one query token"):
        attention.decode_attention(mx.zeros((1, 8, 2, 128)), checks.make_stored(0)["stored"], 0.1)
    odd = checks.make_encode_inputs(0, head_dim=96)
    with pytest.raises(ValueError, match="head_dim"):
        encode.encode(**odd)


@pytest.mark.parametrize(("key_bits", "value_bits"), attention_mma.BITS)
def test_tensor_core_kernel_serves_the_shipped_schemes(key_bits, value_bits):
    for head_dim in attention_mma.HEAD_DIMS:
        for dtype in (mx.float16, mx.bfloat16):
            inputs = checks.make_stored(0, head_dim=head_dim, dtype=dtype, key_bits=key_bits, value_bits=value_bits,
                                        length=10, allocated=16)
            assert attention_mma.serves(inputs["queries"], inputs["stored"])
        inputs = checks.make_stored(0, head_dim=head_dim, dtype=mx.float32, key_bits=key_bits, value_bits=value_bits,
                                    length=10, allocated=16)
        assert not attention_mma.serves(inputs["queries"], inputs["stored"])  # float32: the SIMT kernel
        inputs = checks.make_stored(0, head_dim=head_dim, key_bits=key_bits, value_bits=value_bits, group=32,
                                    length=10, allocated=16)
        assert not attention_mma.serves(inputs["queries"], inputs["stored"])  # per-group scales


def test_tensor_core_kernel_leaves_other_schemes_to_the_simt_kernel():
    inputs = checks.make_stored(0, key_bits=3, value_bits=2, length=10, allocated=16)
    assert not attention_mma.serves(inputs["queries"], inputs["stored"])
    with pytest.raises(ValueError, match="does not serve"):
        attention.decode_attention(**inputs, method="mma")


GPUS = {
    "H200": backend.TUNED_ON,
    "A100": backend.GpuShape(multiprocessors=108, shared_per_multiprocessor=164 * 1024,
                             registers_per_multiprocessor=65536),
    "RTX 4090": backend.GpuShape(multiprocessors=128, shared_per_multiprocessor=100 * 1024,
                                 registers_per_multiprocessor=65536),
}


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("length", [1, 100, 4096, 32768, 131072, 10**6])
@pytest.mark.parametrize("blocks_per_split", [1, 8, 16, 64])
def test_tensor_core_launch_is_at_most_one_wave(length, blocks_per_split, gpu):
    shape = GPUS[gpu]
    warps = attention_mma.WARPS
    shared = attention_mma.shared_bytes(warps, 4, 128, attention_mma.aligned_tables(warps, 4, 128, shape))
    resident = shape.multiprocessors * attention_mma.blocks_per_sm(shared, warps, shape)
    splits = attention_mma.num_splits(length, blocks_per_split, resident, attention_mma.MIN_KEYS_PER_SPLIT)
    assert splits >= 1
    assert splits == 1 or splits * blocks_per_split <= resident
    assert splits <= -(-length // attention_mma.MIN_KEYS_PER_SPLIT)


def test_tables_align_where_it_costs_no_threadgroup():
    """The tables start at a 64 KB boundary (each look-up's address one byte permute) where
    the room for it keeps as many threadgroups per multiprocessor: twelve warps on an H200
    or an A100; not an RTX 4090 (100 KB of shared memory), nor four warps (three per H200
    multiprocessor with 64 KB of tables, one with 128 KB)."""
    aligned = {(gpu, warps): attention_mma.aligned_tables(warps, 4, 128, shape)
               for gpu, shape in GPUS.items() for warps in (attention_mma.WARPS, 4)}
    assert aligned == {("H200", 12): True, ("A100", 12): True, ("RTX 4090", 12): False,
                       ("H200", 4): False, ("A100", 4): False, ("RTX 4090", 4): False}


@pytest.mark.parametrize("gpu", GPUS)
def test_tensor_core_launch_follows_the_device(monkeypatch, gpu):
    """The partials launch of a 128k decode fills one wave of the device's own shape: one
    twelve-warp threadgroup per multiprocessor (registers: 168 x 384 threads), 132 on an
    H200, 108 on an A100, 128 on an RTX 4090; with four warps, three per multiprocessor on
    an H200 (registers), two on an A100 and one on an RTX 4090 (the 64 KB of tables in their
    164 and 100 KB of shared memory). The shape stands in for a device; the launches are
    recorded, not run."""
    shape = GPUS[gpu]
    monkeypatch.setattr(attention_mma, "gpu_shape", lambda: shape)
    monkeypatch.setattr(backend, "cuda_compute_capability", lambda: (9, 0))
    inputs = checks.make_stored(0, q_heads=32, kv_heads=8, head_dim=128, allocated=131072, length=131072,
                                dtype=mx.bfloat16, encoded=False)
    grids = []

    def record(launch):
        grids.append((launch.build.kernel.name, launch.grid, launch.threadgroup))
        return [mx.zeros(s, d) for s, d in zip(launch.output_shapes, launch.build.output_dtypes)]

    for warps, per_sm in ((attention_mma.WARPS, {"H200": 1, "A100": 1, "RTX 4090": 1}),
                          (4, {"H200": 3, "A100": 2, "RTX 4090": 1})):
        grids.clear()
        with executed_by("cuda", record):
            attention.decode_attention(**inputs, method="mma", warps=warps)
        name, grid, threadgroup = grids[0]
        assert name.startswith("butter_aura_decode_mma_partials")
        assert threadgroup[0] == 32 * warps
        threadgroups = grid[0] // threadgroup[0] * grid[1]
        resident = shape.multiprocessors * per_sm[gpu]
        assert resident - 8 < threadgroups <= resident


@pytest.mark.skipif(gpu_backend() != "cuda", reason="the traced decode runs on CUDA only")
@pytest.mark.parametrize(("key_bits", "value_bits", "dtype"),
                         [(4, 2, mx.bfloat16), (8, 8, mx.float16), (4, 4, mx.float32)])
def test_traced_decode_serves_every_step_from_one_trace(key_bits, value_bits, dtype):
    """``traced_decode_attention`` (what a CUDA cache calls) against the reference at live
    lengths up to every allocated slot of one buffer shape, the ring and sinks moving with
    them, all from one trace (the reference on the CPU stream: a GPU's float32 matmuls need
    not be exact to 2e-5)."""
    attention._traced.cache_clear()
    for seed, length in enumerate((6, 40, 200, 256)):
        inputs = checks.make_stored(seed, allocated=256, length=length, key_bits=key_bits, value_bits=value_bits,
                                    dtype=dtype)
        out = attention.traced_decode_attention(inputs["queries"], inputs["stored"], inputs["scale"])
        with mx.stream(mx.cpu):
            expected = reference.decode_attention(inputs["queries"], inputs["stored"], inputs["scale"])
        assert relative_error(out, expected) <= checks.ATTENTION_RTOL[dtype], length
    stored = inputs["stored"]
    traced = attention._traced(stored.key_codec.fields, stored.value_codec.fields, stored.budget)
    assert len(traced.traces) == 1


@pytest.mark.parametrize(("capability", "partials"), [((7, 5), "butter_aura_decode_partials"),
                                                      ((9, 0), "butter_aura_decode_mma_partials_131072")])
def test_decode_takes_the_simt_kernel_on_gpus_without_tensor_cores(monkeypatch, capability, partials):
    """On a CUDA device below compute capability 8.0 (T4, RTX 20xx: MLX's CUDA wheels run
    there) the tensor-core kernel cannot compile, so decode goes to the SIMT kernel. The
    capability stands in for a device; the builds are recorded, not run."""
    monkeypatch.setattr(backend, "cuda_compute_capability", lambda: capability)
    inputs = checks.make_stored(0, length=10, allocated=16)
    with recorded_builds("cuda") as builds:
        attention.decode_attention(**inputs)
    assert [build.kernel.name for build in builds] == [partials, "butter_aura_decode_merge"]


@pytest.mark.skipif(not compiler_available(), reason="the CUDA emulator needs g++ 12+ (_Float16)")
@pytest.mark.parametrize(("dtype", "window", "steps"), [(mx.bfloat16, Window(max_size=16, keep=4), 16),
                                                       (mx.float32, None, 34)],
                         ids=["tensor-cores-window", "simt-ring-wrap"])  # fmt: skip
def test_a_decode_step_writes_its_ring_row_and_attends_in_one_call_as_the_calls_it_replaces(dtype, window, steps):
    """On CUDA a deferred token's ring-row write and the decode attention are one traced call
    (``attention.DecodeStep``), and so is the write of the deferred tokens' codes
    (``encode.traced_encode_into``). Under the emulator their outputs and state equal those of
    the writes and calls they replace: past a window's 16 slots (a ring of 12 rows after 4
    sinks: each token overwrites its slot and row), and, without a window, past the 32-row
    ring's wrap (the 33rd decode token's row holds a deferred token, whose codes are then
    written)."""
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=512, dtype=dtype)
    scale = spec.head_dim**-0.5

    with standing_in_for_gpu(), emulated_cuda():
        attention.step_function.cache_clear()
        encode._traced_encode_into.cache_clear()
        fused, plain = (make_layer_caches(Aura(4, 2), [spec], window)[0] for _ in range(2))
        inner = [getattr(c, "inner", c) for c in (fused, plain)]
        assert inner[0].ops is GPU_OPS
        inner[1].ops = types.SimpleNamespace(**{**vars(GPU_OPS), "decode_step": None, "encode_into": None})
        assert inner[0].budget.recent == (12 if window else 32)
        queries, keys, values = random_chunk(spec, 10, 4, mx.random.key(0))
        for cache in (fused, plain):
            cache.update_and_attend(queries, keys, values, scale=scale)
        for step in range(steps):
            queries, keys, values = random_chunk(spec, 1, 4, mx.random.key(10 + step))
            out_fused, out_plain = (c.update_and_attend(queries, keys, values, scale=scale) for c in (fused, plain))
            assert out_fused.dtype == dtype
            assert mx.array_equal(out_fused, out_plain).item(), step
        function = attention.step_function(inner[0].key_codec.fields, inner[0].value_codec.fields, inner[0].budget,
                                           scale)  # fmt: skip
        assert traced(function).traces  # the fused cache's steps took the traced write
        flushed = encode._traced_encode_into(inner[0].key_codec.fields, inner[0].value_codec.fields,
                                             tuple(inner[0].slots.read(stacked=True)))  # fmt: skip
        # and without a window the traced write of deferred codes (under one, each token's slot and
        # row are the evicted token's, whose codes are never written)
        assert bool(flushed.made) == (window is None)
        for name, array in inner[0].state().items():
            assert mx.array_equal(array, inner[1].state()[name]).item(), name
