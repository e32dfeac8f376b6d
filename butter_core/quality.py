"""What ``butter quality`` measures: each scheme's next-token predictions against raw's, teacher-forced.

For each text, its first ``context`` tokens go through the engine as a cache sees them
in use: a first chunk of ``prefill`` tokens, then the rest in chunks of ``chunk``
tokens, each chunk's queries attending over what the cache stored (a quantized
scheme's compressed K/V), every position's logits kept (``Engine.forward`` with
``all_logits``). A raw baseline and every scheme run in lockstep, chunk by chunk, so only
one chunk of logits per scheme is alive at a time. Raw listed as a scheme is run again,
separately, on the same chunks: identical computation, so its KL is exactly 0 and its
agreement exactly 1.

The copy probe: ``COPY_SPAN`` random tokens (seeded, drawn from the tokenizer's regular
vocabulary) are inserted after the text's first ``COPY_OFFSET`` tokens and repeated at
the end of the context, with text between; ``copy_accuracy`` is how often the scheme's
argmax predicts the repeat's next token (all but the first, which nothing predicts).

Each result is one row of :data:`QUALITY_KEYS` (the JSON's stable keys).
"""

from __future__ import annotations

import math
import os
import random
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TextIO

import attrs
import mlx.core as mx

from butter_core.benchmark import baseline, check_positions, engine_for
from butter_core.cache import AttentionCache, LayerCache
from butter_core.config import CacheKind
from butter_core.engine import Engine
from butter_core.errors import ConfigError
from butter_core.model import Model
from butter_core.progress import Progress
from butter_core.tokenizer import Tokenizer

DEFAULT_CONTEXT = 2048
PREFILL_TOKENS = 512
"""Tokens of the first chunk (the prompt's prefill)."""
CHUNK_TOKENS = 128
"""Tokens of each later chunk fed through the caches."""
COPY_SPAN = 32
COPY_OFFSET = 16
COPY_SEED = 0

QUALITY_KEYS: dict[str, str] = {
    "scheme": "the scheme as a CLI string (raw, affine8, ...)",
    "text": "the text's file name (shipped texts) or path as given",
    "context": "tokens of the text fed (its first N)",
    "tokens": "next-token predictions scored: context - 1",
    "ppl": "perplexity of the text: exp(mean negative log-likelihood of each next token)",
    "kl": "mean KL(raw || scheme) of the next-token distributions, nats per token",
    "top1_agreement": "fraction of positions where the scheme's argmax equals raw's",
    "copy_accuracy": f"copy probe: fraction of a repeated random {COPY_SPAN}-token span's tokens "
    "(after its first) the scheme's argmax predicts",
    "bits_per_element": "bits per stored K/V element: 8 * live KV bytes / (positions x kv_heads x head_dim x 2 "
    "(K and V)), summed over layers, scales and biases included",
}
"""Keys of each ``butter quality`` result, in order, with their meaning."""


@attrs.frozen
class QualityResult:
    """One scheme on one text; fields are :data:`QUALITY_KEYS`."""

    scheme: str
    text: str
    context: int
    tokens: int
    ppl: float
    kl: float
    top1_agreement: float
    copy_accuracy: float
    bits_per_element: float

    def as_dict(self) -> dict:
        """The JSON row: exactly :data:`QUALITY_KEYS`, in order."""
        return {key: getattr(self, key) for key in QUALITY_KEYS}


@attrs.frozen
class Text:
    """A text's name and the token ids evaluated (its first ``context``)."""

    name: str
    ids: list[int]


@attrs.frozen
class CopyProbe:
    """Token ids holding one random span twice: at ``first`` and again at ``repeat`` (the end)."""

    ids: list[int]
    first: int
    repeat: int
    span: int

    @property
    def scored_positions(self) -> range:
        """Positions of the repeat whose token the previous positions can predict (all but its first)."""
        return range(self.repeat + 1, self.repeat + self.span)


def load_text(path: str | os.PathLike, tokenizer: Tokenizer, context: int, *, name: str | None = None) -> Text:
    """The first ``context`` tokens of the UTF-8 file at ``path``; ConfigError if missing or shorter."""
    path = Path(path)
    try:
        content = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"--text {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"--text {path}: cannot read it as UTF-8 text ({exc})") from None
    ids = tokenizer.encode(content)
    if len(ids) < context:
        raise ConfigError(f"--text {path}: {len(ids)} tokens, fewer than --context {context}; pass a smaller --context")
    return Text(name or str(path), ids[:context])


def chunk_bounds(length: int, prefill: int = PREFILL_TOKENS, chunk: int = CHUNK_TOKENS) -> list[tuple[int, int]]:
    """``(start, end)`` of the first chunk of ``prefill`` tokens, then chunks of ``chunk``, covering ``length``."""
    if prefill <= 0 or chunk <= 0:
        raise ConfigError(f"--prefill and --chunk must be positive, got {prefill} and {chunk}")
    starts = [0, *range(prefill, length, chunk)]
    return [(start, min(end, length)) for start, end in zip(starts, [*starts[1:], length])]


def chunked_logits(
    engine: Engine, ids: Sequence[int], caches: Sequence[LayerCache], bounds: Sequence[tuple[int, int]]
) -> Iterator[mx.array]:
    """Feed ``ids`` through ``caches`` chunk by chunk; yield each chunk's logits ``[tokens, vocab]``, evaluated."""
    for start, end in bounds:
        logits = engine.forward(ids[start:end], caches, all_logits=True).astype(mx.float32)
        mx.eval(logits)
        yield logits


def log_softmax(logits: mx.array) -> mx.array:
    """Log-probabilities over the last axis."""
    return logits - mx.logsumexp(logits, axis=-1, keepdims=True)


@attrs.frozen
class TextScores:
    """One scheme's teacher-forced scores on one text (the copy probe is separate)."""

    ppl: float
    kl: float
    top1_agreement: float
    bits_per_element: float


@attrs.define
class _Totals:
    """Running sums over scored positions for one scheme."""

    nll: float = 0.0
    kl: float = 0.0
    agree: int = 0

    def add(self, logp: mx.array, targets: mx.array, base_logp: mx.array, base_top1: mx.array) -> None:
        picked = mx.take_along_axis(logp, targets[:, None], axis=-1)
        kl = mx.exp(base_logp) * (base_logp - logp)
        nll, kl_sum, agree = -picked.sum(), kl.sum(), (mx.argmax(logp, axis=-1) == base_top1).sum()
        mx.eval(nll, kl_sum, agree)
        self.nll += nll.item()
        self.kl += kl_sum.item()
        self.agree += agree.item()


def bits_per_element(caches: Sequence[LayerCache]) -> float:
    """8 * live KV bytes / stored K and V elements, over every attention layer (a recurrent
    layer's state is not a K/V element: its bytes do not depend on the scheme under test)."""
    attention = [c for c in caches if isinstance(c, AttentionCache)]
    elements = sum(2 * c.length * c.spec.batch_size * c.spec.n_kv_heads * c.spec.head_dim for c in attention)
    return 8 * sum(c.nbytes_live for c in attention) / elements


def teacher_forced_scores(
    baseline: Engine,
    engines: dict[CacheKind, Engine],
    ids: Sequence[int],
    bounds: Sequence[tuple[int, int]],
    progress: Progress,
    label: str,
) -> dict[CacheKind, TextScores]:
    """Each scheme's scores against ``baseline``, run alongside.

    All run in lockstep over ``bounds``: per chunk, the baseline's logits, then each
    scheme's, so one chunk of logits per scheme is alive at a time.
    """
    base_stream = chunked_logits(baseline, ids, baseline.make_layer_caches(), bounds)
    caches = {kind: engine.make_layer_caches() for kind, engine in engines.items()}
    streams = {kind: chunked_logits(engines[kind], ids, caches[kind], bounds) for kind in engines}
    totals = {kind: _Totals() for kind in engines}
    all_targets = mx.array(ids[1:], dtype=mx.uint32)
    for index, (start, end) in enumerate(bounds):
        progress.step(f"{label}: teacher forcing, chunk {index + 1}/{len(bounds)}")
        scored = min(end, len(ids) - 1) - start  # the last position has no next token
        base_logits = next(base_stream)
        chunk_logits = {kind: next(stream) for kind, stream in streams.items()}
        if scored <= 0:
            continue
        targets = all_targets[start : start + scored]
        base_logp = log_softmax(base_logits[:scored])
        base_top1 = mx.argmax(base_logp, axis=-1)
        for kind, logits in chunk_logits.items():
            totals[kind].add(log_softmax(logits[:scored]), targets, base_logp, base_top1)
    count = len(ids) - 1
    return {
        kind: TextScores(math.exp(t.nll / count), t.kl / count, t.agree / count, bits_per_element(caches[kind]))
        for kind, t in totals.items()
    }


def regular_token_ids(tokenizer: Tokenizer) -> list[int]:
    """Ids of the tokenizer's vocabulary that are not special or added tokens."""
    added = set(tokenizer.backend.get_added_tokens_decoder())
    return [i for i in range(tokenizer.vocab_size) if i not in added]


def make_copy_probe(
    ids: Sequence[int],
    vocabulary: Sequence[int],
    *,
    span: int = COPY_SPAN,
    offset: int = COPY_OFFSET,
    seed: int = COPY_SEED,
) -> CopyProbe:
    """``len(ids)`` tokens: ids[:offset], a random span, more of ``ids``, the span again at the very end."""
    length = len(ids)
    if length < offset + 2 * span + 1:
        raise ConfigError(f"--context {length} is too short for the copy probe: it needs at least {offset + 2 * span + 1}")
    tokens = random.Random(seed).sample(list(vocabulary), span)
    probe = [*ids[:offset], *tokens, *ids[offset : length - 2 * span], *tokens]
    return CopyProbe(probe, first=offset, repeat=length - span, span=span)


def copy_accuracy(
    engine: Engine, probe: CopyProbe, bounds: Sequence[tuple[int, int]], progress: Progress, label: str
) -> float:
    """Fraction of the probe's scored repeat tokens that ``engine``'s argmax predicts, teacher-forced."""
    predicted: list[int] = []
    caches = engine.make_layer_caches()
    for index, logits in enumerate(chunked_logits(engine, probe.ids, caches, bounds)):
        progress.step(f"{label}: copy probe, chunk {index + 1}/{len(bounds)}")
        predicted += mx.argmax(logits, axis=-1).tolist()
    hits = sum(predicted[p - 1] == probe.ids[p] for p in probe.scored_positions)
    return hits / len(probe.scored_positions)


def run_quality(
    model: Model,
    kinds: Sequence[CacheKind],
    texts: Sequence[Text],
    *,
    prefill: int = PREFILL_TOKENS,
    chunk: int = CHUNK_TOKENS,
    progress_stream: TextIO | None = None,
) -> list[QualityResult]:
    """Score each of ``kinds`` on each text against raw; a progress bar goes to ``progress_stream``."""
    baseline_engine = engine_for(model, baseline())
    engines = {kind: engine_for(model, kind) for kind in kinds}
    vocabulary = regular_token_ids(model.tokenizer)
    plans = []
    for text in texts:
        check_positions(model.engine, len(text.ids), f"--context {len(text.ids)}")
        plans.append((text, chunk_bounds(len(text.ids), prefill, chunk), make_copy_probe(text.ids, vocabulary)))
    progress = Progress(sum(len(bounds) * (1 + len(kinds)) for _, bounds, _ in plans), "quality", progress_stream)
    results = []
    for text, bounds, probe in plans:
        scores = teacher_forced_scores(baseline_engine, engines, text.ids, bounds, progress, text.name)
        for kind, engine in engines.items():
            copy = copy_accuracy(engine, probe, bounds, progress, f"{text.name} {kind}")
            results.append(
                QualityResult(
                    scheme=str(kind),
                    text=text.name,
                    context=len(text.ids),
                    tokens=len(text.ids) - 1,
                    copy_accuracy=copy,
                    **attrs.asdict(scores[kind]),
                )
            )
    progress.finish()
    return results


def format_quality_table(results: Sequence[QualityResult]) -> str:
    """A Markdown table of ``results``, one row per text and scheme."""
    lines = [
        "| text | scheme | context | ppl | KL (nats/token) | top-1 agreement | copy accuracy | bits/element |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.text} | {r.scheme} | {r.context} | {r.ppl:.3f} | {r.kl:.2e} | {r.top1_agreement:.4f} | "
            f"{r.copy_accuracy:.3f} | {r.bits_per_element:.2f} |"
        )
    return "\n".join(lines)
