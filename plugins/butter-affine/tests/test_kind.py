"""``Affine`` rejects invalid values with messages that say what is valid; its defaults follow the seed."""

import pytest

from butter_core import ConfigError, LoadOptions

from butter_affine import Affine


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Affine(bits=5), "bits must be one of 4, 6, 8"),
        (lambda: Affine(bits=4, group_size=48), "group_size must be one of 32, 64, 128"),
        (lambda: LoadOptions(kv_cache="affine5"), "bits must be one of 4, 6, 8"),
    ],
)
def test_invalid_kinds_are_rejected(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_group_size_must_divide_head_dim():
    Affine(bits=4, group_size=64).check_layer(128)
    with pytest.raises(ConfigError, match="does not divide head_dim 96.*32"):
        Affine(bits=4, group_size=64).check_layer(96)


def test_defaults_follow_the_seed():
    assert Affine(bits=8).group_size == 64 and str(Affine(bits=8)) == "affine8"
    assert Affine(bits=4).group_size == 32 and str(Affine(bits=4, group_size=64)) == "affine4g64"
    assert LoadOptions(kv_cache="affine4g64").kv_cache == Affine(4, 64)
