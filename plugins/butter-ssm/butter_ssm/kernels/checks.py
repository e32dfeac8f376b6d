"""``KERNEL_CHECKS``: each fused decode step against its mixer's pure-mx reference at one token.

A step returns three arrays (output, kept conv inputs, state) and a ``KernelCheck`` compares one,
so each kernel has three checks, ``<kernel>`` (the output), ``<kernel>_state`` and
``<kernel>_conv``; they share ``make_*_inputs`` and cases. The reference is
``mixer.reference(conv_state, state, *inputs)`` (``butter_core.recurrent``) with the state it
returns in the state's own dtype, as ``StateCache`` keeps it.

Cases cover Qwen3-Next-80B-like gated delta layers (Hv 32, Hk 16, Dk = Dv = 128) and
Granite/Mamba2-like layers (H 64 and 128, P 64, N 128, G 1 and 8), small odd shapes (rows and
columns that do not fill a warp), batch 1 and above, float32/bfloat16/float16 activations,
float32/bfloat16/float16 states, with and without a convolution bias, and a ``dt_limit``.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from butter_core.plugin_api import GatedDeltaMixer, KernelCheck, Mamba2Mixer

from butter_ssm.kernels.gated_delta import gated_delta_step
from butter_ssm.kernels.mamba2 import mamba2_step

STATE_RTOL = {mx.float32: 1e-4, mx.float16: 4e-3, mx.bfloat16: 1e-2}
"""Bound on the new state's ``‖out − ref‖/‖ref‖`` by state dtype. Measured under both emulators
over every case: float32 states within 1e-7 of the reference, 16-bit states within 1.1e-5 (a few
values on the other side of a rounding). The float32 bound leaves room for what a GPU adds: its
``exp`` is a few ulp from MLX's CPU one, so now and then a 16-bit activation rounds to the
neighbouring value (one part in 256 of it), and a ``B`` or ``k`` channel feeds a whole column
of the state (~1e-5 per such channel at the checks' shapes). A kernel that rounded SiLU
differently from the reference would fail it (3e-4 to 1.1e-3, see ``source.py``)."""

OUT_RTOL = {mx.float32: 1e-5, mx.float16: 2e-3, mx.bfloat16: 1e-2}
"""Bound on the output's relative error by activation dtype (``DEFAULT_RTOL``)."""


def _random_state(rng: np.random.Generator, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape, dtype=np.float32) * 0.5).astype(dtype)


def make_mamba2_inputs(
    seed: int, *, batch: int = 1, heads: int = 4, head_dim: int = 8, groups: int = 2, state_size: int = 8,
    conv_kernel: int = 4, dtype: mx.Dtype = mx.bfloat16, state_dtype: mx.Dtype = mx.float32, bias: bool = True,
    dt_limit: tuple[float, float] = (0.0, math.inf),
) -> dict:
    """A random Mamba2 layer at a real layer's scale and one token's inputs: conv taps ~N(0, 0.5²),
    ``A = -exp(U(0, log 16))`` and ``dt_bias`` so that ``dt`` spans about 1e-3..0.3 (Mamba2's
    initialisation), a state of ~N(0, 0.5²) as after some tokens."""
    rng = np.random.default_rng(seed)
    conv_dim = heads * head_dim + 2 * groups * state_size

    def normal(*shape, scale=1.0):
        return mx.array(rng.standard_normal(shape, dtype=np.float32) * scale)

    mixer = Mamba2Mixer(
        conv_weight=normal(conv_dim, conv_kernel, scale=0.5).astype(dtype),
        conv_bias=normal(conv_dim, scale=0.1).astype(dtype) if bias else None,
        dt_bias=mx.array(rng.uniform(-6.0, -1.0, heads).astype(np.float32)),
        A=-mx.exp(mx.array(rng.uniform(0.0, math.log(16.0), heads).astype(np.float32))),
        D=normal(heads),
        heads=heads, head_dim=head_dim, groups=groups, state_size=state_size, dt_limit=dt_limit,
    )
    return {
        "mixer": mixer,
        "conv_state": normal(batch, conv_kernel - 1, conv_dim).astype(dtype),
        "state": _random_state(rng, (batch, heads, head_dim, state_size), state_dtype),
        "xbc": normal(batch, 1, conv_dim).astype(dtype),
        "dt": normal(batch, 1, heads).astype(dtype),
    }


def make_gated_delta_inputs(
    seed: int, *, batch: int = 1, key_heads: int = 2, value_heads: int = 4, key_dim: int = 16, value_dim: int = 8,
    conv_kernel: int = 4, dtype: mx.Dtype = mx.bfloat16, state_dtype: mx.Dtype = mx.float32, bias: bool = False,
) -> dict:
    """A random gated delta layer at a real layer's scale (Qwen3-Next has no conv bias; ``bias``
    adds one) and one token's inputs: ``A_log ~ U(0, log 16)``, ``dt_bias ~ U(-4, 1)``, a state of
    ~N(0, 0.5²)."""
    rng = np.random.default_rng(seed)
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim

    def normal(*shape, scale=1.0):
        return mx.array(rng.standard_normal(shape, dtype=np.float32) * scale)

    mixer = GatedDeltaMixer(
        conv_weight=normal(conv_dim, conv_kernel, scale=0.5).astype(dtype),
        conv_bias=normal(conv_dim, scale=0.1).astype(dtype) if bias else None,
        A_log=mx.array(rng.uniform(0.0, math.log(16.0), value_heads).astype(np.float32)),
        dt_bias=mx.array(rng.uniform(-4.0, 1.0, value_heads).astype(np.float32)),
        key_heads=key_heads, value_heads=value_heads, key_dim=key_dim, value_dim=value_dim,
    )
    return {
        "mixer": mixer,
        "conv_state": normal(batch, conv_kernel - 1, conv_dim).astype(dtype),
        "state": _random_state(rng, (batch, value_heads, key_dim, value_dim), state_dtype),
        "qkv": normal(batch, 1, conv_dim).astype(dtype),
        "a": normal(batch, 1, value_heads).astype(dtype),
        "b": normal(batch, 1, value_heads).astype(dtype),
    }


def _part(step: Callable, index: int) -> Callable:
    """One of ``step``'s three results (the state in the dtype it came in)."""

    def run(mixer, conv_state, state, **inputs):
        result = step(mixer, conv_state, state, *inputs.values())[index]
        return result.astype(state.dtype) if index == 2 else result

    run.__name__ = f"{getattr(step, '__name__', 'reference')}_{('out', 'conv', 'state')[index]}"
    return run


def _reference(mixer, conv_state, state, *inputs):
    return mixer.reference(conv_state, state, *inputs)


MAMBA2_CASES = (
    {},
    {"batch": 3, "heads": 6, "head_dim": 12, "groups": 3, "state_size": 20, "dtype": mx.float32, "bias": False},
    {"batch": 2, "heads": 4, "head_dim": 16, "groups": 1, "state_size": 64, "dtype": mx.float16,
     "state_dtype": mx.float16, "dt_limit": (0.01, 0.1)},
    {"batch": 2, "state_dtype": mx.bfloat16, "bias": False},
    {"heads": 64, "head_dim": 64, "groups": 1, "state_size": 128},  # Granite 4.0-H-like
    {"batch": 2, "heads": 128, "head_dim": 64, "groups": 8, "state_size": 128, "dtype": mx.float32},  # Mamba2-2.7B-like
    {"batch": 2, "heads": 64, "head_dim": 64, "groups": 8, "state_size": 128, "state_dtype": mx.bfloat16,
     "bias": False},
    {"heads": 128, "head_dim": 64, "groups": 8, "state_size": 128, "dtype": mx.float16, "state_dtype": mx.bfloat16},
)
"""Mamba2 cases: the first four small (rows of 8, 20 and 64 values: lanes that share a warp
between rows, a row that does not fill its lanes), then real layers' shapes."""

GATED_DELTA_CASES = (
    {},
    {"batch": 3, "key_heads": 1, "value_heads": 3, "key_dim": 24, "value_dim": 40, "dtype": mx.float32,
     "bias": True, "conv_kernel": 3},
    {"batch": 2, "key_heads": 2, "value_heads": 2, "key_dim": 32, "value_dim": 64, "dtype": mx.float16,
     "state_dtype": mx.float16},
    {"batch": 2, "state_dtype": mx.bfloat16, "bias": True},
    {"key_heads": 16, "value_heads": 32, "key_dim": 128, "value_dim": 128},  # Qwen3-Next-80B-like
    {"batch": 2, "key_heads": 16, "value_heads": 32, "key_dim": 128, "value_dim": 128, "dtype": mx.float32},
    {"batch": 2, "key_heads": 16, "value_heads": 32, "key_dim": 128, "value_dim": 128, "state_dtype": mx.bfloat16},
    {"key_heads": 16, "value_heads": 32, "key_dim": 128, "value_dim": 128, "dtype": mx.float16, "bias": True,
     "state_dtype": mx.bfloat16},
)
"""Gated delta cases: the first four small (8 columns and 16 rows: 16 row blocks of one row;
40 columns: a second, partly live column block; 24 rows over 4 row blocks), then
Qwen3-Next-80B-like layers."""


def _checks(name: str, step: Callable, make_inputs: Callable, cases: tuple) -> tuple[KernelCheck, ...]:
    return (
        KernelCheck(name=name, kernel=_part(step, 0), reference=_part(_reference, 0), make_inputs=make_inputs,
                    cases=cases, rtol=OUT_RTOL),
        KernelCheck(name=f"{name}_state", kernel=_part(step, 2), reference=_part(_reference, 2),
                    make_inputs=make_inputs, cases=cases, rtol=STATE_RTOL),
        KernelCheck(name=f"{name}_conv", kernel=_part(step, 1), reference=_part(_reference, 1),
                    make_inputs=make_inputs, cases=cases, rtol=OUT_RTOL),
    )


KERNEL_CHECKS: tuple[KernelCheck, ...] = (
    *_checks("mamba2_step", mamba2_step, make_mamba2_inputs, MAMBA2_CASES),
    *_checks("gated_delta_step", gated_delta_step, make_gated_delta_inputs, GATED_DELTA_CASES),
)
"""Both fused decode steps against their references (three checks each: output, state, conv inputs)."""
