"""What the conformance suite cannot know about AURA: rotation, codebooks, packing, slots, state."""

from __future__ import annotations

import math

import mlx.core as mx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from butter_core import ConfigError, LayerSpec, Window, make_layer_caches, parse_kv_cache
from butter_core.cache import reference_attention
from butter_core.testing import on_the_cpu  # noqa: F401 - a fixture
from butter_core.testing.reference import relative_error

from butter_aura import Aura
from butter_aura import packing, reference
from butter_aura.cache import AuraCache
from butter_aura.codebooks import available_bits, codebook
from butter_aura.codec import Codec
from butter_aura.layout import RECENT, SINKS, FullPrecisionBudget
from butter_aura.rotation import Rotation, fwht, layer_seed


def normal(shape, seed=0, dtype=mx.float32):
    return mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)


# -- rotation --------------------------------------------------------------------


@pytest.mark.usefixtures("on_the_cpu")  # held to 1e-5: a GPU's float32 matmuls are not
@pytest.mark.parametrize("dims", [64, 128, 96, 80])
def test_rotation_is_orthogonal_and_inverts(dims):
    rotation = Rotation(3, 4, dims)
    matrices = rotation.matrices()
    eye = mx.eye(dims)
    assert mx.max(mx.abs(matrices @ matrices.swapaxes(-1, -2) - eye)).item() < 1e-5
    x = normal((2, 4, 5, dims))
    assert mx.max(mx.abs(rotation.invert(rotation.apply(x)) - x)).item() < 1e-5
    q, k = normal((1, 4, 3, dims), 1), normal((1, 4, 3, dims), 2)
    exact = mx.sum(q * k, axis=-1)
    rotated = mx.sum(rotation.apply(q) * rotation.apply(k), axis=-1)
    assert mx.max(mx.abs(rotated - exact)).item() < 1e-4


def test_rotation_depends_only_on_seed():
    a, b, c = Rotation(7, 2, 64), Rotation(7, 2, 64), Rotation(8, 2, 64)
    assert mx.array_equal(a.signs, b.signs).item()
    assert not mx.array_equal(a.signs, c.signs).item()
    assert layer_seed(1, 0) != layer_seed(1, 1)


@pytest.mark.usefixtures("on_the_cpu")
def test_fwht_is_the_normalized_hadamard_transform():
    n = 16
    hadamard = mx.array([[(-1) ** bin(i & j).count("1") for j in range(n)] for i in range(n)], dtype=mx.float32)
    x = normal((3, n))
    assert mx.allclose(fwht(x), x @ hadamard.T / math.sqrt(n), atol=1e-5).item()


def test_rotation_spreads_an_outlier_channel():
    x = mx.zeros((1, 1, 1, 128)).at[..., 5].add(10.0)
    y = Rotation(0, 1, 128).apply(x)
    assert mx.allclose(mx.abs(y), mx.full(y.shape, 10.0 / math.sqrt(128)), atol=1e-5).item()


# -- codebooks ---------------------------------------------------------------------


def test_every_core_bit_width_has_a_codebook():
    assert set(available_bits()) >= {2, 3, 4, 8}


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codebook_is_lloyd_max_for_group_normalized_coordinates(bits):
    """Levels are symmetric, each is the centroid of its cell, and the error matches the tabulated MSE."""
    group = 64
    book = codebook(bits, group)
    levels = book.levels_array()
    assert mx.all(levels[1:] > levels[:-1]).item()
    assert mx.allclose(levels, -levels[::-1], atol=1e-9).item()
    samples = normal((8192, group), seed=bits)
    t = (samples / mx.sqrt(mx.mean(samples * samples, axis=-1, keepdims=True))).reshape(-1)
    index = mx.sum(t[:, None] > book.boundaries_array()[None], axis=-1)
    for level in range(2**bits):
        weights = (index == level).astype(mx.float32)
        centroid = mx.sum(weights * t) / mx.sum(weights)
        assert abs(centroid.item() - book.levels[level]) < 0.02 * (1 + abs(book.levels[level])), level
    mse = mx.mean((t - mx.take(levels, index)) ** 2).item()
    assert mse == pytest.approx(book.mse, rel=0.05)
    uniform_step = 2 * 3.0 / 2**bits  # a uniform quantizer over [-3, 3] does worse
    uniform = mx.clip(mx.floor(t / uniform_step) + 0.5, -(2 ** (bits - 1)) + 0.5, 2 ** (bits - 1) - 0.5) * uniform_step
    assert mse < mx.mean((t - uniform) ** 2).item()


def test_unknown_bit_width_is_a_clear_error():
    with pytest.raises(ConfigError, match="no AURA codebook"):
        codebook(5, 64)


# -- packing and codec -------------------------------------------------------------


@pytest.mark.parametrize("bits", packing.PACKED_BITS)
@pytest.mark.parametrize("n", [64, 128, 80, 96, 33, 7])
def test_packing_round_trips(bits, n):
    codes = mx.random.randint(0, 2**bits, (3, 2, n), key=mx.random.key(bits)).astype(mx.uint32)
    words = packing.pack(codes, bits)
    assert words.shape == (3, 2, packing.words_per_row(n, bits)) and words.dtype == mx.uint32
    assert mx.array_equal(packing.unpack(words, bits, n), codes).item()
    top = mx.full((1, n), 2**bits - 1, mx.uint32)
    assert mx.array_equal(packing.unpack(packing.pack(top, bits), bits, n), top).item()


@pytest.mark.parametrize("bits", packing.PACKED_BITS)
def test_packing_handles_no_rows(bits):
    empty = mx.zeros((2, 0, 64), mx.uint32)
    words = packing.pack(empty, bits)
    assert words.shape == (2, 0, packing.words_per_row(64, bits))
    assert packing.unpack(words, bits, 64).shape == (2, 0, 64)


@pytest.mark.parametrize(("bits", "group"), [(2, 64), (3, 32), (4, 128), (8, 16)])
def test_codec_error_is_the_codebook_error(bits, group):
    codec = Codec(bits, group, 128)
    x = normal((4, 256, 128), seed=bits) * 5.0
    error = mx.sum((codec.decode(*codec.encode(x)) - x) ** 2) / mx.sum(x * x)
    # The least-squares scale can only lower the error of the RMS-scaled codes.
    assert error.item() <= codec.book.mse * 1.02


def test_zero_vectors_stay_zero():
    codec = Codec(4, 64, 64)
    codes, scales = codec.encode(mx.zeros((2, 64)))
    assert mx.array_equal(codec.decode(codes, scales), mx.zeros((2, 64))).item()


def test_bytes_per_slot_count_codes_and_scales():
    (cache,) = make_layer_caches(Aura(4, 2), [LayerSpec(n_kv_heads=8, head_dim=128, max_positions=64)])
    # keys: 128 * 4 bits + one float16 scale; values: 128 * 2 bits + one scale.
    assert cache.bytes_per_slot == 8 * ((64 + 2) + (32 + 2))


# -- the cache ---------------------------------------------------------------------


def spec(dtype=mx.float32, capacity=256, heads=2):
    return LayerSpec(n_kv_heads=heads, head_dim=64, max_positions=capacity, dtype=dtype)


def test_rewritten_slot_holds_no_stale_bits():
    """A slot written twice holds exactly what a fresh cache writes for the second vector."""
    kind = Aura(8, 2)
    k1, v1 = normal((1, 2, 50, 64), 1) * 100, normal((1, 2, 50, 64), 2) * 100
    k2, v2 = normal((1, 2, 10, 64), 3) * 1e-3, normal((1, 2, 10, 64), 4) * 1e-3
    twice, once = AuraCache(spec(), kind), AuraCache(spec(), kind)
    twice.write(0, k1, v1)
    twice.write(20, k2, v2)
    once.write(0, k1[:, :, :20], v1[:, :, :20])
    once.write(20, k2, v2)
    for name in ("key_codes", "key_scales", "value_codes", "value_scales"):
        assert mx.array_equal(twice.state()[name][:, :, 20:30], once.state()[name][:, :, 20:30]).item(), name


def test_window_ring_slots_are_reencoded():
    """After the ring wraps, every slot decodes to the position it now holds."""
    window = Window(max_size=40, keep=4)
    (cache,) = make_layer_caches(Aura(8, 8), [spec()], window)
    k, v = normal((1, 2, 130, 64), 5), normal((1, 2, 130, 64), 6)
    for start in range(0, 130, 13):
        cache.append(k[:, :, start : start + 13], v[:, :, start : start + 13])
    keys, values = cache.prepare_for_attention()
    held = cache.slot_positions()
    assert relative_error(keys, k[:, :, held]) < 0.02 and relative_error(values, v[:, :, held]) < 0.02


def test_full_precision_budget_holds_sinks_and_recent_slots():
    cache = AuraCache(spec(), Aura(4, 2))
    k, v = normal((1, 2, 100, 64), 7), normal((1, 2, 100, 64), 8)
    cache.append(k[:, :, :70], v[:, :, :70])
    for t in range(70, 100):
        cache.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
    member, _ = cache.stored().full_precision_map()
    exact = list(range(SINKS)) + list(range(100 - RECENT, 100))
    assert [i for i, m in enumerate(member.tolist()) if m] == exact
    keys, values = cache.load(100)
    assert mx.array_equal(keys[:, :, exact], k[:, :, exact].astype(mx.float16).astype(mx.float32)).item()
    assert relative_error(values[:, :, 10:60], v[:, :, 10:60]) > 0.2  # 2-bit codes elsewhere


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.float32])
@pytest.mark.parametrize("window", [None, Window(max_size=100, keep=4)])
def test_ring_tokens_encoded_late_hold_the_codes_of_an_immediate_encode(dtype, window):
    """Decode-step tokens are coded when they leave the recent ring (``AuraCache.store``):
    token-by-token appends, with or without a wrapping window, end with the same state as
    appends that force every code out at once (a state export after each), and attention
    in between reads the ring's copies. (float32 tokens: both code the ring's float16
    copies, as ``test_float32_ring_tokens_hold_the_codes_of_their_float16_copies`` checks.)"""
    layer = spec(dtype, capacity=window.max_size if window else 256)
    late, early = (make_layer_caches(Aura(4, 2), [layer], window)[0] for _ in range(2))
    k, v = normal((1, 2, 180, 64), 20, dtype), normal((1, 2, 180, 64), 21, dtype)
    q = normal((1, 4, 1, 64), 22, dtype)
    for cache in (late, early):
        cache.append(k[:, :, :20], v[:, :, :20])
    for t in range(20, 180):
        outs = []
        for cache in (late, early):
            outs.append(cache.update_and_attend(q, k[:, :, t : t + 1], v[:, :, t : t + 1], scale=0.125))
        early.state()  # exports flush the codes
        assert mx.array_equal(outs[0], outs[1]).item(), t
    inner = late.inner if window else late
    assert inner._unencoded, "no token was left for later"
    late_state, early_state = late.state(), early.state()
    assert not inner._unencoded
    assert sorted(late_state) == sorted(early_state)
    for name in late_state:
        assert mx.array_equal(late_state[name], early_state[name]).item(), name


def test_float32_ring_tokens_hold_the_codes_of_their_float16_copies():
    """A float32 model's decode tokens are coded from the ring's float16 copies: the state
    after token-by-token appends equals that of a cache given the float16-rounded tokens."""
    layer = spec(mx.float32, capacity=256)
    rounded, late = (make_layer_caches(Aura(4, 2), [layer])[0] for _ in range(2))
    k, v = normal((1, 2, 120, 64), 23, mx.float32), normal((1, 2, 120, 64), 24, mx.float32)
    k16, v16 = (x.astype(mx.float16).astype(mx.float32) for x in (k, v))
    late.append(k[:, :, :20], v[:, :, :20])
    rounded.append(k[:, :, :20], v[:, :, :20])
    for t in range(20, 120):
        late.append(k[:, :, t : t + 1], v[:, :, t : t + 1])
        rounded.append(k16[:, :, t : t + 1], v16[:, :, t : t + 1])
    assert late._unencoded, "no token was left for later"
    late_state, rounded_state = late.state(), rounded.state()
    for name in late_state:
        assert mx.array_equal(late_state[name], rounded_state[name]).item(), name


def test_budget_shrinks_to_tiny_capacities():
    assert FullPrecisionBudget.for_capacity(9) == FullPrecisionBudget(4, 5, 4, 9, 9)
    assert FullPrecisionBudget.for_capacity(3) == FullPrecisionBudget(3, 0, 3, 3, 3)
    assert FullPrecisionBudget.for_capacity(3).rows == 4


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 200), ring_start=st.integers(0, 199), newest=st.integers(0, 10_000))
def test_a_windows_newest_positions_have_distinct_rows(capacity, ring_start, newest):
    """Whatever the window, the slots of the newest ``recent`` positions (consecutive in the
    order the window reuses slots, across its wrap) have rows of their own: a window of 44
    ring slots used to share 12 of the 32 rows between the wrap's two sides."""
    ring_start %= capacity
    budget = FullPrecisionBudget.for_capacity(capacity, ring_start)
    ring = capacity - ring_start
    positions = range(max(0, newest - budget.recent + 1), newest + 1)
    slots = {p if p < ring_start else ring_start + (p - ring_start) % ring for p in positions}
    indices = [budget.ring_index(slot) for slot in slots if slot >= budget.base]
    assert len(set(indices)) == len(indices) and all(0 <= i < budget.ring for i in indices)
    assert budget.capacity - budget.tail < max(budget.recent, 1)  # rows of their own: fewer than a period


def test_prefill_chunk_attends_itself_exactly():
    """Two-phase prefill: a first chunk's attention is exact attention over the chunk."""
    cache = AuraCache(spec(), Aura(2, 2))
    q, k, v = normal((1, 4, 60, 64), 9), normal((1, 2, 60, 64), 10), normal((1, 2, 60, 64), 11)
    out = cache.update_and_attend(q, k, v, scale=0.125)
    assert relative_error(out, reference_attention(q, k, v, scale=0.125, mask="causal")) < 1e-5


def test_decode_attention_matches_attention_over_dequantized_slots():
    cache = AuraCache(spec(), Aura(4, 2))
    k, v = normal((1, 2, 150, 64), 12), normal((1, 2, 150, 64), 13)
    cache.append(k, v)
    q = normal((1, 4, 1, 64), 14)
    keys, values = cache.load(150)
    expected = reference_attention(q, keys, values, scale=0.125)
    assert relative_error(reference.decode_attention(q, cache.stored(), 0.125), expected) < 1e-5


def test_restore_adopts_the_saved_rotation():
    """A state saved by a cache with another rotation seed decodes identically after restore."""
    original, restored = AuraCache(spec(), Aura(4, 4), seed=1), AuraCache(spec(), Aura(4, 4), seed=2)
    k, v = normal((1, 2, 90, 64), 15), normal((1, 2, 90, 64), 16)
    original.append(k, v)
    restored.restore(original.state(), original.meta_state())
    assert restored.rotation.seed == original.rotation.seed
    for a, b in zip(original.load(90), restored.load(90)):
        assert mx.array_equal(a, b).item()
    q = normal((1, 4, 1, 64), 17)
    assert mx.array_equal(
        original.update_and_attend(q, k[:, :, :1], v[:, :, :1], scale=0.125),
        restored.update_and_attend(q, k[:, :, :1], v[:, :, :1], scale=0.125),
    ).item()


def test_state_from_another_kind_is_refused():
    a, b = AuraCache(spec(), Aura(4, 2)), AuraCache(spec(), Aura(8, 8))
    a.append(normal((1, 2, 5, 64)), normal((1, 2, 5, 64)))
    with pytest.raises(ConfigError, match="aura4v2"):
        b.restore(a.state(), a.meta_state())
    with pytest.raises(ConfigError, match="another kind of cache"):
        a.restore({"keys": mx.zeros((1, 2, 5, 64))}, a.meta_state())


def test_cli_strings():
    assert parse_kv_cache("aura4v2") == Aura(4, 2)
    assert parse_kv_cache("aura3v8") == Aura(3, 8)
    with pytest.raises(ConfigError):
        parse_kv_cache("aura4v5")


@settings(max_examples=60, deadline=None)
@given(
    max_size=st.integers(6, 120),
    keep=st.integers(0, 12),
    schedule=st.lists(st.integers(1, 130), min_size=1, max_size=7),
)
def test_the_newest_positions_are_in_full_precision_under_any_window_and_chunking(max_size, keep, schedule):
    """After every chunk, the slots of the newest ``RECENT`` positions past the window's sinks
    are read from full-precision rows holding exactly those tokens (a 44-slot ring, window
    (48, 4), under ``[51, 1, 1, 46, 1, 97, 1]`` kept only about 20 of them before)."""
    keep = min(keep, max_size - 1)
    window = Window(max_size, keep)
    (cache,) = make_layer_caches(Aura(4, 2), [spec(capacity=4096)], window)
    keys = normal((1, 2, sum(schedule), 64), 21)
    position = 0
    for tokens in schedule:
        cache.append(keys[:, :, position : position + tokens], keys[:, :, position : position + tokens])
        position += tokens
        inner, held = cache.inner, cache.slot_positions().tolist()
        stored = inner.stored()
        exact, rows = stored.full_precision_slots()
        newest = range(max(keep, position - inner.budget.recent, position - window.ring_size), position)
        wanted = {held.index(p) for p in newest if held.index(p) >= inner.budget.base}
        assert wanted <= set(exact), (sorted(wanted - set(exact)), window, schedule)
        for slot, row in zip(exact, rows):
            assert mx.array_equal(stored.fp_keys[:, :, row], keys[:, :, held[slot]].astype(stored.fp_keys.dtype)).item()
