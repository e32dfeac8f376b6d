"""butter-ssm's fused decode kernels: their Metal and CUDA builds run by the CPU emulators (any
machine with g++ 12+), every check case on the GPU (where there is one), and the references they
are checked against, against the rule written out in float64 (everywhere)."""

from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np
import pytest

from butter_core.kernels import cuda_emulator, executed_by, gpu_backend, relative_error
from butter_core.kernels.cuda_emulator import emulated_cuda
from butter_core.kernels.metal_emulator import compiler_available, emulated_metal
from butter_core.plugin_api import GATED_DELTA, MAMBA2, StateSpec
from butter_core.testing import on_the_cpu  # noqa: F401 - a fixture

from butter_ssm import SSM, SSMCache, kernels
from butter_ssm.kernels import KERNEL_CHECKS, gated_delta, mamba2, ops_for
from butter_ssm.kernels.checks import (
    GATED_DELTA_CASES,
    MAMBA2_CASES,
    OUT_RTOL,
    STATE_RTOL,
    make_gated_delta_inputs,
    make_mamba2_inputs,
)

CASES = [pytest.param(check, case, id=f"{check.name}-{i}") for check in KERNEL_CHECKS for i, case in enumerate(check.cases)]
NEEDS_COMPILER = pytest.mark.skipif(not compiler_available(), reason="the emulators need g++ 12+ (_Float16)")
STEPS = {"mamba2": (mamba2.mamba2_step, make_mamba2_inputs, MAMBA2_CASES),
         "gated_delta": (gated_delta.gated_delta_step, make_gated_delta_inputs, GATED_DELTA_CASES)}


@pytest.mark.skipif(gpu_backend() is None, reason="no GPU backend (Metal or CUDA) in this MLX")
@pytest.mark.parametrize(("check", "case"), CASES)
def test_kernel_matches_reference(check, case):
    result = check.check(seed=11, **case)
    assert result.passed, result


def _run_step(kind: str, index: int, emulated=contextlib.nullcontext, seed: int = 3):
    """The fused step of one check case (under ``emulated``) and the mixer's reference (on the
    CPU), each as ``(out, conv_state, state)``."""
    step, make_inputs, cases = STEPS[kind]
    inputs = make_inputs(seed, **cases[index])
    mixer, conv_state, state, *rest = inputs.values()
    with mx.stream(mx.cpu):
        expected = mixer.reference(conv_state, state, *rest)
        mx.eval(expected)
    with emulated():
        got = step(mixer, conv_state, state, *rest)
        mx.eval(got)
    return got, expected, state.dtype


# Each case builds its own program (g++: ~8 s for CUDA's, ~4.5 for Metal's, cached under
# butter_cache_dir()), so a few: together both kernels on both emulators, every activation and
# state dtype, conv bias or none, conv widths 3 and 4, dt_limit, lanes sharing a warp between
# rows, a part-live column block. The two CUDA programs serve test_cache_decodes_through_the_kernel
# too. Every case: python -m butter_core.kernels.cuda_emulator ssm (and metal_emulator).
EMULATED = [
    pytest.param(emulated_cuda, "mamba2", 0, id="cuda-mamba2-bf16-f32state"),
    pytest.param(emulated_cuda, "gated_delta", 1, id="cuda-gated_delta-f32-bias-k3"),
    pytest.param(emulated_metal, "mamba2", 2, id="metal-mamba2-f16-f16state-dtlimit"),
    pytest.param(emulated_metal, "mamba2", 3, id="metal-mamba2-bf16-bf16state-nobias"),
    pytest.param(emulated_metal, "gated_delta", 0, id="metal-gated_delta-bf16-f32state-nobias"),
]


@NEEDS_COMPILER
@pytest.mark.parametrize(("emulated", "kind", "index"), EMULATED)
def test_emulated_step_matches_reference(emulated, kind, index):
    """The kernel's Metal or CUDA build, run by the emulator, against the reference: output, new
    conv inputs (bit for bit) and new state. Measured: outputs and float32 states within 2e-7 of
    the reference, 16-bit states within 1e-5, conv inputs exact."""
    (out, conv, state), (ref_out, ref_conv, ref_state), state_dtype = _run_step(kind, index, emulated)
    assert out.dtype == ref_out.dtype and conv.dtype == ref_conv.dtype and state.dtype == state_dtype
    assert out.shape == ref_out.shape and conv.shape == ref_conv.shape and state.shape == ref_state.shape
    assert mx.array_equal(conv, ref_conv).item()
    assert relative_error(out, ref_out) <= OUT_RTOL[out.dtype] / 10
    assert relative_error(state, ref_state.astype(state_dtype)) <= STATE_RTOL[state_dtype] / 10


def _spec(layer_type: str, batch: int = 1, dtype=mx.bfloat16) -> StateSpec:
    """The layers of cases 0 of ``MAMBA2_CASES`` and 1 of ``GATED_DELTA_CASES`` (their emulator
    programs are already built above)."""
    if layer_type == MAMBA2:
        return StateSpec(MAMBA2, conv_dim=4 * 8 + 2 * 2 * 8, conv_kernel=4, state_shape=(4, 8, 8), dtype=dtype,
                         batch_size=batch)
    return StateSpec(GATED_DELTA, conv_dim=2 * 24 + 3 * 40, conv_kernel=3, state_shape=(3, 24, 40), dtype=dtype,
                     batch_size=batch)


@NEEDS_COMPILER
@pytest.mark.parametrize(("layer_type", "index", "batch", "dtype"),
                         [(MAMBA2, 0, 1, mx.bfloat16), (GATED_DELTA, 1, 3, mx.float32)])
def test_cache_decodes_through_the_kernel(monkeypatch, layer_type, index, batch, dtype):
    """A cache made where the default device is a GPU (stood in for: the CUDA emulator) prefills
    through the mixer's reference and decodes each token in one kernel launch, the state fed
    from one to the next; outputs and state follow a cache on the reference throughout."""
    monkeypatch.setattr(kernels, "default_device_is_gpu", lambda: True)
    kind = "mamba2" if layer_type == MAMBA2 else "gated_delta"
    _, make_inputs, cases = STEPS[kind]
    mixer = make_inputs(0, **cases[index])["mixer"]
    spec = _spec(layer_type, batch, dtype)
    launches = []

    def run(launch):
        launches.append(launch.build.kernel.name)
        return cuda_emulator.run(launch)

    with executed_by("cuda", run):
        fused = SSMCache(spec, SSM(), ops=ops_for(spec))
    plain = SSMCache(spec, SSM(), ops=None)
    assert fused.ops is not None
    rng = np.random.default_rng(1)
    for tokens in (5, 1, 1, 1):
        inputs = [mx.array(rng.standard_normal((batch, tokens, spec.conv_dim), dtype=np.float32)).astype(dtype)]
        inputs += [mx.array(rng.standard_normal((batch, tokens, spec.state_shape[0]), dtype=np.float32)).astype(dtype)
                   for _ in range(1 if layer_type == MAMBA2 else 2)]
        with executed_by("cuda", run):
            out = fused.update_and_mix(mixer, *inputs)
        expected = plain.update_and_mix(mixer, *inputs)
        assert relative_error(out, expected) <= OUT_RTOL[dtype] / 10
    assert launches == [f"butter_ssm_{kind}_step"] * 3
    assert relative_error(fused.state()["state"], plain.state()["state"]) <= 1e-5
    assert mx.array_equal(fused.state()["conv"], plain.state()["conv"]).item()
    assert fused.absolute_position == 8


def test_caches_take_the_reference_without_a_gpu(monkeypatch):
    spec = _spec(MAMBA2)
    if mx.default_device().type != mx.gpu:
        assert ops_for(spec) is None
    monkeypatch.setattr(kernels, "default_device_is_gpu", lambda: True)
    with executed_by("cuda", cuda_emulator.run):
        assert ops_for(StateSpec("attention-like", conv_dim=8, conv_kernel=4, state_shape=(2, 4, 4))) is None
        assert ops_for(StateSpec(MAMBA2, conv_dim=48, conv_kernel=1, state_shape=(4, 8, 8))) is None  # no kept inputs
        assert ops_for(StateSpec(MAMBA2, conv_dim=49, conv_kernel=4, state_shape=(4, 8, 8))) is None  # no whole groups
        assert ops_for(StateSpec(GATED_DELTA, conv_dim=2 * 3 * 16 + 4 * 8, conv_kernel=4,
                                 state_shape=(4, 16, 8))) is None  # 3 key heads for 4 value heads
        assert ops_for(spec) is not None and ops_for(_spec(GATED_DELTA)) is not None


def test_launches_fit_every_shape_they_serve():
    """Mamba2: 32 lanes per row of 128, 8 warps of 8 rows for P 64; gated delta: 4 row blocks of
    32 rows for Dk 128, 8 columns and 16 row blocks for Dv 8."""
    assert mamba2.plan(64, 128) == (32, 8, 8, 4)
    assert mamba2.plan(8, 8) == (8, 1, 2, 1)
    assert mamba2.plan(12, 20) == (32, 2, 6, 1)
    assert gated_delta.columns(128) == 32 and gated_delta.columns(8) == 8 and gated_delta.columns(40) == 32
    for head_dim in (16, 32, 64, 80, 128):
        for state_size in (16, 64, 128, 256):
            lanes, warps, steps, ch = mamba2.plan(head_dim, state_size)
            assert warps * (32 // lanes) * steps >= head_dim and lanes * ch >= state_size


@pytest.mark.parametrize(("check", "case"), CASES)
def test_check_cases_are_valid_reference_inputs(check, case):
    out = check.run_reference(check.inputs(0, **case))
    assert not mx.any(mx.isnan(out)).item()
    assert out.dtype == (case.get("state_dtype", mx.float32) if check.name.endswith("_state")
                         else case.get("dtype", mx.bfloat16))


def _softplus(x):
    return np.logaddexp(x, 0.0)


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _conv_silu(window: np.ndarray, weight: np.ndarray, bias) -> np.ndarray:
    """``window`` ``[B, K, C]`` (kept inputs, then the token): the convolution's output and SiLU."""
    conv = np.einsum("bkc,ck->bc", window, weight) + (0.0 if bias is None else bias)
    return conv * _sigmoid(conv)


def _f64(a) -> np.ndarray:
    return np.array(a.astype(mx.float32), dtype=np.float64)


def mamba2_step_f64(mixer, conv_state, state, xbc, dt):
    """One Mamba2 token in float64, row by row as the kernel runs it."""
    window = np.concatenate([_f64(conv_state), _f64(xbc)], axis=1)
    act = _conv_silu(window, _f64(mixer.conv_weight), None if mixer.conv_bias is None else _f64(mixer.conv_bias))
    heads, head_dim, groups, size = mixer.heads, mixer.head_dim, mixer.groups, mixer.state_size
    x = act[:, : heads * head_dim].reshape(-1, heads, head_dim)
    b = act[:, heads * head_dim : heads * head_dim + groups * size].reshape(-1, groups, size)
    c = act[:, heads * head_dim + groups * size :].reshape(-1, groups, size)
    steps = np.clip(_softplus(_f64(dt)[:, 0] + _f64(mixer.dt_bias)), *mixer.dt_limit)  # [B, H]
    s = _f64(state).copy()
    y = np.zeros_like(x)
    for h in range(heads):
        g = h // (heads // groups)
        decay = np.exp(steps[:, h] * _f64(mixer.A)[h])
        s[:, h] = s[:, h] * decay[:, None, None] + (steps[:, h, None] * b[:, g])[:, None, :] * x[:, h, :, None]
        y[:, h] = np.einsum("bpn,bn->bp", s[:, h], c[:, g]) + _f64(mixer.D)[h] * x[:, h]
    return y[:, None], window[:, 1:], s


def gated_delta_step_f64(mixer, conv_state, state, qkv, a, b):
    """One gated delta token in float64, column by column as the kernel runs it."""
    window = np.concatenate([_f64(conv_state), _f64(qkv)], axis=1)
    act = _conv_silu(window, _f64(mixer.conv_weight), None if mixer.conv_bias is None else _f64(mixer.conv_bias))
    hk, hv, dk, dv = mixer.key_heads, mixer.value_heads, mixer.key_dim, mixer.value_dim
    q = act[:, : hk * dk].reshape(-1, hk, dk)
    k = act[:, hk * dk : 2 * hk * dk].reshape(-1, hk, dk)
    v = act[:, 2 * hk * dk :].reshape(-1, hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    g = -np.exp(_f64(mixer.A_log)) * _softplus(_f64(a)[:, 0] + _f64(mixer.dt_bias))  # [B, Hv]
    beta = _sigmoid(_f64(b)[:, 0])
    s = _f64(state).copy()
    out = np.zeros((s.shape[0], hv, dv))
    for h in range(hv):
        kh = h // (hv // hk)
        s[:, h] *= np.exp(g[:, h])[:, None, None]
        for j in range(dv):
            delta = (v[:, h, j] - np.einsum("bi,bi->b", k[:, kh], s[:, h, :, j])) * beta[:, h]
            s[:, h, :, j] += k[:, kh] * delta[:, None]
            out[:, h, j] = np.einsum("bi,bi->b", q[:, kh], s[:, h, :, j])
    return out[:, None], window[:, 1:], s


@pytest.mark.usefixtures("on_the_cpu")  # float32 held to 1e-5: a GPU's float32 matmuls need not be exact
@pytest.mark.parametrize(("kind", "case"), [
    ("mamba2", {"dtype": mx.float32}),
    ("mamba2", {"dtype": mx.float32, "batch": 2, "heads": 8, "groups": 2, "head_dim": 16, "state_size": 32,
                "bias": False, "dt_limit": (0.01, 0.05)}),
    ("gated_delta", {"dtype": mx.float32}),
    ("gated_delta", {"dtype": mx.float32, "batch": 2, "key_heads": 2, "value_heads": 6, "key_dim": 32,
                     "value_dim": 16, "bias": True}),
])
def test_references_are_the_rule_written_out(kind, case):
    """The checks' references (the mixers' ``reference`` on one token, ``butter_core.recurrent_ops``)
    against each mixer's rule as the kernels compute it (row by row, column by column) in float64."""
    _, make_inputs, _ = STEPS[kind]
    inputs = make_inputs(5, **case)
    mixer, conv_state, state, *rest = inputs.values()
    expected = (mamba2_step_f64 if kind == "mamba2" else gated_delta_step_f64)(mixer, conv_state, state, *rest)
    got = mixer.reference(conv_state, state, *rest)
    for ours, theirs in zip(got, expected):
        assert ours.shape == theirs.shape
        assert np.linalg.norm(_f64(ours) - theirs) <= 1e-5 * np.linalg.norm(theirs)
