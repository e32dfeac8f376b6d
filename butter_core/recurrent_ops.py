"""The recurrent mixers of hybrid LLMs in plain MLX: Mamba2's SSD scan and Qwen3-Next's gated delta rule.

Each mixer comes twice: a per-token recurrence, the yardstick and a decode step's form, and a
chunked form for prompts (matmuls within chunks of tokens, a loop over chunks carrying the
state) that agrees with it within float32 rounding. Around them: the depthwise causal
convolution both mixers run first, the preprocessing of their time steps and gates, and their
two gated RMS norms, which apply the gate at different places. Everything follows Hugging Face
transformers' PyTorch reference (5.25: ``models/mamba2/modeling_mamba2.py``,
``models/qwen3_next/modeling_qwen3_next.py``).

Shapes are batch-first, ``T`` tokens on axis 1. The math runs in float32 whatever the inputs'
dtype: results come back in the input's dtype, recurrent states in float32. A ``state`` of
None is the zero state of a sequence's start.

Departures from HF, none of which shows with a float32 model and the default ``time_step_limit``
of ``(0, inf)``: HF's Mamba2 decode step (``mamba2_selective_state_update``) computes ``dt`` and
``dt · B · x`` in the model's dtype, rounds the state to it before reading it with ``C``, and
does not clip ``dt`` to ``time_step_limit`` (its chunked scan does, and so does ``mamba2_dt``
here, for both forms); HF's gated norms and Qwen3-Next's ``beta = sigmoid(b)`` round to the
model's dtype midway.
"""

from __future__ import annotations

import math

import mlx.core as mx

L2_NORM_EPS = 1e-6
"""What HF's ``l2norm`` (the FLA library's) adds to ``Σ x²`` before the reciprocal square root."""


def _f32(a: mx.array) -> mx.array:
    return a.astype(mx.float32)


def _softplus(x: mx.array) -> mx.array:
    """``log(1 + exp(x))`` without overflow (torch's ``softplus`` returns ``x`` itself above 20;
    so, in float32, does this)."""
    return mx.logaddexp(x, 0.0)


def _silu(x: mx.array) -> mx.array:
    return x * mx.sigmoid(x)


def causal_conv1d(
    x: mx.array, weight: mx.array, bias: mx.array | None = None, state: mx.array | None = None
) -> tuple[mx.array, mx.array]:
    """The depthwise causal convolution over time before both mixers, without its activation.

    ``x`` ``[B, T, C]``; ``weight`` ``[C, K]`` (HF's ``Conv1d`` weight ``[C, 1, K]`` squeezed);
    ``bias`` ``[C]``; ``state`` ``[B, K - 1, C]``, the previous ``K - 1`` inputs (None: zeros).
    Output ``t`` is ``bias + Σ_k weight[:, k] · input[t + k - (K - 1)]`` (a cross-correlation
    like torch's ``conv1d``: ``weight[:, -1]`` weighs the token itself). Returns the output
    ``[B, T, C]`` and the new state, the last ``K - 1`` inputs, in ``x``'s dtype.
    """
    tokens, kernel = x.shape[1], weight.shape[1]
    if state is None:
        state = mx.zeros((x.shape[0], kernel - 1, x.shape[2]), dtype=x.dtype)
    window = mx.concatenate([state.astype(x.dtype), x], axis=1)
    inputs, taps = _f32(window), _f32(weight)
    y = sum(inputs[:, k : k + tokens] * taps[:, k] for k in range(kernel))
    if bias is not None:
        y = y + _f32(bias)
    return y.astype(x.dtype), window[:, tokens:]


def mamba2_dt(dt: mx.array, dt_bias: mx.array, limit: tuple[float, float] = (0.0, math.inf)) -> mx.array:
    """Mamba2's time steps ``[B, T, H]`` in float32 from the projection's raw ``dt``:
    ``softplus(dt + dt_bias)`` clipped to the config's ``time_step_limit``."""
    return mx.clip(_softplus(_f32(dt) + _f32(dt_bias)), limit[0], limit[1])


def _heads_of_groups(a: mx.array, heads: int) -> mx.array:
    """``[B, T, G, N]`` -> ``[B, T, H, N]`` in float32: head ``h`` takes group ``h // (H // G)``."""
    return mx.repeat(_f32(a), heads // a.shape[2], axis=2)


def ssd_recurrent(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    state: mx.array | None = None,
) -> tuple[mx.array, mx.array]:
    """Mamba2's scan token by token, the yardstick for ``ssd_chunked`` and a decode step's form.

    ``x`` ``[B, T, H, P]``; ``dt`` ``[B, T, H]`` from ``mamba2_dt``; ``A`` ``[H]`` (``-exp(A_log)``);
    ``B``, ``C`` ``[B, T, G, N]`` with ``H`` a multiple of ``G``; ``D`` ``[H]``; ``state``
    ``[B, H, P, N]``. Per token: ``state = state · exp(dt A) + (dt B) ⊗ x``, ``y = state · C + D x``.
    Returns ``y`` ``[B, T, H, P]`` in ``x``'s dtype and the float32 state after the last token.
    """
    batch, tokens, heads, head_dim = x.shape
    inputs, steps = _f32(x), _f32(dt)
    B, C = _heads_of_groups(B, heads), _heads_of_groups(C, heads)
    decays = mx.exp(steps * _f32(A))
    state = mx.zeros((batch, heads, head_dim, B.shape[-1])) if state is None else _f32(state)
    ys = []
    for t in range(tokens):
        written = (steps[:, t, :, None] * B[:, t])[:, :, None, :] * inputs[:, t, :, :, None]
        state = state * decays[:, t, :, None, None] + written
        ys.append((state @ C[:, t, :, :, None])[..., 0])
    y = mx.stack(ys, axis=1) + inputs * _f32(D)[:, None]
    return y.astype(x.dtype), state


def _chunked(a: mx.array, size: int) -> mx.array:
    """``[B, T, H, ...]`` -> ``[B, H, T' / size, size, ...]`` in float32, ``T`` padded with zeros
    to ``T'``, the next multiple of ``size`` (zero steps and inputs leave a state as it is)."""
    a = _f32(a)
    pad = -a.shape[1] % size
    a = mx.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
    a = a.reshape(a.shape[0], -1, size, *a.shape[2:])
    return a.transpose(0, 3, 1, 2, *range(4, a.ndim))


def _unchunked(a: mx.array, tokens: int) -> mx.array:
    """``[B, H, chunks, size, P]`` -> ``[B, tokens, H, P]``: ``_chunked``'s inverse."""
    batch, heads, _, _, dims = a.shape
    return a.reshape(batch, heads, -1, dims)[:, :, :tokens].transpose(0, 2, 1, 3)


def segsum(a: mx.array) -> mx.array:
    """``[..., L]`` -> ``[..., L, L]``: ``a[j+1] + … + a[i]`` at ``i, j`` for ``j <= i`` (0 on the
    diagonal), -inf above it; its exp decays position ``j``'s contribution to position ``i``.
    Summed as a cumsum of masked copies of ``a``, as HF's ``segment_sum``, not as
    ``cumsum[i] - cumsum[j]``, whose cancellation loses short sums in a long chunk."""
    size = a.shape[-1]
    rows = mx.broadcast_to(a[..., :, None], (*a.shape, size))
    ones = mx.ones((size, size), dtype=mx.bool_)
    sums = mx.cumsum(mx.where(mx.tril(ones, -1), rows, 0.0), axis=-2)
    return mx.where(mx.tril(ones), sums, -mx.inf)


def ssd_chunked(
    x: mx.array,
    dt: mx.array,
    A: mx.array,
    B: mx.array,
    C: mx.array,
    D: mx.array,
    state: mx.array | None = None,
    *,
    chunk_size: int = 64,
) -> tuple[mx.array, mx.array]:
    """Mamba2's scan in chunks of ``chunk_size`` tokens (the SSD algorithm of HF's
    ``mamba2_chunk_scan``); arguments and results as ``ssd_recurrent``'s.

    Within a chunk, a masked attention: ``y_i = Σ_{j<=i} (C_i·B_j) exp(segsum(dt A))_ij dt_j x_j``.
    Across chunks, a loop carries the state: each chunk's start state, read by ``C_i`` decayed by
    ``exp(Σ_{j<=i} dt_j A)``, then decayed over the chunk plus what the chunk wrote. Groups are
    kept apart from heads (``[B, G, H/G, ...]``) so that ``C·B`` is computed once per group.
    The chunk size changes nothing but rounding and speed: 64 was the fastest on a 2-core x86
    with OpenBLAS (8 heads of 32 x 64, 4096 tokens: 98-101 ms at 32 and 64, 162 at 128, 298 at
    HF's default of 256; the token-by-token scan takes 120-146 ms for 512 tokens).
    """
    batch, tokens, heads, head_dim = x.shape
    groups, size = B.shape[2], B.shape[3]

    def grouped(a: mx.array) -> mx.array:
        """``[B, H, ...]`` -> ``[B, G, H/G, ...]``."""
        return a.reshape(batch, groups, -1, *a.shape[2:])

    steps = _f32(dt)
    inputs = grouped(_chunked(_f32(x) * steps[..., None], chunk_size))  # [B, G, R, c, l, P]
    log_decays = grouped(_chunked(steps * _f32(A), chunk_size))  # [B, G, R, c, l]
    B, C = (_chunked(a, chunk_size)[:, :, None] for a in (B, C))  # [B, G, 1, c, l, N]
    cumulative = mx.cumsum(log_decays, axis=-1)

    scores = (C @ B.swapaxes(-1, -2)) * mx.exp(segsum(log_decays))
    within = scores @ inputs
    to_end = mx.exp(cumulative[..., -1:] - cumulative)[..., None]
    written = (inputs * to_end).swapaxes(-1, -2) @ B  # [B, G, R, c, P, N]

    chunk_decays = mx.exp(cumulative[..., -1])[..., None, None]
    state = grouped(mx.zeros((batch, heads, head_dim, size)) if state is None else _f32(state))
    starts = []
    for c in range(inputs.shape[3]):
        starts.append(state)
        state = state * chunk_decays[:, :, :, c] + written[:, :, :, c]
    from_start = (C @ mx.stack(starts, axis=3).swapaxes(-1, -2)) * mx.exp(cumulative)[..., None]

    y = _unchunked((within + from_start).reshape(batch, heads, *within.shape[3:]), tokens)
    y = y + _f32(x) * _f32(D)[:, None]
    return y.astype(x.dtype), state.reshape(batch, heads, head_dim, size)


def gated_delta_gates(a: mx.array, b: mx.array, A_log: mx.array, dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """Qwen3-Next's per-token gates ``[B, T, H]`` in float32 from the projections ``a`` and ``b``:
    the log-decay ``g = -exp(A_log) · softplus(a + dt_bias)`` and ``beta = sigmoid(b)``."""
    g = -mx.exp(_f32(A_log)) * _softplus(_f32(a) + _f32(dt_bias))
    return g, mx.sigmoid(_f32(b))


def _l2_normalized(x: mx.array) -> mx.array:
    return x * mx.rsqrt((x * x).sum(axis=-1, keepdims=True) + L2_NORM_EPS)


def _queries_and_keys(q: mx.array, k: mx.array, normalize: bool) -> tuple[mx.array, mx.array]:
    """``q`` and ``k`` in float32 as the rule reads them: L2-normalised over ``Dk`` if
    ``normalize`` (HF's ``use_qk_l2norm_in_kernel``), then ``q`` times ``Dk ** -0.5`` (always)."""
    q, k = _f32(q), _f32(k)
    if normalize:
        q, k = _l2_normalized(q), _l2_normalized(k)
    return q * q.shape[-1] ** -0.5, k


def gated_delta_recurrent(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    *,
    normalize_qk: bool = False,
) -> tuple[mx.array, mx.array]:
    """Qwen3-Next's gated delta rule token by token, the yardstick for ``gated_delta_chunked`` and
    a decode step's form (HF's ``torch_recurrent_gated_delta_rule``).

    ``q``, ``k`` ``[B, T, H, Dk]`` and ``v`` ``[B, T, H, Dv]``, heads already repeated to one
    count (as HF's ``repeat_interleave``: key head ``i`` serves value heads ``i·r`` to
    ``i·r + r - 1``, ``r`` value heads per key head); ``g`` ``[B, T, H]`` log-decays (<= 0) and ``beta`` ``[B, T, H]`` in (0, 1), from
    ``gated_delta_gates``; ``state`` ``[B, H, Dk, Dv]``. Per token: ``S = S · exp(g)``;
    ``delta = (v - k·S) · beta``; ``S = S + k ⊗ delta``; ``out = q·S``. Returns ``out``
    ``[B, T, H, Dv]`` in ``q``'s dtype and the float32 state after the last token.
    """
    batch, tokens, heads, key_dim = k.shape
    queries, keys = _queries_and_keys(q, k, normalize_qk)
    values, decays, rates = _f32(v), mx.exp(_f32(g)), _f32(beta)
    state = mx.zeros((batch, heads, key_dim, v.shape[-1])) if state is None else _f32(state)
    outs = []
    for t in range(tokens):
        state = state * decays[:, t, :, None, None]
        remembered = keys[:, t, :, None, :] @ state
        delta = (values[:, t, :, None, :] - remembered) * rates[:, t, :, None, None]
        state = state + keys[:, t, :, :, None] * delta
        outs.append((queries[:, t, :, None, :] @ state)[:, :, 0])
    return mx.stack(outs, axis=1).astype(q.dtype), state


def _decays_within(cumulative: mx.array) -> mx.array:
    """``[..., L]`` cumulative log-decays -> ``[..., L, L]``: ``exp(cum_i - cum_j)`` for ``j <= i``,
    0 above the diagonal (masked before the exp, where the difference is positive)."""
    size = cumulative.shape[-1]
    above = mx.triu(mx.ones((size, size), dtype=mx.bool_), 1)
    return mx.exp(mx.where(above, -mx.inf, cumulative[..., :, None] - cumulative[..., None, :]))


def unit_lower_inverse(a: mx.array) -> mx.array:
    """``(I + a)⁻¹`` for ``a`` ``[..., L, L]`` strictly lower triangular, on any device (MLX's
    ``linalg`` solvers run on the CPU only; HF solves the same system with
    ``solve_triangular``, or row by row by forward substitution).

    Recursive doubling: the inverses of the diagonal blocks of size ``s`` give those of size
    ``2s``, ``[[X₁, 0], [a₂₁, X₂]]⁻¹ = [[X₁⁻¹, 0], [-X₂⁻¹ a₂₁ X₁⁻¹, X₂⁻¹]]``, all blocks at once:
    ``log₂ L`` steps of batched products where forward substitution takes ``L - 1`` (a 64-token
    chunk's inverse 3-4 ms against 12-25 for 32 chunks of 64 on a 2-core x86 with OpenBLAS), and
    as accurate (relative error ~1e-7 against float64 in both). ``L`` is padded to a power of 2.
    """
    size, lead = a.shape[-1], a.shape[:-2]
    full = 1 << (size - 1).bit_length()
    a = mx.pad(a, [(0, 0)] * len(lead) + [(0, full - size)] * 2)
    inverses = mx.ones((*lead, full, 1, 1))  # [..., blocks, s, s]: the diagonal blocks' inverses
    s = 1
    while s < full:
        blocks = full // (2 * s)
        tiles = a.reshape(*lead, blocks, 2 * s, blocks, 2 * s)
        pairs = mx.moveaxis(mx.diagonal(tiles, axis1=-4, axis2=-2), -1, -3)  # [..., blocks, 2s, 2s]
        upper, lower = inverses[..., 0::2, :, :], inverses[..., 1::2, :, :]
        corner = -(lower @ pairs[..., s:, :s] @ upper)
        top = mx.concatenate([upper, mx.zeros_like(upper)], axis=-1)
        inverses = mx.concatenate([top, mx.concatenate([corner, lower], axis=-1)], axis=-2)
        s *= 2
    return inverses.reshape(*lead, full, full)[..., :size, :size]


def gated_delta_chunked(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    g: mx.array,
    beta: mx.array,
    state: mx.array | None = None,
    *,
    chunk_size: int = 64,
    normalize_qk: bool = False,
) -> tuple[mx.array, mx.array]:
    """The gated delta rule in chunks of ``chunk_size`` tokens (HF's ``torch_chunk_gated_delta_rule``);
    arguments and results as ``gated_delta_recurrent``'s.

    Within every chunk at once, the WY/UT transform: the chunk's delta-rule updates, each
    correcting the ones before it, solve the unit lower triangular system
    ``(I + tril(diag(beta) K Kᵀ ⊙ decay, -1)) U = diag(beta) V`` for the values ``U`` that
    are written (and likewise for the keys that read the start state). Then a loop over chunks:
    ``U`` minus what the start state already predicts is written, and read by the chunk's queries
    through the decay-masked ``Q Kᵀ`` besides the start state itself.
    """
    batch, tokens, heads, key_dim = k.shape
    queries, keys = _queries_and_keys(q, k, normalize_qk)
    queries, keys, values = (_chunked(a, chunk_size) for a in (queries, keys, v))  # [B, H, c, l, D]
    log_decays, rates = (_chunked(a, chunk_size)[..., None] for a in (g, beta))  # [B, H, c, l, 1]
    cumulative = mx.cumsum(log_decays[..., 0], axis=-1)
    decays = _decays_within(cumulative)

    rated_keys = keys * rates
    solve = unit_lower_inverse(mx.tril((rated_keys @ keys.swapaxes(-1, -2)) * decays, -1))
    written = solve @ (values * rates)
    reading_keys = solve @ (rated_keys * mx.exp(cumulative)[..., None])
    attention = (queries @ keys.swapaxes(-1, -2)) * decays
    queries = queries * mx.exp(cumulative)[..., None]
    keys = keys * mx.exp(cumulative[..., -1:] - cumulative)[..., None]
    chunk_decays = mx.exp(cumulative[..., -1])[..., None, None]

    state = mx.zeros((batch, heads, key_dim, v.shape[-1])) if state is None else _f32(state)
    outs = []
    for c in range(queries.shape[2]):
        new_values = written[:, :, c] - reading_keys[:, :, c] @ state
        outs.append(queries[:, :, c] @ state + attention[:, :, c] @ new_values)
        state = state * chunk_decays[:, :, c] + keys[:, :, c].swapaxes(-1, -2) @ new_values
    return _unchunked(mx.stack(outs, axis=2), tokens).astype(q.dtype), state


def _rms_normalized(x: mx.array, eps: float) -> mx.array:
    return x * mx.rsqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def gate_then_rms_norm(
    x: mx.array, gate: mx.array, weight: mx.array, *, eps: float, group_size: int | None = None
) -> mx.array:
    """Mamba2's gated norm (HF's ``Mamba2RMSNormGated``): ``rms_norm(x · silu(gate)) · weight``,
    the gate applied BEFORE normalising, over the last axis in groups of ``group_size`` channels
    (Mamba2 passes ``intermediate_size // n_groups``; None: one group). ``eps``: the config's
    ``layer_norm_epsilon`` (1e-5 by default)."""
    gated = _f32(x) * _silu(_f32(gate))
    size = group_size or gated.shape[-1]
    groups = gated.reshape(*gated.shape[:-1], -1, size)
    normed = _rms_normalized(groups, eps).reshape(gated.shape)
    return (normed * _f32(weight)).astype(x.dtype)


def rms_norm_then_gate(x: mx.array, gate: mx.array, weight: mx.array, *, eps: float) -> mx.array:
    """Qwen3-Next's gated norm (HF's ``Qwen3NextRMSNormGated``): ``rms_norm(x) · weight · silu(gate)``,
    the gate applied AFTER normalising, over the last axis (one head's ``Dv`` channels). The
    weight multiplies as it is (not ``1 + weight`` as Qwen3-Next's plain RMSNorm); ``eps``: the
    config's ``rms_norm_eps`` (1e-6)."""
    normed = _rms_normalized(_f32(x), eps) * _f32(weight)
    return (normed * _silu(_f32(gate))).astype(x.dtype)
