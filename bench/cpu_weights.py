"""Default model on the CPU: quantized vs dequantized-at-load weights, bundled vs OpenBLAS.

For each configuration a fresh process loads SmolLM2-135M-Instruct (the built-in
default model), prefills a ``--prompt-tokens`` prompt in one chunked pass and decodes
``--decode-tokens`` greedy tokens (no stop), after a short warm-up. Prints prefill and
decode tok/s, peak memory and the weights' size per configuration. Usage:

    python bench/cpu_weights.py [--prompt-tokens 512] [--decode-tokens 64]

The BLAS is chosen per process with ``BUTTER_BLAS`` (``openblas`` needs Debian's
``libopenblas0-pthread``); see ``butter_core/cpu_blas.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

CONFIGS = [(blas, dequantize) for blas in ("reference", "openblas") for dequantize in (False, True)]
TEXT = "The cache keeps every key and value so that decoding does not recompute the prefix. "


def preload_blas_before_mlx() -> str | None:
    """Run butter_core/cpu_blas.py without importing the butter_core package (which imports MLX)."""
    path = Path(__file__).resolve().parents[1] / "butter_core" / "cpu_blas.py"
    spec = importlib.util.spec_from_file_location("_bench_cpu_blas", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LOADED_BLAS


def measure(dequantize: bool, prompt_tokens: int, decode_tokens: int) -> dict:
    blas = preload_blas_before_mlx()
    from butter_core.generation import Generation
    from butter_core.loading.weights import WeightOptions
    from butter_core.model import Model

    model = Model.load(None, weights=WeightOptions(dequantize=dequantize))
    ids = model.tokenizer.encode(TEXT * (prompt_tokens // 10 + 1))[:prompt_tokens]
    warmup = Generation(model.engine, ids[:16], model.engine.make_layer_caches(), max_tokens=4)
    list(warmup)
    run = Generation(model.engine, ids, model.engine.make_layer_caches(), max_tokens=decode_tokens)
    list(run)
    s = run.stats
    return {
        "blas": blas or "bundled reference",
        "weights": str(model.weights),
        "prefill_tok_s": round(s.prompt_tps, 1),
        "decode_tok_s": round(s.decode_tps, 2),
        "peak_mib": round(s.peak_memory / 2**20),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        print(json.dumps(measure(args.child == "dequantized", args.prompt_tokens, args.decode_tokens)))
        return
    print(f"prompt {args.prompt_tokens} tokens, decode {args.decode_tokens} tokens")
    for blas, dequantize in CONFIGS:
        child = [sys.executable, __file__, "--child", "dequantized" if dequantize else "quantized",
                 "--prompt-tokens", str(args.prompt_tokens), "--decode-tokens", str(args.decode_tokens)]  # fmt: skip
        out = subprocess.run(child, env={**os.environ, "BUTTER_BLAS": blas}, capture_output=True, text=True, check=True)
        result = json.loads(out.stdout.strip().splitlines()[-1])
        print(
            f"{result['blas']:>20} | {result['weights']:<60} | prefill {result['prefill_tok_s']:>6} tok/s | "
            f"decode {result['decode_tok_s']:>5} tok/s | peak {result['peak_mib']} MiB",
            flush=True,
        )


if __name__ == "__main__":
    main()
