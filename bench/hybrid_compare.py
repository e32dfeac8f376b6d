"""Recurrent and hybrid families: butter against mlx-lm, same weights and shapes, one run.

For each family (``--families``: mamba2, qwen3_next, granitemoehybrid, nemotron_h) a model of the chosen
``--size`` (``cpu``: small enough for a 2-core CPU; ``gpu``: the published configs' layer
shapes with fewer layers) is built once with mlx-lm's own model class, given seeded random
weights, and saved as mlx-lm saves a converted model (its parameter names, ``config.json``);
butter loads that directory with ``Model.load`` (a tokenizer is written beside it), mlx-lm
with ``Model.load_weights``. Each (engine, family, prompt length) runs in a fresh process:
N random token ids are prefilled, then ``--decode-tokens`` greedy tokens are decoded.
Prefill tok/s = N / time to the first token; decode tok/s = (tokens - 1) / time from the
first to the last. Engines alternate, rounds repeat (``--reps``), medians are reported with
the ratio butter / mlx-lm, and whether the two engines' greedy tokens agree.

butter runs through ``Model.generate`` (prefill chunks of 512 on the CPU, 2048 on a GPU).
mlx-lm runs the loop of ``mlx_lm.generate.generate_step`` 0.32.2, restated (importing
``mlx_lm.generate`` imports transformers, which a GPU machine without a registry lacks):
prefill in chunks of 2048 (its default), each evaluated and followed by
``mx.clear_cache()``, then one ``_step`` per token on a dedicated stream with
``mx.async_eval`` of the next step before the current token is read. Note that mlx-lm's
Mamba2 normalises the gated norm over all groups at once (wrong for ``n_groups > 1``), so
the Mamba2 shapes here use one group.

Usage: python3 bench/hybrid_compare.py [--size cpu] [--contexts 512 4096] [--decode-tokens 32]
       [--reps 2] [--families mamba2 qwen3_next granitemoehybrid] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SIZES = {
    "cpu": {
        "mamba2": dict(hidden_size=768, num_heads=24, head_dim=64, state_size=128, n_groups=1, expand=2,
                       num_hidden_layers=12, vocab_size=32000),
        "qwen3_next": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                           head_dim=128, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64,
                           linear_value_head_dim=64, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=256,
                           shared_expert_intermediate_size=256, intermediate_size=1024, vocab_size=32000),
        "granitemoehybrid": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4,
                                 mamba_n_heads=24, mamba_d_head=64, mamba_d_state=128, num_local_experts=16,
                                 num_experts_per_tok=4, intermediate_size=256, shared_intermediate_size=512,
                                 vocab_size=32000),
        "nemotron_h": dict(hidden_size=768, hybrid_override_pattern="M-M*-ME", num_attention_heads=12,
                           num_key_value_heads=4, head_dim=64, mamba_num_heads=24, mamba_head_dim=64, n_groups=1,
                           ssm_state_size=128, intermediate_size=2048, n_routed_experts=16, num_experts_per_tok=4,
                           moe_intermediate_size=256, moe_shared_expert_intermediate_size=512, vocab_size=32000),
    },
    "gpu": {
        # Mamba2-2.7B's layer (80 heads of 64, state 128), 16 of its 64 layers.
        "mamba2": dict(hidden_size=2560, num_heads=80, head_dim=64, state_size=128, n_groups=1, expand=2,
                       num_hidden_layers=16, vocab_size=50288),
        # Qwen3-Next-80B-A3B's layer shapes (gated delta 16 key / 32 value heads of 128; attention 16/2 of 256;
        # experts of 512, top 10), 8 of its 48 layers, 64 of its 512 experts (a token reads the same 10 experts'
        # bytes; 512 would make a 26 GB file for 8 layers).
        "qwen3_next": dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=2,
                           head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                           linear_value_head_dim=128, num_experts=64, num_experts_per_tok=10,
                           moe_intermediate_size=512, shared_expert_intermediate_size=512, intermediate_size=5120,
                           vocab_size=151936),
        # Granite-4.0-H-Tiny's layers (mamba 48 heads of 64, state 128; attention 12/4; 64 experts, top 6), 10 of 40.
        "granitemoehybrid": dict(hidden_size=1536, num_hidden_layers=10, num_attention_heads=12, num_key_value_heads=4,
                                 mamba_n_heads=48, mamba_d_head=64, mamba_d_state=128, num_local_experts=64,
                                 num_experts_per_tok=6, intermediate_size=512, shared_intermediate_size=1024,
                                 vocab_size=100352),
        # Nemotron-3-Nano-30B-A3B's layers (mamba 64 heads of 64, state 128, 8 groups; attention 32/2 of 128;
        # 128 experts of 1856, top 6, shared expert 3712), 7 of its 52 layers, 32 of its 128 experts.
        "nemotron_h": dict(hidden_size=2688, hybrid_override_pattern="MEMEM*E", num_attention_heads=32,
                           num_key_value_heads=2, head_dim=128, mamba_num_heads=64, mamba_head_dim=64, n_groups=8,
                           ssm_state_size=128, intermediate_size=1856, n_routed_experts=32, num_experts_per_tok=6,
                           moe_intermediate_size=1856, moe_shared_expert_intermediate_size=3712, vocab_size=131072),
    },
}  # fmt: skip


def family_config(family: str, shape: dict) -> dict:
    """A full config.json for ``family`` at ``shape``, in the spelling published checkpoints use."""
    if family == "mamba2":
        return {"architectures": ["Mamba2ForCausalLM"], "model_type": "mamba2", "conv_kernel": 4, "chunk_size": 256,
                "layer_norm_epsilon": 1e-5, "use_conv_bias": True, "use_bias": False, "tie_word_embeddings": True,
                "time_step_limit": [0.0, float("inf")], "residual_in_fp32": True, "hidden_act": "silu",
                "intermediate_size": shape["hidden_size"] * shape["expand"], "time_step_rank": "auto", **shape}  # fmt: skip
    if family == "qwen3_next":
        return {"architectures": ["Qwen3NextForCausalLM"], "model_type": "qwen3_next", "linear_conv_kernel_dim": 4,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "rms_norm_eps": 1e-6,
                "rope_theta": 10000000.0, "partial_rotary_factor": 0.25, "max_position_embeddings": 262144,
                "full_attention_interval": 4, "tie_word_embeddings": False, "attention_bias": False,
                "hidden_act": "silu", **shape}  # fmt: skip
    if family == "granitemoehybrid":
        layers = shape["num_hidden_layers"]
        return {"architectures": ["GraniteMoeHybridForCausalLM"], "model_type": "granitemoehybrid",
                "layer_types": ["attention" if i % 5 == 4 else "mamba" for i in range(layers)],
                "mamba_n_groups": 1, "mamba_d_conv": 4, "mamba_expand": 2, "mamba_chunk_size": 256,
                "mamba_conv_bias": True, "mamba_proj_bias": False, "position_embedding_type": "nope",
                "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                "logits_scaling": 6.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "attention_bias": False,
                "max_position_embeddings": 131072, "hidden_act": "silu", "rope_theta": 10000.0, **shape}  # fmt: skip
    if family == "nemotron_h":
        return {"architectures": ["NemotronHForCausalLM"], "model_type": "nemotron_h", "conv_kernel": 4,
                "chunk_size": 128, "use_conv_bias": True, "use_bias": False, "mamba_proj_bias": False,
                "attention_bias": False, "mlp_bias": False, "mlp_hidden_act": "relu2", "layer_norm_epsilon": 1e-5,
                "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True,
                "routed_scaling_factor": 2.5, "max_position_embeddings": 262144, "tie_word_embeddings": False,
                "num_hidden_layers": len(shape["hybrid_override_pattern"]), "time_step_limit": [0.0, float("inf")],
                **shape}  # fmt: skip
    raise ValueError(family)


def _mlx_lm_models():
    """``mlx_lm.models`` without running ``mlx_lm/__init__.py`` (which imports transformers)."""
    import importlib.util
    import types

    if "mlx_lm" not in sys.modules:
        package = types.ModuleType("mlx_lm")
        package.__path__ = list(importlib.util.find_spec("mlx_lm").submodule_search_locations)
        sys.modules["mlx_lm"] = package
    import importlib

    return importlib.import_module("mlx_lm.models.cache"), importlib.import_module


def mlx_lm_model(directory: Path, family: str):
    """mlx-lm's model of ``family`` shaped by the directory's config (its weights loaded if saved)."""
    import mlx.core as mx
    import mlx.nn as nn

    _, import_module = _mlx_lm_models()
    module = import_module(f"mlx_lm.models.{family}")
    config = json.loads((directory / "config.json").read_text())
    model = module.Model(module.ModelArgs.from_dict(config))
    weights_file = directory / "model.safetensors"
    if weights_file.exists():
        weights = mx.load(str(weights_file))
        model.set_dtype(next(iter(weights.values())).dtype)
        model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    nn.Module.eval(model)
    return model


def write_model(directory: Path, family: str, size: str, dtype: str) -> None:
    """mlx-lm's model with seeded random weights of a trained layer's scale, saved as mlx-lm saves it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    from butter_core.testing.tiny_models import write_tokenizer

    directory.mkdir(parents=True)
    config = family_config(family, SIZES[size][family])
    (directory / "config.json").write_text(json.dumps(config))
    model = mlx_lm_model(directory, family)
    weights = {}
    for i, (name, p) in enumerate(tree_flatten(model.parameters())):
        key = mx.random.key(i)
        if name.endswith("A_log"):
            value = mx.random.uniform(0.0, 2.0, p.shape, key=key)
        elif name.endswith(("dt_bias", "D")):
            value = mx.random.uniform(-2.0, 1.0, p.shape, key=key)
        elif p.ndim == 1:
            value = 1.0 + 0.1 * mx.random.normal(p.shape, key=key)
        else:
            value = mx.random.normal(p.shape, key=key) * p.shape[-1] ** -0.5
        weights[name] = value.astype(getattr(mx, dtype))
    mx.save_safetensors(str(directory / "model.safetensors"), weights)
    write_tokenizer(directory)


def mlx_lm_generate(model, ids: list[int], max_tokens: int) -> tuple[float, float, list[int]]:
    """``generate_step``'s greedy loop (0.32.2), restated: (seconds to the first token, seconds
    from the first to the last, tokens)."""
    import mlx.core as mx

    cache, _ = _mlx_lm_models()
    stream = mx.new_stream(mx.default_device())
    prompt_cache = cache.make_prompt_cache(model)

    def step(tokens):
        with mx.stream(stream):
            logits = model(tokens[None], cache=prompt_cache)[:, -1, :]
            logprobs = logits - mx.logsumexp(logits, keepdims=True)
            return mx.argmax(logprobs, axis=-1)

    start = time.perf_counter()
    prompt = mx.array(ids)
    with mx.stream(stream):
        while prompt.size > 1:
            n = min(2048, prompt.size - 1)
            model(prompt[:n][None], cache=prompt_cache)
            mx.eval([c.state for c in prompt_cache])
            prompt = prompt[n:]
            mx.clear_cache()
    y = step(prompt)
    mx.async_eval(y)
    tokens, first = [], None
    for n in range(max_tokens):
        next_y = step(y) if n + 1 < max_tokens else None
        if next_y is not None:
            mx.async_eval(next_y)
        tokens.append(int(y.item()))
        if first is None:
            first = time.perf_counter()
        y = next_y
    return first - start, time.perf_counter() - first, tokens


def worker(engine: str, family: str, context: int, decode: int, directory: Path) -> dict:
    import mlx.core as mx

    import butter_core

    ids = mx.random.randint(0, 300, (context,), key=mx.random.key(context)).tolist()
    if engine == "butter":
        from butter_core.model import Model

        model = Model.load(str(directory))
        list(model.generate(ids[:32], max_tokens=4, stop_ids=()))
        mx.clear_cache()
        start = time.perf_counter()
        generation = iter(model.generate(ids, max_tokens=decode, stop_ids=()))
        tokens = [next(generation)]
        first = time.perf_counter()
        tokens += list(generation)
        prefill, rest = first - start, time.perf_counter() - first
    else:
        model = mlx_lm_model(directory, family)
        mlx_lm_generate(model, ids[:32], 4)
        mx.clear_cache()
        prefill, rest, tokens = mlx_lm_generate(model, ids, decode)
    return {"engine": engine, "family": family, "context": context, "prefill_tok_s": context / prefill,
            "decode_tok_s": (len(tokens) - 1) / rest, "tokens": tokens, "peak_bytes": mx.get_peak_memory(),
            "device": str(mx.default_device()), "mlx": mx.__version__, "blas": butter_core.cpu_blas.LOADED_BLAS}  # fmt: skip


def main() -> None:
    import butter_core  # noqa: F401 - first: its OpenBLAS preload must precede mlx.core

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        engine, family, context, decode, directory = sys.argv[2:7]
        print("@@" + json.dumps(worker(engine, family, int(context), int(decode), Path(directory))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--dtype", default=None, help="weights' dtype (default: float32 on cpu size, bfloat16 on gpu)")
    parser.add_argument("--families", nargs="+", default=["mamba2", "qwen3_next", "granitemoehybrid", "nemotron_h"])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    dtype = args.dtype or ("float32" if args.size == "cpu" else "bfloat16")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for family in args.families:
            directory = Path(folder) / family
            write_model(directory, family, args.size, dtype)
            for context in args.contexts:
                runs = {"butter": [], "mlx-lm": []}
                for rep in range(args.reps):
                    for engine in (["butter", "mlx-lm"] if rep % 2 == 0 else ["mlx-lm", "butter"]):
                        command = [sys.executable, __file__, "--worker", engine, family, str(context),
                                   str(args.decode_tokens), str(directory)]  # fmt: skip
                        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                        answer = [line for line in done.stdout.splitlines() if line.startswith("@@")]
                        if done.returncode or not answer:
                            raise SystemExit(f"{engine} {family} @{context} failed:\n{done.stderr[-3000:]}")
                        runs[engine].append(json.loads(answer[0][2:]))
                row = {"family": family, "context": context}
                for engine, results in runs.items():
                    row[f"{engine} prefill"] = statistics.median(r["prefill_tok_s"] for r in results)
                    row[f"{engine} decode"] = statistics.median(r["decode_tok_s"] for r in results)
                    row[f"{engine} peak GiB"] = max(r["peak_bytes"] for r in results) / 2**30
                row["prefill ratio"] = row["butter prefill"] / row["mlx-lm prefill"]
                row["decode ratio"] = row["butter decode"] / row["mlx-lm decode"]
                same = [a == b for a, b in zip(runs["butter"][0]["tokens"], runs["mlx-lm"][0]["tokens"])]
                row["tokens agree"] = f"{same.index(False) if False in same else len(same)}/{len(same)}"
                row["meta"] = {k: runs["butter"][0][k] for k in ("device", "mlx", "blas")}
                rows.append(row)
                print(f"{family:<17} {context:>6}  prefill {row['butter prefill']:9.1f} vs {row['mlx-lm prefill']:9.1f} "
                      f"tok/s ({row['prefill ratio']:.2f}x)  decode {row['butter decode']:7.1f} vs "
                      f"{row['mlx-lm decode']:7.1f} ({row['decode ratio']:.2f}x)  tokens agree {row['tokens agree']}",
                      flush=True)  # fmt: skip
    print(f"{platform.machine()} {rows[0]['meta'] if rows else ''}, weights {dtype}, size {args.size}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
