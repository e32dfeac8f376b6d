"""butter-ssm's GPU kernels: one fused decode step per mixer, written once in butter's dialect
(Metal and CUDA), each checked against its mixer's pure-mx reference.

* ``mamba2_step`` (``mamba2.py``): a Mamba2 layer's token, one launch.
* ``gated_delta_step`` (``gated_delta.py``): a gated delta layer's token, one launch.

Each reads the kept convolution inputs and the state once and writes them once (the state
in its stored dtype, float32 arithmetic), and returns ``(out, conv_state, state)`` as the
mixer's ``reference`` does. ``ops_for(spec)`` is what a cache runs its updates with:
the fused step for one-token updates where MLX's default device is a GPU, the mixer's own
reference (chunked matmuls) for prompts and everywhere else. ``KERNEL_CHECKS`` pairs the
kernels with their references for the conformance suite and ``bench/gpu_ssm_decode.py``.
"""

from __future__ import annotations

from butter_core.plugin_api import GATED_DELTA, MAMBA2, StateSpec, default_device_is_gpu

from butter_ssm.kernels import gated_delta, mamba2
from butter_ssm.kernels.checks import KERNEL_CHECKS
from butter_ssm.kernels.gated_delta import gated_delta_step
from butter_ssm.kernels.mamba2 import mamba2_step

_STEPS = {
    MAMBA2: (mamba2_step, mamba2.serves, mamba2.available),
    GATED_DELTA: (gated_delta_step, gated_delta.serves, gated_delta.available),
}


def ops_for(spec: StateSpec):
    """How a cache of ``spec`` runs its updates: None (the mixer's reference) unless MLX's default
    device is a GPU whose backend runs the kernels and ``spec`` is a layer they serve; then
    ``ops(mixer, conv_state, state, *inputs) -> (out, conv_state, state)``, the fused kernel for
    one-token updates and the mixer's reference (chunked matmuls) for longer ones. Decided once,
    when a cache is made."""
    found = _STEPS.get(spec.layer_type)
    if found is None or not default_device_is_gpu():
        return None
    step, serves, available = found
    if not (available() and serves(spec)):
        return None

    def ops(mixer, conv_state, state, *inputs):
        if inputs[0].shape[1] == 1:
            return step(mixer, conv_state, state, *inputs)
        return mixer.reference(conv_state, state, *inputs)

    return ops


__all__ = ["KERNEL_CHECKS", "gated_delta_step", "mamba2_step", "ops_for"]
