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
* embeddings, norms and the LM head are replicated, so every rank computes the same logits and,
  from the same seed (``shared_seed``), samples the same token.

Families with recurrent mixers or experts are refused for now (``ConfigError`` naming the family).
"""

from __future__ import annotations

import random

import attrs
import mlx.core as mx
from mlx.nn.layers.distributed import shard_linear

from butter_core.errors import ConfigError
from butter_core.models.base import MLP, Attention, DecoderModel


def world() -> mx.distributed.Group:
    """The global group: every process ``mlx.launch`` started, or this process alone."""
    return mx.distributed.init()


def shard_network(network, group: mx.distributed.Group) -> None:
    """Keep ``group.rank()``'s share of ``network``'s heads and feed-forward columns (see the module
    docstring); nothing for a group of one."""
    size = group.size()
    if size == 1:
        return
    if not isinstance(network, DecoderModel) or not all(
        isinstance(b.self_attn, Attention) and isinstance(b.mlp, MLP) for b in network.layers
    ):
        raise ConfigError(f"tensor parallelism (mlx.launch with {size} processes) runs Llama-shaped decoders of "
                          f"attention and a SwiGLU feed-forward (llama, qwen3); {network.args.model_type} is not "
                          "one: run it in one process")  # fmt: skip
    args = network.args
    for name, count in (("num_attention_heads", args.num_attention_heads), ("num_key_value_heads",
                        args.num_key_value_heads), ("intermediate_size", args.intermediate_size)):  # fmt: skip
        if count % size:
            raise ConfigError(f"tensor parallelism over {size} processes needs {name} ({count}) divisible by {size}")
    for block in network.layers:
        attention, mlp = block.self_attn, block.mlp
        for part in ("q_proj", "k_proj", "v_proj"):
            setattr(attention, part, shard_linear(getattr(attention, part), "all-to-sharded", group=group))
        attention.o_proj = shard_linear(attention.o_proj, "sharded-to-all", group=group)
        attention.n_heads //= size
        attention.n_kv_heads //= size
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    network.args = attrs.evolve(args, num_attention_heads=args.num_attention_heads // size,
                                num_key_value_heads=args.num_key_value_heads // size)  # fmt: skip
    object.__setattr__(network, "shard", (group.rank(), size))  # not a child module: nn.Module keeps tuples as children
    mx.eval(network.parameters())


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
