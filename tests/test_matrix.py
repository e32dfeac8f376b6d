"""Every installed attention scheme x {no eviction, window} x {llama, qwen3}, on tiny models through the real loader.

* Generation runs for every combination, and a window bounds every layer's live slots.
* With the raw scheme, greedy tokens equal a full recompute exactly — under a window
  too, against a recompute masked to the same window (sinks plus the recent ring),
  with the prompt longer than the window and prefill chunks that wrap the ring. The
  tokens are compared for equality and the logits to 1e-4: bitwise equality is not
  expected, because the cache sums attention over its slots in ring order and the
  recompute over positions in sequence order.
* Other schemes are compared with the same recompute within the relative logit error
  they declare as ``model_tolerance`` on their ``CacheScheme``; a scheme that declares
  none is reported as skipped.
"""

import mlx.core as mx
import numpy as np
import pytest

from butter_core import LoadOptions, Window
from butter_core.cache import ATTENTION
from butter_core.engine import cache_windows
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.testing.recompute import greedy_recompute
from butter_core.testing.tiny_models import TinySpec

SCHEMES = sorted(name for name, r in get_plugin_host().schemes.items() if ATTENTION in r.scheme.layer_types)
EVICTIONS = {"unbounded": None, "window8keep2": Window(max_size=8, keep=2), "window5keep0": Window(max_size=5, keep=0)}
PROMPT = "The quick brown fox jumps over the lazy dog."  # 18 tokens: longer than every window above
STEPS = 10


def load(tiny_model, family, scheme, eviction, prefill_chunk) -> Model:
    host = get_plugin_host()
    kind = host.parse_kv_cache(host.schemes[scheme].scheme.examples[0])
    model = Model.load(str(tiny_model(TinySpec(family=family))), LoadOptions(kv_cache=kind, kv_eviction=eviction))
    model.engine.prefill_chunk = prefill_chunk
    return model


def relative_error(out: mx.array, ref: mx.array) -> float:
    out, ref = np.array(out.astype(mx.float32)), np.array(ref.astype(mx.float32))
    return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


@pytest.mark.parametrize("eviction", EVICTIONS.values(), ids=EVICTIONS.keys())
@pytest.mark.parametrize("scheme", SCHEMES)
def test_generation_runs(tiny_model, family, scheme, eviction):
    model = load(tiny_model, family, scheme, eviction, prefill_chunk=5)
    caches = model.engine.make_layer_caches()
    prompt = model.encode_prompt(PROMPT)
    tokens = list(model.generate(prompt, caches, max_tokens=STEPS, stop_ids=()))
    assert len(tokens) == STEPS and all(0 <= t < model.network.args.vocab_size for t in tokens)
    assert all(cache.absolute_position == len(prompt) + STEPS for cache in caches)
    bound = eviction.max_size if eviction else len(prompt) + STEPS
    assert all(cache.length == bound for cache in caches)


@pytest.mark.usefixtures("raw_scheme")
@pytest.mark.parametrize("prefill_chunk", [512, 5])
@pytest.mark.parametrize("eviction", EVICTIONS.values(), ids=EVICTIONS.keys())
def test_raw_equals_recompute_exactly(tiny_model, family, eviction, prefill_chunk):
    model = load(tiny_model, family, "raw", eviction, prefill_chunk)
    caches = model.engine.make_layer_caches()
    prompt = model.encode_prompt(PROMPT)
    tokens = list(model.generate(prompt, caches, max_tokens=STEPS, stop_ids=()))
    windows = cache_windows(caches)
    assert windows == [eviction] * len(caches)
    assert tokens == greedy_recompute(model.network, prompt, STEPS, windows)[0]
    # Every position of a whole sequence in one pass, ring wrapped mid-chunk included.
    sequence = prompt + tokens
    cached = model.engine.forward(sequence, model.engine.make_layer_caches(), all_logits=True)
    recomputed = model.network(mx.array(sequence)[None], None, windows)[0]
    assert relative_error(cached, recomputed) < 1e-5


@pytest.mark.parametrize("eviction", EVICTIONS.values(), ids=EVICTIONS.keys())
@pytest.mark.parametrize("scheme", [s for s in SCHEMES if s != "raw"])
def test_scheme_within_its_declared_tolerance(tiny_model, family, scheme, eviction):
    tolerance = get_plugin_host().schemes[scheme].scheme.model_tolerance
    if tolerance is None:
        pytest.skip(f"scheme {scheme!r} declares no model_tolerance")
    model = load(tiny_model, family, scheme, eviction, prefill_chunk=5)
    caches = model.engine.make_layer_caches()
    prompt = model.encode_prompt(PROMPT)
    tokens, _ = greedy_recompute(model.network, prompt, STEPS, cache_windows(caches))
    sequence = prompt + tokens
    cached = model.engine.forward(sequence, caches, all_logits=True)
    recomputed = model.network(mx.array(sequence)[None], None, cache_windows(caches))[0]
    assert relative_error(cached, recomputed) <= tolerance
