"""What the conformance suite cannot know about fp8: the codec's own promises."""

import mlx.core as mx
import pytest

from butter_core import ConfigError, LayerSpec, make_layer_caches

from butter_example_scheme import FP8, codec


def relative_error(out, ref):
    return (mx.linalg.norm((out - ref).flatten()) / mx.linalg.norm(ref.flatten())).item()


def test_zero_vectors_decode_to_zero():
    codes, scales = codec.encode(mx.zeros((1, 2, 3, 64)), mx.float16)
    assert mx.array_equal(codec.decode(codes, scales, mx.float32), mx.zeros((1, 2, 3, 64))).item()


def test_every_element_within_half_an_fp8_step():
    x = mx.random.normal((4, 256, 128), key=mx.random.key(0)) * 10.0 ** mx.random.uniform(-2, 2, (4, 256, 1))
    codes, scales = codec.encode(x, mx.float16)
    error = mx.abs(codec.decode(codes, scales, mx.float32) - x)
    # Normal E4M3 values are within 2^-4 of themselves; subnormals within 2^-10 of the scale.
    assert mx.all(error <= mx.maximum(mx.abs(x) * 2**-4, scales.astype(mx.float32) * 2**-10) * 1.0001).item()


@pytest.mark.parametrize("magnitude", [1e-2, 1.0, 300.0])
def test_float16_scales_cost_nothing_at_ordinary_magnitudes(magnitude):
    x = mx.random.normal((8, 512, 128), key=mx.random.key(1)) * magnitude
    half = relative_error(codec.decode(*codec.encode(x, mx.float16), mx.float32), x)
    full = relative_error(codec.decode(*codec.encode(x, mx.float32), mx.float32), x)
    assert half == pytest.approx(full, rel=0.01) and full < 0.03


def test_float32_scales_keep_tiny_vectors():
    x = mx.random.normal((8, 512, 128), key=mx.random.key(2)) * 1e-5
    assert relative_error(codec.decode(*codec.encode(x, mx.float32), mx.float32), x) < 0.03


def test_state_must_come_from_an_fp8_cache():
    (cache,) = make_layer_caches(FP8(), [LayerSpec(n_kv_heads=1, head_dim=64, max_positions=16)])
    with pytest.raises(ConfigError, match="exported by another kind of cache"):
        cache.restore({"keys": mx.zeros((1, 1, 2, 64)), "values": mx.zeros((1, 1, 2, 64))}, {"length": 2})
