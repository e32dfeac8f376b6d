"""Each layer's cache comes from the scheme configured for its layer type; eviction bounds attention only."""

from __future__ import annotations

import sys
import types
from typing import ClassVar

import attrs
import mlx.core as mx
import pytest

from butter_core import CacheKind, CacheScheme, ConfigError, LayerSpec, Window, hookimpl, make_layer_caches
from butter_core.cache import ATTENTION
from butter_core.plugins import temporary_plugin
from butter_core.recurrent import GATED_DELTA, MAMBA2, Mamba2Mixer, StateCache, StateSpec
from butter_core.window import WindowCache

pytestmark = pytest.mark.usefixtures("raw_scheme")


@attrs.frozen
class Toy(CacheKind):
    scheme: ClassVar[str] = "toystate"

    def __str__(self) -> str:
        return "toystate"


def _plugin() -> types.ModuleType:
    module = types.ModuleType("toystate_plugin")

    @hookimpl
    def butter_register_cache_schemes(register):
        register(CacheScheme(
            name="toystate", kind_type=Toy, parse=lambda text: Toy() if text == "toystate" else None,
            create=lambda kind, specs: [StateCache(spec) for spec in specs], examples=("toystate",),
            layer_types=(MAMBA2,),
        ))  # fmt: skip

    module.butter_register_cache_schemes = butter_register_cache_schemes
    return module


@pytest.fixture
def toy():
    plugin = _plugin()
    sys.modules[plugin.__name__] = plugin
    with temporary_plugin(plugin, name="toystate") as host:
        yield host
    del sys.modules[plugin.__name__]


SPECS = [
    LayerSpec(2, 64, 32, layer_index=0),
    StateSpec(MAMBA2, conv_dim=24, conv_kernel=4, state_shape=(2, 8, 4), layer_index=1),
    LayerSpec(2, 64, 32, layer_index=2),
]


def test_each_layer_type_gets_its_scheme_and_only_attention_is_evicted(toy):
    from butter_core import parse_kv_cache

    caches = make_layer_caches({ATTENTION: parse_kv_cache("raw"), MAMBA2: Toy()}, SPECS, Window(8, keep=2), host=toy)
    assert isinstance(caches[0], WindowCache) and isinstance(caches[2], WindowCache)
    assert type(caches[1]) is StateCache and caches[1].capacity is None
    assert caches[1].nbytes_allocated == (3 * 24 + 2 * 8 * 4) * 4  # conv inputs + float32 state, whatever the context


def test_a_scheme_is_never_given_a_layer_type_it_does_not_store(toy):
    from butter_core import parse_kv_cache

    with pytest.raises(ConfigError, match="layer 1 is a mamba2 layer; the 'raw' scheme stores attention layers only: "
                                          "recurrent layers take --state-cache"):  # fmt: skip
        make_layer_caches(parse_kv_cache("raw"), SPECS, host=toy)
    with pytest.raises(ConfigError, match="layer 0 is a attention layer; the 'toystate' scheme stores mamba2 .*--kv-cache"):
        make_layer_caches(Toy(), SPECS, host=toy)
    with pytest.raises(ConfigError, match="layer 1 is a mamba2 layer, but no kind was given for that type"):
        make_layer_caches({ATTENTION: parse_kv_cache("raw")}, SPECS, host=toy)
    gated = StateSpec(GATED_DELTA, conv_dim=24, conv_kernel=4, state_shape=(2, 8, 4))
    with pytest.raises(ConfigError, match="gated_delta layer; the 'toystate' scheme stores mamba2 layers only"):
        make_layer_caches(Toy(), [gated], host=toy)


def test_state_specs_are_checked():
    with pytest.raises(ConfigError, match="conv_kernel must be a positive integer"):
        StateSpec(MAMBA2, conv_dim=8, conv_kernel=0, state_shape=(1, 2, 3))
    with pytest.raises(ConfigError, match="state_shape must be positive integers"):
        StateSpec(MAMBA2, conv_dim=8, conv_kernel=4, state_shape=(1, 0))


def _mixer() -> Mamba2Mixer:
    """A Mamba2 mixer of 2 heads of 8, one group of state size 4 (conv_dim 24), random weights."""
    key = mx.random.key(0)
    parts = mx.random.split(key, 4)
    return Mamba2Mixer(
        conv_weight=mx.random.normal((24, 4), key=parts[0]) * 0.5, conv_bias=None,
        dt_bias=mx.random.normal((2,), key=parts[1]), A=-mx.exp(mx.random.normal((2,), key=parts[2])),
        D=mx.ones((2,)), heads=2, head_dim=8, groups=1, state_size=4,
    )  # fmt: skip


def test_a_recurrent_cache_cannot_trim_and_rewinds_to_a_snapshot(toy):
    cache = make_layer_caches(Toy(), SPECS[1:2], host=toy)[0]
    mixer, inputs = _mixer(), mx.random.normal((1, 8, 24), key=mx.random.key(1))
    steps = mx.random.normal((1, 8, 2), key=mx.random.key(2))
    cache.update_and_mix(mixer, inputs[:, :5], steps[:, :5])
    assert cache.trim(3) == 0 and cache.absolute_position == 5
    snapshot = cache.snapshot()
    first = cache.update_and_mix(mixer, inputs[:, 5:], steps[:, 5:])
    cache.rewind(snapshot)
    assert cache.absolute_position == 5 == snapshot.position
    assert mx.array_equal(cache.update_and_mix(mixer, inputs[:, 5:], steps[:, 5:]), first)
    with pytest.raises(ConfigError, match="does not fit this cache"):
        cache.restore({"conv": mx.zeros((1, 3, 24))}, {"position": 0})
    with pytest.raises(ConfigError, match=r"mixer input of shape \[1, 2, 23\]"):
        cache.update_and_mix(mixer, inputs[:, :2, :23], steps[:, :2])
