"""Continuous batching: butter's ``BatchGeneration`` against mlx-lm's ``BatchGenerator``, same weights, one run.

For each batch size B (``--batch``) and engine, a fresh process loads the model, warms up, then
generates for B sequences at once: B prompts of ``--prompt-tokens`` tokens each (the first
tokens of Python's ``textwrap`` source, shifted by one token per sequence so no two are
equal), ``--decode-tokens`` greedy tokens each, no stop token. Every token's arrival time is
recorded. Aggregate decode tok/s = tokens produced after the moment every sequence has its
first token, divided by the time from that moment to the last token (the steady state where
all B decode together); time to all first tokens is reported too, and the peak memory.

Model (``--model``): the default, butter's conversion of the built-in GGUF (Qwen2-shaped
SmolLM2-135M); butter runs it as ``Model.load`` does on this device (float32 weights on the
CPU), mlx-lm the same weights dequantized in float32 (``set_dtype``, then ``dequantize_model``).
butter: ``make_batched_caches(capacity_tokens=B * (prompt + decode + page))`` (or ``--capacity-tokens``), kv cache
``--kv-cache``. mlx-lm 0.32.2: ``BatchGenerator(completion_batch_size=B,
prefill_batch_size=min(B, 8))``, its defaults otherwise. Engines alternate within each
repetition; medians over ``--reps``.

Usage: python bench/batched_decode.py [--batch 1 8] [--prompt-tokens 128] [--decode-tokens 64]
       [--reps 3] [--kv-cache raw] [--capacity-tokens N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def prompts(tokenizer_encode, count: int, tokens: int) -> list[list[int]]:
    source = Path(textwrap.__file__).read_text()
    ids = tokenizer_encode(source)
    return [ids[i : i + tokens] for i in range(count)]


def steady_rate(arrivals: list[tuple[int, float]], count: int) -> tuple[float, float]:
    """(seconds until every sequence had its first token, aggregate tok/s after that)."""
    first: dict[int, float] = {}
    for sequence, at in arrivals:
        first.setdefault(sequence, at)
    assert len(first) == count, "a sequence produced no token"
    start = max(first.values())
    later = [at for _, at in arrivals if at > start]
    return start, (len(later) / (later[-1] - start) if later else float("nan"))


def run_butter(batch: int, prompt_tokens: int, decode: int, kv_cache: str, capacity: int) -> dict:
    import mlx.core as mx

    from butter_core import LoadOptions, parse_kv_cache
    from butter_core.model import Model

    model = Model.load(None, LoadOptions(kv_cache=parse_kv_cache(kv_cache)))
    seqs = prompts(model.tokenizer.encode, batch, prompt_tokens)
    capacity = capacity or batch * (prompt_tokens + decode + 64)
    warm = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=capacity))
    for ids in seqs:
        warm.add(ids, max_tokens=4, stop_ids=())
    list(warm)
    mx.clear_cache()
    mx.reset_peak_memory()
    generation = model.generate_batch(model.engine.make_batched_caches(capacity_tokens=capacity))
    start = time.perf_counter()
    for ids in seqs:
        generation.add(ids, max_tokens=decode, stop_ids=())
    arrivals, tokens = [], {}
    for sequence, token in generation:
        arrivals.append((sequence, time.perf_counter() - start))
        tokens.setdefault(sequence, []).append(token)
    return {"arrivals": arrivals, "tokens": [tokens[i] for i in sorted(tokens)], "peak": mx.get_peak_memory()}


def run_mlx_lm(batch: int, prompt_tokens: int, decode: int, kv_cache: str, capacity: int) -> dict:
    import butter_core  # noqa: F401 - the same OpenBLAS preload as butter's run
    import mlx.core as mx
    from mlx_lm.generate import BatchGenerator
    from mlx_lm.utils import dequantize_model, load

    from butter_core.model import Model

    path = Model.load(None).path
    model, tokenizer = load(str(path))
    model.set_dtype(mx.float32)  # scales and biases first, so the weights dequantize in float32, as butter's do
    model = dequantize_model(model)
    seqs = prompts(tokenizer.encode, batch, prompt_tokens)

    def generate(max_tokens: int) -> tuple[list, dict]:
        generator = BatchGenerator(model, max_tokens=max_tokens, completion_batch_size=batch,
                                   prefill_batch_size=min(batch, 8))  # fmt: skip
        uids = generator.insert(seqs, [max_tokens] * batch)
        order = {uid: i for i, uid in enumerate(uids)}
        arrivals, tokens = [], {}
        start = time.perf_counter()
        while responses := generator.next_generated():
            now = time.perf_counter() - start
            for r in responses:
                arrivals.append((order[r.uid], now))
                tokens.setdefault(order[r.uid], []).append(r.token)
        generator.close()
        return arrivals, tokens

    generate(4)
    mx.clear_cache()
    mx.reset_peak_memory()
    arrivals, tokens = generate(decode)
    return {"arrivals": arrivals, "tokens": [tokens[i] for i in sorted(tokens)], "peak": mx.get_peak_memory()}


def main() -> None:
    import butter_core  # noqa: F401 - first: its OpenBLAS preload must precede mlx.core

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        engine, batch, prompt_tokens, decode, kv_cache, capacity = sys.argv[2:8]
        run = run_butter if engine == "butter" else run_mlx_lm
        print("@@" + json.dumps(run(int(batch), int(prompt_tokens), int(decode), kv_cache, int(capacity))), flush=True)
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--kv-cache", default="raw")
    parser.add_argument("--capacity-tokens", type=int, default=0,
                        help="butter's batched caches (default: B * (prompt + decode + 64), what the run needs)")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args()
    rows = []
    for batch in args.batch:
        runs: dict[str, list[dict]] = {"butter": [], "mlx-lm": []}
        for rep in range(args.reps):
            for engine in (["butter", "mlx-lm"] if rep % 2 == 0 else ["mlx-lm", "butter"]):
                command = [sys.executable, __file__, "--worker", engine, str(batch), str(args.prompt_tokens),
                           str(args.decode_tokens), args.kv_cache, str(args.capacity_tokens)]  # fmt: skip
                done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
                answer = [line for line in done.stdout.splitlines() if line.startswith("@@")]
                if done.returncode or not answer:
                    raise SystemExit(f"{engine} B={batch} failed:\n{done.stderr[-3000:]}")
                result = json.loads(answer[0][2:])
                result["first"], result["rate"] = steady_rate(result["arrivals"], batch)
                runs[engine].append(result)
        row = {"batch": batch}
        for engine, results in runs.items():
            row[f"{engine} tok/s"] = statistics.median(r["rate"] for r in results)
            row[f"{engine} first s"] = statistics.median(r["first"] for r in results)
            row[f"{engine} peak MiB"] = max(r["peak"] for r in results) / 2**20
        row["ratio"] = row["butter tok/s"] / row["mlx-lm tok/s"]
        same = sum(a == b for a, b in zip(runs["butter"][0]["tokens"], runs["mlx-lm"][0]["tokens"]))
        row["sequences agree"] = f"{same}/{batch}"
        rows.append(row)
        print(f"B={batch:<3} butter {row['butter tok/s']:8.1f} tok/s (all first tokens {row['butter first s']:.2f} s, "
              f"peak {row['butter peak MiB']:.0f} MiB)  mlx-lm {row['mlx-lm tok/s']:8.1f} tok/s "
              f"({row['mlx-lm first s']:.2f} s, {row['mlx-lm peak MiB']:.0f} MiB)  ratio {row['ratio']:.2f}x  "
              f"greedy sequences agree {row['sequences agree']}", flush=True)  # fmt: skip
    print(f"{platform.machine()}, prompt {args.prompt_tokens}, decode {args.decode_tokens}, kv {args.kv_cache}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
