"""Default model on the CPU: butter vs mlx-lm on the same weights, interleaved in one run.

Each configuration ("variant") runs in its own long-lived worker process, which picks its
BLAS before MLX is imported (``BUTTER_BLAS``, through ``butter_core/cpu_blas.py``, so
both engines get the same OpenBLAS preload), loads its model once and warms up. The
parent then asks the workers in turn, one at a time (idle workers only hold memory),
for one timed greedy generation each: repetition by repetition, prompt length by prompt
length, the variants' order rotating every repetition so that the machine's noise hits
all of them. Medians are reported.

Every run feeds the same token ids to both engines (the first N tokens of Python's
``textwrap`` source, tokenized by the default model's tokenizer) and decodes
``--decode-tokens`` greedy tokens with no stop token. Prefill tok/s = prompt tokens /
(time until the first generated token is in Python), decode tok/s = (tokens - 1) /
(time from the first to the last); peak memory = ``mx.get_peak_memory()`` after
``mx.reset_peak_memory()`` (weights included). butter runs through ``Model.generate``,
mlx-lm through ``mlx_lm.generate.generate_step`` (the loop under its ``generate`` and
``stream_generate``). Greedy tokens are compared with butter's on every timed prompt and
on a chat prompt.

The weights: butter's conversion of the built-in GGUF (``~/.cache/butter/gguf/v1/<sha>``,
MLX safetensors + ``config.json`` with ``quantization``) loads in mlx-lm as it is; the
other mlx-lm variants are made from it once with ``mlx_lm.convert`` into
``~/.cache/butter/bench/mlx-lm-<version>/<sha>/``. Variants (``--variants``):

    butter            Model.load(None): butter's CPU default (dequantized to float32, OpenBLAS)
    butter-q4         butter keeping the 4-bit weights (float32 scales), OpenBLAS
    butter-ref        butter, dequantized to float32 (forced), MLX's bundled reference BLAS
    butter-q4-ref     4-bit weights, reference BLAS
    mlx-lm-fp32       mlx_lm.convert --dequantize --dtype float32, OpenBLAS
    mlx-lm-q4         the 4-bit weights as shipped (float16 scales), OpenBLAS
    mlx-lm-q4-f32s    mlx_lm.convert --dtype float32 (4-bit, float32 scales), OpenBLAS
    mlx-lm-fp32-ref   float32 weights, reference BLAS

The quantized and reference-BLAS variants prefill ~15x slower, so they run only in the
first ``--slow-reps`` repetitions. ``--variants butter butter-q4 butter-ref butter-q4-ref``
is what ``bench/cpu_weights.py`` measured (butter alone: weights x BLAS). Needs
``pip install -r bench/requirements.txt`` (mlx-lm is a benchmark-only dependency). Usage:

    python bench/mlx_lm_compare.py [--prompt-tokens 128 512] [--decode-tokens 64]
        [--reps 7] [--slow-reps 3] [--variants butter mlx-lm-fp32 ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTOCOL = "@@"  # prefix of the workers' answer lines (anything else on stdout is passed through)


@dataclass(frozen=True)
class Variant:
    name: str
    engine: str  # "butter" or "mlx-lm"
    weights: str  # butter: "default", "dequantized" or "quantized"; mlx-lm: "shipped", "fp32" or "q4-f32s"
    blas: str  # BUTTER_BLAS for the worker: "openblas" or "reference"
    slow: bool  # ~15x slower prefill (quantized matmul or reference BLAS): fewer repetitions
    label: str  # the weights, for the table


VARIANTS = {
    v.name: v
    for v in (
        Variant("butter", "butter", "default", "openblas", False, "Model.load(None): fp32, dequantized at load"),
        Variant("butter-q4", "butter", "quantized", "openblas", True, "4-bit kept, fp32 scales"),
        Variant("butter-ref", "butter", "dequantized", "reference", True, "fp32, dequantize=True forced"),
        Variant("butter-q4-ref", "butter", "quantized", "reference", True, "4-bit kept, fp32 scales"),
        Variant("mlx-lm-fp32", "mlx-lm", "fp32", "openblas", False, "fp32 (convert --dequantize --dtype float32)"),
        Variant("mlx-lm-q4", "mlx-lm", "shipped", "openblas", True, "4-bit as shipped, fp16 scales"),
        Variant("mlx-lm-q4-f32s", "mlx-lm", "q4-f32s", "openblas", True, "4-bit, fp32 scales (convert --dtype float32)"),
        Variant("mlx-lm-fp32-ref", "mlx-lm", "fp32", "reference", True, "fp32 (convert --dequantize --dtype float32)"),
    )
}
DEFAULT_VARIANTS = ("butter", "mlx-lm-fp32", "mlx-lm-q4", "mlx-lm-q4-f32s")
MLX_LM_CONVERT_ARGS = {"fp32": ["--dequantize", "--dtype", "float32"], "q4-f32s": ["--dtype", "float32"]}
CHAT_PROMPT = "Write a Python function that returns the n-th Fibonacci number."


# ---------------------------------------------------------------- worker side


def preload_blas_before_mlx() -> str | None:
    """Run butter_core/cpu_blas.py without importing the butter_core package (which imports MLX),
    so the mlx-lm worker gets exactly butter's preload."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_bench_cpu_blas", REPO / "butter_core" / "cpu_blas.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.LOADED_BLAS


class ButterRunner:
    def __init__(self, variant: Variant, model_path: str):
        from butter_core.loading.weights import WeightOptions
        from butter_core.model import Model

        weights = {"dequantized": WeightOptions(dequantize=True), "quantized": WeightOptions(dequantize=False)}
        self.model = Model.load(None, weights=weights.get(variant.weights))
        self.weights = str(self.model.weights)

    def generate(self, ids: list[int], max_tokens: int):
        return self.model.generate(ids, max_tokens=max_tokens, stop_ids=())

    def parameters(self):
        return self.model.network.parameters()


class MlxLmRunner:
    def __init__(self, variant: Variant, model_path: str):
        from mlx_lm import load

        self.model, _ = load(model_path)
        self.weights = f"mlx-lm {variant.weights} from {Path(model_path).name}"

    def generate(self, ids: list[int], max_tokens: int):
        import mlx.core as mx
        from mlx_lm.generate import generate_step

        return (token for token, _ in generate_step(mx.array(ids, dtype=mx.uint32), self.model, max_tokens=max_tokens))

    def parameters(self):
        return self.model.parameters()


def timed_run(runner, ids: list[int], max_tokens: int) -> dict:
    import mlx.core as mx

    mx.clear_cache()
    mx.reset_peak_memory()
    tokens, times = [], []
    start = time.perf_counter()
    for token in runner.generate(ids, max_tokens):
        times.append(time.perf_counter())
        tokens.append(int(token))
    return {
        "prefill_tok_s": len(ids) / (times[0] - start),
        "decode_tok_s": (len(times) - 1) / (times[-1] - times[0]) if len(times) > 1 else 0.0,
        "peak_mib": mx.get_peak_memory() / 2**20,
        "tokens": tokens,
    }


def worker(variant_name: str, model_path: str) -> None:
    variant = VARIANTS[variant_name]
    if variant.engine == "butter":
        import butter_core  # preloads the BLAS itself, as for any user: must come before mlx.core

        blas = butter_core.cpu_blas.LOADED_BLAS
    else:
        blas = preload_blas_before_mlx()
    import mlx.core as mx
    from mlx.utils import tree_flatten

    runner = (ButterRunner if variant.engine == "butter" else MlxLmRunner)(variant, model_path)
    nbytes = sum(a.nbytes for _, a in tree_flatten(runner.parameters()))
    timed_run(runner, list(range(1000, 1032)), 8)  # warm-up
    ready = {"blas": blas or "bundled reference", "weights": runner.weights, "weights_mib": nbytes / 2**20}
    if variant.engine == "mlx-lm":
        import mlx_lm

        ready["mlx_lm"] = mlx_lm.__version__
    ready["mlx"] = mx.__version__
    print(PROTOCOL, json.dumps(ready), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(PROTOCOL, json.dumps(timed_run(runner, request["ids"], request["max_tokens"])), flush=True)


# ---------------------------------------------------------------- parent side


class Worker:
    def __init__(self, variant: Variant, model_path: Path):
        self.variant = variant
        env = {**os.environ, "BUTTER_BLAS": variant.blas}
        command = [sys.executable, __file__, "--worker", variant.name, "--model-path", str(model_path)]
        self.process = subprocess.Popen(command, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._answer()

    def _answer(self) -> dict:
        for line in self.process.stdout:
            if line.startswith(PROTOCOL):
                return json.loads(line[len(PROTOCOL) :])
            print(f"[{self.variant.name}] {line}", end="", file=sys.stderr)
        raise RuntimeError(f"worker {self.variant.name} exited with {self.process.wait()}")

    def run(self, ids: list[int], max_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"ids": ids, "max_tokens": max_tokens}) + "\n")
        self.process.stdin.flush()
        return self._answer()

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait()


def mlx_lm_weights(variant: Variant, butter_dir: Path) -> Path:
    """The folder mlx-lm loads for ``variant``: butter's own conversion, or a converted copy, made once."""
    if variant.weights == "shipped":
        return butter_dir
    import mlx_lm
    from butter_core.loading.gguf import butter_cache_dir

    target = butter_cache_dir() / "bench" / f"mlx-lm-{mlx_lm.__version__}" / butter_dir.name / variant.weights
    if not target.is_dir():
        target.parent.mkdir(parents=True, exist_ok=True)
        temporary = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        shutil.rmtree(temporary, ignore_errors=True)
        command = [sys.executable, "-m", "mlx_lm", "convert", "--hf-path", str(butter_dir)]
        command += ["--mlx-path", str(temporary)]
        print(f"converting for mlx-lm: {' '.join(command[1:] + MLX_LM_CONVERT_ARGS[variant.weights])}", file=sys.stderr)
        subprocess.run(command + MLX_LM_CONVERT_ARGS[variant.weights], check=True, stdout=subprocess.DEVNULL)
        temporary.rename(target)
    return target


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    for index, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return index
    return None if len(reference) == len(other) else min(len(reference), len(other))


def agreement(reference: list[int], other: list[int], tokenizer) -> dict:
    index = first_divergence(reference, other)
    if index is None:
        return {"identical": True, "tokens": len(reference)}
    return {
        "identical": False,
        "tokens": len(reference),
        "first_divergence": index,
        "context": tokenizer.decode(reference[max(0, index - 8) : index]),
        "butter": tokenizer.decode(reference[index : index + 8]),
        "other": tokenizer.decode(other[index : index + 8]),
    }


def median_row(runs: list[dict]) -> dict:
    return {
        key: statistics.median(run[key] for run in runs) for key in ("prefill_tok_s", "decode_tok_s", "peak_mib")
    } | {"reps": len(runs)}


def paired_ratios(runs: list[dict], reference: list[dict]) -> dict:
    """Median over repetitions of ``run / reference`` within the same repetition (the two ran back to
    back, so slow drifts in the machine's load cancel)."""
    by_rep = {run["rep"]: run for run in reference}
    pairs = [(run, by_rep[run["rep"]]) for run in runs if run["rep"] in by_rep]
    return {
        key: statistics.median(run[key] / ref[key] for run, ref in pairs) for key in ("prefill_tok_s", "decode_tok_s")
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--slow-reps", type=int, default=3, help="repetitions of the slow variants (quantized, reference BLAS)")
    parser.add_argument("--variants", nargs="+", default=list(DEFAULT_VARIANTS), choices=sorted(VARIANTS))
    parser.add_argument("--json", type=Path, help="write every run, the medians and the token agreement here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.model_path)
        return

    import inspect
    import textwrap

    from butter_core.default_model import default_model_dir
    from butter_core.tokenizer import Tokenizer

    butter_dir = default_model_dir()
    tokenizer = Tokenizer.from_dir(butter_dir)
    source_ids = tokenizer.encode(inspect.getsource(textwrap))
    if max(args.prompt_tokens) > len(source_ids):
        parser.error(f"--prompt-tokens at most {len(source_ids)}")
    prompts = {n: source_ids[:n] for n in args.prompt_tokens}
    chat_ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": CHAT_PROMPT}]), add_special_tokens=False
    )
    variants = [VARIANTS[name] for name in args.variants]
    if variants[0].engine != "butter" or variants[0].name != "butter":
        variants = [VARIANTS["butter"]] + [v for v in variants if v.name != "butter"]

    paths = {v.name: butter_dir if v.engine == "butter" else mlx_lm_weights(v, butter_dir) for v in variants}
    workers = {}
    for v in variants:
        print(f"starting {v.name} ...", file=sys.stderr, flush=True)
        workers[v.name] = Worker(v, paths[v.name])
    if "dequantized" not in workers["butter"].info["weights"]:
        print(f"WARNING: butter's default kept {workers['butter'].info['weights']} (no OpenBLAS?)", file=sys.stderr)
    runs: dict[str, dict[int, list[dict]]] = {v.name: {n: [] for n in prompts} for v in variants}
    try:
        chat = {v.name: workers[v.name].run(chat_ids, args.decode_tokens)["tokens"] for v in variants}
        for rep in range(args.reps):
            # The fast variants back to back (rotating), then the slow ones (rotating).
            fast = [v for v in variants if not v.slow]
            slow = [v for v in variants if v.slow] if rep < args.slow_reps else []
            order = [group[(i + rep) % len(group)] for group in (fast, slow) for i in range(len(group))]
            for n, ids in prompts.items():
                for v in order:
                    result = workers[v.name].run(ids, args.decode_tokens) | {"rep": rep}
                    runs[v.name][n].append(result)
                    print(
                        f"rep {rep + 1}/{args.reps} prompt {n:>4} {v.name:<16} prefill {result['prefill_tok_s']:7.1f} "
                        f"decode {result['decode_tok_s']:6.2f} tok/s peak {result['peak_mib']:6.0f} MiB",
                        file=sys.stderr,
                        flush=True,
                    )
    finally:
        for w in workers.values():
            w.close()

    medians = {name: {n: median_row(rs) for n, rs in by_n.items()} for name, by_n in runs.items()}
    ratios = {name: {n: paired_ratios(rs, runs["butter"][n]) for n, rs in by_n.items()} for name, by_n in runs.items()}
    agreements = {}
    for v in variants[1:]:
        agreements[v.name] = {"chat": agreement(chat["butter"], chat[v.name], tokenizer)} | {
            str(n): agreement(runs["butter"][n][0]["tokens"], runs[v.name][n][0]["tokens"], tokenizer) for n in prompts
        }
    deterministic = {
        name: all(r["tokens"] == rs[0]["tokens"] for rs in by_n.values() for r in rs) for name, by_n in runs.items()
    }

    import mlx.core as mx

    versions = {"mlx": mx.__version__, "python": platform.python_version()}
    mlx_lm_info = next((w.info for w in workers.values() if "mlx_lm" in w.info), None)
    if mlx_lm_info:
        versions["mlx_lm"] = mlx_lm_info["mlx_lm"]
    print(
        f"\nmlx {versions['mlx']}, mlx-lm {versions.get('mlx_lm', '-')}, {os.cpu_count()} CPUs; prompt = first N tokens "
        f"of textwrap.py, {args.decode_tokens} greedy tokens; medians of {args.reps} reps "
        f"({args.slow_reps} for the slow variants); last column: median of per-rep ratios to butter "
        f"(>1: faster than butter)\n"
    )
    print("| prompt | engine | weights (MiB) | BLAS | prefill tok/s | decode tok/s | peak MiB | / butter: prefill, decode |")
    print("|---|---|---|---|---|---|---|---|")
    for n in prompts:
        for v in variants:
            m, r = medians[v.name][n], ratios[v.name][n]
            ratio = "—" if v.name == "butter" else f"{r['prefill_tok_s']:.2f}x, {r['decode_tok_s']:.2f}x"
            info = workers[v.name].info
            blas = "OpenBLAS" if "openblas" in info["blas"] else "reference"
            print(
                f"| {n} | {v.engine} | {v.label} ({info['weights_mib']:.0f}) | {blas} | "
                f"{m['prefill_tok_s']:.1f} | {m['decode_tok_s']:.2f} | {m['peak_mib']:.0f} | {ratio} |"
            )
    print("\ngreedy tokens vs butter:")
    for name, by_prompt in agreements.items():
        parts = []
        for prompt, a in by_prompt.items():
            label = "chat" if prompt == "chat" else f"{prompt}-token prompt"
            if a["identical"]:
                parts.append(f"{label}: identical ({a['tokens']}/{a['tokens']})")
            else:
                parts.append(
                    f"{label}: diverge at token {a['first_divergence']} "
                    f"(...{a['context']!r} -> butter {a['butter']!r} vs {a['other']!r})"
                )
        print(f"  {name}: " + "; ".join(parts))
    if not all(deterministic.values()):
        print("  NOT deterministic across reps: " + ", ".join(k for k, d in deterministic.items() if not d))

    if args.json:
        report = {
            "date": time.strftime("%Y-%m-%d"),
            "machine": {"platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count()},
            "versions": versions,
            "settings": {
                "prompt_tokens": args.prompt_tokens,
                "decode_tokens": args.decode_tokens,
                "reps": args.reps,
                "slow_reps": args.slow_reps,
                "prompt": "first N tokens of Python's textwrap module source",
                "chat_prompt": CHAT_PROMPT,
            },
            "variants": {
                v.name: asdict(v) | {"path": str(paths[v.name])} | workers[v.name].info for v in variants
            },
            "medians": {name: {str(n): row for n, row in by_n.items()} for name, by_n in medians.items()},
            "paired_ratios_vs_butter": {name: {str(n): r for n, r in by_n.items()} for name, by_n in ratios.items()},
            "runs": {name: {str(n): rs for n, rs in by_n.items()} for name, by_n in runs.items()},
            "chat_tokens": chat,
            "agreement": agreements,
            "deterministic": deterministic,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
