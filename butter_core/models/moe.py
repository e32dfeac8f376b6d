"""Mixture-of-experts pieces the MoE families share: stacked expert projections, SwiGLU and ReLU²
experts over them, the routers' top-k choices, and checkpoint helpers that stack per-expert tensors.

* :class:`StackedLinear` holds ``num_experts`` projections as one ``[E, out, in]`` weight and
  applies, per token, the ones its router chose (``mx.gather_mm``); ``to_quantized`` gives
  :class:`QuantizedStackedLinear` (``mx.gather_qmm`` over MLX affine-quantized weights, as
  ``mlx_lm.convert`` writes them: ``weight`` packed ``[E, out, in·bits/32]``, ``scales`` and
  ``biases`` ``[E, out, in/group_size]``), so the loader's ``nn.quantize`` handles it as it
  does ``nn.Linear``.
* :class:`SwiGLUExperts`: ``down(silu(gate(x)) · up(x))`` per chosen expert, the tokens sorted
  by expert for long inputs (each expert's rows then read once, contiguously), optionally
  summed with the router's weights. Parameter names ``gate_proj``/``up_proj``/``down_proj``,
  each ``[E, out, in]``: mlx-lm's ``switch_mlp`` layout.
* :class:`ReLU2Experts`: ``fc2(relu(fc1(x))²)``, ungated (Nemotron-H), mlx-lm's names; both
  derive from :class:`Experts`, which routes tokens to the chosen experts.
* Routers: :func:`softmax_top_k` (softmax over all experts, then the top k, optionally
  renormalised: Qwen2/3-MoE, Qwen3-Next, OLMoE), :func:`top_k_softmax` (the top k logits,
  then a softmax over them: Mixtral, Granite) and :func:`grouped_sigmoid_top_k` (sigmoid
  scores, a correction bias and group-limited choice: DeepSeek-V3, Nemotron-H).
* :func:`stacked_entry` / :func:`experts_stacked` / :func:`sliced_entry` map a checkpoint's
  per-expert or fused tensors onto a stacked parameter, for a family's ``checkpoint_layout``.

No host synchronisation anywhere: the expert choice stays on the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn

from butter_core.errors import ModelLoadError
from butter_core.kernels.backend import default_device_is_gpu
from butter_core.loading.checkpoint import TensorEntry

SORT_THRESHOLD = 64
"""Token-expert pairs from which ``SwiGLUExperts`` sorts the tokens by expert before the gathered
matmuls (a prompt's chunk); fewer (a decode step) gather straight from the token order."""
BLOCK = 16
"""Rows per matmul of ``SwiGLUExperts.in_blocks`` (the CPU's prompt path): on a 2-core x86 with
OpenBLAS, 2048 rows through 32 experts of 1024 x 256 took 549 ms one row at a time, 170 ms in
blocks of 8, 83 in blocks of 16, 65 in blocks of 32; larger blocks pad more rows."""


@partial(mx.compile, shapeless=True)
def swiglu(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) · up``, fused into one kernel."""
    return gate * mx.sigmoid(gate) * up


@partial(mx.compile, shapeless=True)
def relu2(x: mx.array) -> mx.array:
    """``relu(x)²`` (Nemotron-H's ``relu2``), fused into one kernel."""
    return mx.square(mx.maximum(x, 0))


class StackedLinear(nn.Module):
    """``num_experts`` linear maps in one ``weight`` ``[E, out, in]`` (and ``bias`` ``[E, out]``).

    ``layer(x, indices)`` applies expert ``indices[...]`` to the matching row of ``x``: ``x``
    ``[..., 1, in]`` broadcast against ``indices`` ``[...]`` gives ``[..., 1, out]``
    (``mx.gather_mm``'s batching). ``sorted_indices`` promises ``indices`` ascending (faster).
    Stored quantized (``.scales`` beside the weight), the loader makes it a
    ``QuantizedStackedLinear`` through ``to_quantized``.
    """

    def __init__(self, input_dims: int, output_dims: int, num_experts: int, *, bias: bool = False):
        super().__init__()
        self.weight = mx.zeros((num_experts, output_dims, input_dims))
        if bias:
            self.bias = mx.zeros((num_experts, output_dims))

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def _extra_repr(self) -> str:
        experts, output_dims, input_dims = self.weight.shape
        return f"experts={experts}, input_dims={input_dims}, output_dims={output_dims}, bias={'bias' in self}"

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        weight = self["weight"]
        if weight.dtype == mx.float32 or default_device_is_gpu():
            y = mx.gather_mm(x, weight.swapaxes(-1, -2), rhs_indices=indices, sorted_indices=sorted_indices)
        else:
            y = _cpu_half_gather_mm(x, weight, indices, sorted_indices)
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y

    def to_quantized(self, group_size: int = 64, bits: int = 4, mode: str = "affine", **_: Any) -> nn.Module:
        """This layer with its weight MLX-quantized (``nn.quantize`` calls it)."""
        return QuantizedStackedLinear(self["weight"], self.get("bias"), group_size=group_size, bits=bits, mode=mode)


def _cpu_half_gather_mm(x: mx.array, weight: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
    """``gather_mm`` for half-precision weights on the CPU, whose ``gather_mm`` multiplies float32
    only: in float32, from the chosen experts' weights where there are fewer choices than experts
    (a decode step), else from all of them (each call converts every expert: slow, but a
    half-precision model on the CPU is a choice against the default)."""
    if indices.size <= weight.shape[0]:
        y = x.astype(mx.float32) @ weight[indices].astype(mx.float32).swapaxes(-1, -2)
    else:
        y = mx.gather_mm(x.astype(mx.float32), weight.astype(mx.float32).swapaxes(-1, -2), rhs_indices=indices,
                         sorted_indices=sorted_indices)  # fmt: skip
    return y.astype(x.dtype)


class QuantizedStackedLinear(nn.Module):
    """:class:`StackedLinear` with MLX affine-quantized weights (``weight``, ``scales``, ``biases``),
    applied with ``mx.gather_qmm``."""

    def __init__(self, weight: mx.array, bias: mx.array | None, *, group_size: int, bits: int, mode: str = "affine"):
        super().__init__()
        self.group_size, self.bits, self.mode = group_size, bits, mode
        self.weight, self.scales, *biases = mx.quantize(weight, group_size, bits, mode=mode)
        self.biases = biases[0] if biases else None
        if bias is not None:
            self.bias = bias
        self.freeze()

    @property
    def num_experts(self) -> int:
        return self.weight.shape[0]

    def _extra_repr(self) -> str:
        return f"experts={self.num_experts}, group_size={self.group_size}, bits={self.bits}, mode={self.mode}"

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        y = mx.gather_qmm(
            x, self["weight"], self["scales"], self.get("biases"), rhs_indices=indices, transpose=True,
            group_size=self.group_size, bits=self.bits, mode=self.mode, sorted_indices=sorted_indices,
        )  # fmt: skip
        if "bias" in self:
            y = y + mx.expand_dims(self["bias"][indices], -2)
        return y


class Experts(nn.Module):
    """``num_experts`` feed-forwards over stacked weights, applied to each token's chosen experts.

    A subclass defines the projections and ``experts`` (one expert's feed-forward on gathered
    rows); this class routes tokens to it: gathered in token order for a few pairs (a decode
    step), sorted by expert for many (a prompt's chunk), in blocks on the CPU (``in_blocks``).
    """

    def experts(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        """The chosen experts applied to rows ``x`` ``[..., 1, D]`` -> ``[..., 1, D]``."""
        raise NotImplementedError

    @property
    def first_projection(self) -> nn.Module:
        """The projection the input meets first (its expert count and storage decide the path)."""
        raise NotImplementedError

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array | None = None) -> mx.array:
        """Each token's chosen experts: ``x`` ``[..., D]``, ``indices`` ``[..., k]`` (integer expert
        ids) -> ``[..., k, D]``; with ``weights`` ``[..., k]``, their weighted sum ``[..., D]``."""
        k, dims = indices.shape[-1], x.shape[-1]
        if weights is not None and self.blocked(indices.size):
            return self.in_blocks(x, indices, weights)
        if indices.size >= SORT_THRESHOLD:
            flat = indices.reshape(-1)
            order = mx.argsort(flat)
            rows = x.reshape(-1, 1, dims)[order // k]
            y = self.experts(rows, flat[order], sorted_indices=True)
            y = y[mx.argsort(order)].reshape(*indices.shape, dims)
        else:
            y = self.experts(mx.expand_dims(x, (-2, -3)), indices, sorted_indices=False).squeeze(-2)
        if weights is None:
            return y
        return (y * weights[..., None].astype(y.dtype)).sum(axis=-2)

    def blocked(self, pairs: int) -> bool:
        """Whether ``pairs`` token-expert pairs run as blocks of ``BLOCK`` rows per expert
        (``in_blocks``): on the CPU, with dense weights, for pairs enough to share experts."""
        experts = self.first_projection.num_experts
        return (pairs >= max(SORT_THRESHOLD, 2 * experts) and isinstance(self.first_projection, StackedLinear)
                and not default_device_is_gpu())  # fmt: skip

    def in_blocks(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        """``self(x, indices, weights)`` as matmuls of ``BLOCK`` rows each.

        MLX's CPU ``gather_mm`` multiplies each gathered row on its own, reading its expert's
        weights once per row; here the token-expert pairs, sorted by expert, are laid out in
        blocks of ``BLOCK`` rows, each expert's pairs padded with zero rows to whole blocks
        (every block one expert's), so each block is one ``[BLOCK, D] x [D, I]`` product. The
        layout is computed on the device, sized for the worst case: no host synchronisation.
        """
        k, dims = indices.shape[-1], x.shape[-1]
        experts = self.first_projection.num_experts
        flat = indices.reshape(-1).astype(mx.int32)
        pairs = flat.size
        order = mx.argsort(flat)
        chosen = flat[order]
        counts = mx.zeros((experts,), dtype=mx.int32).at[flat].add(1)
        padded = (counts + BLOCK - 1) // BLOCK * BLOCK
        padded_ends = mx.cumsum(padded)
        rank = mx.arange(pairs, dtype=mx.int32) - (mx.cumsum(counts) - counts)[chosen]
        position = (padded_ends - padded)[chosen] + rank
        blocks = -(-(pairs + min(experts, pairs) * (BLOCK - 1)) // BLOCK)
        starts = mx.arange(blocks, dtype=mx.int32) * BLOCK
        block_expert = mx.minimum((padded_ends[None, :] <= starts[:, None]).sum(axis=1), experts - 1)
        rows = mx.zeros((blocks * BLOCK, dims), dtype=x.dtype)
        rows[position] = x.reshape(-1, dims)[order // k]
        y = self.experts(rows.reshape(blocks, BLOCK, dims), block_expert.astype(mx.uint32), sorted_indices=True)
        y = y.reshape(-1, dims)[position] * weights.reshape(-1)[order][:, None].astype(y.dtype)
        out = mx.zeros((pairs // k, dims), dtype=y.dtype).at[order // k].add(y)
        return out.reshape(*indices.shape[:-1], dims)


class SwiGLUExperts(Experts):
    """SwiGLU experts, ``down(silu(gate(x)) · up(x))``; mlx-lm's ``switch_mlp`` names."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, *, bias: bool = False):
        super().__init__()
        self.gate_proj = StackedLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.up_proj = StackedLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.down_proj = StackedLinear(hidden_dims, input_dims, num_experts, bias=bias)

    @property
    def first_projection(self) -> nn.Module:
        return self.gate_proj

    def experts(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        hidden = swiglu(self.gate_proj(x, indices, sorted_indices), self.up_proj(x, indices, sorted_indices))
        return self.down_proj(hidden, indices, sorted_indices)


class ReLU2Experts(Experts):
    """Ungated experts with a squared ReLU, ``fc2(relu(fc1(x))²)`` (Nemotron-H); mlx-lm's
    ``switch_mlp.fc1``/``fc2`` names."""

    def __init__(self, input_dims: int, hidden_dims: int, num_experts: int, *, bias: bool = False):
        super().__init__()
        self.fc1 = StackedLinear(input_dims, hidden_dims, num_experts, bias=bias)
        self.fc2 = StackedLinear(hidden_dims, input_dims, num_experts, bias=bias)

    @property
    def first_projection(self) -> nn.Module:
        return self.fc1

    def experts(self, x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array:
        return self.fc2(relu2(self.fc1(x, indices, sorted_indices)), indices, sorted_indices)


def softmax_top_k(logits: mx.array, k: int, *, normalize: bool) -> tuple[mx.array, mx.array]:
    """``(indices, weights)`` ``[..., k]`` of the ``k`` largest router probabilities, the softmax
    over every expert computed in float32, renormalised to sum to 1 if ``normalize``
    (``norm_topk_prob``); weights in ``logits``' dtype."""
    probs = mx.softmax(logits, axis=-1, precise=True)
    indices = mx.argpartition(probs, kth=-k, axis=-1)[..., -k:]
    weights = mx.take_along_axis(probs, indices, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return indices, weights.astype(logits.dtype)


def top_k_softmax(logits: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """``(indices, weights)`` ``[..., k]``: the ``k`` largest logits and the softmax over just them
    (float32 inside), weights in ``logits``' dtype."""
    indices = mx.argpartition(logits, kth=-k, axis=-1)[..., -k:]
    chosen = mx.take_along_axis(logits, indices, axis=-1)
    return indices, mx.softmax(chosen, axis=-1, precise=True).astype(logits.dtype)


def grouped_sigmoid_top_k(
    logits: mx.array, correction_bias: mx.array, k: int, *, groups: int, top_groups: int, normalize: bool, scale: float
) -> tuple[mx.array, mx.array]:
    """``(indices, weights)`` ``[..., k]`` by DeepSeek-V3's router (Nemotron-H's MoE layers).

    Scores are the sigmoids of ``logits`` (float32); the choice ranks ``score + correction_bias``,
    limited to the ``top_groups`` of ``groups`` equal groups of experts whose two best biased
    scores sum highest; the weights are the chosen experts' unbiased scores, renormalised to sum
    to 1 if ``normalize``, times ``scale``.
    """
    scores = mx.sigmoid(logits.astype(mx.float32))
    choice = scores + correction_bias.astype(mx.float32)
    if top_groups < groups:
        grouped = choice.reshape(*choice.shape[:-1], groups, -1)
        group_scores = mx.topk(grouped, 2, axis=-1).sum(axis=-1, keepdims=True)
        dropped = mx.argpartition(group_scores, kth=groups - top_groups - 1, axis=-2)[..., : groups - top_groups, :]
        grouped = mx.put_along_axis(grouped, dropped, mx.array(-mx.inf, dtype=grouped.dtype), axis=-2)
        choice = grouped.reshape(choice.shape)
    indices = mx.argpartition(-choice, kth=k - 1, axis=-1)[..., :k]
    weights = mx.take_along_axis(scores, indices, axis=-1)
    if normalize:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return indices, (weights * scale).astype(logits.dtype)


def stacked_entry(sources: Sequence[TensorEntry]) -> tuple[TensorEntry, Any]:
    """A ``checkpoint_layout`` value: the experts' tensors ``sources`` (same shape, in expert
    order) read as one stacked tensor ``[E, *shape]``."""
    from butter_core.loading.weights import Derived

    first = sources[0]
    shapes = {entry.shape for entry in sources}
    if len(shapes) != 1:
        raise ModelLoadError(
            f"{first.file}: the experts' tensors {first.name!r}... have different shapes {sorted(shapes)}"
        )
    seen = attrs.evolve(first, shape=(len(sources), *first.shape))
    return seen, Derived(tuple(sources), mx.stack)


def experts_stacked(
    entries: dict[str, TensorEntry], marker: str, target: str, projections: dict[str, str], num_experts: int
) -> dict[str, Any]:
    """A ``checkpoint_layout`` piece: per-expert tensors ``<layer><marker><e>.<projection>.weight``
    read as stacked ``<layer><target>.<projections[projection]>.weight`` ``[E, out, in]``.

    A layer with some experts' tensor but not all is a ModelLoadError naming the first missing;
    tensors of other names stay as they are, for the loader to name.
    """
    by_layer: dict[str, dict[str, TensorEntry]] = {}
    for name, entry in entries.items():
        layer, rest = name.split(marker, 1)
        by_layer.setdefault(layer, {})[rest] = entry
    stacked: dict[str, Any] = {}
    for layer, tensors in by_layer.items():
        for projection, name in projections.items():
            keys = [f"{e}.{projection}.weight" for e in range(num_experts)]
            present = [k for k in keys if k in tensors]
            if not present:
                continue
            missing = [k for k in keys if k not in tensors]
            if missing:
                raise ModelLoadError(
                    f"{tensors[present[0]].file}: missing tensor '{layer}{marker}{missing[0]}' "
                    f"(the layer's other {len(present)} experts are there)"
                )
            stacked[f"{layer}{target}.{name}.weight"] = stacked_entry([tensors.pop(k) for k in keys])
        stacked.update({f"{layer}{marker}{rest}": entry for rest, entry in tensors.items()})
    return stacked


def sliced_entry(source: TensorEntry, axis: int, start: int, stop: int) -> tuple[TensorEntry, Any]:
    """A ``checkpoint_layout`` value: ``source[..., start:stop, ...]`` along ``axis`` (one half of
    a fused gate/up tensor, say)."""
    from butter_core.loading.weights import Derived

    shape = list(source.shape)
    shape[axis] = stop - start
    index = (slice(None),) * (axis % len(shape)) + (slice(start, stop),)
    return attrs.evolve(source, shape=tuple(shape)), Derived((source,), lambda arrays: arrays[0][index])
