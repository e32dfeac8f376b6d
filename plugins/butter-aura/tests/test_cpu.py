"""``butter_aura.cpu`` against ``butter_aura.reference``: the same codes, attention and dequantized slots."""

from __future__ import annotations

import attrs
import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter_core import LayerSpec, Window, make_layer_caches
from butter_core.kernels import gpu_backend, relative_error
from butter_core.testing import on_the_cpu  # noqa: F401 - the fixture below

from butter_aura import Aura
from butter_aura import cpu, packing, reference
from butter_aura.codec import Codec
from butter_aura.kernels import ops_for
from butter_aura.kernels.checks import ATTENTION_RTOL, make_stored
from butter_aura.layout import FullPrecisionBudget, codecs
from butter_aura.rotation import Rotation

pytestmark = pytest.mark.usefixtures("on_the_cpu")  # the CPU path, where it runs, on any machine

KINDS = ("aura4v2", "aura4v4", "aura8v4", "aura8v8", "aura3v2")
HEAD_DIMS = (64, 96, 128)
BOUNDARY_TOLERANCE = 1e-5
"""How close to a decision boundary a normalized coordinate must lie for a code to differ
(the rotation is a matmul here and butterflies in the reference: float32 rounding)."""


def normal(shape, seed, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# -- encode ------------------------------------------------------------------------


def float16_ulp(x: mx.array) -> mx.array:
    """The spacing of float16 values at ``|x|`` (float32), subnormals included."""
    exponent = mx.floor(mx.log2(mx.maximum(mx.abs(x), 2.0**-14)))
    return 2.0 ** (exponent - 10)


def assert_same_coding(codec: Codec, rotated: mx.array, got: tuple, expected: tuple) -> None:
    """Codes identical except within float32 rounding of a boundary; scales identical or one float16 ulp apart.

    A scale may move further only in a vector whose codes moved (another least-squares fit).
    """
    codes, scales = got
    ref_codes, ref_scales = expected
    assert codes.shape == ref_codes.shape and codes.dtype == ref_codes.dtype
    assert scales.shape == ref_scales.shape and scales.dtype == ref_scales.dtype
    index = packing.unpack(codes, codec.bits, codec.head_dim).astype(mx.int32)
    ref_index = packing.unpack(ref_codes, codec.bits, codec.head_dim).astype(mx.int32)
    moved = index != ref_index
    y = rotated.reshape(*rotated.shape[:-1], codec.groups, codec.group)
    t = (y / mx.sqrt(mx.mean(y * y, axis=-1, keepdims=True))).reshape(rotated.shape)
    distance = mx.min(mx.abs(t[..., None] - codec.book.boundaries_array()), axis=-1)
    assert mx.all(mx.where(moved, (mx.abs(index - ref_index) == 1) & (distance < BOUNDARY_TOLERANCE), True)).item()
    assert mx.mean(moved).item() < 1e-3
    kept = ~mx.any(moved.reshape(*moved.shape[:-1], codec.groups, codec.group), axis=-1)
    scale, ref_scale = scales.astype(mx.float32), ref_scales.astype(mx.float32)
    within_ulp = mx.abs(scale - ref_scale) <= float16_ulp(ref_scale)
    assert mx.all(mx.where(kept, within_ulp, True)).item()


@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", KINDS)
def test_encode_codes_as_the_reference(kind, head_dim, tokens):
    kv_heads = 3
    rotation = Rotation(tokens + head_dim, kv_heads, head_dim)
    key_codec, value_codec = codecs(Aura.named(kind), head_dim)
    keys = normal((2, kv_heads, tokens, head_dim), 1) * 3
    values = normal((2, kv_heads, tokens, head_dim), 2)
    got = cpu.encode(keys, values, rotation, key_codec, value_codec)
    expected = reference.encode(keys, values, rotation, key_codec, value_codec)
    assert_same_coding(key_codec, rotation.apply(keys), got[:2], expected[:2])
    assert_same_coding(value_codec, rotation.apply(values), got[2:], expected[2:])


@pytest.mark.parametrize(
    ("key_codec", "value_codec", "kv_heads"),
    [(Codec(4, 16, 64), Codec(2, 64, 64), 3), (Codec(8, 128, 128), Codec(8, 128, 128), 32)],
    ids=["scale-groups-differ", "many-comparisons"],
)
def test_one_token_encode_outside_the_joint_path_codes_as_the_reference(key_codec, value_codec, kv_heads):
    """Keys and values coded apart: different scale groups, or too many stacked comparisons."""
    head_dim = key_codec.head_dim
    rotation = Rotation(9, kv_heads, head_dim)
    keys, values = normal((1, kv_heads, 1, head_dim), 5) * 2, normal((1, kv_heads, 1, head_dim), 6)
    got = cpu.encode(keys, values, rotation, key_codec, value_codec)
    expected = reference.encode(keys, values, rotation, key_codec, value_codec)
    assert_same_coding(key_codec, rotation.apply(keys), got[:2], expected[:2])
    assert_same_coding(value_codec, rotation.apply(values), got[2:], expected[2:])


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_encode_takes_16_bit_rows(dtype):
    rotation = Rotation(5, 2, 64)
    key_codec, value_codec = codecs(Aura.named("aura4v2"), 64)
    keys, values = normal((1, 2, 1, 64), 3, dtype), normal((1, 2, 1, 64), 4, dtype)
    got = cpu.encode(keys, values, rotation, key_codec, value_codec)
    expected = reference.encode(keys, values, rotation, key_codec, value_codec)
    assert_same_coding(key_codec, rotation.apply(keys), got[:2], expected[:2])
    assert_same_coding(value_codec, rotation.apply(values), got[2:], expected[2:])


def test_encode_codes_an_all_zero_vector_as_the_reference():
    rotation = Rotation(6, 1, 64)
    key_codec, value_codec = codecs(Aura.named("aura4v2"), 64)
    zeros = mx.zeros((1, 1, 1, 64))
    for got, expected in zip(cpu.encode(zeros, zeros, rotation, key_codec, value_codec),
                             reference.encode(zeros, zeros, rotation, key_codec, value_codec)):
        assert mx.array_equal(got, expected).item()


# -- decode attention and dequantize -----------------------------------------------------


def check_against_reference(queries: mx.array, stored, scale: float) -> None:
    """Decode attention and dequantize of ``stored`` agree with the reference's."""
    rtol = ATTENTION_RTOL[queries.dtype]
    out = cpu.decode_attention(queries, stored, scale)
    assert out.dtype == queries.dtype and out.shape == queries.shape
    assert relative_error(out, reference.decode_attention(queries, stored, scale)) < rtol
    for got, expected in zip(cpu.dequantize(stored, queries.dtype), reference.dequantize(stored, queries.dtype)):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert relative_error(got, expected) < rtol


def stored_case(kind: str, **sizes) -> dict:
    aura = Aura.named(kind)
    return make_stored(7, key_bits=aura.key_bits, value_bits=aura.value_bits, dtype=mx.float32, **sizes)


@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("kind", KINDS)
def test_attention_and_dequantize_match_the_reference(kind, head_dim, group):
    """Sinks and a recent ring at the end of the live slots, with a stale and an empty ring entry."""
    check_against_reference(**stored_case(kind, head_dim=head_dim, kv_heads=2, q_heads=2 * group,
                                          length=300, allocated=320))


@pytest.mark.parametrize(
    "sizes",
    [
        pytest.param({"length": 20, "allocated": 32}, id="shorter-than-the-budget"),
        pytest.param({"length": 1, "allocated": 16}, id="one-slot"),
        pytest.param({"length": 37, "allocated": 40}, id="just-past-the-budget"),
        pytest.param({"length": 400, "allocated": 512, "recent_end": 150}, id="ring-inside-the-live-slots"),
        pytest.param({"length": 200, "allocated": 256, "sinks": 0, "recent": 0}, id="no-full-precision-rows"),
        pytest.param({"length": 200, "allocated": 256, "sinks": 2, "recent": 5}, id="small-budget"),
        pytest.param({"length": 200, "allocated": 200, "batch": 2}, id="batch-2-full-buffer"),
        pytest.param({"length": 150, "allocated": 256, "group": 32}, id="scale-groups"),
        pytest.param({"length": 150, "allocated": 256, "group": 32, "head_dim": 96}, id="scale-groups-96"),
    ],
)
@pytest.mark.parametrize("kind", ["aura4v2", "aura8v4", "aura3v2"])
def test_full_precision_layouts_match_the_reference(kind, sizes):
    check_against_reference(**stored_case(kind, **{"kv_heads": 3, "q_heads": 9, "head_dim": 64, **sizes}))


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_16_bit_queries_match_the_reference(dtype):
    check_against_reference(**make_stored(8, dtype=dtype, length=250, allocated=256, kv_heads=2, q_heads=6))


@pytest.mark.parametrize("kind", ["aura4v2", "aura4v4", "aura8v8", "aura3v2"])
def test_wrapped_window_ring_matches_the_reference(kind):
    """After the window decorator wraps, the recent slots are two runs: the end of the ring and its start."""
    window = Window(max_size=100, keep=4)
    spec = LayerSpec(n_kv_heads=3, head_dim=64, max_positions=100, dtype=mx.float32)
    (cache,) = make_layer_caches(Aura.named(kind), [spec], window)
    assert cache.inner.ops is cpu
    keys, values = normal((1, 3, 115, 64), 9), normal((1, 3, 115, 64), 10)
    cache.append(keys[:, :, :100], values[:, :, :100])
    for t in range(100, 115):  # positions 100.. wrap to slots 4..
        cache.append(keys[:, :, t : t + 1], values[:, :, t : t + 1])
    stored = cache.inner.stored()
    slots, _ = stored.full_precision_slots()
    assert sorted(slots) == [*range(4), *range(4, 19), *range(83, 100)]
    check_against_reference(normal((1, 9, 1, 64), 11), stored, 0.125)


def test_attention_rejects_what_the_reference_rejects():
    inputs = make_stored(0, length=10, allocated=16)
    with pytest.raises(ValueError, match="one query token"):
        cpu.decode_attention(mx.zeros((1, 8, 2, 128)), inputs["stored"], 0.1)
    with pytest.raises(ValueError, match="one query token"):
        cpu.decode_attention(mx.zeros((1, 3, 1, 128)), inputs["stored"], 0.1)


# -- the host's full-precision slots --------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(
    sinks=st.integers(0, 4),
    period=st.integers(1, 8),
    ring_start=st.one_of(st.none(), st.integers(0, 10)),
    length=st.integers(1, 48),
    entries=st.lists(st.integers(-1, 50), min_size=48, max_size=48),
    known_on_host=st.booleans(),
)
def test_full_precision_slots_are_the_map_on_the_host(sinks, period, ring_start, length, entries, known_on_host):
    """Any ring contents (stale, empty, misplaced entries), with or without a window's rows of
    their own: the host list is ``full_precision_map``, and the coded span holds exactly the
    other slots plus, masked, the full-precision slots inside it."""
    stored = make_stored(0, length=length, allocated=48, sinks=0, recent=1, head_dim=64, encoded=False)["stored"]
    budget = FullPrecisionBudget.for_capacity(48, ring_start, sinks, period)
    recent = entries[: budget.ring]
    stored = attrs.evolve(
        stored,
        budget=budget,
        recent_slots=mx.array(recent, dtype=mx.int32),
        fp_keys=mx.zeros((1, 2, budget.rows, 64)),
        fp_values=mx.zeros((1, 2, budget.rows, 64)),
        recent_host=tuple(recent) if known_on_host else None,
    )
    slots, rows = stored.full_precision_slots()
    member, row = stored.full_precision_map()
    assert sorted(slots) == [slot for slot, m in enumerate(member.tolist()) if m]
    assert all(row.tolist()[slot] == r for slot, r in zip(slots, rows))
    first, stop = cpu._coded_span(slots, length)
    coded = [slot for slot, m in enumerate(member.tolist()) if not m]
    assert (first, stop) == ((min(coded), max(coded) + 1) if coded else (length, length))


# -- wiring -----------------------------------------------------------------------------------


def test_caches_without_gpu_kernels_use_the_cpu_path():
    if gpu_backend() is None or mx.default_device().type != mx.gpu:
        assert ops_for(LayerSpec(n_kv_heads=2, head_dim=128, max_positions=16)) is cpu
    assert ops_for(LayerSpec(n_kv_heads=2, head_dim=96, max_positions=16)) is cpu


@pytest.mark.parametrize("dims", [64, 96, 128])
def test_mixing_matrix_is_the_rotation_without_its_signs(dims):
    rotation = Rotation(3, 2, dims)
    mixing = rotation.mixing_matrix()
    signs = rotation.signs[:, None, :]
    x = normal((1, 2, 5, dims), 12)
    assert mx.allclose((x * signs) @ mixing, rotation.apply(x), atol=1e-5).item()
    assert mx.allclose((x @ mixing.swapaxes(-1, -2)) * signs, rotation.invert(x), atol=1e-5).item()
    assert rotation.mixing_matrix() is mixing and rotation.arrays()[-1] is mixing
    assert mixing.shape == ((2, dims, dims) if dims == 96 else (dims, dims))  # Hadamard: one for every head
