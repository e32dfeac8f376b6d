"""``Aura`` rejects invalid values with messages that say what is valid."""

import pytest

from butter_core import ConfigError, LoadOptions

from butter_aura import Aura


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Aura(key_bits=5), "key_bits must be one of 2, 3, 4, 8"),
        (lambda: Aura.named("aurora"), "aura{kbits}v{vbits}"),
    ],
)
def test_invalid_kinds_are_rejected(build, message):
    with pytest.raises(ConfigError, match=message):
        build()


def test_names_round_trip():
    assert Aura.named("aura4v2") == Aura(4, 2) and str(Aura(8, 4)) == "aura8v4"
    assert LoadOptions(kv_cache="aura8v4").kv_cache == Aura(8, 4)
