"""The measurements behind butter-aura's design choices (docs/aura.md), on the default model.

Teacher-forced next-token distributions of SmolLM2-135M (head_dim 64, float32 on the CPU)
with each candidate KV coding, against the model with exact K/V: mean KL(raw ‖ coded)
over every position, and top-1 agreement. Texts: the first ``--tokens`` tokens of the
texts ``butter quality`` uses by default (code: CPython's ``textwrap.py``; prose: the
GPL-3 text; ``butter_core/data``).

What is simulated: decode, one token at a time. Query ``t`` attends to positions
``0..t`` as a cache holds them after ``t + 1`` single-token appends: each position's key
and value decoded from its codes, except the full-precision budget (the first
``sinks`` positions and the ``recent`` most recent ones, ``t`` itself included), which
are read as 16-bit copies. One forward pass over the whole text computes exactly that
(a causal mask per band); ``--check`` confirms it against the real ``AuraCache`` fed token
by token. A chunked prefill is *not* what is measured: butter-aura's two-phase prefill
attends each chunk to itself in full precision, which would hide most of the coding
error.

Candidates (``VARIANTS``): AURA with per-vector or per-group scales, with and without the
budget, without rotation; affine baselines in mlx-lm's layout (``mx.quantize``: a float16
scale and bias per group), which is what butter-affine stores, with and without the
same budget.

Bits per element count every code, scale and norm: "asymptotic" per position, and "at
N" as allocated for an N-token context including the fixed full-precision rows; the
script also prints what the real caches allocate (``nbytes_allocated``).

Usage: ``python bench/aura_design.py [--tokens 2048] [--variants NAME ...] [--check]``
(about a minute per variant and text on two CPU cores).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import butter_core  # noqa: F401 - first: loads a fast BLAS before MLX (butter_core/cpu_blas.py)
import attrs
import mlx.core as mx

from butter_core.cache import attend
from butter_core.data import CODE_TEXT, PROSE_TEXT
from butter_core.model import Model

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugins" / "butter-aura"))

from butter_aura.codec import Codec  # noqa: E402
from butter_aura.layout import DEFAULT_SEED  # noqa: E402
from butter_aura.rotation import Rotation, layer_seed  # noqa: E402

TEXTS = {"code": CODE_TEXT, "prose": PROSE_TEXT}


@attrs.frozen
class Variant:
    """One way of coding K and V: AURA (rotated codebook) or affine (mx.quantize)."""

    name: str
    method: str  # "aura" | "affine"
    key_bits: int
    value_bits: int
    group: int | None = None  # None: one scale per vector
    sinks: int = 0
    recent: int = 0
    rotate: bool = True

    def bits_per_element(self, head_dim: int, tokens: int | None = None) -> float:
        """Average bits per stored K/V element, per position (``tokens`` None) or as allocated for ``tokens``."""
        group = self.group or head_dim
        if self.method == "affine":
            per_position = sum(bits + 32 / group for bits in (self.key_bits, self.value_bits)) / 2
        else:
            per_position = sum(bits + 16 / group for bits in (self.key_bits, self.value_bits)) / 2
        if tokens is None or not (self.sinks or self.recent):
            return per_position
        return per_position + 16 * (self.sinks + self.recent) / tokens


def aura(name, k, v, group=None, sinks=0, recent=0, rotate=True):
    return Variant(name, "aura", k, v, group, sinks, recent, rotate)


VARIANTS = [
    Variant("affine4 g64", "affine", 4, 4, 64),
    Variant("affine4 g32", "affine", 4, 4, 32),
    Variant("affine8 g64", "affine", 8, 8, 64),
    Variant("affine8/4 g64", "affine", 8, 4, 64),
    Variant("affine4 g64 s4 r32", "affine", 4, 4, 64, sinks=4, recent=32),
    aura("k4v2 vector", 4, 2),
    aura("k4v2 g32", 4, 2, 32),
    aura("k4v2 g16", 4, 2, 16),
    aura("k4v2 g32 unrotated", 4, 2, 32, rotate=False),
    aura("k4v2 vector s4", 4, 2, sinks=4),
    aura("k4v2 vector s4 r32", 4, 2, sinks=4, recent=32),
    aura("k4v2 g32 s4 r32", 4, 2, 32, sinks=4, recent=32),
    aura("k4v2 vector s4 r64", 4, 2, sinks=4, recent=64),
    aura("k4v4 vector", 4, 4),
    aura("k4v4 g32", 4, 4, 32),
    aura("k4v4 vector s4 r32", 4, 4, sinks=4, recent=32),
    aura("k8v4 vector s4 r32", 8, 4, sinks=4, recent=32),
    aura("k8v8 vector s4 r32", 8, 8, sinks=4, recent=32),
    aura("k8v8 vector", 8, 8),
    aura("k3v2 vector s4 r32", 3, 2, sinks=4, recent=32),
]


def fake_affine(x: mx.array, bits: int, group: int) -> mx.array:
    """``x`` through mx.quantize / mx.dequantize (float16 scales and biases, as a float16 model stores them)."""
    x16 = x.astype(mx.float16)
    return mx.dequantize(*mx.quantize(x16, group_size=group, bits=bits), group_size=group, bits=bits).astype(x.dtype)


class DecodeEquivalentAttention:
    """A stand-in for one layer's cache: attention of a whole text as single-token decode would compute it."""

    def __init__(self, variant: Variant, layer_index: int, n_kv_heads: int, head_dim: int):
        self.variant = variant
        self.rotation = Rotation(layer_seed(DEFAULT_SEED, layer_index), n_kv_heads, head_dim)
        group = variant.group or head_dim
        if variant.method == "aura":
            self.codecs = (Codec(variant.key_bits, group, head_dim), Codec(variant.value_bits, group, head_dim))

    absolute_position = 0

    def coded(self, x: mx.array, index: int) -> mx.array:
        v = self.variant
        if v.method == "affine":
            return fake_affine(x, (v.key_bits, v.value_bits)[index], v.group)
        codec = self.codecs[index]
        if not v.rotate:
            return codec.decode(*codec.encode(x))
        return self.rotation.invert(codec.decode(*codec.encode(self.rotation.apply(x))))

    def update_and_attend(self, queries, keys, values, *, scale):
        v, tokens = self.variant, keys.shape[2]
        coded_keys, coded_values = self.coded(keys, 0), self.coded(values, 1)
        if not (v.sinks or v.recent):
            return attend(queries, coded_keys, coded_values, scale=scale, mask="causal")
        position = mx.arange(tokens)
        query, key = position[:, None], position[None]
        exact = (key <= query) & ((key < v.sinks) | (key > query - v.recent))
        coded = (key <= query) & ~exact
        exact_keys, exact_values = keys.astype(mx.float16).astype(keys.dtype), values.astype(mx.float16).astype(values.dtype)
        b, h, _, d = keys.shape
        group = queries.shape[1] // h
        q = queries.reshape(b, h, group, tokens, d)
        scores_exact = (q @ exact_keys[:, :, None].swapaxes(-1, -2)) * scale
        scores_coded = (q @ coded_keys[:, :, None].swapaxes(-1, -2)) * scale
        scores = mx.where(exact, scores_exact, mx.where(coded, scores_coded, -mx.inf))
        weights = mx.softmax(scores, axis=-1)
        out = mx.where(exact, weights, 0) @ exact_values[:, :, None] + mx.where(coded, weights, 0) @ coded_values[:, :, None]
        return out.reshape(queries.shape).astype(queries.dtype)


def text_tokens(model: Model, name: str, tokens: int) -> list[int]:
    text = TEXTS[name].read_text(encoding="utf-8")
    ids = model.tokenizer.encode(text)[:tokens]
    if len(ids) < tokens:
        raise SystemExit(f"text {name!r} has only {len(ids)} tokens")
    return ids


def log_probs(model: Model, ids: list[int], caches=None) -> mx.array:
    logits = model.network(mx.array([ids]), caches)[0].astype(mx.float32)
    out = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    mx.eval(out)
    return out


def compare(reference: mx.array, candidate: mx.array) -> dict:
    kl = mx.sum(mx.exp(reference) * (reference - candidate), axis=-1)
    top1 = mx.argmax(reference, axis=-1) == mx.argmax(candidate, axis=-1)
    return {"kl_mean": mx.mean(kl).item(), "kl_p99": sorted(kl.tolist())[int(0.99 * kl.size)], "top1": mx.mean(top1).item()}


def variant_caches(model: Model, variant: Variant):
    args = model.network.args
    return [DecodeEquivalentAttention(variant, i, args.num_key_value_heads, args.head_dim) for i in range(args.num_hidden_layers)]


def check_against_real_cache(model: Model, ids: list[int]) -> None:
    """The one-pass simulation of the shipped configuration equals the real cache fed one token at a time."""
    from butter_aura import Aura
    from butter_aura.layout import RECENT, SCALE_GROUP, SINKS

    for name in ("aura4v2", "aura8v4"):
        kind = Aura.named(name)
        variant = aura(name, kind.key_bits, kind.value_bits, SCALE_GROUP, SINKS, RECENT)
        simulated = log_probs(model, ids, variant_caches(model, variant))
        real_model = Model.load(None, options=attrs.evolve(model.options, kv_cache=kind))
        caches = real_model.engine.make_layer_caches()
        stepped = mx.stack([real_model.engine.forward([token], caches).astype(mx.float32) for token in ids])
        stepped = stepped - mx.logsumexp(stepped, axis=-1, keepdims=True)
        exact = log_probs(model, ids)
        real, sim = compare(exact, stepped), compare(exact, simulated)
        gap = compare(simulated, stepped)
        print(
            f"check {name}, {len(ids)} tokens: KL vs exact K/V: real cache token by token {real['kl_mean']:.5f}, "
            f"simulation {sim['kl_mean']:.5f}; KL(simulation || real) {gap['kl_mean']:.2e}, top-1 agreement {gap['top1']:.3f}"
        )


def allocated_bits(kind_name: str, head_dim: int, kv_heads: int, tokens: int) -> float:
    """Bits per K/V element a real cache of ``kind_name`` allocates for ``tokens`` positions (one layer)."""
    from butter_core import LayerSpec, make_layer_caches, parse_kv_cache

    spec = LayerSpec(n_kv_heads=kv_heads, head_dim=head_dim, max_positions=tokens, dtype=mx.float32)
    (cache,) = make_layer_caches(parse_kv_cache(kind_name), [spec])
    for start in range(0, tokens, 4096):
        n = min(4096, tokens - start)
        rows = mx.random.normal((1, kv_heads, n, head_dim), key=mx.random.key(start))
        cache.append(rows, rows)
        mx.eval(cache.buffers())
    return 8 * cache.nbytes_allocated / (tokens * kv_heads * head_dim * 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--texts", nargs="+", default=list(TEXTS))
    parser.add_argument("--variants", nargs="+", help="names from VARIANTS (default: all)")
    parser.add_argument("--check", action="store_true", help="also check the simulation against the real cache")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    model = Model.load(None)
    head_dim = model.network.args.head_dim
    chosen = [v for v in VARIANTS if not args.variants or v.name in args.variants]
    if args.check:
        check_against_real_cache(model, text_tokens(model, "code", 96))
    kinds = ["aura4v2", "aura4v4", "aura8v4", "aura8v8", "aura3v2", "affine4g64", "affine4", "affine8"]
    args_model = model.network.args
    print("bits per K/V element as allocated by the real caches (one layer of the default model):")
    for name in kinds:
        try:
            cells = [f"{allocated_bits(name, head_dim, args_model.num_key_value_heads, n):.3f} at {n}" for n in (2048, 32768)]
            print(f"  {name:11s} " + ", ".join(cells))
        except Exception as exc:  # e.g. butter-affine not installed
            print(f"  {name:11s} unavailable: {exc}")
    results = []
    for text in args.texts:
        ids = text_tokens(model, text, args.tokens)
        reference = log_probs(model, ids)
        for variant in chosen:
            start = time.perf_counter()
            row = {"text": text, "variant": variant.name, **compare(reference, log_probs(model, ids, variant_caches(model, variant)))}
            row["bits"] = variant.bits_per_element(head_dim)
            row["bits_at_tokens"] = variant.bits_per_element(head_dim, args.tokens)
            results.append(row)
            print(
                f"{text:5s} {variant.name:22s} KL {row['kl_mean']:.5f}  p99 {row['kl_p99']:.4f}  top-1 {row['top1']:.4f}  "
                f"bits {row['bits']:.3f} ({row['bits_at_tokens']:.3f} at {args.tokens})  [{time.perf_counter() - start:.0f} s]",
                flush=True,
            )
    print("\n| variant | bits/elem (asymptotic) | bits/elem at %d | " % args.tokens
          + " | ".join(f"{t} KL | {t} top-1" for t in args.texts) + " |")
    print("|---|---|---|" + "---|---|" * len(args.texts))
    for variant in chosen:
        rows = {r["text"]: r for r in results if r["variant"] == variant.name}
        cells = " | ".join(f"{rows[t]['kl_mean']:.5f} | {rows[t]['top1']:.3f}" for t in args.texts)
        print(f"| {variant.name} | {variant.bits_per_element(head_dim):.3f} | "
              f"{variant.bits_per_element(head_dim, args.tokens):.3f} | {cells} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
