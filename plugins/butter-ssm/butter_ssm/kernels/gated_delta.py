"""``gated_delta_step``: one decode token of a gated delta rule layer (Qwen3-Next), one launch.

The convolution's shift, SiLU, the L2 norms of q and k, the gates, the delta rule's state
update and its output, fused: per token and layer the kernel reads the state once and writes
it once, and reads the new input, the ``K - 1`` kept inputs and the layer's small parameters.

Layout. The state is ``[B, Hv, Dk, Dv]``, a value head's ``Dk`` rows of ``Dv`` contiguous
columns. The rule works column by column: column ``j`` needs ``k·S[:, j]`` before it can
update that column (``delta_j = (v_j − k·S_j)·beta``), then ``q·S'[:, j]``. So a thread owns
one column ``j`` and ``ROWS`` of its rows, keeps those ``ROWS`` state values in registers
between the two passes (read once, written once), and adjacent threads own adjacent columns:
every load and store of a warp is one contiguous run of 32 columns of a row (128 bytes of a
float32 state, 64 of a 16-bit one). A threadgroup is ``COLS`` columns (32, or ``Dv`` rounded
up to a power of two when smaller) times ``PARTS`` row blocks, 128 threads, for one
``(sequence, value head, block of COLS columns)``: ``Dv / COLS · Hv · B`` threadgroups
(Qwen3-Next-80B-like, Hv 32, Dk = Dv = 128: 128 threadgroups at batch 1, one per H200
multiprocessor, each thread holding 32 float32 state values). The two column sums over the
row blocks go through threadgroup memory (``PARTS`` partial sums per column, added in one
fixed order, so every thread of a column computes the same ``delta``).

The threadgroup first computes what every column shares: its key head's ``q`` and ``k``
(``2·Dk`` channels of the convolution and SiLU, then their L2 norms by a warp sum and a
threadgroup sum) and its own ``COLS`` values ``v``, into threadgroup memory. The state loads
are issued before that, so their latency overlaps it. A channel's new kept inputs are written
by exactly one thread: q/k channels by the threadgroup of the key head's first value head and
first column block (value heads sharing a key head recompute its q and k, ``2·Dk·K``
multiply-adds, instead of a second launch), v channels by the row block 0 thread of their
column.

Per token and layer, memory traffic: the state read and written once (``B·Hv·Dk·Dv`` values
each way), the output (``B·Hv·Dv``), the conv inputs (``K`` values per channel read, ``K − 1``
written) and parameters (``conv_dim·K`` taps, re-read from L2 by the threadgroups sharing them).

Arithmetic in float32 as ``butter_core.recurrent_ops.gated_delta_recurrent`` orders it
(decay the state, ``k·S``, delta, rank-one update, ``q·S``), with the rounding of the
reference's convolution and SiLU (``source.py``); the state is read and written in its own
dtype (float32, bfloat16 or float16).
"""

from __future__ import annotations

import mlx.core as mx

from butter_core.plugin_api import GatedDeltaMixer, Kernel, StateSpec, kernel_params

from butter_ssm.kernels.source import HELPERS

THREADS = 128
"""Threads per threadgroup: ``COLS`` columns times ``PARTS`` row blocks."""
MAX_ROWS = 64
"""Most state rows one thread keeps in registers (``Dk / PARTS``): Dk up to 256 at 32 columns."""

_GATED_DELTA = Kernel(
    name="butter_ssm_gated_delta_step",
    input_names=("qkv", "gate_a", "gate_b", "conv_state", "state", "conv_weight", "conv_bias", "a_log", "dt_bias"),
    output_names=("out", "conv_out", "state_out"),
    helpers=HELPERS,
    body="""
  constexpr int REPEATS = HV / HK;
  constexpr int CD = 2 * HK * DK + HV * DV;
  constexpr int PARTS = THREADS / COLS;
  constexpr int ROWS = (DK + PARTS - 1) / PARTS;
  constexpr int WARPS = THREADS / BT_WARP_SIZE;
  const int b = static_cast<int>(block_idx.z);
  const int h = static_cast<int>(block_idx.y);
  const int kh = h / REPEATS;
  const int c = static_cast<int>(thread_rank) % COLS;
  const int part = static_cast<int>(thread_rank) / COLS;
  const int j = static_cast<int>(block_idx.x) * COLS + c;
  const bool live = j < DV;

  // The state column's rows part * ROWS .. (part + 1) * ROWS - 1, loaded first.
  const int64_t column = static_cast<int64_t>(b * HV + h) * DK * DV + j;
  float s[ROWS];
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int i = part * ROWS + r;
    s[r] = (live && i < DK) ? bt_to_float(state[column + static_cast<int64_t>(i) * DV]) : 0.0f;
  }

  // Gates: g = -exp(A_log) softplus(a + dt_bias), the decay exp(g), beta = sigmoid(b).
  const int bh = b * HV + h;
  const float g = -bt_exp(bt_to_float(a_log[h])) * ssm_softplus(bt_to_float(gate_a[bh]) + bt_to_float(dt_bias[h]));
  const float decay = bt_exp(g);
  const float beta = ssm_sigmoid(bt_to_float(gate_b[bh]));

  // q and k of the key head, and this block's v: convolution, SiLU; sums of squares of q, k.
  BT_SHARED float qk[2 * DK];
  BT_SHARED float vs[COLS];
  BT_SHARED float squares[2 * WARPS];
  const bool writes_qk = h % REPEATS == 0 && block_idx.x == 0;
  float q_squares = 0.0f;
  float k_squares = 0.0f;
  for (int e = static_cast<int>(thread_rank); e < 2 * DK + COLS; e += THREADS) {
    if (e < 2 * DK) {
      const int ch = e < DK ? kh * DK + e : HK * DK + kh * DK + (e - DK);
      const float x = ssm_conv_silu<T, K, CD, HAS_BIAS>(qkv, conv_state, conv_weight, conv_bias, conv_out, b, ch,
                                                         writes_qk);
      qk[e] = x;
      if (e < DK) {
        q_squares += x * x;
      } else {
        k_squares += x * x;
      }
    } else {
      const int jj = static_cast<int>(block_idx.x) * COLS + (e - 2 * DK);
      if (jj < DV) {
        vs[e - 2 * DK] = ssm_conv_silu<T, K, CD, HAS_BIAS>(qkv, conv_state, conv_weight, conv_bias, conv_out, b,
                                                            2 * HK * DK + h * DV + jj, true);
      }
    }
  }
  q_squares = bt_warp_sum(q_squares);
  k_squares = bt_warp_sum(k_squares);
  if (lane_id == 0) {
    squares[warp_id] = q_squares;
    squares[WARPS + warp_id] = k_squares;
  }
  BT_BARRIER;
  float q_total = 0.0f;
  float k_total = 0.0f;
  for (int w = 0; w < WARPS; ++w) {
    q_total += squares[w];
    k_total += squares[WARPS + w];
  }
  // x * rsqrt(sum x^2 + 1e-6), then q times Dk^-0.5, as the reference multiplies.
  const float q_norm = 1.0f / bt_sqrt(q_total + 1e-6f);
  const float k_norm = 1.0f / bt_sqrt(k_total + 1e-6f);
  const float q_scale = 1.0f / bt_sqrt(static_cast<float>(DK));

  // Pass 1: decay the column, k . S over this thread's rows, summed over the row blocks.
  BT_SHARED float partial_ks[PARTS * COLS];
  BT_SHARED float partial_qs[PARTS * COLS];
  float ks = 0.0f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int i = part * ROWS + r;
    if (i < DK) {
      s[r] = s[r] * decay;
      ks += (qk[DK + i] * k_norm) * s[r];
    }
  }
  partial_ks[part * COLS + c] = ks;
  BT_BARRIER;
  float remembered = 0.0f;
  for (int p = 0; p < PARTS; ++p) {
    remembered += partial_ks[p * COLS + c];
  }
  const float delta = live ? (vs[c] - remembered) * beta : 0.0f;

  // Pass 2: S += k delta, written once; q . S over this thread's rows, summed as above.
  float qs = 0.0f;
#pragma unroll
  for (int r = 0; r < ROWS; ++r) {
    const int i = part * ROWS + r;
    if (i < DK) {
      s[r] = s[r] + (qk[DK + i] * k_norm) * delta;
      if (live) {
        state_out[column + static_cast<int64_t>(i) * DV] = bt_from_float<S>(s[r]);
      }
      qs += ((qk[i] * q_norm) * q_scale) * s[r];
    }
  }
  partial_qs[part * COLS + c] = qs;
  BT_BARRIER;
  if (part == 0 && live) {
    float total = 0.0f;
    for (int p = 0; p < PARTS; ++p) {
      total += partial_qs[p * COLS + c];
    }
    out[static_cast<int64_t>(bh) * DV + j] = bt_from_float<T>(total);
  }
""",
)


def columns(value_dim: int) -> int:
    """Columns per threadgroup: 32, or ``value_dim`` rounded up to a power of two when smaller."""
    return min(32, 1 << (value_dim - 1).bit_length())


def serves(spec: StateSpec) -> bool:
    """Whether the kernel serves a layer of ``spec``: a convolution of at least 2 taps, key heads
    dividing the value heads, and at most ``MAX_ROWS`` state rows per thread."""
    value_heads, key_dim, value_dim = spec.state_shape
    key_heads, odd = divmod(spec.conv_dim - value_heads * value_dim, 2 * key_dim)
    parts = THREADS // columns(value_dim)
    return (spec.conv_kernel >= 2 and not odd and key_heads > 0 and value_heads % key_heads == 0
            and -(-key_dim // parts) <= MAX_ROWS)


_LAUNCHES: dict[tuple, dict] = {}
"""Launch arguments by layer shape and dtypes: built once, so a call does no more than look them up."""


def _launch(mixer: GatedDeltaMixer, conv_state: mx.array, state: mx.array, qkv: mx.array, has_bias: bool) -> dict:
    key = (tuple(state.shape), tuple(conv_state.shape), mixer.key_heads, qkv.dtype, state.dtype, has_bias)
    launch = _LAUNCHES.get(key)
    if launch is None:
        batch, heads, key_dim, value_dim = state.shape
        cols = columns(value_dim)
        launch = {
            "template": [("T", qkv.dtype), ("S", state.dtype), ("HK", mixer.key_heads), ("HV", heads), ("DK", key_dim),
                         ("DV", value_dim), ("K", conv_state.shape[1] + 1), ("COLS", cols), ("THREADS", THREADS),
                         ("HAS_BIAS", has_bias)],
            "grid": (-(-value_dim // cols) * THREADS, heads, batch),
            "threadgroup": (THREADS, 1, 1),
            "output_shapes": [(batch, 1, heads, value_dim), tuple(conv_state.shape), tuple(state.shape)],
            "output_dtypes": [qkv.dtype, qkv.dtype, state.dtype],
        }
        _LAUNCHES[key] = launch
    return launch


def gated_delta_step(mixer: GatedDeltaMixer, conv_state: mx.array, state: mx.array, qkv: mx.array, a: mx.array,
                     b: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """``mixer.reference(conv_state, state, qkv, a, b)`` for one token (``qkv`` ``[B, 1, conv_dim]``),
    in one launch: ``(out [B, 1, Hv, Dv] in qkv's dtype, conv_state in qkv's dtype, state in its
    own dtype)``. The caller checks that ``serves`` the layer's spec."""
    if conv_state.dtype != qkv.dtype:
        conv_state = conv_state.astype(qkv.dtype)
    bias = mixer.conv_bias
    has_bias = bias is not None
    return _GATED_DELTA(
        inputs=[qkv, a, b, conv_state, state, mixer.conv_weight, bias if has_bias else kernel_params((0.0,), mx.float32),
                mixer.A_log, mixer.dt_bias],
        **_launch(mixer, conv_state, state, qkv, has_bias),
    )


def available() -> bool:
    """Whether this kernel can run here (a Metal or CUDA build of MLX)."""
    return _GATED_DELTA.available()
