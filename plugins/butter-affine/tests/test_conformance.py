"""butter-affine against the conformance suite shipped in butter-core, unmodified."""

import pytest

from butter_core import LayerSpec, parse_kv_cache
from butter_core.testing import SchemeConformance

from butter_affine import Affine

TOLERANCE = {8: 0.02, 6: 0.05, 4: 0.25}
"""Relative attention error allowed against fp32 attention over the original K/V, by
code width, for every model dtype and group size. Measured over this suite's chunk and
window patterns with 4 seeds (342 attention calls per kind and dtype, CPU path):
affine8 0.0066 median / 0.0119 worst (bf16), affine8g32 0.0108 worst; affine6 0.024 /
0.033, affine6g64 0.028 / 0.040; affine4 0.102 / 0.170, affine4g64 0.114 / 0.186.
That is the quantization itself (Gaussian vectors lose ~8% per element at 4 bits,
~2% at 6, ~0.5% at 8); the model dtype's rounding is lost in it. A wrong slot, a lost
scale or bias, or stale codes give errors above 0.5."""


class TestAffineConformance(SchemeConformance):
    scheme = "affine"

    @pytest.fixture(params=["affine8", "affine6", "affine4", "affine4g64"])
    def cache_kind(self, request):
        return parse_kv_cache(request.param)

    @pytest.fixture
    def attention_tolerance(self, cache_kind, dtype):
        return TOLERANCE[cache_kind.bits]

    @pytest.fixture
    def invalid_kinds(self):
        return [
            lambda: Affine(bits=5),
            lambda: Affine(bits=4, group_size=48),
            lambda: parse_kv_cache("affine3"),
            lambda: parse_kv_cache("affine4g16"),
            lambda: LayerSpec(n_kv_heads=2, head_dim=0, max_positions=16),
        ]
