"""``mamba2_step``: one decode token of a Mamba2 (SSD) layer, one launch.

The convolution's shift, SiLU, the time step, the state update and the output with its ``D``
skip, fused: per token and layer the kernel reads the state once and writes it once, and reads
the new input, the ``K - 1`` kept inputs and the layer's small parameters.

Layout. The state is ``[B, H, P, N]``, each head's ``P`` rows of ``N`` contiguous values. Row
``p`` is independent of the others: ``S[p, n] = S[p, n]·exp(dt·A) + (dt·B[n])·x[p]`` and
``y[p] = S[p, :]·C + D·x[p]``, a sum along the row. So a row belongs to ``LANES`` adjacent
lanes of a warp (32, or ``N`` rounded up to a power of two when smaller), lane ``l`` holding
``n = l, l + LANES, …``: every load and store of a warp is one contiguous run of the row (128
bytes of a float32 state, 64 of a 16-bit one), and ``y[p]`` is a sum over the lane group
(``bt_group_sum``) with no threadgroup memory. A threadgroup is one ``(sequence, head)``:
``WARPS`` warps (8 when ``P`` is 64 or more) take its rows ``STEPS`` at a time, each lane
holding ``STEPS·CH`` state values, loaded before anything else so that their latency overlaps
the convolution. ``B·H`` threadgroups: 128 at batch 1 for a Mamba2-2.7B-like layer (H 128, P 64,
N 128), each lane holding 32 float32 values.

What rows share (the head's ``x``, its group's ``B`` and ``C``: ``P + 2N`` channels of the
convolution and SiLU) the threadgroup computes first, into threadgroup memory. A channel's new
kept inputs are written by one thread: ``x`` channels by their head's threadgroup, ``B``/``C``
channels by the threadgroup of their group's first head (the other heads of a group recompute
its ``B`` and ``C``, ``2·N·K`` multiply-adds, instead of a second launch).

Per token and layer, memory traffic: the state read and written once (``B·H·P·N`` values each
way), the output (``B·H·P``), the conv inputs (``K`` values per channel read, ``K − 1``
written) and parameters.

Arithmetic in float32 as ``butter_core.recurrent_ops.ssd_recurrent`` orders it, ``dt`` as
``mamba2_dt`` (softplus, then clipped to ``dt_limit``), with the rounding of the reference's
convolution and SiLU (``source.py``); the state is read and written in its own dtype.
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import Kernel, Mamba2Mixer, StateSpec, kernel_params

from butter_ssm.kernels.source import HELPERS

ROWS_PER_WARP = 8
"""Rows a warp takes (``STEPS``) when the head has enough rows for ``WARPS`` warps of them."""
MAX_WARPS = 8
MAX_VALUES = 64
"""Most state values one lane keeps in registers (``STEPS · CH``)."""

_MAMBA2 = Kernel(
    name="butter_ssm_mamba2_step",
    input_names=("xbc", "dt", "conv_state", "state", "conv_weight", "conv_bias", "dt_bias", "a", "d", "dt_limit"),
    output_names=("out", "conv_out", "state_out"),
    helpers=HELPERS,
    body="""
  constexpr int HEADS_PER_GROUP = H / G;
  constexpr int CD = H * P + 2 * G * N;
  constexpr int THREADS = WARPS * BT_WARP_SIZE;
  constexpr int ROWS_AT_ONCE = WARPS * (BT_WARP_SIZE / LANES);
  constexpr int CH = (N + LANES - 1) / LANES;
  const int b = static_cast<int>(block_idx.z);
  const int h = static_cast<int>(block_idx.y);
  const int group = h / HEADS_PER_GROUP;
  const int sub = static_cast<int>(lane_id) % LANES;
  const int slot = static_cast<int>(warp_id) * (BT_WARP_SIZE / LANES) + static_cast<int>(lane_id) / LANES;

  // This lane's state values: rows step * ROWS_AT_ONCE + slot, columns sub + c * LANES.
  const int64_t head = static_cast<int64_t>(b * H + h) * P * N;
  float s[STEPS * CH];
#pragma unroll
  for (int step = 0; step < STEPS; ++step) {
    const int p = step * ROWS_AT_ONCE + slot;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int n = sub + c * LANES;
      s[step * CH + c] = (p < P && n < N) ? bt_to_float(state[head + static_cast<int64_t>(p) * N + n]) : 0.0f;
    }
  }

  // dt = clip(softplus(dt + dt_bias), lo, hi); the decay exp(dt A).
  const int bh = b * H + h;
  float step_size = ssm_softplus(bt_to_float(dt[bh]) + bt_to_float(dt_bias[h]));
  step_size = bt_max(step_size, dt_limit[0]);
  step_size = step_size > dt_limit[1] ? dt_limit[1] : step_size;
  const float decay = bt_exp(step_size * bt_to_float(a[h]));

  // The head's x and its group's B and C: convolution and SiLU.
  BT_SHARED float xs[P];
  BT_SHARED float bs[N];
  BT_SHARED float cs[N];
  const bool writes_bc = h % HEADS_PER_GROUP == 0;
  for (int e = static_cast<int>(thread_rank); e < P + 2 * N; e += THREADS) {
    if (e < P) {
      xs[e] = ssm_conv_silu<T, K, CD, HAS_BIAS>(xbc, conv_state, conv_weight, conv_bias, conv_out, b, h * P + e, true);
    } else if (e < P + N) {
      bs[e - P] = ssm_conv_silu<T, K, CD, HAS_BIAS>(xbc, conv_state, conv_weight, conv_bias, conv_out, b,
                                                     H * P + group * N + (e - P), writes_bc);
    } else {
      cs[e - P - N] = ssm_conv_silu<T, K, CD, HAS_BIAS>(xbc, conv_state, conv_weight, conv_bias, conv_out, b,
                                                         H * P + G * N + group * N + (e - P - N), writes_bc);
    }
  }
  BT_BARRIER;

  // S = S exp(dt A) + (dt B) x, written once; y = S . C + D x, summed over the row's lanes.
  const float skip = bt_to_float(d[h]);
#pragma unroll
  for (int step = 0; step < STEPS; ++step) {
    const int p = step * ROWS_AT_ONCE + slot;
    const float x = p < P ? xs[p] : 0.0f;
    float y = 0.0f;
#pragma unroll
    for (int c = 0; c < CH; ++c) {
      const int n = sub + c * LANES;
      if (p < P && n < N) {
        const float v = s[step * CH + c] * decay + (step_size * bs[n]) * x;
        state_out[head + static_cast<int64_t>(p) * N + n] = bt_from_float<S>(v);
        y += v * cs[n];
      }
    }
    y = bt_group_sum<LANES>(y);
    if (sub == 0 && p < P) {
      out[static_cast<int64_t>(bh) * P + p] = bt_from_float<T>(y + x * skip);
    }
  }
""",
)


def lanes(state_size: int) -> int:
    """Lanes per state row: 32, or ``state_size`` rounded up to a power of two when smaller."""
    return min(32, 1 << (state_size - 1).bit_length())


def plan(head_dim: int, state_size: int) -> tuple[int, int, int, int]:
    """``(LANES, WARPS, STEPS, CH)`` for a head of ``head_dim`` rows of ``state_size``: rows
    ``ROWS_PER_WARP`` to a warp where the head has enough for ``MAX_WARPS`` warps, fewer warps
    otherwise, more rows per warp beyond."""
    row_lanes = lanes(state_size)
    rows_per_warp = 32 // row_lanes
    warps = max(1, min(MAX_WARPS, -(-head_dim // (rows_per_warp * ROWS_PER_WARP))))
    steps = -(-head_dim // (warps * rows_per_warp))
    return row_lanes, warps, steps, -(-state_size // row_lanes)


def serves(spec: StateSpec) -> bool:
    """Whether the kernel serves a layer of ``spec``: a convolution of at least 2 taps, a whole
    number of groups dividing the heads, at most ``MAX_VALUES`` state values per lane, and
    threadgroup memory for ``P + 2N`` floats within Metal's 32 KiB."""
    heads, head_dim, state_size = spec.state_shape
    grouped, odd = divmod(spec.conv_dim - heads * head_dim, 2 * state_size)
    _, _, steps, ch = plan(head_dim, state_size)
    return (spec.conv_kernel >= 2 and not odd and grouped > 0 and heads % grouped == 0
            and steps * ch <= MAX_VALUES and (head_dim + 2 * state_size) * 4 <= 16384)


_LAUNCHES: dict[tuple, dict] = {}
"""Launch arguments by layer shape and dtypes: built once, so a call does no more than look them up."""


def _launch(mixer: Mamba2Mixer, conv_state: mx.array, state: mx.array, xbc: mx.array, has_bias: bool) -> dict:
    key = (tuple(state.shape), tuple(conv_state.shape), mixer.groups, xbc.dtype, state.dtype, has_bias)
    launch = _LAUNCHES.get(key)
    if launch is None:
        batch, heads, head_dim, state_size = state.shape
        row_lanes, warps, steps, _ = plan(head_dim, state_size)
        launch = {
            "template": [("T", xbc.dtype), ("S", state.dtype), ("H", heads), ("P", head_dim), ("G", mixer.groups),
                         ("N", state_size), ("K", conv_state.shape[1] + 1), ("LANES", row_lanes), ("WARPS", warps),
                         ("STEPS", steps), ("HAS_BIAS", has_bias)],
            "grid": (warps * 32, heads, batch),
            "threadgroup": (warps * 32, 1, 1),
            "output_shapes": [(batch, 1, heads, head_dim), tuple(conv_state.shape), tuple(state.shape)],
            "output_dtypes": [xbc.dtype, xbc.dtype, state.dtype],
        }
        _LAUNCHES[key] = launch
    return launch


def mamba2_step(mixer: Mamba2Mixer, conv_state: mx.array, state: mx.array, xbc: mx.array,
                dt: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``mixer.reference(conv_state, state, xbc, dt)`` for one token (``xbc`` ``[B, 1, conv_dim]``),
    in one launch: ``(y [B, 1, H, P] in xbc's dtype, conv_state in xbc's dtype, state in its own
    dtype)``. The caller checks that ``serves`` the layer's spec."""
    if conv_state.dtype != xbc.dtype:
        conv_state = conv_state.astype(xbc.dtype)
    bias = mixer.conv_bias
    has_bias = bias is not None
    return _MAMBA2(
        inputs=[xbc, dt, conv_state, state, mixer.conv_weight, bias if has_bias else kernel_params((0.0,), mx.float32),
                mixer.dt_bias, mixer.A, mixer.D, kernel_params(mixer.dt_limit, mx.float32)],
        **_launch(mixer, conv_state, state, xbc, has_bias),
    )


def available() -> bool:
    """Whether this kernel can run here (a Metal or CUDA build of MLX)."""
    return _MAMBA2.available()
