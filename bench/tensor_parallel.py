"""Decode speed and room of a tensor-parallel model: one process against ``mlx.launch -n 2``.

A Qwen3-8B-shaped model with random bf16 weights (``--shape 8b``; ``tiny`` for a smoke run on the
CPU) is built in every process and sharded over the global group (``butter_core.distributed``):
run it alone, then under ``mlx.launch -n 2`` (NCCL on CUDA, the ring backend elsewhere), and
compare. For each scheme (``--kv-cache``) and context (``--context``): prefill the context in
chunks, then time ``--decode-tokens`` greedy steps, host included (median of ``--rounds``).
Reported by rank 0: decode tok/s, peak memory of one rank, KV bytes of one rank and of all, and
the most positions this rank's memory holds for that scheme (``--memory-gib`` per device less
the weights and the measured peak beside the KV), which is the context a single sequence can reach.

Usage::

    python bench/tensor_parallel.py --context 4096,32768 --kv-cache raw,affine4,aura4v2
    mlx.launch -n 2 -- python bench/tensor_parallel.py --context 4096,32768 --kv-cache raw,affine4,aura4v2
    mlx.launch -n 2 --backend ring -- python bench/tensor_parallel.py --shape tiny --context 256   # CPU smoke
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import butter_core  # noqa: F401 - before mlx.core (CPU BLAS)
import mlx.core as mx
from mlx.utils import tree_flatten

from butter_core import LoadOptions
from butter_core.distributed import shard_network, total_bytes, world
from butter_core.engine import Engine
from butter_core.models import build_model

SHAPES = {
    "8b": {"hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 128, "num_hidden_layers": 36, "vocab_size": 151936},
    "tiny": {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8, "num_key_value_heads": 4,
             "head_dim": 32, "num_hidden_layers": 4, "vocab_size": 1024},
}  # fmt: skip


def network(shape: str, context: int):
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": context, "tie_word_embeddings": False,
              **SHAPES[shape]}  # fmt: skip
    mx.random.seed(0)  # the same weights in every process: each keeps its share
    model = build_model(config, Path(f"qwen3-{shape}-shaped (random weights)"))
    model.set_dtype(mx.bfloat16)
    shard_network(model, world())
    mx.eval(model.parameters())
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    parser.add_argument("--context", default="4096,32768")
    parser.add_argument("--kv-cache", default="raw,affine4,aura4v2")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--memory-gib", type=float, default=80.0)
    args = parser.parse_args()
    group = world()
    contexts = [int(c) for c in args.context.split(",")]
    model = network(args.shape, max(contexts) + args.decode_tokens * (args.rounds + 1) + 8)
    weights = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    show = group.rank() == 0
    if show:
        print("| ranks | scheme | context | decode tok/s | peak GiB (one rank) | KV one rank | KV all ranks | positions that fit |")
        print("|---|---|---|---|---|---|---|---|")
    for scheme in args.kv_cache.split(","):
        for context in contexts:
            engine = Engine(model, LoadOptions(kv_cache=scheme, max_context_length=context + args.decode_tokens * (args.rounds + 1) + 8))
            caches = engine.make_layer_caches()
            prompt = mx.random.randint(0, SHAPES[args.shape]["vocab_size"], (context,), key=mx.random.key(1)).astype(mx.uint32)
            mx.reset_peak_memory()
            token = mx.argmax(engine.forward(prompt, caches))
            mx.eval(token)
            speeds = []
            for _ in range(args.rounds):
                start = time.perf_counter()
                for _ in range(args.decode_tokens):
                    token = mx.argmax(engine.run(token.reshape(1), caches))
                    mx.async_eval(token)
                mx.eval(token)
                speeds.append(args.decode_tokens / (time.perf_counter() - start))
            kv = sum(c.nbytes_live for c in caches)
            every = total_bytes(kv, group)
            peak = mx.get_peak_memory()
            per_position = kv / caches[0].absolute_position
            room = (args.memory_gib * 2**30 - weights - (peak - weights - kv)) / per_position
            if show:
                print(f"| {group.size()} | {scheme} | {context} | {statistics.median(speeds):.1f} | {peak / 2**30:.2f} | "
                      f"{kv / 2**20:.2f} MiB | {every / 2**20:.2f} MiB | {int(room):,} |")
            del caches
            mx.clear_cache()
    if show:
        print(f"MLX {mx.__version__}; {mx.default_device()}; shape {args.shape}; weights {weights / 2**30:.2f} GiB per rank")


if __name__ == "__main__":
    main()
