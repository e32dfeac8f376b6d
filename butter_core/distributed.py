"""Tensor parallelism over ``mx.distributed``: a model's heads and feed-forward columns split across ranks.

Launched with MLX's launcher, every process (rank) loads the checkpoint and keeps its share::

    mlx.launch -n 2 -- butter generate -p "Hello"        # two processes on this machine

``mlx.launch`` picks the backend by platform (NCCL where MLX has CUDA, the ring backend
elsewhere; ``--backend`` overrides) and ``Model.load`` shards the network when the global group
(``world()``) has more than one rank; one process runs as before. The split is Megatron's, as
mlx-lm's ``shard`` makes it:

* attention: rank ``r`` of ``n`` keeps query and KV heads ``[r h / n, (r + 1) h / n)``: the
  q/k/v projections are sharded by output rows (``all-to-sharded``), the output projection by
  input columns (``sharded-to-all``, whose all-reduce sums the ranks' partial outputs). Its
  caches hold its own KV heads only (``layer_specs`` reads the sharded head counts), in any
  scheme, windowed or batched, so their bytes are per rank (``total_bytes`` sums them);
* the SwiGLU feed-forward: gate and up by output rows, down by input columns with its all-reduce;
* a Mamba2 mixer by heads and groups (each head reads its own group's ``B`` and ``C``, so the scan
  and the gated norm stay local): the input projection's gate, ``x``, ``B``, ``C`` and ``dt`` segments
  each by rows, the convolution's channels and per-head parameters to match, the output
  projection by input columns; each rank's recurrent state holds its heads. With one group
  (Granite 4.0-H) every rank keeps ``B`` and ``C`` whole and the gated norm sums its squares across
  the ranks;
* a gated delta layer (Qwen3-Next) by key heads with their value heads: the ``q | k | v | z`` and
  ``b | a`` projection segments, the convolution's channels and per-head parameters sliced, the
  output projection by columns; its gated attention by query heads, with KV heads sharded where
  they divide among the ranks and kept whole on every rank where there is one (``kv_shard``);
* a MoE layer (Nemotron-H, Qwen3-Next, Granite 4.0-H): each routed expert and the shared expert by intermediate
  columns, the router (and shared-expert gate) replicated, so every rank routes every token alike,
  the partial outputs summed by one all-reduce per layer (``RankSum``);
* embeddings, norms and the LM head are replicated, so every rank computes the same logits and,
  from the same seed (``shared_seed``), samples the same token.

Every family butter loads runs so (llama, qwen3, mamba2, nemotron_h, qwen3_next, granitemoehybrid).
MLX-quantized weights shard as float ones do: rows of their packed weights, scales and biases, and
input columns by whole quantization groups. Head counts that do not divide among the ranks, and a
quantized projection whose input columns do not split into whole groups per rank, are refused
(``ConfigError`` naming what).
"""

from __future__ import annotations

import functools
import json
import os
import random
from typing import Any

import attrs
import mlx.core as mx
import numpy as np
from mlx import nn
from mlx.nn.layers.distributed import shard_linear

from butter_core.errors import ConfigError
from butter_core.models.base import MLP, Attention, DecoderModel
from butter_core.models.granitemoehybrid import MAMBA as GRANITE_MAMBA
from butter_core.models.granitemoehybrid import GraniteMoeHybridModel
from butter_core.models.mamba2 import Mamba2Model
from butter_core.models.nemotron_h import ATTENTION, MAMBA, NemotronHModel
from butter_core.models.nemotron_h import MLP as MLP_LAYER
from butter_core.models.qwen3_next import FULL_ATTENTION, Qwen3NextModel


def world() -> mx.distributed.Group:
    """The global group: every process ``mlx.launch`` started (it sets ``MLX_RANK``), or this process
    alone. A process not launched so asks only the ring backend, which without a host file is a group
    of one: no other backend (NCCL on a CUDA machine) is touched by a plain ``butter generate``."""
    return mx.distributed.init(backend="any" if "MLX_RANK" in os.environ else "ring")


def shard_network(network, group: mx.distributed.Group) -> None:
    """Keep ``group.rank()``'s share of ``network``'s heads and feed-forward columns (see the module
    docstring); nothing for a group of one."""
    size = group.size()
    if size == 1:
        return
    object.__setattr__(network, "shard", (group.rank(), size))  # not a child module: nn.Module keeps tuples as children
    object.__setattr__(network, "kv_shard", network.shard)
    if isinstance(network, DecoderModel) and all(
        isinstance(b.self_attn, Attention) and isinstance(b.mlp, MLP) for b in network.layers
    ):
        args = network.args
        _check_divisible(size, num_attention_heads=args.num_attention_heads, num_key_value_heads=args.num_key_value_heads,
                         intermediate_size=args.intermediate_size)  # fmt: skip
        for block in network.layers:
            _shard_attention(block.self_attn, group)
            _shard_mlp(block.mlp, group)
        network.args = attrs.evolve(args, num_attention_heads=args.num_attention_heads // size,
                                    num_key_value_heads=args.num_key_value_heads // size)  # fmt: skip
    elif type(network) is Mamba2Model:
        mixer = network.args.mixer
        _check_divisible(size, num_heads=mixer.num_heads, n_groups=mixer.n_groups)
        for block in network.layers:
            _shard_mamba2(block.mixer, group)
        network.args = attrs.evolve(network.args, mixer=network.layers[0].mixer.shape)
    elif type(network) is NemotronHModel:
        _shard_nemotron_h(network, group)
    elif type(network) is Qwen3NextModel:
        _shard_qwen3_next(network, group)
    elif type(network) is GraniteMoeHybridModel:
        _shard_granite(network, group)
    else:
        raise ConfigError(f"tensor parallelism (mlx.launch with {size} processes) runs the llama, qwen3, mamba2, "
                          f"nemotron_h, qwen3_next and granitemoehybrid families; {network.args.model_type} is not one of "
                          "them yet: run it in one process")  # fmt: skip
    mx.eval(network.parameters())


def _check_divisible(size: int, **counts: int) -> None:
    for name, count in counts.items():
        if count % size:
            raise ConfigError(f"tensor parallelism over {size} processes needs {name} ({count}) divisible by {size}")


def _shard_attention(attention, group: mx.distributed.Group) -> None:
    """Query and KV heads by output rows, the output projection by input columns (its all-reduce)."""
    for part in ("q_proj", "k_proj", "v_proj"):
        setattr(attention, part, shard_linear(getattr(attention, part), "all-to-sharded", group=group))
    attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
    attention.n_heads //= group.size()
    attention.n_kv_heads //= group.size()


def _shard_mlp(mlp, group: mx.distributed.Group, first: tuple[str, ...] = ("gate_proj", "up_proj"),
               last: str = "down_proj", *, summed: bool = True) -> None:  # fmt: skip
    """A feed-forward by intermediate columns: the ``first`` projections by output rows, ``last`` by
    input columns, with its all-reduce; without it (``summed=False``) where the caller sums this
    output with others in one all-reduce (``RankSum``), its bias then kept on rank 0 alone."""
    for name in first:
        setattr(mlp, name, shard_linear(getattr(mlp, name), "all-to-sharded", group=group))
    if summed:
        setattr(mlp, last, shard_linear(getattr(mlp, last), "sharded-to-all", group=group))
        return
    _keep_columns(getattr(mlp, last), group.rank(), group.size(), last)


def _shard_mamba2(layer, group: mx.distributed.Group) -> None:
    """A Mamba2 mixer by heads: each rank keeps its heads' gate, ``x`` and ``dt``, the convolution's
    channels and per-head parameters to match, and the output projection by input columns with its
    all-reduce. With as many groups as ranks or more, each rank keeps its groups' ``B`` and ``C`` (a
    head reads its own group's only, so the scan and the per-group gated norm stay local); with one
    group, every rank keeps ``B`` and ``C`` whole and the gated norm, over all heads' channels, sums
    its squares across the ranks (``_gated_norm_across``)."""
    s, rank, size = layer.shape, group.rank(), group.size()
    bc = s.n_groups * s.state_size
    if s.n_groups % size == 0:
        cuts = [s.inner, 2 * s.inner, 2 * s.inner + bc, 2 * s.inner + 2 * bc]  # gate | x | B | C | dt
        layer.in_proj = shard_linear(layer.in_proj, "all-to-sharded", segments=cuts, group=group)
        conv = _share_index(s.conv_dim, [s.inner, s.inner + bc], rank, size)  # x | B | C
        groups = s.n_groups // size
    elif s.n_groups == 1:
        mine = _share_index(s.inner, [], rank, size)
        whole = mx.arange(2 * bc, dtype=mx.int32)
        heads = _share_index(s.num_heads, [], rank, size)
        layer.in_proj = _linear_rows(layer.in_proj, mx.concatenate([mine, s.inner + mine, 2 * s.inner + whole,
                                                                    2 * s.inner + 2 * bc + heads]))  # fmt: skip
        conv = mx.concatenate([mine, s.inner + whole])
        groups = 1
        layer.norm_across = functools.partial(_gated_norm_across, group=group, channels=s.inner)
    else:
        raise ConfigError(f"tensor parallelism over {size} processes needs a Mamba2 n_groups ({s.n_groups}) divisible "
                          f"by {size}, or 1")  # fmt: skip
    layer.conv1d.weight = layer.conv1d.weight[conv]
    if "bias" in layer.conv1d:
        layer.conv1d.bias = layer.conv1d.bias[conv]
    for name in ("dt_bias", "A_log", "D"):
        setattr(layer, name, _share(getattr(layer, name), [], rank, size))
    layer.norm.weight = _share(layer.norm.weight, [], rank, size)
    layer.out_proj = shard_linear(layer.out_proj, "sharded-to-all", group=group)
    layer.shape = attrs.evolve(s, num_heads=s.num_heads // size, n_groups=groups)


def _gated_norm_across(x: mx.array, gate: mx.array, weight: mx.array, *, eps: float, group: mx.distributed.Group,
                       channels: int) -> mx.array:  # fmt: skip
    """``recurrent_ops.gate_then_rms_norm`` over one group of ``channels`` that the ranks hold in parts:
    the mean square is each rank's sum of squares, all-reduced."""
    gated = x.astype(mx.float32) * nn.silu(gate.astype(mx.float32))
    squares = mx.distributed.all_sum(mx.sum(gated * gated, axis=-1, keepdims=True), group=group)
    return (gated * mx.rsqrt(squares / channels + eps) * weight.astype(mx.float32)).astype(x.dtype)


def _linear_rows(linear, rows: mx.array):
    """``linear`` (float or MLX-quantized) keeping output ``rows`` only."""
    for name in ("weight", "scales", "biases", "bias"):
        if linear.get(name) is not None:
            setattr(linear, name, linear[name][rows])
    return linear


def _keep_columns(projection, rank: int, size: int, what: str) -> None:
    """``projection`` (float or MLX-quantized, one matrix or stacked experts) keeping rank ``rank``'s
    share of its input columns, its bias on rank 0 alone (the ranks' outputs are summed); a
    quantized one's share must be whole quantization groups."""
    if projection.get("scales") is not None and projection["scales"].shape[-1] % size:
        groups = projection["scales"].shape[-1]
        raise ConfigError(f"tensor parallelism over {size} processes splits {what}'s input columns by whole quantization "
                          f"groups, and its {groups} group(s) of {projection.group_size} do not divide by {size}: load "
                          "a float checkpoint or one quantized in smaller groups")  # fmt: skip
    for name in ("weight", "scales", "biases"):
        if projection.get(name) is not None:
            setattr(projection, name, mx.split(projection[name], size, axis=-1)[rank])
    _partial_bias(projection, rank)


def _shard_granite(network, group: mx.distributed.Group) -> None:
    """Granite 4.0-H layer by layer: Mamba2 mixers by heads (its one group's ``B``/``C`` whole on every
    rank), attention by heads, the MoE's experts by intermediate columns and the shared MLP by columns,
    each summed by an all-reduce, or a dense MLP by columns."""
    args, size = network.args, group.size()
    counts = {"num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads,
              "intermediate_size": args.intermediate_size, "shared_intermediate_size": args.shared_intermediate_size}  # fmt: skip
    if args.mamba is not None:
        counts["mamba_n_heads"] = args.mamba.num_heads
    _check_divisible(size, **counts)
    for layer in network.layers:
        if layer.layer_type == GRANITE_MAMBA:
            _shard_mamba2(layer.mamba, group)
        else:
            _shard_attention(layer.self_attn, group)
        if "mlp" in layer:
            _shard_mlp(layer.mlp, group)
            continue
        _shard_experts(layer.block_sparse_moe.switch_mlp, ("gate_proj", "up_proj"), "down_proj", group.rank(), size)
        layer.block_sparse_moe = RankSum(layer.block_sparse_moe, group)
        shared = layer.shared_mlp
        shared.input_linear = shard_linear(shared.input_linear, "all-to-sharded", segments=2, group=group)  # gate | up
        shared.output_linear = shard_linear(shared.output_linear, "sharded-to-all", group=group)
    mambas = [layer.mamba.shape for layer in network.layers if layer.layer_type == GRANITE_MAMBA]
    network.args = attrs.evolve(
        args, num_attention_heads=args.num_attention_heads // size, num_key_value_heads=args.num_key_value_heads // size,
        mamba=mambas[0] if mambas else None,
    )  # fmt: skip


def _shard_experts(experts, first: tuple[str, ...], last: str, rank: int, size: int) -> None:
    """Stacked experts (``[E, out, in]``, float or MLX-quantized) by intermediate columns: the ``first``
    projections by output rows, ``last`` by input columns, its bias kept on rank 0 (the ranks' outputs
    are summed)."""
    for name in first:
        projection = getattr(experts, name)
        for part, axis in (("weight", -2), ("scales", -2), ("biases", -2), ("bias", -1)):
            if projection.get(part) is not None:
                setattr(projection, part, mx.split(projection[part], size, axis=axis)[rank])
    _keep_columns(getattr(experts, last), rank, size, last)


def _shard_nemotron_h(network, group: mx.distributed.Group) -> None:
    """Nemotron-H layer by layer: Mamba2 mixers by heads and groups, attention by heads, squared-ReLU
    MLPs by columns; a MoE layer's routed experts and shared expert each by intermediate columns
    (every rank routes every token, replicated router), their partial outputs summed by one
    all-reduce for the layer (``RankSum``)."""
    args, size = network.args, group.size()
    counts = {"intermediate_size": args.intermediate_size}
    if args.count(ATTENTION):
        counts |= {"num_attention_heads": args.num_attention_heads, "num_key_value_heads": args.num_key_value_heads}
    if args.mamba is not None:
        counts |= {"mamba_num_heads": args.mamba.num_heads, "n_groups": args.mamba.n_groups}
    if args.moe is not None:
        if args.moe.latent_size is not None:
            raise ConfigError("tensor parallelism does not shard Nemotron-H's latent MoE projection (moe_latent_size) yet")
        counts |= {"moe_intermediate_size": args.moe.intermediate_size,
                   "moe_shared_expert_intermediate_size": args.moe.shared_intermediate_size}  # fmt: skip
    _check_divisible(size, **counts)
    for block in network.layers:
        if block.layer_type == MAMBA:
            _shard_mamba2(block.mixer, group)
        elif block.layer_type == ATTENTION:
            _shard_attention(block.mixer, group)
        elif block.layer_type == MLP_LAYER:
            _shard_mlp(block.mixer, group, ("up_proj",))
        else:
            _shard_experts(block.mixer.switch_mlp, ("fc1",), "fc2", group.rank(), size)
            _shard_mlp(block.mixer.shared_experts, group, ("up_proj",), summed=False)
            block.mixer = RankSum(block.mixer, group)
    mambas = [block.mixer.shape for block in network.layers if block.layer_type == MAMBA]
    network.args = attrs.evolve(
        args, num_attention_heads=args.num_attention_heads // size, num_key_value_heads=args.num_key_value_heads // size,
        mamba=mambas[0] if mambas else None,
    )  # fmt: skip


def _shard_qwen3_next(network, group: mx.distributed.Group) -> None:
    """Qwen3-Next layer by layer: a gated delta layer by key heads (with their value heads: the
    projections' ``q | k | v | z`` and ``b | a`` segments, the convolution's ``q | k | v`` channels and
    the per-value-head parameters sliced to match); gated attention by query heads, its KV heads
    sharded too where there are as many as ranks, else kept whole on every rank (``kv_shard`` (0, 1));
    a MoE layer's experts and shared expert by intermediate columns, summed by one all-reduce
    (``RankSum``), a dense MLP by columns."""
    args, rank, size = network.args, group.rank(), group.size()
    linear = args.linear
    replicated = args.num_key_value_heads < size and args.num_key_value_heads == 1
    counts = {"num_attention_heads": args.num_attention_heads, "linear_num_key_heads": linear.key_heads,
              "linear_num_value_heads": linear.value_heads}  # fmt: skip
    if not replicated:
        counts["num_key_value_heads"] = args.num_key_value_heads
    if any(args.sparse_layers):
        counts |= {"moe_intermediate_size": args.moe_intermediate_size,
                   "shared_expert_intermediate_size": args.shared_expert_intermediate_size}  # fmt: skip
    if not all(args.sparse_layers):
        counts["intermediate_size"] = args.intermediate_size
    _check_divisible(size, **counts)
    for layer in network.layers:
        if layer.layer_type == FULL_ATTENTION:
            attention = layer.self_attn
            attention.q_proj = shard_linear(attention.q_proj, "all-to-sharded", group=group)
            attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
            attention.n_heads //= size
            if not replicated:
                attention.k_proj = shard_linear(attention.k_proj, "all-to-sharded", group=group)
                attention.v_proj = shard_linear(attention.v_proj, "all-to-sharded", group=group)
                attention.n_kv_heads //= size
        else:
            delta, s = layer.linear_attn, linear
            delta.in_proj_qkvz = shard_linear(delta.in_proj_qkvz, "all-to-sharded", segments=[s.keys, 2 * s.keys,
                                              s.conv_dim], group=group)  # fmt: skip
            delta.in_proj_ba = shard_linear(delta.in_proj_ba, "all-to-sharded", segments=[s.value_heads], group=group)
            delta.conv1d.weight = _share(delta.conv1d.weight, [s.keys, 2 * s.keys], rank, size)
            delta.dt_bias = _share(delta.dt_bias, [], rank, size)
            delta.A_log = _share(delta.A_log, [], rank, size)
            delta.out_proj = shard_linear(delta.out_proj, "sharded-to-all", group=group)
            delta.shape = attrs.evolve(s, key_heads=s.key_heads // size, value_heads=s.value_heads // size)
        if isinstance(layer.mlp, MLP):
            _shard_mlp(layer.mlp, group)
            continue
        _shard_experts(layer.mlp.switch_mlp, ("gate_proj", "up_proj"), "down_proj", rank, size)
        _shard_mlp(layer.mlp.shared_expert, group, summed=False)
        layer.mlp = RankSum(layer.mlp, group)
    network.args = attrs.evolve(
        args, num_attention_heads=args.num_attention_heads // size,
        num_key_value_heads=args.num_key_value_heads if replicated else args.num_key_value_heads // size,
        linear=attrs.evolve(linear, key_heads=linear.key_heads // size, value_heads=linear.value_heads // size),
    )  # fmt: skip
    if replicated:
        object.__setattr__(network, "kv_shard", (0, 1))


def _partial_bias(layer, rank: int) -> None:
    """A layer whose outputs the ranks sum: its bias added once (rank 0's), not once per rank."""
    if "bias" in layer and rank:
        layer.bias = mx.zeros_like(layer.bias)


class RankSum(nn.Module):
    """``inner``'s output summed over the group: each rank computes its share of a sum (a MoE layer's
    experts' columns), and one all-reduce adds them."""

    def __init__(self, inner: nn.Module, group: mx.distributed.Group):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "group", group)

    def __call__(self, x: mx.array) -> mx.array:
        return mx.distributed.all_sum(self.inner(x), group=self.group)


def _share_index(length: int, cuts: list[int], rank: int, size: int) -> mx.array:
    """The indices of ``_share``'s rows: rank ``rank``'s part of each segment of ``[0, length)``."""
    return _share(mx.arange(length, dtype=mx.int32), cuts, rank, size)


def _share(array: mx.array, cuts: list[int], rank: int, size: int) -> mx.array:
    """Rank ``rank``'s part of each segment of ``array``'s first axis (split at ``cuts``), concatenated."""
    segments = mx.split(array, cuts, axis=0) if cuts else [array]
    return mx.concatenate([mx.split(segment, size, axis=0)[rank] for segment in segments], axis=0)


def total_bytes(nbytes: int, group: mx.distributed.Group | None = None) -> int:
    """``nbytes`` summed over the ranks of ``group`` (default ``world()``): one rank's cache bytes, all ranks'."""
    group = group or world()
    if group.size() == 1:
        return nbytes
    return int(mx.distributed.all_sum(mx.array(nbytes, dtype=mx.int64), group=group).item())


def shared_seed(seed: int | None, group: mx.distributed.Group | None = None) -> int | None:
    """``seed``, or where it is None and several ranks sample, rank 0's random seed given to all, so that
    every rank draws the same tokens (None for a single process: its own randomness)."""
    group = group or world()
    if seed is not None or group.size() == 1:
        return seed
    mine = random.getrandbits(31) if group.rank() == 0 else 0
    return int(mx.distributed.all_sum(mx.array(mine, dtype=mx.int32), group=group).item())


def broadcast_json(value: Any, group: mx.distributed.Group) -> Any:
    """Rank 0's ``value`` (JSON-serializable; the other ranks pass anything) on every rank of
    ``group``: its encoded length, then its bytes, each an all-reduce to which the other ranks add
    zeros (what ``butter serve`` sends its followers each scheduler step)."""
    data = json.dumps(value).encode() if group.rank() == 0 else b""
    size = int(mx.distributed.all_sum(mx.array(len(data), dtype=mx.int32), group=group).item())
    local = mx.array(np.frombuffer(data, dtype=np.uint8)) if group.rank() == 0 else mx.zeros((size,), dtype=mx.uint8)
    return json.loads(bytes(np.array(mx.distributed.all_sum(local, group=group))))
