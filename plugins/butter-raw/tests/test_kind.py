"""``Raw`` rejects dtypes it cannot store, and is the scheme attention layers get by default."""

import pytest

from butter_core import ConfigError, LoadOptions
from butter_core.layer_caches import kv_cache_kind

from butter_raw import Raw


def test_invalid_dtype_is_rejected():
    with pytest.raises(ConfigError, match="dtype must be one of"):
        Raw(dtype="int8")


def test_raw_is_the_default_attention_scheme():
    assert kv_cache_kind(LoadOptions()) == Raw()
    assert kv_cache_kind(LoadOptions(kv_cache="raw-float32")) == Raw("float32")
