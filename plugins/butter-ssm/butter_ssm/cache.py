"""``SSMCache``: a recurrent layer's convolution inputs and state, updated by core's mixers or by kernels."""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import StateCache, StateSpec

from butter_ssm.kind import MODEL_DTYPE, SSM


class SSMCache(StateCache):
    """One Mamba2 or gated delta layer's cache, its state kept in ``kind.state_dtype``.

    ``ops`` chooses how an update runs (``butter_ssm.kernels.ops_for``): a fused kernel per
    decode step where the default device is a GPU, the mixer's chunked reference otherwise.
    """

    def __init__(self, spec: StateSpec, kind: SSM, ops=None):
        dtype = spec.dtype if kind.state_dtype == MODEL_DTYPE else getattr(mx, kind.state_dtype)
        super().__init__(spec, state_dtype=dtype)
        self.kind = kind
        self.ops = ops

    def mix(self, mixer, conv_state, state, *inputs):
        if self.ops is None:
            return super().mix(mixer, conv_state, state, *inputs)
        return self.ops(mixer, conv_state, state, *inputs)
