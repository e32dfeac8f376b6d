"""``butter_core.cpu_attention``: the CPU's float32 decode attention against the reference."""

from __future__ import annotations

import mlx.core as mx
import pytest

from butter_core import cpu_attention, reference_attention
from butter_core.cache import attend
from butter_core.testing import on_the_cpu  # noqa: F401 - fixture

pytestmark = pytest.mark.usefixtures("on_the_cpu")


@pytest.mark.parametrize("batch, q_heads, kv_heads, length, dims", [
    (1, 9, 3, 1, 64), (1, 9, 3, 1000, 64), (2, 8, 8, 37, 32), (1, 32, 8, 300, 128), (1, 4, 1, 5, 16),
])
def test_decode_attention_matches_the_reference(batch, q_heads, kv_heads, length, dims):
    mx.random.seed(length + dims)
    q = mx.random.normal((batch, q_heads, 1, dims))
    k = mx.random.normal((batch, kv_heads, length, dims))
    v = mx.random.normal((batch, kv_heads, length, dims))
    got = cpu_attention.decode_attention(q, k, v, scale=dims**-0.5)
    want = reference_attention(q, k, v, scale=dims**-0.5)
    assert got.shape == want.shape and got.dtype == mx.float32
    assert mx.allclose(got, want, atol=1e-6, rtol=1e-5).item()


def test_scores_far_below_the_largest_weigh_nothing_visible():
    """A sink-like key scoring hundreds above the rest (shifted scores far below
    ``LOWEST_EXPONENT``, where the clamp applies) still leaves the sink's value alone."""
    dims, length = 16, 64
    q = mx.ones((1, 2, 1, dims))
    k = mx.random.normal((1, 1, length, dims), key=mx.random.key(1)) * 0.1
    k[:, :, 0] = 60.0  # q·k0 = 960 · scale: 2^(-1000) and less for every other key
    v = mx.random.normal((1, 1, length, dims), key=mx.random.key(2))
    got = cpu_attention.decode_attention(q, k, v, scale=1.0)
    assert mx.allclose(got, mx.broadcast_to(v[:, :, :1], got.shape), atol=0, rtol=1e-6).item()
    assert mx.allclose(got, reference_attention(q, k, v, scale=1.0), atol=1e-6).item()


def test_softmax_log2_is_the_softmax_of_natural_scores():
    scores = mx.random.normal((3, 5, 700), key=mx.random.key(3)) * 20
    got = cpu_attention.softmax_log2(scores * cpu_attention.LOG2E)
    assert mx.allclose(got, mx.softmax(scores, axis=-1), atol=1e-7, rtol=1e-5).item()
    masked = cpu_attention.softmax_log2(mx.array([[0.0, -mx.inf, 1.0]]))
    assert masked[0, 1].item() <= 2.0**-126


def test_attend_takes_it_only_for_one_float32_token_without_mask():
    q, k = mx.zeros((1, 2, 1, 8)), mx.zeros((1, 1, 4, 8))
    assert cpu_attention.serves(q, k, k, None)
    assert not cpu_attention.serves(q, k, k, mx.ones((1, 1, 1, 4), dtype=mx.bool_))
    assert not cpu_attention.serves(mx.zeros((1, 2, 3, 8)), k, k, None)
    assert not cpu_attention.serves(q.astype(mx.float16), k.astype(mx.float16), k.astype(mx.float16), None)
    if mx.is_available(mx.gpu):
        with mx.stream(mx.gpu):
            assert not cpu_attention.serves(q, k, k, None)
    v = mx.random.normal((1, 1, 4, 8), key=mx.random.key(4))
    q = mx.random.normal((1, 2, 1, 8), key=mx.random.key(5))
    assert mx.allclose(attend(q, v, v, scale=0.3), reference_attention(q, v, v, scale=0.3), atol=1e-6).item()


def test_short_rows_take_mx_softmax_and_long_ones_base_2():
    assert cpu_attention.softmax_for(cpu_attention.POWER_MIN_KEYS - 1)[0] == 1.0
    factor, softmax = cpu_attention.softmax_for(cpu_attention.POWER_MIN_KEYS)
    assert (factor, softmax) == (cpu_attention.LOG2E, cpu_attention.softmax_log2)
    scores = mx.random.normal((2, 3, 40), key=mx.random.key(6)) * 5
    for length in (40, cpu_attention.POWER_MIN_KEYS):
        factor, softmax = cpu_attention.softmax_for(length)
        assert mx.allclose(softmax(scores * factor), mx.softmax(scores, axis=-1), atol=1e-7, rtol=1e-5).item()
