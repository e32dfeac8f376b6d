"""``butter_core.recurrent_ops``: chunked scans against per-token ones, per-token ones against numpy
transcriptions of Hugging Face's PyTorch formulas (float64), and states carried across calls."""

from __future__ import annotations

import itertools
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter_core import recurrent_ops as ops
from butter_core.testing import on_the_cpu  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("on_the_cpu")

F32_TOLERANCE = 2e-5
"""Chunked against per-token forms, and two calls against one, in float32: the largest difference
over the largest magnitude of the expected result, at least 1 (seen over 300 random cases of
these tests' shapes: outputs 1e-6, states 2.2e-6)."""

BF16_RTOL = 2.0**-7
"""The same from bfloat16 inputs, outputs rounded to bfloat16: a float32 difference may round the
two one bfloat16 step apart, at most 2^-7 of the value (seen: 1.1e-3 of the largest magnitude;
float32 states as above)."""

NUMPY_TOLERANCE = 1e-5
"""MLX's float32 per-token forms against the float64 numpy transcriptions of HF's, as above
(seen: 6e-7)."""

PROPERTY = settings(max_examples=40, deadline=None)

tokens_st = st.integers(1, 70)
chunk_st = st.sampled_from([1, 3, 8, 16, 64])


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)).astype(np.float64)


def _assert_near(got: np.ndarray, want: np.ndarray, tolerance: float) -> None:
    """``got`` within ``tolerance`` of ``want``'s largest magnitude (at least 1) everywhere."""
    assert got.shape == want.shape
    scale = max(1.0, float(np.abs(want).max(initial=0.0)))
    np.testing.assert_allclose(got, want, rtol=0, atol=tolerance * scale)


def _assert_close(got: mx.array, want: mx.array) -> None:
    """Two forms' results from the same inputs: of one dtype; float32 within ``F32_TOLERANCE``,
    bfloat16 within a rounding step of each other besides."""
    assert got.shape == want.shape and got.dtype == want.dtype
    if want.dtype == mx.bfloat16:
        scale = max(1.0, float(np.abs(_np(want)).max(initial=0.0)))
        np.testing.assert_allclose(_np(got), _np(want), rtol=BF16_RTOL, atol=F32_TOLERANCE * scale)
    else:
        _assert_near(_np(got), _np(want), F32_TOLERANCE)


# ---------------------------------------------------------------- numpy transcriptions (float64)


def numpy_conv(x, weight, bias, state):
    """HF's ``causal_conv1d_update``: ``conv1d`` over ``cat(state, x)`` without padding, per channel
    (a cross-correlation, hence the reversed kernel for ``np.convolve``)."""
    window = np.concatenate([state, x], axis=1)
    batch, _, channels = x.shape
    out = np.empty(x.shape)
    for b in range(batch):
        for c in range(channels):
            out[b, :, c] = np.convolve(window[b, :, c], weight[c, ::-1], mode="valid")
    return out + (0.0 if bias is None else bias), window[:, x.shape[1] :]


def numpy_softplus(x):
    """torch's ``softplus``: ``x`` above 20, else ``log1p(exp(x))``."""
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


def numpy_ssd(x, dt, A, B, C, D, state):
    """HF's ``mamba2_selective_state_update`` token after token."""
    repeat = x.shape[2] // B.shape[2]
    B, C = np.repeat(B, repeat, axis=2), np.repeat(C, repeat, axis=2)
    ys = []
    for t in range(x.shape[1]):
        dA = np.exp(dt[:, t] * A)
        dB = dt[:, t, :, None] * B[:, t]
        dBx = dB[:, :, None, :] * x[:, t, :, :, None]
        state = state * dA[:, :, None, None] + dBx
        ys.append(np.einsum("bhpn,bhn->bhp", state, C[:, t]) + x[:, t] * D[:, None])
    return np.stack(ys, axis=1), state


def numpy_gated_delta(q, k, v, g, beta, state, normalize):
    """HF's ``torch_recurrent_gated_delta_rule``."""
    if normalize:
        q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6)
        k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    q = q / np.sqrt(q.shape[-1])
    outs = []
    for t in range(q.shape[1]):
        state = state * np.exp(g[:, t])[..., None, None]
        kv_mem = (state * k[:, t, :, :, None]).sum(-2)
        delta = (v[:, t] - kv_mem) * beta[:, t, :, None]
        state = state + k[:, t, :, :, None] * delta[:, :, None, :]
        outs.append((state * q[:, t, :, :, None]).sum(-2))
    return np.stack(outs, axis=1), state


def numpy_silu(x):
    return x / (1 + np.exp(-x))


def numpy_mamba2_norm(x, gate, weight, eps, group_size):
    """HF's ``Mamba2RMSNormGated``: gate, then normalise per group."""
    h = x * numpy_silu(gate)
    groups = h.reshape(*h.shape[:-1], -1, group_size)
    groups = groups / np.sqrt((groups**2).mean(-1, keepdims=True) + eps)
    return weight * groups.reshape(h.shape)


def numpy_qwen3_next_norm(x, gate, weight, eps):
    """HF's ``Qwen3NextRMSNormGated``: normalise, weigh, then gate."""
    return weight * x / np.sqrt((x**2).mean(-1, keepdims=True) + eps) * numpy_silu(gate)


# ---------------------------------------------------------------- inputs


def ssd_inputs(seed, batch, tokens, groups, heads_per_group, head_dim=4, size=8, with_state=True, dtype=mx.float32):
    """Mamba2 scan inputs as the mixer makes them, decays from mild to vanishing within a chunk."""
    rng = np.random.default_rng(seed)
    heads = groups * heads_per_group

    def normal(*shape):
        return mx.array(rng.normal(size=shape).astype(np.float32)).astype(dtype)

    dt_raw = mx.array(rng.normal(size=(batch, tokens, heads)).astype(np.float32) * 2)
    A = -mx.exp(mx.array(rng.uniform(-3, 2, size=heads).astype(np.float32)))
    state = normal(batch, heads, head_dim, size).astype(mx.float32) if with_state else None
    return {
        "x": normal(batch, tokens, heads, head_dim),
        "dt": ops.mamba2_dt(dt_raw, mx.array(rng.normal(size=heads).astype(np.float32))),
        "A": A,
        "B": normal(batch, tokens, groups, size),
        "C": normal(batch, tokens, groups, size),
        "D": normal(heads),
        "state": state,
    }


def delta_inputs(seed, batch, tokens, heads, normalize, key_dim=8, value_dim=4, with_state=True, dtype=mx.float32):
    """Gated delta rule inputs as Qwen3-Next makes them; unnormalised keys are kept short (|k| < 1)
    so that the rule stays stable."""
    rng = np.random.default_rng(seed)

    def normal(*shape, scale=1.0):
        return mx.array((rng.normal(size=shape) * scale).astype(np.float32)).astype(dtype)

    g, beta = ops.gated_delta_gates(
        normal(batch, tokens, heads),
        normal(batch, tokens, heads),
        mx.array(rng.uniform(-3, 2, size=heads).astype(np.float32)),
        mx.array(rng.normal(size=heads).astype(np.float32)),
    )
    state = normal(batch, heads, key_dim, value_dim).astype(mx.float32) if with_state else None
    return {
        "q": normal(batch, tokens, heads, key_dim),
        "k": normal(batch, tokens, heads, key_dim, scale=1.0 if normalize else 0.3 / math.sqrt(key_dim)),
        "v": normal(batch, tokens, heads, value_dim),
        "g": g,
        "beta": beta,
        "state": state,
    }


def in_two_calls(scan, inputs: dict, at: int, **options) -> tuple[mx.array, mx.array]:
    """``scan`` over tokens ``[0, at)``, then over ``[at, T)`` from the state the first call left."""
    per_token = {name: value for name, value in inputs.items() if name not in ("A", "D", "state")}
    fixed = {name: value for name, value in inputs.items() if name in ("A", "D")}
    first, state = scan(**{n: v[:, :at] for n, v in per_token.items()}, **fixed, state=inputs["state"], **options)
    second, state = scan(**{n: v[:, at:] for n, v in per_token.items()}, **fixed, state=state, **options)
    return mx.concatenate([first, second], axis=1), state


# ---------------------------------------------------------------- causal conv1d


@pytest.mark.parametrize("tokens", [1, 2, 3, 9])
@pytest.mark.parametrize("with_bias", [False, True])
def test_causal_conv1d_is_the_direct_convolution(tokens, with_bias):
    """Decode (1 token), fewer tokens than the state holds (2 < K - 1 = 3), and a prompt."""
    rng = np.random.default_rng(tokens)
    x, weight = rng.normal(size=(2, tokens, 5)), rng.normal(size=(5, 4))
    bias = rng.normal(size=5) if with_bias else None
    state = rng.normal(size=(2, 3, 5))
    y, new_state = ops.causal_conv1d(
        mx.array(x, dtype=mx.float32),
        mx.array(weight, dtype=mx.float32),
        None if bias is None else mx.array(bias, dtype=mx.float32),
        mx.array(state, dtype=mx.float32),
    )
    want_y, want_state = numpy_conv(x, weight, bias, state)
    np.testing.assert_allclose(_np(y), want_y, atol=1e-5)
    np.testing.assert_allclose(_np(new_state), want_state, atol=1e-6)


def test_causal_conv1d_starts_from_zeros_and_keeps_the_dtype():
    x = mx.random.normal((1, 6, 3), key=mx.random.key(0)).astype(mx.bfloat16)
    weight = mx.random.normal((3, 4), key=mx.random.key(1))
    y, state = ops.causal_conv1d(x, weight)
    want, _ = ops.causal_conv1d(x, weight, state=mx.zeros((1, 3, 3), dtype=mx.bfloat16))
    assert y.dtype == state.dtype == mx.bfloat16 and state.shape == (1, 3, 3)
    assert mx.array_equal(y, want).item() and mx.array_equal(state, x[:, 3:]).item()


@PROPERTY
@given(tokens=st.integers(1, 20), cuts=st.lists(st.integers(1, 19), max_size=4), kernel=st.integers(1, 5))
def test_causal_conv1d_in_pieces_equals_one_go(tokens, cuts, kernel):
    rng = np.random.default_rng(tokens * 7 + kernel)
    x = mx.array(rng.normal(size=(2, tokens, 3)).astype(np.float32))
    weight, bias = mx.array(rng.normal(size=(3, kernel)).astype(np.float32)), mx.array([0.5, -1.0, 2.0])
    whole, whole_state = ops.causal_conv1d(x, weight, bias)
    bounds = sorted({0, tokens, *(c for c in cuts if c < tokens)})
    state, pieces = None, []
    for start, stop in itertools.pairwise(bounds):
        y, state = ops.causal_conv1d(x[:, start:stop], weight, bias, state)
        pieces.append(y)
    assert mx.allclose(mx.concatenate(pieces, axis=1), whole, atol=1e-6).item()
    assert mx.array_equal(state, whole_state).item()


# ---------------------------------------------------------------- Mamba2


def test_mamba2_dt_is_softplus_of_the_biased_step_clipped():
    raw = mx.array([[[-30.0, -1.0, 0.0], [2.0, 25.0, 200.0]]])
    bias = mx.array([0.5, -0.5, 1.0])
    want = numpy_softplus(_np(raw) + _np(bias))
    np.testing.assert_allclose(_np(ops.mamba2_dt(raw, bias)), want, rtol=1e-5)
    np.testing.assert_allclose(_np(ops.mamba2_dt(raw, bias, (0.001, 100.0))), np.clip(want, 0.001, 100.0), rtol=1e-5)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), tokens=tokens_st, groups=st.integers(1, 2), per_group=st.integers(1, 3))
def test_ssd_recurrent_is_hf_selective_state_update(seed, tokens, groups, per_group):
    inputs = ssd_inputs(seed, 2, tokens, groups, per_group)
    y, state = ops.ssd_recurrent(**inputs)
    want_y, want_state = numpy_ssd(*(_np(inputs[n]) for n in ("x", "dt", "A", "B", "C", "D", "state")))
    assert state.dtype == mx.float32
    _assert_near(_np(y), want_y, NUMPY_TOLERANCE)
    _assert_near(_np(state), want_state, NUMPY_TOLERANCE)


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=tokens_st,
    chunk=chunk_st,
    groups=st.integers(1, 2),
    per_group=st.integers(1, 3),
    with_state=st.booleans(),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
)
def test_ssd_chunked_equals_recurrent(seed, tokens, chunk, groups, per_group, with_state, dtype):
    inputs = ssd_inputs(seed, 2, tokens, groups, per_group, with_state=with_state, dtype=dtype)
    y, state = ops.ssd_chunked(**inputs, chunk_size=chunk)
    want_y, want_state = ops.ssd_recurrent(**inputs)
    assert y.dtype == dtype and state.dtype == mx.float32
    _assert_close(y, want_y)
    _assert_close(state, want_state)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(2, 40), data=st.data(), chunk=chunk_st)
@pytest.mark.parametrize("scan", [ops.ssd_recurrent, ops.ssd_chunked])
def test_ssd_in_two_calls_equals_one(scan, seed, tokens, data, chunk):
    at = data.draw(st.integers(1, tokens - 1))
    inputs = ssd_inputs(seed, 1, tokens, 2, 2)
    options = {"chunk_size": chunk} if scan is ops.ssd_chunked else {}
    y, state = in_two_calls(scan, inputs, at, **options)
    want_y, want_state = scan(**inputs, **options)
    _assert_close(y, want_y)
    _assert_close(state, want_state)


def test_segsum_sums_between_positions():
    a = mx.array([1.0, 2.0, 4.0, 8.0])
    want = np.array([[0, -np.inf, -np.inf, -np.inf], [2, 0, -np.inf, -np.inf], [6, 4, 0, -np.inf], [14, 12, 8, 0]])
    np.testing.assert_array_equal(_np(ops.segsum(a)), want)


# ---------------------------------------------------------------- gated delta rule


def test_gated_delta_gates_are_qwen3_next_formulas():
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 5, 3)) * 10, rng.normal(size=(2, 5, 3))
    A_log, dt_bias = rng.normal(size=3), rng.normal(size=3)
    g, beta = ops.gated_delta_gates(*(mx.array(n, dtype=mx.float32) for n in (a, b, A_log, dt_bias)))
    np.testing.assert_allclose(_np(g), -np.exp(A_log) * numpy_softplus(a + dt_bias), rtol=1e-5)
    np.testing.assert_allclose(_np(beta), 1 / (1 + np.exp(-b)), rtol=1e-6)


@pytest.mark.parametrize("size", [1, 2, 3, 16, 37, 64])
def test_unit_lower_inverse_inverts(size):
    rng = np.random.default_rng(size)
    a = np.tril(rng.normal(size=(2, 3, size, size)) * 0.3, -1)
    got = ops.unit_lower_inverse(mx.array(a, dtype=mx.float32))
    want = np.linalg.inv(a + np.eye(size))
    np.testing.assert_allclose(_np(got), want, atol=1e-5 * np.abs(want).max())


def test_unit_lower_inverse_of_an_ill_conditioned_system():
    """All ones below the diagonal: a Neumann series of it cancels terms of ~1e17; the inverse
    itself is the identity minus the first subdiagonal."""
    got = ops.unit_lower_inverse(mx.tril(mx.ones((64, 64)), -1))
    np.testing.assert_allclose(_np(got), np.eye(64) - np.eye(64, k=-1), atol=1e-6)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), tokens=tokens_st, heads=st.integers(1, 3), normalize=st.booleans())
def test_gated_delta_recurrent_is_hf_recurrent_rule(seed, tokens, heads, normalize):
    inputs = delta_inputs(seed, 2, tokens, heads, normalize)
    out, state = ops.gated_delta_recurrent(**inputs, normalize_qk=normalize)
    want_out, want_state = numpy_gated_delta(
        *(_np(inputs[n]) for n in ("q", "k", "v", "g", "beta", "state")), normalize
    )
    assert state.dtype == mx.float32
    _assert_near(_np(out), want_out, NUMPY_TOLERANCE)
    _assert_near(_np(state), want_state, NUMPY_TOLERANCE)


@PROPERTY
@given(
    seed=st.integers(0, 2**32 - 1),
    tokens=tokens_st,
    chunk=chunk_st,
    heads=st.integers(1, 3),
    normalize=st.booleans(),
    with_state=st.booleans(),
    dtype=st.sampled_from([mx.float32, mx.bfloat16]),
)
def test_gated_delta_chunked_equals_recurrent(seed, tokens, chunk, heads, normalize, with_state, dtype):
    inputs = delta_inputs(seed, 2, tokens, heads, normalize, with_state=with_state, dtype=dtype)
    out, state = ops.gated_delta_chunked(**inputs, chunk_size=chunk, normalize_qk=normalize)
    want_out, want_state = ops.gated_delta_recurrent(**inputs, normalize_qk=normalize)
    assert out.dtype == dtype and state.dtype == mx.float32
    _assert_close(out, want_out)
    _assert_close(state, want_state)


@PROPERTY
@given(seed=st.integers(0, 2**32 - 1), tokens=st.integers(2, 40), data=st.data(), chunk=chunk_st)
@pytest.mark.parametrize("rule", [ops.gated_delta_recurrent, ops.gated_delta_chunked])
def test_gated_delta_in_two_calls_equals_one(rule, seed, tokens, data, chunk):
    at = data.draw(st.integers(1, tokens - 1))
    inputs = delta_inputs(seed, 1, tokens, 2, True)
    options = {"chunk_size": chunk} if rule is ops.gated_delta_chunked else {}
    out, state = in_two_calls(rule, inputs, at, normalize_qk=True, **options)
    want_out, want_state = rule(**inputs, normalize_qk=True, **options)
    _assert_close(out, want_out)
    _assert_close(state, want_state)


# ---------------------------------------------------------------- gated norms


@pytest.mark.parametrize("groups", [1, 4])
def test_gate_then_rms_norm_is_mamba2s(groups):
    rng = np.random.default_rng(groups)
    x, gate, weight = rng.normal(size=(2, 3, 16)), rng.normal(size=(2, 3, 16)), rng.normal(size=16)
    got = ops.gate_then_rms_norm(*(mx.array(n, dtype=mx.float32) for n in (x, gate, weight)), eps=1e-5, group_size=16 // groups)
    np.testing.assert_allclose(_np(got), numpy_mamba2_norm(x, gate, weight, 1e-5, 16 // groups), rtol=1e-5, atol=1e-6)


def test_rms_norm_then_gate_is_qwen3_nexts():
    rng = np.random.default_rng(0)
    x, gate, weight = rng.normal(size=(2, 3, 8)), rng.normal(size=(2, 3, 8)), rng.normal(size=8)
    got = ops.rms_norm_then_gate(*(mx.array(n, dtype=mx.float32) for n in (x, gate, weight)), eps=1e-6)
    np.testing.assert_allclose(_np(got), numpy_qwen3_next_norm(x, gate, weight, 1e-6), rtol=1e-5, atol=1e-6)


def test_the_two_gated_norms_differ_and_keep_the_dtype():
    x = mx.random.normal((2, 8), key=mx.random.key(0)).astype(mx.bfloat16)
    gate = mx.random.normal((2, 8), key=mx.random.key(1)).astype(mx.bfloat16)
    weight = mx.ones((8,), dtype=mx.bfloat16)
    mamba2, qwen3_next = ops.gate_then_rms_norm(x, gate, weight, eps=1e-6), ops.rms_norm_then_gate(x, gate, weight, eps=1e-6)
    assert mamba2.dtype == qwen3_next.dtype == mx.bfloat16
    assert not mx.allclose(mamba2, qwen3_next, atol=1e-2).item()
