"""butter-ssm runs core's recurrent conformance suite: fixtures only."""

import mlx.core as mx
import pytest

from butter_core import parse_kv_cache
from butter_core.testing import RecurrentConformance

from butter_ssm import SSM

FLOAT32_MATMULS_ROUND = mx.cuda.is_available() and mx.default_device() == mx.gpu
TOLERANCE = {"float32": 1e-3 if FLOAT32_MATMULS_ROUND else 2e-5, "float16": 6e-3, "bfloat16": 6e-2}
"""Outputs against the float32 recompute over the whole history, by model dtype. The worst of 40
random sequences of up to 120 tokens per layer type (the state machine's shape; 2-core CPU,
2026-12-04): float32 4.4e-7; float16 2.2e-3; bfloat16 2.8e-2 — a 16-bit model rounds the
convolution's output and its activation to 16 bits before the scan, as transformers does, and
the float32 reference does not."""
STATE_ROUNDING = {"float32": 0.0, "bfloat16": 2e-2, "float16": 4e-3}
"""What keeping the state itself in 16 bits adds (rounded once per token): ssm-bfloat16 in a
float32 model measured 3.8e-3 (mamba2) and 7.2e-3 (gated delta) at worst over the same sequences;
docs/benchmarks.md measures it over 8k tokens."""


class TestSSMConformance(RecurrentConformance):
    scheme = "ssm"

    @pytest.fixture(params=["ssm", "ssm-bfloat16", "ssm-model"])
    def cache_kind(self, request):
        return parse_kv_cache(request.param)

    @pytest.fixture
    def state_tolerance(self, cache_kind, dtype):
        name = str(dtype).removeprefix("mlx.core.")
        state = cache_kind.state_dtype if cache_kind.state_dtype != "model" else name
        return TOLERANCE[name] + STATE_ROUNDING[state]

    @pytest.fixture
    def invalid_kinds(self):
        return [lambda: SSM(state_dtype="int8"), lambda: SSM(state_dtype=None)]
