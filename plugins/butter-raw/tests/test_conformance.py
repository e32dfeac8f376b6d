"""butter-raw against the conformance suite shipped in butter-core."""

import pytest

from butter_core import LayerSpec, Raw, parse_kv_cache
from butter_core.testing import SchemeConformance

# fp32 storage is exact up to summation order; fp16/bf16 storage rounds each element.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


class TestRawConformance(SchemeConformance):
    scheme = "raw"

    @pytest.fixture(params=["raw", "raw-float32"])
    def cache_kind(self, request):
        return parse_kv_cache(request.param)

    @pytest.fixture
    def attention_tolerance(self, cache_kind, dtype):
        stored = cache_kind.dtype or str(dtype).removeprefix("mlx.core.")
        return max(TOLERANCE[stored], TOLERANCE[str(dtype).removeprefix("mlx.core.")])

    @pytest.fixture
    def invalid_kinds(self):
        return [lambda: Raw(dtype="int8"), lambda: Raw(dtype="float64"), lambda: LayerSpec(0, 64, 16)]
