"""Device functions both fused decode kernels share: the causal convolution's step, SiLU and the
gates, in butter's dialect (one source for Metal and CUDA).

They round where the mixers' pure-mx references (``butter_core.recurrent``) round: the
convolution's output is rounded to the activation dtype ``T`` (``causal_conv1d`` returns ``x``'s
dtype), and SiLU is computed in float32 from it and rounded once to ``T`` (``recurrent.silu``,
as torch computes it), so a kernel agrees with its reference to float32 rounding on every
backend. (An earlier form copied MLX's CPU ``sigmoid``, which rounds midway on 16-bit values and
differs from MLX's GPU backends; the reference no longer uses it.)

The dialect has no logarithm, so ``ssm_softplus`` sums the series of ``log1p`` itself (below);
``bt_exp`` is the hardware's approximation on CUDA (about 2 ulp).
"""

from __future__ import annotations

HELPERS = """
template <typename T> BT_FUNC float ssm_round(float x) { return bt_to_float(bt_from_float<T>(x)); }

// sigmoid(x) in float32, without overflow for either sign.
BT_FUNC float ssm_sigmoid(float x) {
  const float y = 1.0f / (1.0f + bt_exp(x < 0.0f ? x : -x));
  return x < 0.0f ? 1.0f - y : y;
}

// log(1 + e) for e in [0, 1]: 2 atanh(t) with t = e / (2 + e) <= 1/3, the series to t^17
// (its next term is below 2^-29 of the sum), so no cancellation near e = 0 as log(1 + e) has.
BT_FUNC float ssm_log1p_unit(float e) {
  const float t = e / (2.0f + e);
  const float u = t * t;
  float s = 1.0f / 17.0f;
  s = s * u + 1.0f / 15.0f;
  s = s * u + 1.0f / 13.0f;
  s = s * u + 1.0f / 11.0f;
  s = s * u + 1.0f / 9.0f;
  s = s * u + 1.0f / 7.0f;
  s = s * u + 1.0f / 5.0f;
  s = s * u + 1.0f / 3.0f;
  s = s * u + 1.0f;
  return 2.0f * t * s;
}

// log(1 + exp(x)) = max(x, 0) + log1p(exp(-|x|)), as mx.logaddexp(x, 0) computes it.
BT_FUNC float ssm_softplus(float x) {
  const float magnitude = x < 0.0f ? -x : x;
  return bt_max(x, 0.0f) + ssm_log1p_unit(bt_exp(-magnitude));
}

// One token of the depthwise causal convolution for channel `ch` of sequence `b`, then SiLU:
// taps[ch, k] over the K - 1 kept inputs and the new one, plus the bias when HAS_BIAS, summed
// in float32, rounded to T; SiLU in float32, rounded to T. When `write`, this thread also writes the channel's
// new kept inputs (the window shifted by one, the new input last) to conv_out.
template <typename T, int K, int CD, bool HAS_BIAS, typename X, typename CS, typename W, typename BI, typename Out>
BT_FUNC float ssm_conv_silu(X x_in, CS conv_state, W taps, BI bias, Out conv_out, int b, int ch, bool write) {
  const int64_t kept = static_cast<int64_t>(b) * (K - 1) * CD + ch;
  float acc = 0.0f;
  for (int k = 0; k < K - 1; ++k) {
    const auto held = conv_state[kept + static_cast<int64_t>(k) * CD];
    acc += bt_to_float(taps[ch * K + k]) * bt_to_float(held);
    if (write && k > 0) {
      conv_out[kept + static_cast<int64_t>(k - 1) * CD] = held;
    }
  }
  const auto fresh = x_in[static_cast<int64_t>(b) * CD + ch];
  acc += bt_to_float(taps[ch * K + K - 1]) * bt_to_float(fresh);
  if (write) {
    conv_out[kept + static_cast<int64_t>(K - 2) * CD] = fresh;
  }
  if (HAS_BIAS) {
    acc += bt_to_float(bias[ch]);
  }
  const float c = ssm_round<T>(acc);
  return ssm_round<T>(c * ssm_sigmoid(c));
}
"""
"""Header code of both kernels (``Kernel(helpers=...)``)."""
