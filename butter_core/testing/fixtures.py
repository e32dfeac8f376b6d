"""Fixtures a scheme provides to the conformance suite, and the flags that skip what it does not claim."""

from __future__ import annotations

import functools

import attrs
import mlx.core as mx
import pytest

from butter_core.cache import LayerSpec
from butter_core.config import CacheKind, LoadOptions, Window
from butter_core.errors import ConfigError
from butter_core.model import Model
from butter_core.plugins import get_plugin_host


@pytest.fixture
def on_the_cpu():
    """Runs a test on MLX's CPU stream (``pytestmark = pytest.mark.usefixtures("on_the_cpu")``
    after ``from butter_core.testing import on_the_cpu``): for tests of pure-mx arithmetic
    held to float32 exactness, which a GPU's float32 matmuls do not give (TF32-like on MLX's
    CUDA backend), and of the path a machine without GPU kernels takes (caches made inside
    choose it, since MLX's default device is then the CPU)."""
    with mx.stream(mx.cpu):
        yield


def example_kind(scheme: str, head_dim: int) -> tuple[CacheKind, float | None]:
    """The first of installed ``scheme``'s examples whose kind stores vectors of ``head_dim``, and
    the scheme's ``model_tolerance``; skips the calling test when no example does."""
    registered = get_plugin_host().schemes[scheme].scheme
    for example in registered.examples:
        kind = registered.parse(example)
        try:
            kind.check_layer(head_dim)
        except ConfigError:
            continue
        return kind, registered.model_tolerance
    pytest.skip(f"no example of {scheme} fits head_dim {head_dim}")


@functools.cache
def example_model(path: str, scheme: str, window: Window | None = None) -> Model:
    """The model at ``path`` loaded with ``example_kind(scheme, 32)`` (the tiny models' head_dim) under
    ``window``, once per process."""
    kind, _ = example_kind(scheme, 32)
    return Model.load(path, LoadOptions(kv_cache=kind, kv_eviction=window))


@attrs.frozen
class Capabilities:
    """What a scheme claims; checks of an unclaimed capability are skipped, not failed."""

    trim: bool = True
    state: bool = True
    window: bool = True
    dtypes: tuple[str, ...] = ("float32", "float16", "bfloat16")


class SchemeFixtures:
    """The fixtures a conformance subclass must provide, and shared helpers.

    ``scheme`` (class attribute): the registered scheme name under test.
    """

    scheme: str = ""

    @pytest.fixture
    def cache_kind(self) -> CacheKind:
        """The ``CacheKind`` under test (parametrize the fixture to cover several)."""
        raise NotImplementedError("provide a cache_kind fixture returning the CacheKind to check")

    @pytest.fixture
    def attention_tolerance(self, cache_kind, dtype) -> float:
        """Largest allowed ‖out − ref‖ / ‖ref‖ of attention output against fp32 attention
        over the original (unencoded) keys and values, for ``cache_kind`` in ``dtype``."""
        raise NotImplementedError("provide attention_tolerance(cache_kind, dtype) -> relative error bound")

    @pytest.fixture
    def chunking_tolerance(self, attention_tolerance) -> float:
        """Largest allowed relative difference between decode attention over the same positions
        stored in different chunkings (a chunked prefill against one token at a time), under
        any window. Default: an eighth of ``attention_tolerance`` — storage should hold a
        position alike however it arrived, up to rounding; a scheme that encodes a chunk's
        tokens jointly may raise it."""
        return attention_tolerance / 8

    @pytest.fixture
    def invalid_kinds(self) -> list:
        """Zero-argument callables that must each raise ``ConfigError`` (bad bits, group sizes...)."""
        raise NotImplementedError("provide invalid_kinds: callables that build invalid kinds")

    @pytest.fixture
    def capabilities(self) -> Capabilities:
        """What the scheme supports; defaults to everything."""
        return Capabilities()

    @pytest.fixture(params=["float32", "float16", "bfloat16"])
    def dtype(self, request, capabilities) -> mx.Dtype:
        """The model dtype the caches are created for."""
        if request.param not in capabilities.dtypes:
            pytest.skip(f"{self.scheme} does not claim dtype {request.param}")
        return getattr(mx, request.param)

    @pytest.fixture
    def layer_spec(self, dtype) -> LayerSpec:
        """A small GQA-shaped layer: 2 KV heads of 64 dims, 256 positions."""
        return LayerSpec(n_kv_heads=2, head_dim=64, max_positions=256, dtype=dtype)
