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

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from butter_core import ConfigError, LayerSpec, LoadOptions, Window
from butter_core.cache import ATTENTION
from butter_core.cli import main
from butter_core.engine import Engine, cache_windows
from butter_core.errors import ModelLoadError
from butter_core.loading.weights import WeightOptions, load_network
from butter_core.model import Model
from butter_core.plugins import get_plugin_host
from butter_core.recurrent import StateCache, StateSpec
from butter_core.testing.fixtures import example_kind
from butter_core.window import WindowCache

DATA = Path(__file__).parent / "data" / "hybrid"
FAMILIES = [
    "mamba2",
    "qwen3_next",
    "granitemoehybrid",
    "nemotron_h",
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


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
@pytest.mark.parametrize("family", FAMILIES)
def test_generates_through_model_load(family_model, family):
    model = Model.load(str(family_model(family)))
    tokens = list(model.generate(model.encode_prompt("The quick brown fox"), max_tokens=8, stop_ids=()))
    assert len(tokens) == 8
    state_bytes = {cache.nbytes_allocated for cache in model.engine.make_layer_caches() if cache.capacity is None}
    assert state_bytes and 0 not in state_bytes


HYBRIDS = [family for family in FAMILIES if family != "mamba2"]
ATTENTION_SCHEMES = sorted(name for name, r in get_plugin_host().schemes.items() if ATTENTION in r.scheme.layer_types)


@pytest.mark.usefixtures("state_scheme")
@pytest.mark.parametrize("window", [None, Window(16, keep=4)], ids=["unbounded", "window16keep4"])
@pytest.mark.parametrize("scheme", ATTENTION_SCHEMES)
@pytest.mark.parametrize("family", HYBRIDS)
def test_attention_layers_take_every_attention_scheme_and_the_window(family, scheme, window):
    """A hybrid's attention layers run under any attention scheme and the window decorator; its
    recurrent layers keep their state caches, which no window wraps. Against a full recompute
    masked to the same windows: raw within float32 rounding, other schemes within the relative
    logit error they declare (``CacheScheme.model_tolerance``)."""
    network, _ = load_network(DATA / family / "hf", WeightOptions())
    # 32 tokens: the 16-position window wraps; within the sequence length schemes declare their
    # model_tolerance for (AURA keeps its newest 32-36 rows in full precision)
    prompt = reference(family, "hf")["prompt_ids"][:32]
    head_dim = next(s.head_dim for s in network.layer_specs(64) if isinstance(s, LayerSpec))
    kind, tolerance = example_kind(scheme, head_dim)
    engine = Engine(network, LoadOptions(kv_cache=kind, kv_eviction=window), prefill_chunk=8)
    caches = engine.make_layer_caches()
    recurrent = [cache for cache in caches if isinstance(cache, StateCache)]
    attention = [cache for cache in caches if not isinstance(cache, StateCache)]
    assert recurrent and attention
    assert all(isinstance(cache, WindowCache) == (window is not None) for cache in attention)
    cached = engine.forward(prompt, caches, all_logits=True)
    recomputed = network(prompt[None], None, cache_windows(caches))[0]
    bound = TOLERANCE if scheme == "raw" else tolerance
    if bound is None:
        pytest.skip(f"{scheme} declares no model_tolerance")
    assert relative(cached, recomputed) <= bound
    if window is not None:
        assert all(cache.length <= window.max_size for cache in attention)


def _cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
def test_the_commands_run_a_hybrid_model(capsys, family_model, tmp_path):
    """generate, inspect --layer-trace (each layer's type and cache bytes), bench and quality."""
    path = str(family_model("qwen3_next" if "qwen3_next" in HYBRIDS else FAMILIES[0]))
    code, out, _ = _cli(capsys, "generate", "-m", path, "-p", "The quick brown fox", "--max-tokens", "6",
                        "--kv-window-size", "8", "--state-cache", "ssm-bfloat16")  # fmt: skip
    assert code == 0 and out.strip()
    code, out, _ = _cli(capsys, "inspect", "-m", path, "--layer-trace")
    assert code == 0
    traced = [line for line in out.splitlines() if line.strip().startswith("layer ") and " ms " in line]
    assert traced and all(("gated_delta" in line or "attention" in line or "mamba2" in line) and "cache" in line
                          for line in traced)  # fmt: skip
    assert "state [1, " in out and " ssm " in out
    report = tmp_path / "bench.json"
    code, _, err = _cli(capsys, "bench", "-m", path, "--kv-cache", "raw", "--context", "24", "--decode-tokens", "2",
                        "--json", str(report))  # fmt: skip
    assert code == 0, err
    rows = json.loads(report.read_text())["results"]
    assert all(row["state_bytes"] > 0 and row["kv_bytes_live"] > 0 for row in rows)
    code, _, err = _cli(capsys, "bench", "-m", path, "--kv-cache", "raw", "--context", "24", "--decode-tokens", "2",
                        "--batch", "1,2", "--json", str(report))  # fmt: skip
    assert code == 0, err
    rows = json.loads(report.read_text())["results"]
    one, two = (row for row in rows if row["scheme"] == "raw")
    assert (one["batch"], two["batch"]) == (1, 2) and two["state_bytes"] == 2 * one["state_bytes"] > 0
    text = tmp_path / "text.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 8)
    code, _, err = _cli(capsys, "quality", "-m", path, "--kv-cache", "raw", "--text", str(text), "--context", "120",
                        "--prefill", "64", "--chunk", "16")  # fmt: skip
    assert code == 0, err


@pytest.mark.usefixtures("raw_scheme")
def test_a_recurrent_layer_given_an_attention_scheme_names_the_flag(capsys, family_model):
    code, _, err = _cli(capsys, "generate", "-m", str(family_model(FAMILIES[0])), "-p", "hi", "--state-cache", "raw")
    assert code == 2 and "--state-cache" in err and "stores attention layers only" in err


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
def test_nemotron_h_keeps_caches_for_its_mixer_layers_only(capsys, family_model):
    """Nemotron-H's MLP and MoE layers keep no state: one cache per Mamba2 or attention layer, laid
    along the layers; the layer trace shows every layer; a wrong count of caches is named."""
    path = family_model("nemotron_h")
    model = Model.load(str(path))
    caches = model.engine.make_layer_caches()
    assert [cache.spec.layer_index for cache in caches] == [0, 1, 4]
    assert [type(cache).__name__ for cache in model.network.along_layers(caches)][2:4] == ["NoneType"] * 2
    with pytest.raises(ConfigError, match=r"got 2 caches for a model of 5 layers \(3 of them keep state\)"):
        model.engine.forward([1, 2, 3], caches[:2])
    code, out, _ = _cli(capsys, "inspect", "-m", str(path), "--layer-trace")
    assert code == 0
    traced = [line.split() for line in out.splitlines() if line.strip().startswith("layer ") and " ms " in line]
    assert [(words[1], words[2]) for words in traced] == [
        ("0", "mamba2"), ("1", "attention"), ("2", "none"), ("3", "none"), ("4", "mamba2")]  # fmt: skip


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        ({"hybrid_override_pattern": "M*X"}, r"hybrid_override_pattern must be a string of M \(Mamba2\), \*"),
        ({"hybrid_override_pattern": "M*-E"}, "num_hidden_layers is 5 but the layer pattern lists 4 layers"),
        ({"mlp_hidden_act": "gelu"}, "mlp_hidden_act 'gelu' is not supported; supported: relu2"),
        ({"n_group": 3}, r"n_group \(3\) must divide n_routed_experts \(8\)"),
        ({"hybrid_override_pattern": None, "layers_block_type": ["mamba", "conv"]}, "layers_block_type must list"),
    ],
)
def test_nemotron_h_config_errors_name_the_key(family_model, edit, message):
    path = family_model("nemotron_h")
    config = json.loads((path / "config.json").read_text())
    config.update(edit)
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=message) as info:
        Model.load(str(path))
    assert str(path / "config.json") in str(info.value)


@pytest.mark.usefixtures("state_scheme", "raw_scheme")
@pytest.mark.parametrize("window", [None, Window(16, keep=4)], ids=["unbounded", "window16keep4"])
@pytest.mark.parametrize("family", FAMILIES)
def test_families_generate_batched_as_alone(family_model, family, window):
    """Continuous batching over pages and state pools: each sequence's greedy tokens are those it
    generates alone (under the same window, which bounds the attention layers only); with two
    sequence slots the third sequence reuses a slot, whose recurrent state starts from zero again."""
    model = Model.load(str(family_model(family)), LoadOptions(kv_eviction=window))
    prompts = [model.encode_prompt(text) for text in ("The quick brown fox", "def add(a, b):", "Once upon a time")]
    alone = [list(model.generate(p, max_tokens=n, stop_ids=())) for p, n in zip(prompts, (8, 4, 6))]
    caches = model.engine.make_batched_caches(capacity_tokens=512, page_size=8, max_sequences=2)
    batch = model.generate_batch(caches, prefill_chunk=5)
    ids = [batch.add(p, max_tokens=n, stop_ids=()) for p, n in zip(prompts, (8, 4, 6))]
    got: dict[int, list[int]] = {}
    most = 0
    while batch.active:
        for sequence_id, token in batch.step():
            got.setdefault(sequence_id, []).append(token)
        most = max(most, batch.running)
    assert most == 2 and [got[i] for i in ids] == alone
    recurrent = sum(isinstance(s, StateSpec) for s in model.engine.layer_specs())
    assert (caches.state_bytes > 0) == (recurrent > 0)
