"""What ``butter bench`` measures: KV bytes, peak memory, prefill and decode speed per scheme and context.

For each context length N, each scheme runs on the same prompt — N tokens of a
shipped text (``butter_core.data.BENCH_TEXT``), repeated as needed — followed by
``decode_tokens`` greedy decode steps, through the engine's own ``Generation`` loop
(the code ``butter generate`` runs). Schemes are interleaved per context (raw, affine8,
raw, affine8, ...) so a slow spell of the machine hits all of them alike, and every
ratio to raw comes from the same run. raw is always measured, as the baseline. Before
the timed runs each scheme does one short warm-up generation; ``repeats`` rounds per
context give median speeds, for noisy machines.

Each result is one row of :data:`BENCH_KEYS` (the JSON's stable keys, documented there
and in ``docs/benchmarks.md``). The pieces ``butter quality`` shares — scheme lists,
one engine per scheme over one loaded network, the context check, run metadata, the
progress bar — live here too.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from importlib import metadata as importlib_metadata
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

import attrs
import mlx.core as mx

from butter_core import parse_kv_cache
from butter_core.batched import PAGE_SIZE, capacity_for
from butter_core.cache import LayerSpec
from butter_core.config import DEFAULT_KV_CACHE, CacheKind
from butter_core.cpu_blas import LOADED_BLAS
from butter_core.data import BENCH_TEXT
from butter_core.engine import Engine
from butter_core.errors import ConfigError
from butter_core.generation import Generation, GenerationStats, format_bytes
from butter_core.kernels.backend import default_device_is_gpu
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.progress import Progress
from butter_core.tokenizer import Tokenizer

if TYPE_CHECKING:
    from butter_core.batch_generation import BatchGeneration

BASELINE = DEFAULT_KV_CACHE
"""The scheme every other is compared with (its CLI string): raw, unquantized K/V in the model's dtype."""

DEFAULT_CONTEXTS = (512, 1024, 2048)
DEFAULT_DECODE_TOKENS = 32
WARMUP_PROMPT_TOKENS = 16
PLOT_INSTALL = "pip install 'butter-core[plot]'"

BENCH_KEYS: dict[str, str] = {
    "scheme": "the scheme as a CLI string (raw, affine8, ...)",
    "context": "prompt tokens N",
    "batch": "sequences generated together, B (1 without --batch: one sequence through Model.generate; with "
    "--batch every size, 1 too, runs B prompts of N tokens through BatchGeneration over paged caches)",
    "kv_bytes_allocated": "bytes the caches of all attention layers hold at the end of the run (N + "
    "decode_tokens positions), growth slack included; batched: every page, allocated at creation for B "
    "sequences of N + decode_tokens positions",
    "kv_bytes_live": "bytes that encode the live positions, all attention layers (batched: the most at once, "
    "all sequences)",
    "state_bytes": "bytes the recurrent layers' caches hold (convolution inputs and state; constant in N; 0 "
    "without recurrent layers; batched: the state pools, one row per sequence)",
    "bytes_per_token": "kv_bytes_live / positions held (N + decode_tokens per sequence)",
    "bytes_ratio_vs_raw": "bytes_per_token / raw's bytes_per_token at the same context (null without butter-raw)",
    "peak_memory_bytes": "MLX peak memory over a run (reset before it; the largest over --repeats): weights, "
    "activations and caches",
    "prefill_tok_s": "B * N / seconds from the start until every sequence's first generated token is ready "
    "(median over --repeats)",
    "decode_tok_s": "tokens generated after every sequence had its first, / seconds from then to the last token: "
    "(decode_tokens - 1) * B / ... for B sequences decoded together (median over --repeats)",
    "decode_tok_s_per_sequence": "decode_tok_s / B",
}
"""Keys of each ``butter bench`` result, in order, with their meaning."""

METADATA_KEYS: dict[str, str] = {
    "date": "when the run ended (UTC, ISO 8601)",
    "machine": "CPU/GPU name, core count and OS",
    "mlx_version": "mlx.core.__version__",
    "backend": "cpu or gpu (MLX's default device)",
    "model": "the -m argument, or the default model's name",
    "butter_version": "butter-core's version",
    "blas": "the BLAS butter preloaded for MLX's CPU matmuls (null: MLX's bundled one)",
}
"""Keys of the ``metadata`` object of both commands' JSON (each adds its settings)."""


@attrs.frozen
class BenchResult:
    """One scheme at one context length; fields are :data:`BENCH_KEYS`."""

    scheme: str
    context: int
    batch: int
    kv_bytes_allocated: int
    kv_bytes_live: int
    state_bytes: int
    bytes_per_token: float
    bytes_ratio_vs_raw: float | None
    peak_memory_bytes: int
    prefill_tok_s: float
    decode_tok_s: float
    decode_tok_s_per_sequence: float

    def as_dict(self) -> dict:
        """The JSON row: exactly :data:`BENCH_KEYS`, in order."""
        return {key: getattr(self, key) for key in BENCH_KEYS}


# -- shared with butter quality ----------------------------------------------------


def parse_scheme_list(text: str) -> list[CacheKind]:
    """The kinds a comma-separated ``--kv-cache`` value names (``raw,affine8``), duplicates dropped."""
    names = [name.strip() for name in text.split(",")]
    if not all(names):
        raise ConfigError(f"--kv-cache: empty scheme name in {text!r}; give a comma-separated list such as raw,affine8")
    kinds: list[CacheKind] = []
    for name in names:
        kind = parse_kv_cache(name)
        if kind not in kinds:
            kinds.append(kind)
    return kinds


def with_baseline(kinds: Sequence[CacheKind]) -> list[CacheKind]:
    """``kinds`` with raw first if it is missing and butter-raw is installed."""
    if BASELINE not in get_plugin_host().schemes or baseline() in kinds:
        return list(kinds)
    return [baseline(), *kinds]


def baseline() -> CacheKind:
    """The kind of ``BASELINE`` (an ``UnknownSchemeError`` saying what to install where butter-raw is not)."""
    return parse_kv_cache(BASELINE)


def engine_for(model: Model, kind: CacheKind) -> Engine:
    """An engine over ``model``'s network (shared, not copied) whose caches are of ``kind``."""
    options = attrs.evolve(model.options, kv_cache=kind)
    return Engine(model.network, options, prefill_chunk=model.engine.prefill_chunk)


def check_positions(engine: Engine, positions: int, what: str) -> None:
    """Raise ConfigError when ``positions`` do not fit the model's window (``what`` says where they come from)."""
    window = min((s.max_positions for s in engine.layer_specs() if isinstance(s, LayerSpec)), default=None)
    if window is not None and positions > window:
        raise ConfigError(f"{what} needs {positions} positions, more than the model's window of {window}")


def machine_description() -> str:
    """``2-core AMD EPYC, Linux``: the default device's name, the CPU cores, the OS."""
    name = mx.device_info().get("device_name") or platform.processor() or platform.machine()
    cores = f"{os.cpu_count()}-core "
    return f"{'' if default_device_is_gpu() else cores}{name}, {platform.system()}"


def run_metadata(model_name: str, **settings) -> dict:
    """The ``metadata`` object of a JSON report (:data:`METADATA_KEYS`), plus the run's ``settings``."""
    try:
        butter_version = importlib_metadata.version("butter-core")
    except importlib_metadata.PackageNotFoundError:
        butter_version = "0+source"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_description(),
        "mlx_version": mx.__version__,
        "backend": "gpu" if default_device_is_gpu() else "cpu",
        "model": model_name,
        "butter_version": butter_version,
        "blas": LOADED_BLAS,
        **settings,
    }


def check_output_path(path: str | None, flag: str) -> None:
    """Fail before a long run, not after it, when ``path`` could not be written: a directory,
    in a directory that does not exist, or not writable."""
    if path is None:
        return
    target = Path(path)
    folder = target.resolve().parent
    if target.is_dir():
        raise ConfigError(f"{flag} {path}: is a directory; give a file name")
    if not folder.is_dir():
        raise ConfigError(f"{flag} {path}: the directory {folder} does not exist")
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ConfigError(f"{flag} {path}: not writable")


def write_json(path: str | os.PathLike, metadata: dict, rows: Sequence[dict]) -> None:
    """``{"metadata": {...}, "results": [...]}``, indented."""
    try:
        Path(path).write_text(json.dumps({"metadata": metadata, "results": list(rows)}, indent=2) + "\n")
    except OSError as exc:
        raise ConfigError(f"--json {path}: {exc.strerror or exc}") from exc


# -- butter bench ------------------------------------------------------------------


def bench_prompt(tokenizer: Tokenizer, context: int) -> list[int]:
    """``context`` token ids of the bench text, repeated as needed."""
    ids = tokenizer.encode(BENCH_TEXT.read_text(encoding="utf-8"))
    return (ids * math.ceil(context / len(ids)))[:context]


def generate_once(engine: Engine, prompt: Sequence[int], decode_tokens: int) -> tuple[GenerationStats, int]:
    """Prefill ``prompt`` into fresh caches and decode ``decode_tokens`` greedy tokens (no stop token).

    Returns the generation's statistics and the positions the caches hold at the end.
    """
    caches = engine.make_layer_caches()
    generation = Generation(engine, prompt, caches, max_tokens=decode_tokens)
    for _ in generation:
        pass
    return generation.stats, caches[0].absolute_position


def summarize(kind: CacheKind, context: int, runs: Sequence[tuple[GenerationStats, int]]) -> BenchResult:
    """One result from a scheme's runs at one context: median speeds, the largest peak; no ratio yet."""
    stats, positions = runs[-1]  # byte accounting is the same in every run
    decode = statistics.median(s.decode_tps for s, _ in runs)
    return BenchResult(
        scheme=str(kind),
        context=context,
        batch=1,
        kv_bytes_allocated=stats.kv_bytes_allocated,
        kv_bytes_live=stats.kv_bytes_live,
        state_bytes=stats.state_bytes,
        bytes_per_token=stats.kv_bytes_live / positions,
        bytes_ratio_vs_raw=None,
        peak_memory_bytes=max(s.peak_memory for s, _ in runs),
        prefill_tok_s=statistics.median(s.prompt_tps for s, _ in runs),
        decode_tok_s=decode,
        decode_tok_s_per_sequence=decode,
    )


@attrs.frozen
class BatchRun:
    """One batched generation's measurements (``generate_batch_once``)."""

    first_seconds: float
    """From the start until every sequence had its first token."""
    decode_tok_s: float
    kv_bytes_allocated: int
    kv_bytes_live: int
    positions: int
    """Positions held when ``kv_bytes_live`` was."""
    state_bytes: int
    peak_memory: int


def steady_decode_rate(steps: Sequence[tuple[float, Sequence[int]]]) -> tuple[float, float]:
    """``(seconds until every sequence had its first token, tokens per second while every sequence
    decodes)`` from each step's ``(seconds since the start, sequences that got a token)``: the window
    runs from the step that gave the last sequence its first token to the step that gave some
    sequence its last (NaN when it holds no step). Where prompts are prefilled a chunk at a time, the
    first sequences decode while later ones still prefill and may end before the last one starts;
    ``decode_budget`` gives each enough tokens that the window holds every sequence."""
    every = set().union(*(sequences for _, sequences in steps))
    seen: set[int] = set()
    start, last = None, {}
    for index, (_, sequences) in enumerate(steps):
        seen.update(sequences)
        if start is None and seen == every:
            start = index
        last.update((sequence, index) for sequence in sequences)
    end = min(last.values())
    seconds = steps[start][0]
    if end <= start:
        return seconds, math.nan
    tokens = sum(len(sequences) for _, sequences in steps[start + 1 : end + 1])
    return seconds, tokens / (steps[end][0] - seconds)


def decode_budget(prompt_lengths: Sequence[int], prefill_chunk: int, decode_tokens: int) -> int:
    """``max_tokens`` for each of these prompts, generated together, that keeps every sequence decoding
    for ``decode_tokens`` steps after the last one's first token (``steady_decode_rate``'s window): a
    sequence decodes a token per step while the others prefill, which takes at most a step per
    ``prefill_chunk`` tokens of each prompt."""
    return decode_tokens + sum(-(-n // prefill_chunk) for n in prompt_lengths)


def decode_together(generation: BatchGeneration, prompts: Sequence, decode_tokens: int,
                    on_step: Callable[[list[int]], None] | None = None, extra: int = 0) -> tuple[float, float]:
    """``steady_decode_rate`` of ``prompts`` generated together by ``generation``: each added with
    ``decode_budget`` tokens and no stop token, then steps (``on_step`` after each, with the sequences
    that got a token) until a sequence has ended after every one started, which closes the window.
    With ``extra``, each has ``extra`` tokens more and the window closes that many tokens before
    the first one's end, so ``extra`` more steps of ``generation`` give every sequence a token (a
    caller may time them apart)."""
    budget = decode_budget([len(p) for p in prompts], generation.prefill_chunk, decode_tokens) + extra
    start = time.perf_counter()
    for prompt in prompts:
        generation.add(prompt, max_tokens=budget, stop_ids=())
    steps, produced = [], {}
    while generation.active:
        sequences = [sequence for sequence, _ in generation.step()]
        steps.append((time.perf_counter() - start, sequences))
        if on_step is not None:
            on_step(sequences)
        for sequence in sequences:
            produced[sequence] = produced.get(sequence, 0) + 1
        if len(produced) == len(prompts) and max(produced.values()) == budget - extra:
            break
    return steady_decode_rate(steps)


def generate_batch_once(engine: Engine, prompts: Sequence[Sequence[int]], decode_tokens: int) -> BatchRun:
    """``prompts`` generated together, ``decode_tokens`` greedy tokens each (no stop token), over
    batched caches holding exactly their positions (whole pages)."""
    from butter_core.batch_generation import BatchGeneration

    page, budget = PAGE_SIZE, decode_budget([len(p) for p in prompts], engine.prefill_chunk, decode_tokens)
    capacity = capacity_for([len(p) + budget for p in prompts], page)
    caches = engine.make_batched_caches(capacity_tokens=capacity, page_size=page, max_sequences=len(prompts))
    mx.reset_peak_memory()
    most = {"live": 0, "positions": 0}

    def note_live(_: list[int]) -> None:
        if caches.nbytes_live > most["live"]:
            most.update(live=caches.nbytes_live, positions=caches.live_positions)

    first, rate = decode_together(BatchGeneration(engine, caches), prompts, decode_tokens, on_step=note_live)
    live, positions = most["live"], most["positions"]
    return BatchRun(first, rate, caches.nbytes_allocated, live, positions, caches.state_bytes, mx.get_peak_memory())


def summarize_batches(kind: CacheKind, context: int, batch: int, runs: Sequence[BatchRun]) -> BenchResult:
    """One result from a scheme's batched runs at one context and batch size."""
    last = runs[-1]
    decode = statistics.median(r.decode_tok_s for r in runs)
    return BenchResult(
        scheme=str(kind),
        context=context,
        batch=batch,
        kv_bytes_allocated=last.kv_bytes_allocated,
        kv_bytes_live=last.kv_bytes_live,
        state_bytes=last.state_bytes,
        bytes_per_token=last.kv_bytes_live / last.positions,
        bytes_ratio_vs_raw=None,
        peak_memory_bytes=max(r.peak_memory for r in runs),
        prefill_tok_s=statistics.median(batch * context / r.first_seconds for r in runs),
        decode_tok_s=decode,
        decode_tok_s_per_sequence=decode / batch,
    )


def run_bench(
    model: Model,
    kinds: Sequence[CacheKind],
    contexts: Sequence[int],
    decode_tokens: int = DEFAULT_DECODE_TOKENS,
    *,
    repeats: int = 1,
    batches: Sequence[int] | None = None,
    progress_stream: TextIO | None = None,
) -> list[BenchResult]:
    """Measure each of ``kinds`` (raw added first when missing) at each context, one sequence
    at a time, or, with ``batches``, ``B`` sequences generated together for each ``B``.

    Per context (and batch size), ``repeats`` rounds each run every scheme once
    (interleaved); speeds are the median over rounds, peak memory the largest. A progress
    bar goes to ``progress_stream`` (None: no progress).
    """
    if decode_tokens < 2:
        raise ConfigError(f"--decode-tokens must be at least 2 (decode speed is timed between tokens), got {decode_tokens}")
    if repeats < 1:
        raise ConfigError(f"--repeats must be at least 1, got {repeats}")
    kinds = with_baseline(kinds)
    engines = {kind: engine_for(model, kind) for kind in kinds}
    for context in contexts:
        check_positions(model.engine, context + decode_tokens, f"--context {context} with --decode-tokens {decode_tokens}")
    if batches is not None:
        return _run_batched(model, engines, contexts, decode_tokens, repeats, batches, progress_stream)
    progress = Progress(len(kinds) * (1 + len(contexts) * repeats), "bench", progress_stream)
    for kind, engine in engines.items():
        progress.step(f"warm-up {kind}")
        generate_once(engine, bench_prompt(model.tokenizer, WARMUP_PROMPT_TOKENS), 2)
    results: list[BenchResult] = []
    for context in contexts:
        prompt = bench_prompt(model.tokenizer, context)
        runs: dict[CacheKind, list[tuple[GenerationStats, int]]] = {kind: [] for kind in kinds}
        for round_index in range(repeats):
            for kind, engine in engines.items():
                progress.step(f"{kind} @ {context}" + (f", round {round_index + 1}/{repeats}" if repeats > 1 else ""))
                mx.clear_cache()
                runs[kind].append(generate_once(engine, prompt, decode_tokens))
        results += with_ratios([summarize(kind, context, kind_runs) for kind, kind_runs in runs.items()])
    progress.finish()
    return results


def with_ratios(row: Sequence[BenchResult]) -> list[BenchResult]:
    """One context's (and batch size's) results with ``bytes_ratio_vs_raw`` filled in."""
    raw = next((r for r in row if r.scheme == BASELINE), None)
    return [attrs.evolve(r, bytes_ratio_vs_raw=None if raw is None else r.bytes_per_token / raw.bytes_per_token)
            for r in row]  # fmt: skip


def _run_batched(model, engines, contexts, decode_tokens, repeats, batches, progress_stream) -> list[BenchResult]:
    """``run_bench`` with ``batches``: B prompts of each context (the bench text from B different
    offsets, so no two are equal) through ``BatchGeneration``."""
    for engine in engines.values():
        engine.make_batched_caches(capacity_tokens=PAGE_SIZE)  # a scheme that cannot run batched fails now
    progress = Progress(len(engines) * (1 + len(contexts) * len(batches) * repeats), "bench", progress_stream)
    for kind, engine in engines.items():
        progress.step(f"warm-up {kind}")
        generate_batch_once(engine, [bench_prompt(model.tokenizer, WARMUP_PROMPT_TOKENS)] * 2, 2)
    results: list[BenchResult] = []
    for context in contexts:
        text = bench_prompt(model.tokenizer, context + max(batches))
        for batch in batches:
            prompts = [text[i : i + context] for i in range(batch)]
            runs: dict[CacheKind, list[BatchRun]] = {kind: [] for kind in engines}
            for round_index in range(repeats):
                for kind, engine in engines.items():
                    progress.step(f"{kind} @ {context} x {batch}" + (f", round {round_index + 1}/{repeats}" if repeats > 1 else ""))
                    mx.clear_cache()
                    runs[kind].append(generate_batch_once(engine, prompts, decode_tokens))
            results += with_ratios([summarize_batches(kind, context, batch, r) for kind, r in runs.items()])
    progress.finish()
    return results


def format_bench_table(results: Sequence[BenchResult]) -> str:
    """A Markdown table of ``results``, one row per scheme and context."""
    lines = [
        "| scheme | context | batch | KV allocated | KV live | state | bytes/token | vs raw | peak memory | prefill tok/s "
        "| decode tok/s | per sequence |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        ratio = "—" if r.bytes_ratio_vs_raw is None else f"{r.bytes_ratio_vs_raw:.3f}"
        lines.append(
            f"| {r.scheme} | {r.context} | {r.batch} | {format_bytes(r.kv_bytes_allocated)} | "
            f"{format_bytes(r.kv_bytes_live)} | {format_bytes(r.state_bytes)} | {r.bytes_per_token:,.0f} | {ratio} | "
            f"{format_bytes(r.peak_memory_bytes)} | {r.prefill_tok_s:.1f} | {r.decode_tok_s:.2f} | "
            f"{r.decode_tok_s_per_sequence:.2f} |"
        )
    return "\n".join(lines)


def require_matplotlib() -> None:
    """Raise ConfigError naming the ``plot`` extra when matplotlib is not installed."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ConfigError(f"--plot needs matplotlib, which is not installed: {PLOT_INSTALL}") from exc


PLOT_PANELS = (
    ("kv_bytes_allocated", "KV cache allocated (MiB)", 2**-20),
    ("peak_memory_bytes", "peak memory (MiB)", 2**-20),
    ("prefill_tok_s", "prefill (tokens/s)", 1),
    ("decode_tok_s", "decode (tokens/s)", 1),
)


def write_plot(results: Sequence[BenchResult], metadata: dict, path: str | os.PathLike) -> None:
    """A PNG of memory and speed against context, one line per scheme (and batch size; decode tok/s
    is then the batch's aggregate) (needs matplotlib)."""
    require_matplotlib()
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11, 8), layout="constrained")
    axes = figure.subplots(2, 2).flatten()
    batched = any(r.batch > 1 for r in results)
    for scheme, batch in dict.fromkeys((r.scheme, r.batch) for r in results):
        rows = sorted((r for r in results if (r.scheme, r.batch) == (scheme, batch)), key=lambda r: r.context)
        label = f"{scheme}, B={batch}" if batched else scheme
        for ax, (key, _, scale) in zip(axes, PLOT_PANELS):
            ax.plot([r.context for r in rows], [getattr(r, key) * scale for r in rows], marker="o", label=label)
    for ax, (_, label, _) in zip(axes, PLOT_PANELS):
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    axes[0].legend(title="KV cache")
    figure.suptitle(
        f"butter bench: {metadata['model']} on {metadata['machine']}, "
        f"mlx {metadata['mlx_version']} ({metadata['backend']}), {metadata['date'][:10]}"
    )
    try:
        figure.savefig(path, dpi=110)
    except OSError as exc:
        raise ConfigError(f"--plot {path}: {exc.strerror or exc}") from exc
