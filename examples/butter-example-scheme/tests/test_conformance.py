"""butter-example-scheme against the conformance suite shipped in butter-core, unmodified."""

import pytest

from butter_core import LayerSpec, parse_kv_cache
from butter_core.testing import SchemeConformance

from butter_example_scheme import FP8

TOLERANCE = 0.08
"""Relative attention error allowed against fp32 attention over the original K/V, for
every model dtype and both scale dtypes. E4M3 keeps 3 mantissa bits, so each element
is off by at most 2^-4 = 6.25% of itself, and a vector by ~2.6% (measured). Measured
attention errors: 0.026-0.043 in this suite's fixed cases; 0.059 at worst over 9,000
random chunk patterns and windows (1,500 per model dtype x scale dtype), the tail being
single-token decode steps. The model dtype's own rounding (<= 1.5e-2 for bf16) is lost
in that noise. A real encoding bug (a lost scale, a wrong slot) gives errors above 0.3."""


class TestFP8Conformance(SchemeConformance):
    scheme = "fp8"

    @pytest.fixture(params=["fp8", "fp8-scale-float32"])
    def cache_kind(self, request):
        return parse_kv_cache(request.param)

    @pytest.fixture
    def attention_tolerance(self, cache_kind, dtype):
        return TOLERANCE

    @pytest.fixture
    def invalid_kinds(self):
        return [
            lambda: FP8(scale_dtype="int8"),
            lambda: FP8(scale_dtype="float64"),
            lambda: FP8(scale_dtype=16),
            lambda: LayerSpec(n_kv_heads=2, head_dim=0, max_positions=16),
        ]
