"""Configuration classes reject invalid values with messages that say what is valid."""

import pytest

from butter_core import Affine, Aura, ConfigError, LoadOptions, Raw, Window


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Affine(bits=5), "bits must be one of 4, 6, 8"),
        (lambda: Affine(bits=4, group_size=48), "group_size must be one of 32, 64, 128"),
        (lambda: Aura(key_bits=5), "key_bits must be one of 2, 3, 4, 8"),
        (lambda: Aura.named("aurora"), "aura{kbits}v{vbits}"),
        (lambda: Raw(dtype="int8"), "dtype must be one of"),
        (lambda: Window(max_size=0), "max_size must be a positive integer"),
        (lambda: Window(max_size=8, keep=8), "keep \\(8\\) must be smaller than Window.max_size \\(8\\)"),
        (lambda: Window(max_size=8, keep=-1), "non-negative"),
        (lambda: LoadOptions(max_context_length=0), "max_context_length must be a positive integer"),
        (lambda: LoadOptions(kv_cache="affine4"), "parse_kv_cache"),
        (lambda: LoadOptions(kv_eviction=(8, 2)), "Window\\(max_size, keep\\)"),
    ],
)
def test_invalid_configuration_is_rejected(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_group_size_must_divide_head_dim():
    Affine(bits=4, group_size=64).check_layer(128)
    with pytest.raises(ConfigError, match="does not divide head_dim 96.*32"):
        Affine(bits=4, group_size=64).check_layer(96)


def test_defaults_follow_the_seed():
    assert Affine(bits=8).group_size == 64 and str(Affine(bits=8)) == "affine8"
    assert Affine(bits=4).group_size == 32 and str(Affine(bits=4, group_size=64)) == "affine4g64"
    assert Aura.named("aura4v2") == Aura(4, 2) and str(Aura(8, 4)) == "aura8v4"
    assert LoadOptions().kv_cache == Raw() and LoadOptions().kv_eviction is None
    assert Window(2048).keep == 4 and Window(2048).ring_size == 2044
