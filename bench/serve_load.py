"""Load test of an OpenAI-compatible server: many concurrent streaming clients, some leaving early.

For each engine (``--engines``: ``butter`` runs ``butter serve``, ``mlx-lm`` runs ``python -m
mlx_lm server``), a fresh server process on loopback serves the same model directory
(``--model``; default: butter's conversion of the built-in GGUF, an MLX-quantized folder both
engines load; ``--model`` another, e.g. a float32 one both run dense). ``--clients`` chat requests
are sent at once, each asking a different question for ``--max-tokens`` greedy tokens, streamed
(a request's ``model`` is the folder's path, which mlx-lm's server needs and butter's ignores);
``--disconnect`` of them (chosen at random) close their stream after a random number of tokens.
``--random-shape qwen3-1.7b`` serves instead a model of that shape with seeded random bfloat16
weights (``long_prefill.write_model``) and the tokenizer of ``--tokenizer`` (default: the
built-in model's), written once to ``--random-dir``: what a GPU machine without a registry
can serve. Butter engines use ``--kv-cache`` (default raw) and ``--kv-memory`` bytes of pages. With ``--system-words N`` every request starts with the
same system message of N words (a shared prefix: what the prefix cache reuses; the engine
``butter-noprefix`` is butter with ``--prefix-cache-bytes 0``; ``butter@N`` is butter with
``--prefill-chunk N``). Reported per engine: requests per second
(completed streams over the wall time of the whole run), time to first token p50/p99,
aggregate streamed tokens per second, the share of prompt tokens the server reports as cached
(``usage.prompt_tokens_details.cached_tokens``), peak resident memory of the server process, and errors.
For butter, ``/health`` must show nothing reserved after the run (no leaked pages).

Usage::

    python bench/serve_load.py [--engines butter,mlx-lm] [--clients 64] [--disconnect 0.25]
        [--max-tokens 64] [--max-sessions 16] [--system-words 0] [--seed 0] [--kv-cache raw]
        [--kv-memory BYTES] [--random-shape qwen3-1.7b [--tokenizer DIR] [--random-dir DIR]]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from openai import AsyncOpenAI

TOPICS = ["the sea", "a fox", "Paris", "rain", "bread", "a clock", "mountains", "music", "a library", "winter",
          "the moon", "a garden", "trains", "coffee", "a river", "chess"]  # fmt: skip


def default_model() -> str:
    from butter_core.default_model import default_model_dir

    return str(default_model_dir())


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def system_message(words: int) -> list[dict]:
    """A system message of ``words`` words that every request shares (none for 0)."""
    if not words:
        return []
    text = " ".join(f"rule {i}: answer in plain words about {TOPICS[i % len(TOPICS)]}." for i in range(words))
    return [{"role": "system", "content": " ".join(text.split()[:words])}]


def random_model(shape: str, tokenizer: Path, directory: Path) -> str:
    """A model of ``shape`` with seeded random bfloat16 weights and ``tokenizer``'s tokenizer files."""
    from tokenizers import Tokenizer

    from long_prefill import write_model

    if not (directory / "model.safetensors").exists():
        vocab = Tokenizer.from_file(str(tokenizer / "tokenizer.json")).get_vocab_size()
        write_model(directory, shape, "bfloat16", 8192, vocab_size=vocab)
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(tokenizer / name, directory / name)
    return str(directory)


def start(engine: str, model: str, port: int, args) -> subprocess.Popen:
    if engine.startswith("butter"):
        argv = [sys.executable, "-c", "import sys; from butter_core.cli import main; sys.exit(main())", "serve",
                "-m", model, "--port", str(port), "--max-sessions", str(args.max_sessions), "--max-queue", "256",
                "--kv-memory", str(args.kv_memory), "--kv-cache", args.kv_cache]  # fmt: skip
        name, _, chunk = engine.partition("@")
        if name == "butter-noprefix":
            argv += ["--prefix-cache-bytes", "0"]
        if chunk:
            argv += ["--prefill-chunk", chunk]
    else:
        argv = [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port)]  # its defaults
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2).read()
            return process
        except OSError:
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{engine} server did not start: {process.stderr.read()}") from None
            time.sleep(0.2)


def peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


async def one_client(client: AsyncOpenAI, model: str, index: int, leave_after: int | None, max_tokens: int,
                     system: list[dict]) -> dict:  # fmt: skip
    start = time.perf_counter()
    first, pieces, error, finish, usage = None, 0, None, None, None
    try:
        stream = await client.chat.completions.create(
            model=model, stream=True, max_tokens=max_tokens, temperature=0, stream_options={"include_usage": True},
            messages=[*system, {"role": "user", "content": f"Write a short poem about {TOPICS[index % len(TOPICS)]}."}],
        )  # fmt: skip
        async for chunk in stream:
            usage = chunk.usage or usage
            if not chunk.choices:
                continue
            if chunk.choices[0].delta.content:
                pieces += 1
                first = first or time.perf_counter() - start
                if leave_after is not None and pieces >= leave_after:
                    await stream.close()
                    break
            finish = chunk.choices[0].finish_reason or finish
    except Exception as exc:  # noqa: BLE001 - counted, reported
        error = f"{type(exc).__name__}: {exc}"
    details = usage and usage.prompt_tokens_details
    return {"first": first, "pieces": pieces, "left": leave_after is not None, "finish": finish, "error": error,
            "seconds": time.perf_counter() - start, "prompt": usage.prompt_tokens if usage else 0,
            "cached": (details.cached_tokens or 0) if details else 0}  # fmt: skip


async def load(port: int, model: str, clients: int, disconnect: float, max_tokens: int, seed: int,
               system: list[dict]) -> tuple[list[dict], float]:  # fmt: skip
    rng = random.Random(seed)
    leave = [rng.randint(1, max_tokens // 2) if rng.random() < disconnect else None for _ in range(clients)]
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=5, timeout=600)
    start = time.perf_counter()
    results = await asyncio.gather(*(one_client(client, model, i, leave[i], max_tokens, system) for i in range(clients)))
    await client.close()
    return results, time.perf_counter() - start


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--engines", default="butter,mlx-lm")
    parser.add_argument("--model")
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--disconnect", type=float, default=0.25)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-sessions", type=int, default=16)
    parser.add_argument("--system-words", type=int, default=0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--kv-cache", default="raw")
    parser.add_argument("--kv-memory", type=int, default=2 * 2**30)
    parser.add_argument("--random-shape")
    parser.add_argument("--tokenizer", type=Path)
    parser.add_argument("--random-dir", type=Path, default=Path("/tmp/butter-serve-random-model"))
    args = parser.parse_args()
    if args.random_shape:
        model = random_model(args.random_shape, args.tokenizer or Path(default_model()), args.random_dir)
    else:
        model = args.model or default_model()
    rows = []
    for engine in args.engines.split(","):
        port = free_port()
        process = start(engine, model, port, args)
        try:
            results, seconds = asyncio.run(load(port, model, args.clients, args.disconnect, args.max_tokens, args.seed,
                                                system_message(args.system_words)))  # fmt: skip
            leaked = None
            if engine.startswith("butter"):
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
                time.sleep(0.5)  # the last cancellations reach the scheduler
                health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/health").read())
                leaked = health["pages_reserved"] + health["running"] + health["waiting"]
            rss = peak_rss(process.pid)
        finally:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
        done = [r for r in results if not r["left"] and r["error"] is None]
        firsts = [r["first"] for r in results if r["first"] is not None]
        rows.append({
            "engine": engine, "clients": args.clients, "left early": sum(r["left"] for r in results),
            "completed": len(done), "errors": sum(r["error"] is not None for r in results),
            "requests/s": len(done) / seconds, "ttft p50 s": percentile(firsts, 0.5),
            "ttft p99 s": percentile(firsts, 0.99),
            "streamed tokens/s": sum(r["pieces"] for r in results) / seconds,
            "cached prompt share": sum(r["cached"] for r in results) / max(1, sum(r["prompt"] for r in results)),
            "peak RSS GiB": rss / 2**30, "leaked (pages + requests)": leaked, "wall s": seconds,
            "first error": next((r["error"] for r in results if r["error"]), None),
        })  # fmt: skip
        if len(rows) == 1:
            print("| " + " | ".join(rows[0]) + " |")
            print("|" + "---|" * len(rows[0]))
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in rows[-1].values()) + " |", flush=True)
    print(f"model {model}; {os.cpu_count()} CPUs; max_tokens {args.max_tokens}; disconnect {args.disconnect}; "
          f"system words {args.system_words}; max sessions {args.max_sessions}; butter kv cache {args.kv_cache}")


if __name__ == "__main__":
    main()
