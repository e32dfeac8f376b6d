"""The recurrent-layer cache contract: what a Mamba2 or gated-delta mixer keeps between forwards.

A recurrent layer carries no keys and values: it keeps the last ``K - 1`` inputs of its
causal convolution and one recurrent state, both of a size fixed by the layer, whatever
the context length. A model's mixer projects its inputs, then makes one call per layer
per forward, ``cache.update_and_mix(mixer, *inputs)``, where ``mixer`` (a
:class:`Mamba2Mixer` or :class:`GatedDeltaMixer`) carries the layer's convolution and
scan parameters; the cache runs the convolution and the scan from its state, keeps the
new state, and returns the mixer's output.

* :class:`StateSpec` sizes one recurrent layer's cache (its ``layer_type`` says which mixer).
* :class:`StateCache` is the base a recurrent scheme subclasses: it keeps the two states and
  implements the whole ``LayerCache`` API; a scheme chooses how the state is stored
  (``state_dtype``) and may override ``mix`` with fused kernels. Each mixer's ``reference``
  is the pure-``mx`` computation (``butter_core.recurrent_ops``): the default ``mix``, and
  the yardstick kernels are checked against.

The state cannot be trimmed (``trim`` returns 0): going back means ``rewind`` to a
``snapshot()`` (or restoring a saved ``state()``).
"""

from __future__ import annotations

from typing import ClassVar

import attrs
import mlx.core as mx

from butter_core.cache import LayerCache
from butter_core.errors import ConfigError
from butter_core.recurrent_ops import (
    causal_conv1d,
    gated_delta_chunked,
    gated_delta_gates,
    gated_delta_recurrent,
    mamba2_dt,
    ssd_chunked,
    ssd_recurrent,
)

MAMBA2 = "mamba2"
"""Layer type of a Mamba2 (SSD) mixer: Mamba2, Granite 4.0-H, NemotronH, Falcon-H1."""
GATED_DELTA = "gated_delta"
"""Layer type of a gated delta rule mixer (Gated DeltaNet): Qwen3-Next, Qwen3.5."""


@attrs.frozen
class StateSpec:
    """What a scheme needs to size one recurrent layer's cache.

    ``conv_dim`` channels go through a causal convolution of ``conv_kernel`` taps (the cache
    keeps ``conv_kernel - 1`` inputs); ``state_shape`` is the recurrent state per sequence:
    ``[heads, head_dim, state_size]`` for Mamba2, ``[value_heads, key_dim, value_dim]`` for a
    gated delta layer. ``dtype`` is the model's activation dtype.
    """

    layer_type: str
    conv_dim: int
    conv_kernel: int
    state_shape: tuple[int, ...]
    dtype: mx.Dtype = mx.float32
    layer_index: int = 0
    batch_size: int = 1

    def __attrs_post_init__(self):
        for name in ("conv_dim", "conv_kernel", "batch_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"StateSpec.{name} must be a positive integer, got {value!r}")
        if not self.state_shape or not all(isinstance(d, int) and d > 0 for d in self.state_shape):
            raise ConfigError(f"StateSpec.state_shape must be positive integers, got {self.state_shape!r}")


@attrs.frozen(eq=False)
class Mamba2Mixer:
    """A Mamba2 layer's parameters the cache update needs, and its reference computation.

    Inputs of ``update_and_mix``: ``xbc`` ``[B, T, conv_dim]`` (the projection's ``x``, ``B``
    and ``C`` before the convolution; ``conv_dim = heads·head_dim + 2·groups·state_size``)
    and ``dt`` ``[B, T, heads]`` (raw). Output: ``y`` ``[B, T, heads, head_dim]`` in ``xbc``'s
    dtype, the scan's output with the ``D`` skip, before the gated norm.
    """

    layer_type: ClassVar[str] = MAMBA2
    conv_weight: mx.array
    """``[conv_dim, K]``."""
    conv_bias: mx.array | None
    dt_bias: mx.array
    A: mx.array
    """``-exp(A_log)``, ``[heads]``."""
    D: mx.array
    heads: int
    head_dim: int
    groups: int
    state_size: int
    dt_limit: tuple[float, float] = (0.0, float("inf"))
    chunk_size: int = 64

    def split(self, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The activated convolution's output as ``x`` ``[B, T, H, P]``, ``B`` and ``C`` ``[B, T, G, N]``."""
        batch, tokens, _ = conv_out.shape
        inner, grouped = self.heads * self.head_dim, self.groups * self.state_size
        x, b, c = mx.split(conv_out, [inner, inner + grouped], axis=-1)
        return (
            x.reshape(batch, tokens, self.heads, self.head_dim),
            b.reshape(batch, tokens, self.groups, self.state_size),
            c.reshape(batch, tokens, self.groups, self.state_size),
        )

    def reference(self, conv_state, state, xbc: mx.array, dt: mx.array):
        """``(y, conv_state, state)`` after ``xbc``/``dt``, from the given states (None: zeros)."""
        conv, conv_state = causal_conv1d(xbc, self.conv_weight, self.conv_bias, conv_state)
        x, b, c = self.split(silu(conv))
        steps = mamba2_dt(dt, self.dt_bias, self.dt_limit)
        if xbc.shape[1] == 1:
            y, state = ssd_recurrent(x, steps, self.A, b, c, self.D, state)
        else:
            y, state = ssd_chunked(x, steps, self.A, b, c, self.D, state, chunk_size=self.chunk_size)
        return y, conv_state, state


@attrs.frozen(eq=False)
class GatedDeltaMixer:
    """A gated delta rule layer's parameters the cache update needs, and its reference computation.

    Inputs of ``update_and_mix``: ``qkv`` ``[B, T, conv_dim]`` (queries, keys and values before
    the convolution; ``conv_dim = 2·key_heads·key_dim + value_heads·value_dim``), ``a`` and
    ``b`` ``[B, T, value_heads]`` (the decay and write-rate projections). Output ``[B, T,
    value_heads, value_dim]`` in ``qkv``'s dtype, before the gated norm. Queries and keys are
    L2-normalised and queries scaled by ``key_dim ** -0.5`` (Qwen3-Next's kernel does both).
    """

    layer_type: ClassVar[str] = GATED_DELTA
    conv_weight: mx.array
    conv_bias: mx.array | None
    A_log: mx.array
    dt_bias: mx.array
    key_heads: int
    value_heads: int
    key_dim: int
    value_dim: int
    chunk_size: int = 64

    def split(self, conv_out: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        """The activated convolution's output as ``q``, ``k`` ``[B, T, Hv, Dk]`` (key heads repeated
        to the value heads, each key head serving consecutive value heads) and ``v`` ``[B, T, Hv, Dv]``."""
        batch, tokens, _ = conv_out.shape
        keys = self.key_heads * self.key_dim
        q, k, v = mx.split(conv_out, [keys, 2 * keys], axis=-1)
        repeats = self.value_heads // self.key_heads
        q = mx.repeat(q.reshape(batch, tokens, self.key_heads, self.key_dim), repeats, axis=2)
        k = mx.repeat(k.reshape(batch, tokens, self.key_heads, self.key_dim), repeats, axis=2)
        return q, k, v.reshape(batch, tokens, self.value_heads, self.value_dim)

    def reference(self, conv_state, state, qkv: mx.array, a: mx.array, b: mx.array):
        """``(out, conv_state, state)`` after ``qkv``/``a``/``b``, from the given states (None: zeros)."""
        conv, conv_state = causal_conv1d(qkv, self.conv_weight, self.conv_bias, conv_state)
        q, k, v = self.split(silu(conv))
        g, beta = gated_delta_gates(a, b, self.A_log, self.dt_bias)
        if qkv.shape[1] == 1:
            out, state = gated_delta_recurrent(q, k, v, g, beta, state, normalize_qk=True)
        else:
            out, state = gated_delta_chunked(q, k, v, g, beta, state, chunk_size=self.chunk_size, normalize_qk=True)
        return out, conv_state, state


Mixer = Mamba2Mixer | GatedDeltaMixer


def silu(x: mx.array) -> mx.array:
    """``x · sigmoid(x)``, the activation after both mixers' convolutions, computed in float32 and
    rounded once to ``x``'s dtype (as torch computes it for 16-bit tensors; MLX's own ``sigmoid``
    on a 16-bit array rounds midway, differently on the CPU and on each GPU backend)."""
    wide = x.astype(mx.float32)
    return (wide * mx.sigmoid(wide)).astype(x.dtype)


class StateCache(LayerCache):
    """Base of a recurrent scheme's caches: the convolution's last inputs and the recurrent state.

    ``state_dtype`` is how the recurrent state is kept between calls (the scan itself runs in
    float32). A subclass may override ``mix`` to run fused kernels; it receives and returns
    the states as this class keeps them.
    """

    def __init__(self, spec: StateSpec, state_dtype: mx.Dtype = mx.float32):
        self.spec = spec
        self.state_dtype = state_dtype
        s = spec
        self._conv = mx.zeros((s.batch_size, s.conv_kernel - 1, s.conv_dim), dtype=s.dtype)
        self._state = mx.zeros((s.batch_size, *s.state_shape), dtype=state_dtype)
        self._position = 0

    def mix(self, mixer: Mixer, conv_state: mx.array, state: mx.array, *inputs: mx.array):
        """``(out, conv_state, state)`` after ``inputs``: the mixer's reference; schemes override with kernels."""
        return mixer.reference(conv_state, state, *inputs)

    def update_and_mix(self, mixer: Mixer, *inputs: mx.array) -> mx.array:
        """Run ``mixer`` over ``inputs`` (``tokens`` new positions) from the kept state, keep the
        state after them, and return the mixer's output (see ``Mamba2Mixer``, ``GatedDeltaMixer``)."""
        self.check_inputs(mixer, inputs[0])
        out, conv, state = self.mix(mixer, self._conv, self._state, *inputs)
        self._conv, self._state = conv.astype(self.spec.dtype), state.astype(self.state_dtype)
        self._position += inputs[0].shape[1]
        return out

    def check_inputs(self, mixer: Mixer, first: mx.array) -> None:
        """Raise ConfigError unless ``mixer`` is of this layer's type and ``first`` is ``[batch, tokens, conv_dim]``."""
        s = self.spec
        if mixer.layer_type != s.layer_type:
            raise ConfigError(f"layer {s.layer_index}: a {mixer.layer_type} mixer called a {s.layer_type} layer's cache")
        if first.ndim != 3 or first.shape[0] != s.batch_size or first.shape[2] != s.conv_dim or first.shape[1] == 0:
            raise ConfigError(
                f"layer {s.layer_index}: mixer input of shape {list(first.shape)}; this cache holds "
                f"[batch {s.batch_size}, tokens >= 1, conv_dim {s.conv_dim}]"
            )

    @property
    def absolute_position(self) -> int:
        return self._position

    @property
    def nbytes_allocated(self) -> int:
        return self._conv.nbytes + self._state.nbytes

    @property
    def nbytes_live(self) -> int:
        return self.nbytes_allocated

    def state(self) -> dict[str, mx.array]:
        return {"conv": self._conv, "state": self._state}

    def meta_state(self) -> dict[str, int | str]:
        return {"position": self._position}

    def restore(self, state: dict[str, mx.array], meta: dict[str, int | str]) -> None:
        expected = self.state()
        if set(state) != set(expected) or any(state[k].shape != expected[k].shape for k in expected):
            shapes = {k: list(v.shape) for k, v in state.items()}
            raise ConfigError(
                f"layer {self.spec.layer_index}: restored state {shapes} does not fit this cache "
                f"({ {k: list(v.shape) for k, v in expected.items()} })"
            )
        self._conv = state["conv"].astype(self.spec.dtype)
        self._state = state["state"].astype(self.state_dtype)
        self._position = int(meta["position"])

    def trim(self, n: int) -> int:
        return 0

