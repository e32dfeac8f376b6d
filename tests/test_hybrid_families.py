"""Recurrent and hybrid families against Hugging Face transformers' PyTorch reference.

``tests/data/hybrid/<family>/`` holds tiny random models that ``tools/make_hybrid_reference.py``
wrote with transformers (``hf/``, float32) and converted with ``mlx_lm.convert`` (``mlx/``,
and MLX-quantized ``mlx-q4/``), with the reference logits of a 37-token prompt and of 16
greedy steps (``reference.safetensors``; ``reference_mlx_q4.safetensors`` for the quantized
weights). Every layout loads through the real loader; logits match within ``TOLERANCE`` of
the largest logit and the greedy tokens are identical. Then the invariants every family
keeps: any prefill chunking equals one chunk and token by token, multi-turn continuation
equals one shot, a snapshot rewinds exactly.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from butter_core import LoadOptions
from butter_core.engine import Engine
from butter_core.loading.weights import WeightOptions, load_network
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.testing.tiny_models import write_tokenizer

DATA = Path(__file__).parent / "data" / "hybrid"
FAMILIES = [
    "mamba2",
]
LAYOUTS = ["hf", "mlx", "mlx-q4"]
TOLERANCE = 1e-4
"""Relative to the largest logit, float32: butter's chunked scans against transformers' (4e-7
to 1e-6 measured on the committed models)."""


def reference(family: str, layout: str) -> dict[str, mx.array]:
    name = "reference_mlx_q4.safetensors" if layout == "mlx-q4" else "reference.safetensors"
    return mx.load(str(DATA / family / name))


def relative(a: mx.array, b: mx.array) -> float:
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.fixture
def state_scheme():
    if "ssm" not in get_plugin_host().schemes:
        pytest.skip("needs the ssm state cache scheme (pip install butter-ssm)")


def greedy(engine: Engine, prompt: mx.array, steps: int, chunk: int | None = None):
    """Prompt logits (every position), then ``steps`` greedy tokens and the logits before each."""
    caches = engine.make_layer_caches()
    if chunk is not None:
        engine = Engine(engine.network, engine.options, prefill_chunk=chunk)
    logits = engine.forward(prompt, caches, all_logits=True)
    prompt_logits, last, tokens, step_logits = logits, logits[-1], [], []
    for _ in range(steps):
        step_logits.append(last)
        tokens.append(int(mx.argmax(last).item()))
        last = engine.forward([tokens[-1]], caches)
    return prompt_logits, tokens, mx.stack(step_logits)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_full_recompute_matches_transformers(family, layout):
    network, _ = load_network(DATA / family / layout, WeightOptions())
    ref = reference(family, layout)
    assert relative(network(ref["prompt_ids"][None])[0], ref["prompt_logits"]) <= TOLERANCE


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", FAMILIES)
def test_cached_generation_matches_transformers(family, layout):
    network, _ = load_network(DATA / family / layout, WeightOptions(dequantize=False))
    ref = reference(family, layout)
    prompt_logits, tokens, step_logits = greedy(Engine(network, LoadOptions(), prefill_chunk=16), ref["prompt_ids"], 16)
    assert relative(prompt_logits, ref["prompt_logits"]) <= TOLERANCE
    assert tokens == ref["greedy_ids"].tolist()
    assert relative(step_logits, ref["greedy_logits"]) <= TOLERANCE


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
@pytest.mark.parametrize("family", FAMILIES)
def test_any_prefill_chunking_equals_one_chunk_and_token_by_token(family):
    network, _ = load_network(DATA / family / "hf", WeightOptions())
    prompt = reference(family, "hf")["prompt_ids"]
    one_chunk = Engine(network, LoadOptions(), prefill_chunk=64)
    expected = one_chunk.forward(prompt, one_chunk.make_layer_caches(), all_logits=True)
    for chunk in (1, 5, 8, 13):
        engine = Engine(network, LoadOptions(), prefill_chunk=chunk)
        assert relative(engine.forward(prompt, engine.make_layer_caches(), all_logits=True), expected) <= TOLERANCE, chunk


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
@pytest.mark.parametrize("family", FAMILIES)
def test_multi_turn_equals_one_shot_and_a_snapshot_rewinds_exactly(family):
    network, _ = load_network(DATA / family / "hf", WeightOptions())
    prompt = reference(family, "hf")["prompt_ids"]
    engine = Engine(network, LoadOptions(), prefill_chunk=16)
    whole = engine.forward(prompt, engine.make_layer_caches(), all_logits=True)
    caches = engine.make_layer_caches()
    first = engine.forward(prompt[:20], caches, all_logits=True)
    snapshots = [cache.snapshot() for cache in caches]
    second = engine.forward(prompt[20:], caches, all_logits=True)
    assert relative(mx.concatenate([first, second]), whole) <= TOLERANCE
    engine.forward(prompt[3:9], caches)
    for cache, snapshot in zip(caches, snapshots):
        cache.rewind(snapshot)
    assert mx.array_equal(engine.forward(prompt[20:], caches, all_logits=True), second)


@pytest.fixture
def family_model(tmp_path):
    """A family's ``hf`` model with a tokenizer beside it, as a user's model directory."""

    def make(family: str) -> Path:
        directory = tmp_path / family
        shutil.copytree(DATA / family / "hf", directory)
        write_tokenizer(directory)
        return directory

    return make


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
@pytest.mark.parametrize("family", FAMILIES)
def test_generates_through_model_load(family_model, family):
    model = Model.load(str(family_model(family)))
    tokens = list(model.generate(model.encode_prompt("The quick brown fox"), max_tokens=8, stop_ids=()))
    assert len(tokens) == 8
    state_bytes = {cache.nbytes_allocated for cache in model.engine.make_layer_caches() if cache.capacity is None}
    assert state_bytes and 0 not in state_bytes
