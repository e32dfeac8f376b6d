"""``SSM``: the configuration of butter-ssm's caches (the dtype the recurrent state is kept in)."""

from __future__ import annotations

from typing import ClassVar

import attrs

from butter_core.plugin_api import CacheKind, one_of

MODEL_DTYPE = "model"
STATE_DTYPES = ("float32", "bfloat16", "float16", MODEL_DTYPE)


@attrs.frozen
class SSM(CacheKind):
    """Recurrent state caches for Mamba2 and gated delta layers.

    ``state_dtype`` is how the recurrent state is kept between tokens: ``float32`` by
    default, because the state is a running sum that every token decays and adds to; kept
    in 16 bits it is rounded once per token, and the rounding accumulates over a long
    context where an attention cache's rows are each rounded once (docs/benchmarks.md
    measures the difference). ``model`` keeps it in the model's dtype, as mlx-lm does.
    The scan itself always runs in float32; the convolution's inputs are kept in the
    model's dtype.
    """

    scheme: ClassVar[str] = "ssm"
    state_dtype: str = attrs.field(default="float32", validator=one_of("state_dtype", STATE_DTYPES))

    def __str__(self) -> str:
        return "ssm" if self.state_dtype == "float32" else f"ssm-{self.state_dtype}"
