"""AffineCache beyond the conformance suite: window overwrites re-quantize, path selection, parsing."""

import attrs
import mlx.core as mx
import pytest

from butter_core import ConfigError, LayerSpec, Window, make_layer_caches, parse_kv_cache
from butter_core.slots import unstack

from butter_affine import Affine
from butter_affine import AffineCache, parse
from butter_affine.ops import select_ops
from butter_affine.packing import BUFFERS, STACKS, PackedFormat


def rows(spec, tokens, scale, seed):
    shape = (1, spec.n_kv_heads, tokens, spec.head_dim)
    k, v = (mx.random.normal(shape, key=mx.random.key(seed + i)) * scale for i in range(2))
    return k.astype(spec.dtype), v.astype(spec.dtype)


@pytest.mark.parametrize("name", ["affine8", "affine6", "affine4"])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("chunks", [[1] * 6, [6], [2, 4]], ids=["one-at-a-time", "one-chunk", "two-chunks"])
def test_overwritten_slots_hold_only_the_new_rows(name, dtype, chunks):
    """Fill a window with huge outlier rows, then let new small rows wrap onto them: every
    overwritten slot's codes, scales and biases are exactly those of the new row alone."""
    window = Window(max_size=8, keep=2)
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=64, dtype=dtype)
    (cache,) = make_layer_caches(parse_kv_cache(name), [spec], window)
    old_k, old_v = rows(spec, 8, 1000.0, seed=0)
    old_k = old_k.at[..., 5].add(1e5)  # an outlier that would leave a huge scale behind
    scale = spec.head_dim**-0.5
    queries = mx.zeros((1, 4, 8, spec.head_dim), dtype)
    cache.update_and_attend(queries, old_k, old_v, scale=scale)
    new_k, new_v = rows(spec, 6, 0.01, seed=5)
    start = 0
    for tokens in chunks:
        q = queries[:, :, :tokens]
        cache.update_and_attend(q, new_k[:, :, start:start + tokens], new_v[:, :, start:start + tokens], scale=scale)
        start += tokens
    # positions 8..13 went to ring slots 2..7, replacing positions 2..7
    expected = unstack(cache.inner.ops.quantize(new_k, new_v), STACKS)
    stored = cache.inner.slots.read()
    for name_ in BUFFERS:
        assert mx.array_equal(stored[name_][:, :, 2:8], expected[name_]).item(), name_
    keys, _ = cache.prepare_for_attention()
    assert mx.max(mx.abs(keys[:, :, 2:8])).item() < 1.0


def test_rewrite_after_trim_requantizes():
    spec = LayerSpec(n_kv_heads=1, head_dim=64, max_positions=32)
    (cache,) = make_layer_caches(Affine(4), [spec])
    cache.append(*rows(spec, 10, 500.0, seed=1))
    cache.trim(4)
    new = rows(spec, 4, 0.1, seed=2)
    cache.append(*new)
    expected = unstack(cache.ops.quantize(*new), STACKS)
    assert all(mx.array_equal(cache.slots.read()[n][:, :, 6:10], expected[n]).item() for n in BUFFERS)


def test_cpu_paths():
    spec32 = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=16, dtype=mx.float32)
    spec16 = attrs.evolve(spec32, dtype=mx.bfloat16)
    if select_ops(PackedFormat(4, 32, 64, mx.float32)).name.startswith("cpu"):
        assert AffineCache(spec32, Affine(4)).ops.decode is not None  # mx.quantized_matmul
        assert AffineCache(spec16, Affine(4)).ops.decode is None  # dequantize + SDPA


def test_single_token_attention_uses_the_decode_path():
    spec = LayerSpec(n_kv_heads=2, head_dim=64, max_positions=16, dtype=mx.float32)
    cache = AffineCache(spec, Affine(8))
    calls = []

    def spy(queries, buffers, length, scale):
        calls.append(length)
        return mx.zeros(queries.shape, queries.dtype)

    cache.ops = attrs.evolve(cache.ops, decode=spy)
    k, v = rows(spec, 3, 1.0, seed=0)
    cache.update_and_attend(mx.zeros((1, 4, 3, 64)), k, v, scale=0.125)
    cache.update_and_attend(mx.zeros((1, 4, 1, 64)), k[:, :, :1], v[:, :, :1], scale=0.125)
    assert calls == [4]


@pytest.mark.parametrize(("text", "kind"), [
    ("affine8", Affine(8, 64)), ("affine6", Affine(6, 32)), ("affine4", Affine(4, 32)),
    ("affine4g64", Affine(4, 64)), ("affine8g128", Affine(8, 128)), ("raw", None), ("affine", None),
])
def test_parse(text, kind):
    assert parse(text) == kind
    if kind is not None:
        assert parse(str(kind)) == kind


@pytest.mark.parametrize("text", ["affine5", "affine4g48", "affine2g32"])
def test_parse_rejects_unsupported_parameters(text):
    with pytest.raises(ConfigError, match="must be one of"):
        parse(text)


def test_group_must_divide_head_dim():
    with pytest.raises(ConfigError, match="does not divide head_dim"):
        make_layer_caches(Affine(4, 128), [LayerSpec(n_kv_heads=1, head_dim=64, max_positions=8)])


def test_layers_of_one_model_share_one_pipeline():
    caches = make_layer_caches(Affine(4), [LayerSpec(n_kv_heads=1, head_dim=64, max_positions=8, layer_index=i)
                                           for i in range(3)])
    assert caches[0].pipeline is caches[1].pipeline is caches[2].pipeline is not None
