"""Configuration classes reject invalid values with messages that say what is valid."""

import pytest

import mlx.core as mx

from butter_core import ConfigError, LayerSpec, LoadOptions, Window, make_layer_caches, parse_kv_cache


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Window(max_size=0), "max_size must be a positive integer"),
        (lambda: Window(max_size=8, keep=8), "keep \\(8\\) must be smaller than Window.max_size \\(8\\)"),
        (lambda: Window(max_size=8, keep=-1), "non-negative"),
        (lambda: LoadOptions(max_context_length=0), "max_context_length must be a positive integer"),
        (lambda: LoadOptions(kv_cache=4), "kv_cache must be None .*a scheme's CLI string"),
        (lambda: LoadOptions(state_cache=b"ssm"), "state_cache must be None"),
        (lambda: LoadOptions(kv_eviction=(8, 2)), "Window\\(max_size, keep\\)"),
    ],
)
def test_invalid_configuration_is_rejected(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_defaults_follow_the_seed():
    assert LoadOptions().kv_cache is None and LoadOptions().state_cache is None  # raw and ssm, when made
    assert LoadOptions().kv_eviction is None
    assert Window(2048).keep == 4 and Window(2048).ring_size == 2044


@pytest.mark.usefixtures("raw_scheme")
def test_a_scheme_may_be_given_as_its_cli_string():
    assert LoadOptions(kv_cache="raw-float32").kv_cache == parse_kv_cache("raw-float32")


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: parse_kv_cache(None), "named by a string such as 'raw'.*got None"),
        (lambda: make_layer_caches("raw", [LayerSpec(2, 64, 16)]), r"kind must be a CacheKind.*parse_kv_cache\('raw'\)"),
        (lambda: make_layer_caches(_raw(), LayerSpec(2, 64, 16)), "specs must be a list of LayerSpec"),
        (lambda: make_layer_caches(_raw(), [(2, 64, 16)]), "specs must be a list of LayerSpec"),
        (lambda: make_layer_caches(_raw(), [LayerSpec(2, 64, 16)], "window"), "eviction must be None, Window"),
        (lambda: make_layer_caches(_raw(), [LayerSpec(2, 64, 16)], layer_windows=[]), "0 layer_windows for 1 specs"),
    ],
)
@pytest.mark.usefixtures("raw_scheme")
def test_api_misuse_is_a_config_error_saying_what_was_expected(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def _raw():
    return parse_kv_cache("raw")


@pytest.mark.usefixtures("raw_scheme")
@pytest.mark.parametrize("window", [None, Window(8, keep=2)])
@pytest.mark.parametrize(
    ("queries", "keys", "message"),
    [
        ((1, 4, 1, 128), (1, 2, 1, 128), r"keys of shape \[1, 2, 1, 128\]; this cache holds \[batch 1, kv heads 2, tokens, head_dim 64\]"),
        ((1, 6, 1, 64), (1, 3, 1, 64), r"keys of shape \[1, 3, 1, 64\]"),
        ((4, 1, 64), (2, 1, 64), r"keys of shape \[2, 1, 64\]"),
        ((1, 3, 1, 64), (1, 2, 1, 64), "queries of shape .* a multiple of 2 heads"),
        ((1, 4, 2, 64), (1, 2, 1, 64), "queries of shape .* 1 tokens"),
    ],
)
def test_a_chunk_of_the_wrong_shape_is_a_config_error(window, queries, keys, message):
    cache = make_layer_caches(_raw(), [LayerSpec(2, 64, 16)], window)[0]
    with pytest.raises(ConfigError, match=message):
        cache.update_and_attend(mx.zeros(queries), mx.zeros(keys), mx.zeros(keys), scale=1.0)
    with pytest.raises(ConfigError, match="(keys|values) of shape"):
        cache.append(mx.zeros(keys), mx.zeros(keys[:-1] + (32,)))
    assert cache.absolute_position == 0
