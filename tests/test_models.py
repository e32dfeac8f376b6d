"""Model families through the real loader: cached decoding equals recomputation, chunking, weights."""

import json
import math
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from butter_core import LoadOptions, Window
from butter_core.loading.weights import WeightOptions
from butter_core.model import Model
from butter_core.models.base import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig, llama3_frequencies, parse_args
from butter_core.testing.recompute import greedy_recompute
from butter_core.testing.tiny_models import TinySpec, tiny_config, tiny_weights, write_tokenizer, write_weights
from butter_core.window import WindowCache

PROMPT = "The quick brown fox jumps over the lazy dog."
STEPS = 12


def assert_close(a, b, tol=1e-4):
    a, b = np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32))
    assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max())


@pytest.mark.usefixtures("raw_scheme")
@pytest.mark.parametrize(
    "variant",
    [{}, {"dtype": "bfloat16"}, {"tie_word_embeddings": True}, {"quantization": (4, 32)}],
    ids=["fp32", "bf16-stored", "tied", "q4"],
)
def test_raw_cache_greedy_equals_full_recompute(tiny_model, family, variant):
    """The cache's tokens are the recompute's. A bf16 model's (a GPU keeps a bf16 checkpoint in
    bf16; a CPU computes in float32) may part at a near-tie: its cached decode and its recompute
    are different kernels there, each rounding to bf16 (2**-8 relative) layer after layer, so
    the recompute's two candidates must lie within 2**-5 of its logits' largest magnitude."""
    model = Model.load(str(tiny_model(TinySpec(family=family, **variant))))
    prompt = model.encode_prompt(PROMPT)
    generation = model.generate(prompt, max_tokens=STEPS, stop_ids=())
    tokens = list(generation)
    expected, logits = greedy_recompute(model.network, prompt, STEPS)
    parted = next((step for step, (got, want) in enumerate(zip(tokens, expected)) if got != want), STEPS)
    if parted < STEPS:
        row = logits[parted].astype(mx.float32)
        margin = (row[expected[parted]] - row[tokens[parted]]).item()
        assert model.network.dtype == mx.bfloat16 and margin <= 2**-5 * mx.abs(row).max().item(), (parted, margin)
    assert tokens[:parted] == expected[:parted]
    assert generation.stats.finish_reason == "length"


@pytest.mark.usefixtures("raw_scheme")
def test_chunked_prefill_equals_token_by_token(tiny_model, family):
    model = Model.load(str(tiny_model(TinySpec(family=family))))
    prompt = model.encode_prompt(PROMPT * 2)
    engine = model.engine
    whole = engine.forward(prompt, engine.make_layer_caches(), all_logits=True)
    engine.prefill_chunk = 5
    chunked_caches = engine.make_layer_caches()
    chunked = engine.forward(prompt, chunked_caches, all_logits=True)
    one_by_one_caches = engine.make_layer_caches()
    one_by_one = mx.stack([engine.forward([t], one_by_one_caches) for t in prompt])
    assert whole.shape == (len(prompt), model.network.args.vocab_size)
    assert_close(chunked, whole)
    assert_close(one_by_one, whole)
    assert_close(engine.forward(prompt[:1], engine.make_layer_caches()), whole[0])
    assert chunked_caches[0].absolute_position == one_by_one_caches[0].absolute_position == len(prompt)


@pytest.mark.usefixtures("raw_scheme")
def test_family_sliding_layers_are_bounded_by_their_window(tiny_model):
    spec = TinySpec(family="qwen3", layer_types=("sliding_attention", "full_attention"), sliding_window=6)
    model = Model.load(str(tiny_model(spec)))
    caches = model.engine.make_layer_caches()
    assert isinstance(caches[0], WindowCache) and caches[0].window.max_size == 6 and caches[0].window.keep == 0
    assert not isinstance(caches[1], WindowCache)
    prompt = model.encode_prompt(PROMPT)
    tokens = list(model.generate(prompt, caches, max_tokens=STEPS, stop_ids=()))
    assert caches[0].length == 6 and caches[1].length == len(prompt) + STEPS
    assert tokens == greedy_recompute(model.network, prompt, STEPS)[0]
    # The family window is real: attending everything gives other logits.
    _, windowed = greedy_recompute(model.network, prompt, 1)
    _, unbounded = greedy_recompute(model.network, prompt, 1, windows=[None, None])
    assert not np.allclose(np.array(windowed), np.array(unbounded), atol=1e-3)


@pytest.mark.usefixtures("raw_scheme")
def test_max_context_length_sizes_full_attention_layers(tiny_model):
    path = str(tiny_model(TinySpec(family="qwen3", layer_types=("sliding_attention", "full_attention"), sliding_window=6)))
    advertised = Model.load(path).engine.layer_specs()
    assert {s.max_positions for s in advertised} == {512}
    capped = Model.load(path, LoadOptions(max_context_length=64))
    assert [s.max_positions for s in capped.engine.layer_specs()] == [64, 64]
    caches = capped.engine.make_layer_caches()
    assert caches[0].spec.max_positions == 6 and caches[1].spec.max_positions == 64


def test_quantized_weights_stay_quantized_or_dequantize_to_the_same_model(tiny_model, family):
    """A bf16 checkpoint's 4-bit weights, kept or dequantized, compared in float32: there the two
    products differ by their summation order alone (in bf16 on a GPU, MLX's quantized matmul and a
    dense one round 1e-2 apart)."""
    path = str(tiny_model(TinySpec(family=family, quantization=(4, 32), dtype="bfloat16")))
    kept = Model.load(path, weights=WeightOptions(dequantize=False, dtype="float32"))
    dense = Model.load(path, weights=WeightOptions(dequantize=True, dtype="float32"))
    attention = kept.network.layers[0].self_attn
    assert isinstance(attention.q_proj, nn.QuantizedLinear) and attention.q_proj.bits == 4
    assert isinstance(kept.network.model.embed_tokens, nn.QuantizedEmbedding)
    assert type(dense.network.layers[0].self_attn.q_proj) is nn.Linear
    assert dense.weights.dequantized and not kept.weights.dequantized
    assert kept.weights.nbytes < dense.weights.nbytes
    ids = mx.array(kept.encode_prompt(PROMPT))[None]
    assert_close(kept.network(ids), dense.network(ids), tol=1e-3)


def test_per_module_quantization_overrides_are_honoured(tmp_path):
    spec = TinySpec(quantization=(4, 32))
    config = tiny_config(spec)
    config["quantization"]["model.embed_tokens"] = {"group_size": 64, "bits": 8}
    weights = tiny_weights(tiny_config(spec), spec)
    names = [f"model.embed_tokens.{part}" for part in ("weight", "scales", "biases")]
    dense = mx.dequantize(*(weights[n] for n in names), group_size=32, bits=4)
    weights |= dict(zip(names, mx.quantize(dense, group_size=64, bits=8)))
    write_weights(tmp_path, weights)
    write_tokenizer(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    embed = Model.load(str(tmp_path), weights=WeightOptions(dequantize=False)).network.model.embed_tokens
    assert (embed.bits, embed.group_size) == (8, 64)


def test_sharded_checkpoint_loads_like_a_single_file(tiny_model, family):
    single = Model.load(str(tiny_model(TinySpec(family=family))))
    sharded = Model.load(str(tiny_model(TinySpec(family=family, shards=3))))
    ids = mx.array(single.encode_prompt(PROMPT))[None]
    assert mx.array_equal(single.network(ids), sharded.network(ids))


def test_weights_dtype_option(tiny_model):
    path = str(tiny_model(TinySpec(dtype="bfloat16")))
    assert Model.load(path, weights=WeightOptions(dtype="bfloat16")).network.dtype == mx.bfloat16
    assert Model.load(path, weights=WeightOptions(dtype="float32")).network.dtype == mx.float32


def test_llama3_rope_frequencies_match_the_hugging_face_formula():
    config = RopeConfig(theta=500000.0, type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                        original_max_position_embeddings=8192)  # fmt: skip
    dims = 128
    inv_freq = 1.0 / (config.theta ** (np.arange(0, dims, 2) / dims))
    wavelen = 2 * math.pi / inv_freq
    low_wavelen, high_wavelen = 8192 / 1.0, 8192 / 4.0
    scaled = np.where(wavelen > low_wavelen, inv_freq / 8.0, inv_freq)
    smooth = (8192 / wavelen - 1.0) / (4.0 - 1.0)
    smoothed = (1 - smooth) * scaled / 8.0 + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    expected = np.where(medium, smoothed, scaled)
    ours = 1.0 / np.array(llama3_frequencies(dims, config))
    np.testing.assert_allclose(ours, expected, rtol=1e-5)


@pytest.mark.parametrize(
    "keys, expected",
    [
        ({}, (FULL_ATTENTION, FULL_ATTENTION, FULL_ATTENTION)),
        ({"use_sliding_window": False, "max_window_layers": 1}, (FULL_ATTENTION,) * 3),
        ({"use_sliding_window": True, "max_window_layers": 1}, (FULL_ATTENTION, SLIDING_ATTENTION, SLIDING_ATTENTION)),
        ({"layer_types": [SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION]},
         (SLIDING_ATTENTION, FULL_ATTENTION, SLIDING_ATTENTION)),
    ],
)  # fmt: skip
def test_sliding_layers_from_config_keys(keys, expected):
    config = tiny_config(TinySpec(family="qwen3")) | {"num_hidden_layers": 3, "sliding_window": 6} | keys
    args = parse_args(config, Path("config.json"))
    assert args.layer_types == expected
    assert args.layer_windows() == [Window(6, keep=0) if t == SLIDING_ATTENTION else None for t in expected]
