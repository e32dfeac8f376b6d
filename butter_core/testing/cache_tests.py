"""Conformance checks of the layer-cache contract, run against the real scheme through its entry point."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

from butter_core.cache import LayerSpec
from butter_core.config import Window
from butter_core.errors import ConfigError, UnknownSchemeError
from butter_core.layer_caches import make_layer_caches
from butter_core.plugins import PluginHost, get_plugin_host
from butter_core.testing.fixtures import SchemeFixtures
from butter_core.testing.reference import ReferenceCache, random_chunk, relative_error

GQA = 2
CHUNK_PATTERNS = {
    "one-at-a-time": [1] * 24,
    "mixed": [7, 1, 13, 1, 1, 30],
    "prefill-then-decode": [40, 1, 1, 1],
}
WINDOW = Window(max_size=24, keep=4)
WINDOW_PATTERNS = {
    "decode-past-wrap": [3] + [1] * 40,
    "chunk-overflows-window": [10, 50, 1, 33, 1],
    "chunk-larger-than-ring": [2, 70, 1],
    "from-empty-huge-chunk": [90],
}
CHUNKING_WINDOWS = {
    "no-window": None,
    "24-keep-4": WINDOW,
    "48-keep-4": Window(max_size=48, keep=4),
    "40-keep-0": Window(max_size=40, keep=0),
    "100-keep-10": Window(max_size=100, keep=10),
}
"""Windows whose rings wrap several times under ``CHUNKING_SCHEDULE`` (44 ring slots: a
period of 32 does not divide it; 90 slots after 10 sinks)."""
CHUNKING_SCHEDULE = [51, 1, 1, 46, 1, 97, 1]
"""Chunks that wrap a window's ring mid-chunk and in slot order (issue 30's reproduction)."""


def make_cache(kind, spec: LayerSpec, window: Window | None = None):
    """One cache of ``kind`` created through the plugin host, as a model would."""
    return make_layer_caches(kind, [spec], window)[0]


def run_chunks(cache, reference: ReferenceCache, spec: LayerSpec, pattern, seed: int = 0):
    """Feed the same random tokens to both caches in ``pattern`` chunks; yield (out, ref) per chunk.

    The tokens depend only on ``seed`` and the total length, so two patterns of equal
    sum feed identical data.
    """
    q, k, v = random_chunk(spec, sum(pattern), spec.n_kv_heads * GQA, mx.random.key(seed))
    scale = spec.head_dim**-0.5
    start = 0
    for tokens in pattern:
        chunk = [x[:, :, start : start + tokens] for x in (q, k, v)]
        start += tokens
        yield cache.update_and_attend(*chunk, scale=scale), reference.update_and_attend(*chunk, scale=scale)


class DiscoveryTests(SchemeFixtures):
    """The scheme is found through its entry point and its CLI strings round-trip."""

    def test_discovered_through_entry_point(self):
        host = PluginHost()
        assert self.scheme in host.schemes, f"{self.scheme!r} not registered via entry points; problems: {host.problems}"
        assert host.schemes[self.scheme].plugin.distribution != "test"

    def test_kind_string_round_trips(self, cache_kind):
        assert get_plugin_host().parse_kv_cache(str(cache_kind)) == cache_kind

    def test_examples_parse_to_the_scheme(self):
        registered = get_plugin_host().schemes[self.scheme].scheme
        assert registered.examples, "a scheme lists at least one CLI string"
        for text in registered.examples:
            kind = get_plugin_host().parse_kv_cache(text)
            assert isinstance(kind, registered.kind_type) and kind.scheme == self.scheme


class AppendAttendTests(SchemeFixtures):
    """Append 1..N tokens in chunks; attention matches fp32 attention over the original K/V."""

    @pytest.mark.parametrize("pattern", CHUNK_PATTERNS.values(), ids=CHUNK_PATTERNS.keys())
    def test_attention_matches_reference(self, cache_kind, layer_spec, attention_tolerance, pattern):
        cache, reference = make_cache(cache_kind, layer_spec), ReferenceCache()
        for out, ref in run_chunks(cache, reference, layer_spec, pattern):
            assert out.shape == ref.shape and out.dtype == layer_spec.dtype
            assert relative_error(out, ref) <= attention_tolerance
            assert cache.length == cache.absolute_position == reference.position

    def test_across_capacity_growth(self, cache_kind, dtype, attention_tolerance):
        spec = LayerSpec(n_kv_heads=1, head_dim=64, max_positions=700, dtype=dtype)
        cache, reference = make_cache(cache_kind, spec), ReferenceCache()
        for out, ref in run_chunks(cache, reference, spec, [250, 1, 300, 1, 120, 1]):
            assert relative_error(out, ref) <= attention_tolerance
        assert cache.length == 673

    def test_prepare_for_attention_gives_live_kv(self, cache_kind, layer_spec, attention_tolerance):
        cache, reference = make_cache(cache_kind, layer_spec), ReferenceCache()
        list(run_chunks(cache, reference, layer_spec, [5, 9]))
        keys, values = cache.prepare_for_attention()
        assert keys.shape == values.shape == reference.keys.shape
        assert relative_error(keys, reference.keys) <= attention_tolerance
        assert relative_error(values, reference.values) <= attention_tolerance

    def test_exceeding_capacity_is_a_clear_error(self, cache_kind, dtype):
        spec = LayerSpec(n_kv_heads=1, head_dim=64, max_positions=8, dtype=dtype)
        cache = make_cache(cache_kind, spec)
        _, k, v = random_chunk(spec, 9, 2, mx.random.key(1))
        with pytest.raises(ConfigError, match="capacity"):
            cache.append(k, v)


class WindowTests(SchemeFixtures):
    """Under the window decorator: sinks kept, FIFO ring, exact multi-token overflow, bounded size."""

    @pytest.fixture(autouse=True)
    def _needs_window(self, capabilities):
        if not capabilities.window:
            pytest.skip(f"{self.scheme} does not claim window eviction")

    @pytest.mark.parametrize("pattern", WINDOW_PATTERNS.values(), ids=WINDOW_PATTERNS.keys())
    def test_window_attention_matches_reference(self, cache_kind, layer_spec, attention_tolerance, pattern):
        cache, reference = make_cache(cache_kind, layer_spec, WINDOW), ReferenceCache(WINDOW)
        for out, ref in run_chunks(cache, reference, layer_spec, pattern):
            assert relative_error(out, ref) <= attention_tolerance
            assert cache.length == reference.live <= WINDOW.max_size
            assert cache.absolute_position == reference.position

    def test_chunked_equals_one_at_a_time(self, cache_kind, layer_spec, attention_tolerance):
        one = make_cache(cache_kind, layer_spec, WINDOW)
        chunked = make_cache(cache_kind, layer_spec, WINDOW)
        singles = list(run_chunks(one, ReferenceCache(WINDOW), layer_spec, [1] * 60))
        chunks = list(run_chunks(chunked, ReferenceCache(WINDOW), layer_spec, [60]))
        one_out = mx.concatenate([out for out, _ in singles], axis=2)
        assert relative_error(chunks[0][0], one_out) <= 2 * attention_tolerance
        assert one.length == chunked.length == WINDOW.max_size

    @pytest.mark.parametrize("window", CHUNKING_WINDOWS.values(), ids=CHUNKING_WINDOWS.keys())
    def test_what_decode_sees_does_not_depend_on_the_chunking(
        self, cache_kind, layer_spec, attention_tolerance, chunking_tolerance, window
    ):
        """The same positions, fed in ``CHUNKING_SCHEDULE`` or one at a time: the next tokens'
        attention agrees within ``chunking_tolerance``, and each within the scheme's tolerance
        of exact attention over the window, however the ring wrapped inside a chunk."""
        decode = [1] * 8
        outputs = []
        for pattern in (CHUNKING_SCHEDULE + decode, [1] * sum(CHUNKING_SCHEDULE) + decode):
            cache, reference = make_cache(cache_kind, layer_spec, window), ReferenceCache(window)
            steps = list(run_chunks(cache, reference, layer_spec, pattern, seed=5))[-len(decode) :]
            for out, ref in steps:
                assert relative_error(out, ref) <= attention_tolerance
            outputs.append(mx.concatenate([out for out, _ in steps], axis=2))
        assert relative_error(outputs[0], outputs[1]) <= chunking_tolerance

    def test_sinks_pinned_and_ring_fifo(self, cache_kind, layer_spec, attention_tolerance):
        cache, reference = make_cache(cache_kind, layer_spec, WINDOW), ReferenceCache(WINDOW)
        list(run_chunks(cache, reference, layer_spec, [30, 1, 1, 17]))
        held = cache.slot_positions()
        keys, _ = cache.prepare_for_attention()
        expected = reference.keys[:, :, held]
        assert relative_error(keys, expected) <= attention_tolerance
        top = reference.position
        assert sorted(held.tolist()) == list(range(WINDOW.keep)) + list(range(top - WINDOW.ring_size, top))


class StateTests(SchemeFixtures):
    """Export/restore round trips exactly; trim drops positions."""

    @pytest.mark.parametrize("window", [None, WINDOW], ids=["plain", "window"])
    def test_state_round_trip(self, cache_kind, layer_spec, capabilities, window):
        if not capabilities.state:
            pytest.skip(f"{self.scheme} does not claim state export")
        if window and not capabilities.window:
            pytest.skip(f"{self.scheme} does not claim window eviction")
        original = make_cache(cache_kind, layer_spec, window)
        list(run_chunks(original, ReferenceCache(window), layer_spec, [20, 1, 15]))
        restored = make_cache(cache_kind, layer_spec, window)
        restored.restore(original.state(), original.meta_state())
        assert restored.length == original.length
        assert restored.absolute_position == original.absolute_position
        a = list(run_chunks(original, ReferenceCache(), layer_spec, [3, 1], seed=7))
        b = list(run_chunks(restored, ReferenceCache(), layer_spec, [3, 1], seed=7))
        for (out_a, _), (out_b, _) in zip(a, b):
            assert mx.array_equal(out_a, out_b).item()

    def test_trim(self, cache_kind, layer_spec, attention_tolerance, capabilities):
        if not capabilities.trim:
            pytest.skip(f"{self.scheme} does not claim trim")
        cache, reference = make_cache(cache_kind, layer_spec), ReferenceCache()
        list(run_chunks(cache, reference, layer_spec, [12, 1, 1]))
        assert cache.trim(5) == reference.trim(5) == 5
        assert cache.length == cache.absolute_position == 9
        for out, ref in run_chunks(cache, reference, layer_spec, [4, 1], seed=3):
            assert relative_error(out, ref) <= attention_tolerance
        assert cache.trim(100) == 14 and cache.length == 0


class AccountingTests(SchemeFixtures):
    """Byte accounting equals what the arrays really hold."""

    def test_live_bytes_equal_state_nbytes(self, cache_kind, layer_spec):
        cache = make_cache(cache_kind, layer_spec)
        list(run_chunks(cache, ReferenceCache(), layer_spec, [17, 1]))
        assert cache.nbytes_live == sum(a.nbytes for a in cache.state().values())
        assert 0 < cache.nbytes_live <= cache.nbytes_allocated

    def test_allocated_bytes_equal_device_memory(self, cache_kind, dtype):
        spec = LayerSpec(n_kv_heads=4, head_dim=64, max_positions=4096, dtype=dtype)
        chunks = [random_chunk(spec, 50, 8, mx.random.key(i)) for i in range(6)]
        mx.eval(chunks)
        gc.collect()
        # With MLX's buffer cache on, an allocation may be served by a cached block larger
        # than asked for, counted whole as active memory: what earlier tests left there
        # would decide the result. Off, each array holds what it asks for.
        limit = mx.set_cache_limit(0)
        mx.clear_cache()
        try:
            before = mx.get_active_memory()
            cache = make_cache(cache_kind, spec)
            for _, k, v in chunks:
                cache.append(k, v)
            mx.eval(cache.buffers())
            gc.collect()
            held = mx.get_active_memory() - before
        finally:
            mx.set_cache_limit(limit)
        # MLX's GPU allocators round each array up: CUDA's to a power of two below 16 KB
        # and to whole 16 KB pages above (an 18 KB array holds 32 KB), so there each
        # array may hold up to a page more than its bytes.
        pages = len(cache.buffers()) if mx.default_device().type == mx.gpu else 1
        assert held == pytest.approx(cache.nbytes_allocated, rel=0.05, abs=16384 * pages)


class ParameterTests(SchemeFixtures):
    """Bad parameters raise ConfigError with a message; unknown names list what is installed."""

    def test_invalid_kinds_raise(self, invalid_kinds):
        assert invalid_kinds, "list at least one invalid configuration"
        for build in invalid_kinds:
            with pytest.raises(ConfigError):
                build()

    def test_unknown_string_lists_installed_schemes(self):
        with pytest.raises(UnknownSchemeError, match=self.scheme):
            get_plugin_host().parse_kv_cache(f"{self.scheme}-no-such-variant-xyz")
