"""butter-raw against the conformance suite shipped in butter-core."""

import mlx.core as mx
import pytest

from butter_core import LayerSpec, parse_kv_cache
from butter_core.testing import SchemeConformance

from butter_raw import Raw

# fp32 storage is exact up to summation order where float32 matmuls are float32; fp16/bf16
# storage rounds each element. MLX's CUDA backend computes float32 matmuls and attention
# with TF32-like precision: on an H200 (MLX 0.32.4) the suite's float32 cases reached 4.0e-4
# relative error against the float32 reference (2026-11-30), so there float32 gets 1e-3.
FLOAT32_MATMULS_ROUND = mx.cuda.is_available() and mx.default_device() == mx.gpu
TOLERANCE = {"float32": 1e-3 if FLOAT32_MATMULS_ROUND else 1e-5, "float16": 2e-3, "bfloat16": 1.5e-2}


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
