"""Prefill time and peak memory against prompt length: butter against mlx-lm, same weights, one run.

A Qwen3-family model with seeded random weights (``--shape``: ``qwen3-1.7b`` for a GPU,
``small``, SmolLM2-135M's sizes, for the CPU) is written once as a model directory;
butter loads it with ``Model.load``, mlx-lm builds ``mlx_lm.models.qwen3.Model`` from the
same ``config.json`` and safetensors. Each (engine, prompt length) runs in a fresh
process, so that peak memory (``mx.get_peak_memory()``, weights included) is that run's
alone; the engines alternate, rounds repeat (``--reps``), medians are reported.

A prompt of N random token ids is prefilled and one token sampled, each engine as a user
runs it: butter through ``Model.generate(..., max_tokens=1)`` (chunks of 512; it
reserves the cache for prompt + max_tokens at once), mlx-lm through the prefill of
``mlx_lm.generate.generate_step`` 0.32.2 (chunks of ``prefill_step_size=2048``, its
default, each evaluated and followed by ``mx.clear_cache()``, then the last token; its
``KVCache`` grows in steps of 256 positions by concatenation). That loop is restated
here (``mlx_lm_prefill``) around mlx-lm's own model and cache classes, because importing
``mlx_lm.generate`` imports ``transformers`` for its tokenizers, which a GPU machine
without a registry lacks and a prefill of token ids does not need; on the CPU it gives
the same first token as ``generate_step`` (checked by ``--check-mlx-lm``). Prefill time
is the time to the first token.

Usage: python3 bench/long_prefill.py [--shape qwen3-1.7b] [--contexts 4096 16384 ...]
       [--reps 2] [--dtype bfloat16] [--json PATH]    (needs mlx-lm: bench/requirements.txt)
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

SHAPES = {
    "qwen3-1.7b": dict(hidden_size=2048, intermediate_size=6144, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, num_hidden_layers=28, vocab_size=151936),
    "small": dict(hidden_size=576, intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
                  head_dim=64, num_hidden_layers=30, vocab_size=49152),
}  # fmt: skip


def write_model(directory: Path, shape: str, dtype: str, max_positions: int, vocab_size: int | None = None) -> None:
    """``config.json``, seeded random safetensors and a tiny tokenizer (butter wants one);
    ``vocab_size`` replaces the shape's (to match another tokenizer put in its place)."""
    import mlx.core as mx

    from butter_core.testing.tiny_models import write_tokenizer

    sizes = SHAPES[shape] | ({"vocab_size": vocab_size} if vocab_size else {})
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6,
              "rope_theta": 1000000.0, "max_position_embeddings": max_positions, "tie_word_embeddings": True,
              "hidden_act": "silu", **sizes}  # fmt: skip
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    h, f, d = sizes["hidden_size"], sizes["intermediate_size"], sizes["head_dim"]
    q, kv = sizes["num_attention_heads"] * d, sizes["num_key_value_heads"] * d
    shapes = {"model.embed_tokens.weight": (sizes["vocab_size"], h), "model.norm.weight": (h,)}
    for i in range(sizes["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes |= {p + "self_attn.q_proj.weight": (q, h), p + "self_attn.k_proj.weight": (kv, h),
                   p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, q),
                   p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                   p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
                   p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,)}  # fmt: skip
    key = mx.random.key(0)
    weights = {}
    for name, shape_ in shapes.items():
        key, sub = mx.random.split(key)
        weights[name] = (mx.ones(shape_) if len(shape_) == 1 else mx.random.normal(shape_, key=sub) * 0.02).astype(getattr(mx, dtype))
        mx.eval(weights[name])
    mx.save_safetensors(str(directory / "model.safetensors"), weights, metadata={"format": "mlx"})
    write_tokenizer(directory)


def worker(engine: str, context: int, directory: Path) -> dict:
    """One prefill of ``context`` random ids and one sampled token, in this process (both
    engines with butter's BLAS preload: ``main`` imports butter_core before MLX)."""
    import mlx.core as mx

    import butter_core

    ids = mx.random.randint(0, 1000, (context,), key=mx.random.key(context)).tolist()
    if engine.startswith("butter"):
        from butter_core.config import LoadOptions
        from butter_core.engine import Engine
        from butter_core.model import Model

        model = Model.load(str(directory), LoadOptions(max_context_length=context + 8))
        if "@" in engine:  # butter@N: prefill in chunks of N tokens
            model.engine = Engine(model.network, model.options, prefill_chunk=int(engine.split("@")[1]))
        warm = model.generate(ids[:64], max_tokens=1, stop_ids=())
        list(warm)
        mx.clear_cache()
        mx.reset_peak_memory()
        start = time.perf_counter()
        generation = model.generate(ids, max_tokens=1, stop_ids=())
        next(iter(generation))
        seconds = time.perf_counter() - start
    else:
        model = mlx_lm_model(directory)
        mlx_lm_prefill(model, ids[:64])
        mx.clear_cache()
        mx.reset_peak_memory()
        start = time.perf_counter()
        mlx_lm_prefill(model, ids)
        seconds = time.perf_counter() - start
    return {"engine": engine, "context": context, "seconds": seconds, "peak_bytes": mx.get_peak_memory(),
            "device": str(mx.default_device()), "mlx": mx.__version__, "blas": butter_core.cpu_blas.LOADED_BLAS}  # fmt: skip


def _mlx_lm_models():
    """``mlx_lm.models`` without running ``mlx_lm/__init__.py`` (which imports transformers)."""
    import importlib.util
    import types

    if "mlx_lm" not in sys.modules:
        package = types.ModuleType("mlx_lm")
        package.__path__ = list(importlib.util.find_spec("mlx_lm").submodule_search_locations)
        sys.modules["mlx_lm"] = package
    from mlx_lm.models import cache, qwen3

    return cache, qwen3


def mlx_lm_model(directory: Path):
    """mlx-lm's Qwen3 model with the directory's weights, in their dtype."""
    import mlx.core as mx
    import mlx.nn as nn

    _, qwen3 = _mlx_lm_models()
    config = json.loads((directory / "config.json").read_text())
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    weights = mx.load(str(directory / "model.safetensors"))
    model.set_dtype(next(iter(weights.values())).dtype)
    model.load_weights(list(weights.items()))
    mx.eval(model.parameters())
    nn.Module.eval(model)
    return model


def mlx_lm_prefill(model, ids: list[int], prefill_step_size: int = 2048) -> int:
    """The prefill of ``mlx_lm.generate.generate_step`` (0.32.2), greedy: the prompt but its last
    token in chunks, each evaluated and followed by ``mx.clear_cache()``, then the last
    token's logits and their argmax. Returns the first generated token."""
    import mlx.core as mx

    cache, _ = _mlx_lm_models()
    prompt_cache = cache.make_prompt_cache(model)
    prompt = mx.array(ids)
    while prompt.size > 1:
        n = min(prefill_step_size, prompt.size - 1)
        model(prompt[:n][None], cache=prompt_cache)
        mx.eval([c.state for c in prompt_cache])
        prompt = prompt[n:]
        mx.clear_cache()
    logits = model(prompt[None], cache=prompt_cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    return int(mx.argmax(logprobs, axis=-1).item())


def check_mlx_lm(directory: Path, context: int) -> None:
    """``mlx_lm_prefill`` against mlx-lm's own ``generate_step`` (needs transformers)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    ids = mx.random.randint(0, 1000, (context,), key=mx.random.key(context)).tolist()
    model = mlx_lm_model(directory)
    ours = mlx_lm_prefill(model, ids)
    theirs, _ = next(generate_step(mx.array(ids), model, max_tokens=1))
    print(f"first token: restated prefill {ours}, generate_step {int(theirs)}")
    if ours != int(theirs):
        raise SystemExit("the restated prefill disagrees with mlx-lm's generate_step")


def main() -> None:
    import butter_core  # noqa: F401 - first: its OpenBLAS preload must precede mlx.core (cpu_blas)

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        print("@@" + json.dumps(worker(sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-1.7b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 16384, 32768, 65536, 131072])
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--engines", nargs="+", default=["butter", "mlx-lm"],
                        help="butter, butter@N (prefill chunks of N tokens) and mlx-lm")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds a run may take before it is given up")
    parser.add_argument("--json", metavar="PATH")
    parser.add_argument("--check-mlx-lm", action="store_true",
                        help="compare the restated prefill with mlx-lm's generate_step (needs transformers) and stop")
    args = parser.parse_args()
    if args.check_mlx_lm:
        with tempfile.TemporaryDirectory() as folder:
            write_model(Path(folder) / "model", args.shape, args.dtype, max(args.contexts) + 16)
            for context in args.contexts:
                check_mlx_lm(Path(folder) / "model", context)
        return
    results = []
    with tempfile.TemporaryDirectory() as folder:
        directory = Path(folder) / "model"
        write_model(directory, args.shape, args.dtype, max(args.contexts) + 16)
        for context in args.contexts:
            for rep in range(args.reps):
                engines = args.engines if rep % 2 == 0 else args.engines[::-1]
                for engine in engines:
                    command = [sys.executable, __file__, "--worker", engine, str(context), str(directory)]
                    try:
                        done = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout)
                    except subprocess.TimeoutExpired:
                        print(f"{engine} @ {context}: over {args.timeout:.0f} s, given up", flush=True)
                        continue
                    line = next((l for l in done.stdout.splitlines() if l.startswith("@@")), None)
                    if line is None:
                        print(f"{engine} @ {context}: failed\n{done.stderr[-2000:]}", flush=True)
                        continue
                    result = json.loads(line[2:])
                    results.append(result)
                    print(f"{engine:>7} @ {context:>6}: {result['seconds']:8.2f} s, "
                          f"peak {result['peak_bytes'] / 2**30:6.2f} GiB", flush=True)  # fmt: skip
    if not results:
        return
    device, mlx_version = results[0]["device"], results[0]["mlx"]
    blas = results[0]["blas"] or "MLX's own"
    print(f"\n{args.shape}, {args.dtype}, {device}, MLX {mlx_version}, BLAS {blas}, {platform.node()}; medians of {args.reps}")
    print("| prompt | engine | prefill s | prefill tok/s | peak GiB | mlx-lm / butter: time, peak |")
    print("|---:|---|---:|---:|---:|---|")
    for context in args.contexts:
        rows = {}
        for engine in args.engines:
            runs = [r for r in results if r["engine"] == engine and r["context"] == context]
            if runs:
                rows[engine] = (statistics.median(r["seconds"] for r in runs), max(r["peak_bytes"] for r in runs))
        for engine, (seconds, peak) in rows.items():
            ratio = ""
            if engine != "butter" and "butter" in rows:
                ratio = f"{seconds / rows['butter'][0]:.2f}x, {peak / rows['butter'][1]:.2f}x"
            print(f"| {context} | {engine} | {seconds:.2f} | {context / seconds:,.0f} | {peak / 2**30:.2f} | {ratio} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"shape": args.shape, "dtype": args.dtype, "results": results}, indent=2))


if __name__ == "__main__":
    main()
