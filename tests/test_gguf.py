"""GGUF to MLX model directory: names, config, Q/K un-permutation, quantized triplets,
atomic writes and the conversion cache, on tiny GGUF files written here.

``write_gguf`` writes GGUF v3 itself because ``mx.save_gguf`` cannot write quantized
tensors; ``quantize`` produces ggml's Q4_0/Q4_1/Q8_0 blocks (as llama.cpp's reference
quantizers do) together with the values they dequantize to.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from tokenizers import pre_tokenizers

from butter_core.errors import ModelLoadError
from butter_core.loading.gguf import (
    CONVERTER_VERSION,
    LOCK_FILE,
    cached_conversion_dir,
    conversion_lock,
    convert_gguf,
    convert_gguf_cached,
    file_sha256,
    unpermute_rope_rows,
)
from butter_core.tokenizer import Tokenizer

F32, F16, Q4_0, Q4_1, Q8_0 = 0, 1, 2, 3, 8
_ALIGNMENT = 32

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TOKENS = SPECIAL_TOKENS + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
CHAT_TEMPLATE = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}{% endfor %}"
TOKENIZER_METADATA = {
    "tokenizer.ggml.model": "gpt2",
    "tokenizer.ggml.pre": "smollm",
    "tokenizer.ggml.tokens": TOKENS,
    "tokenizer.ggml.token_type": [3] * len(SPECIAL_TOKENS) + [1] * (len(TOKENS) - len(SPECIAL_TOKENS)),
    "tokenizer.ggml.merges": ["Ġ t", "h e", "Ġt he"],
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
    "tokenizer.ggml.add_bos_token": False,
    "tokenizer.chat_template": CHAT_TEMPLATE,
}


def llama_metadata(*, hidden=64, heads=4, kv_heads=2, ffn=96, layers=2, theta=10000.0, **extra) -> dict:
    """GGUF metadata of a tiny llama model with a tiny byte-level BPE tokenizer."""
    metadata = {
        "general.architecture": "llama",
        "general.name": "tiny",
        "llama.embedding_length": hidden,
        "llama.attention.head_count": heads,
        "llama.attention.head_count_kv": kv_heads,
        "llama.feed_forward_length": ffn,
        "llama.block_count": layers,
        "llama.context_length": 256,
        "llama.rope.freq_base": theta,
        "llama.rope.dimension_count": hidden // heads,
        "llama.attention.layer_norm_rms_epsilon": 1e-5,
        **TOKENIZER_METADATA,
    }
    metadata.update(extra)
    return metadata


def llama_permute(rows: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's Q/K row permutation (``LlamaModel.permute`` in convert_hf_to_gguf.py)."""
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def hf_llama_weights(rng: np.random.Generator, metadata: dict, *, tied: bool = True) -> dict[str, np.ndarray]:
    """Random float32 weights of the tiny model, under Hugging Face names and layout."""
    hidden, ffn = metadata["llama.embedding_length"], metadata["llama.feed_forward_length"]
    heads, kv_heads = metadata["llama.attention.head_count"], metadata["llama.attention.head_count_kv"]
    head_dim, vocab = hidden // heads, len(metadata["tokenizer.ggml.tokens"])
    shapes = {"model.embed_tokens.weight": (vocab, hidden), "model.norm.weight": (hidden,)}
    if not tied:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(metadata["llama.block_count"]):
        p = f"model.layers.{i}."
        shapes |= {
            p + "self_attn.q_proj.weight": (heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": (hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": (ffn, hidden),
            p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
            p + "input_layernorm.weight": (hidden,),
            p + "post_attention_layernorm.weight": (hidden,),
        }
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def to_gguf_layout(hf: dict[str, np.ndarray], metadata: dict, *, permute: bool = True) -> dict[str, np.ndarray]:
    """What llama.cpp's converter makes of ``hf``: GGUF names, Q and K rows permuted (llama)."""
    top = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
    out = {}
    for name, value in hf.items():
        module = name.removesuffix(".weight")
        if module in top:
            out[f"{top[module]}.weight"] = value
            continue
        _, _, layer, *rest = module.split(".")
        role = _GGUF_NAMES[".".join(rest)]
        if permute and role == "attn_q":
            value = llama_permute(value, metadata["llama.attention.head_count"])
        elif permute and role == "attn_k":
            value = llama_permute(value, metadata["llama.attention.head_count_kv"])
        out[f"blk.{layer}.{role}.weight"] = value
    return out


def save_gguf_mlx(path: Path, tensors: dict[str, np.ndarray], metadata: dict) -> Path:
    """Write a dense GGUF with ``mx.save_gguf``."""
    arrays = {name: mx.array(value) for name, value in tensors.items()}
    mx.save_gguf(str(path), arrays, {key: _mlx_value(value) for key, value in metadata.items()})
    return path


def _mlx_value(value):
    if isinstance(value, bool):
        return mx.array(value)
    if isinstance(value, int):
        return mx.array(value, dtype=mx.uint32)
    if isinstance(value, float):
        return mx.array(value, dtype=mx.float32)
    if isinstance(value, list) and value and not isinstance(value[0], str):
        return mx.array(value, dtype=mx.float32 if isinstance(value[0], float) else mx.int32)
    return value


def quantize(values: np.ndarray, ggml_type: int) -> tuple[bytes, np.ndarray]:
    """ggml blocks of ``values`` (rows of a multiple of 32) and the values they dequantize to."""
    blocks = values.astype(np.float32).reshape(-1, 32)
    if ggml_type == Q8_0:
        d = (np.abs(blocks).max(1) / 127).astype(np.float16)
        q = np.round(blocks / np.where(d == 0, 1, d.astype(np.float32))[:, None]).astype(np.int8)
        data = np.concatenate([d.view(np.uint8).reshape(-1, 2), q.view(np.uint8)], 1)
        return data.tobytes(), (q * d.astype(np.float32)[:, None]).reshape(values.shape)
    if ggml_type == Q4_0:
        extreme = blocks[np.arange(len(blocks)), np.abs(blocks).argmax(1)]
        d = (extreme / -8).astype(np.float16)
        inv = 1 / np.where(d == 0, 1, d.astype(np.float32))
        q = np.clip((blocks * inv[:, None] + 8.5).astype(np.int8), 0, 15).astype(np.uint8)
        head, dequant = d.view(np.uint8).reshape(-1, 2), (q.astype(np.float32) - 8) * d.astype(np.float32)[:, None]
    elif ggml_type == Q4_1:
        low, high = blocks.min(1), blocks.max(1)
        d, m = ((high - low) / 15).astype(np.float16), low.astype(np.float16)
        inv = 1 / np.where(d == 0, 1, d.astype(np.float32))
        q = ((blocks - m.astype(np.float32)[:, None]) * inv[:, None] + 0.5).astype(np.int32)
        q = np.clip(q, 0, 15).astype(np.uint8)
        head = np.concatenate([d.view(np.uint8).reshape(-1, 2), m.view(np.uint8).reshape(-1, 2)], 1)
        dequant = q * d.astype(np.float32)[:, None] + m.astype(np.float32)[:, None]
    else:
        raise ValueError(f"no quantizer for ggml type {ggml_type}")
    packed = q[:, :16] | (q[:, 16:] << 4)  # byte j holds values j (low nibble) and j + 16 (high)
    return np.concatenate([head, packed], 1).tobytes(), dequant.reshape(values.shape)


def write_gguf(path: Path, tensors: dict[str, tuple[int, np.ndarray]], metadata: dict) -> dict[str, np.ndarray]:
    """Write GGUF v3 with tensors ``name -> (ggml type, values)``; return the values as stored
    (dequantized for quantized types)."""
    stored, datas = {}, []
    for name, (ggml_type, values) in tensors.items():
        if ggml_type == F32:
            data, stored[name] = values.astype(np.float32).tobytes(), values.astype(np.float32)
        elif ggml_type == F16:
            data, stored[name] = values.astype(np.float16).tobytes(), values.astype(np.float16).astype(np.float32)
        else:
            data, stored[name] = quantize(values, ggml_type)
        datas.append(data)
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(metadata)))
    for key, value in metadata.items():
        out += _string(key) + _kv_value(value)
    offset = 0
    for (name, (ggml_type, values)), data in zip(tensors.items(), datas):
        dims = values.shape[::-1]
        out += _string(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, ggml_type, offset)
        offset += -(-len(data) // _ALIGNMENT) * _ALIGNMENT
    for data in [b"", *datas]:
        out += b"\0" * (-len(out) % _ALIGNMENT) + data
    path.write_bytes(bytes(out))
    return stored


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack("<Q", len(raw)) + raw


def _kv_value(value) -> bytes:
    if isinstance(value, bool):
        return struct.pack("<I?", 7, value)
    if isinstance(value, int):
        return struct.pack("<II", 4, value)
    if isinstance(value, float):
        return struct.pack("<If", 6, value)
    if isinstance(value, str):
        return struct.pack("<I", 8) + _string(value)
    if isinstance(value[0], str):
        return struct.pack("<IIQ", 9, 8, len(value)) + b"".join(_string(v) for v in value)
    if isinstance(value[0], float):
        return struct.pack(f"<IIQ{len(value)}f", 9, 6, len(value), *value)
    return struct.pack(f"<IIQ{len(value)}i", 9, 5, len(value), *value)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTTER_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _dense_llama(tmp_path, *, tied=True, **metadata_overrides):
    metadata = llama_metadata(**metadata_overrides)
    hf = hf_llama_weights(np.random.default_rng(0), metadata, tied=tied)
    path = save_gguf_mlx(tmp_path / "tiny.gguf", to_gguf_layout(hf, metadata), metadata)
    return path, hf, metadata


def test_dense_llama_becomes_a_hugging_face_directory(tmp_path):
    path, hf, _ = _dense_llama(tmp_path)
    model_dir = convert_gguf(path, tmp_path / "model")

    assert sorted(os.listdir(model_dir)) == [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert set(weights) == set(hf)  # tied: no lm_head
    for name, value in hf.items():
        assert weights[name].shape == value.shape and weights[name].dtype == mx.float32, name
        np.testing.assert_array_equal(np.array(weights[name]), value, err_msg=name)

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    expected = {
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "num_hidden_layers": 2,
        "head_dim": 16,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["rms_norm_eps"] == 1e-5 and config["rope_theta"] == 10000.0
    assert config["max_position_embeddings"] == 256 and config["vocab_size"] == hf["model.embed_tokens.weight"].shape[0]
    assert config["tie_word_embeddings"] is True
    assert config["bos_token_id"] == 1 and config["eos_token_id"] == 2
    assert "quantization" not in config

    tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["bos_token"] == "<|im_start|>" and tokenizer_config["eos_token"] == "<|im_end|>"
    assert tokenizer_config["chat_template"] == CHAT_TEMPLATE
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.encode("the the") == [TOKENS.index("t"), TOKENS.index("he"), TOKENS.index("Ġthe")]
    assert tokenizer.decode(tokenizer.encode("the band, 42")) == "the band, 42"


def test_untied_model_keeps_lm_head(tmp_path):
    path, hf, _ = _dense_llama(tmp_path, tied=False)
    model_dir = convert_gguf(path, tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["tie_word_embeddings"] is False
    lm_head = mx.load(str(model_dir / "model.safetensors"))["lm_head.weight"]
    np.testing.assert_array_equal(np.array(lm_head), hf["lm_head.weight"])


def test_end_of_turn_token_also_ends_generation(tmp_path):
    path, _, _ = _dense_llama(tmp_path, **{"tokenizer.ggml.eot_token_id": 0})
    model_dir = convert_gguf(path, tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["eos_token_id"] == [2, 0]
    assert Tokenizer.from_dir(model_dir).eos_token_ids == {0, 2}


def test_qwen3_keeps_qk_rows_and_gets_its_qk_norms(tmp_path):
    llama = llama_metadata(layers=1, **{"llama.attention.key_length": 16})
    hf = hf_llama_weights(np.random.default_rng(3), llama)
    tensors = to_gguf_layout(hf, llama, permute=False)
    tensors |= {f"blk.0.attn_{name}_norm.weight": np.ones(16, np.float32) for name in "qk"}
    metadata = {key.replace("llama.", "qwen3.", 1): value for key, value in llama.items()}
    metadata["general.architecture"] = "qwen3"
    model_dir = convert_gguf(save_gguf_mlx(tmp_path / "qwen3.gguf", tensors, metadata), tmp_path / "model")

    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"] and config["model_type"] == "qwen3"
    assert config["head_dim"] == 16
    weights = mx.load(str(model_dir / "model.safetensors"))
    assert weights["model.layers.0.self_attn.q_norm.weight"].shape == (16,)
    assert weights["model.layers.0.self_attn.k_norm.weight"].shape == (16,)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        np.testing.assert_array_equal(np.array(weights[name]), hf[name])


def test_unpermute_inverts_llama_cpp_permutation():
    rows = np.arange(8 * 16 * 3, dtype=np.float32).reshape(8 * 16, 3)
    for heads in (1, 2, 8):
        restored = unpermute_rope_rows(mx.array(llama_permute(rows, heads)), heads)
        np.testing.assert_array_equal(np.array(restored), rows)


def _roped_scores(x, q_weight, k_weight, *, traditional, theta=500.0):
    """Per-head attention logits of ``x`` (tokens, 64) after RoPE, for 4 query and 2 KV heads."""

    def heads(weight, n):
        projected = (x @ weight.T).reshape(x.shape[0], n, -1).swapaxes(0, 1)[None]
        return mx.fast.rope(projected, projected.shape[-1], traditional=traditional, base=theta, scale=1.0, offset=0)

    q, k = heads(q_weight, 4), heads(k_weight, 2)
    return q @ mx.repeat(k, 2, axis=1).swapaxes(-1, -2)


def test_converted_qk_with_rotate_half_rope_matches_gguf_with_interleaved_rope(tmp_path):
    """llama.cpp runs GGUF Q/K with interleaved RoPE; the converted Q/K must give the same
    attention logits with Hugging Face's rotate-half RoPE (MLX ``traditional=False``)."""
    path, _, _ = _dense_llama(tmp_path, theta=500.0)
    model_dir = convert_gguf(path, tmp_path / "model")
    gguf = mx.load(str(path))
    hf = mx.load(str(model_dir / "model.safetensors"))
    x = mx.random.normal((7, 64), key=mx.random.key(1))
    for layer in range(2):
        gguf_qk = gguf[f"blk.{layer}.attn_q.weight"], gguf[f"blk.{layer}.attn_k.weight"]
        hf_qk = (hf[f"model.layers.{layer}.self_attn.{name}_proj.weight"] for name in "qk")
        reference = np.array(_roped_scores(x, *gguf_qk, traditional=True))
        converted = np.array(_roped_scores(x, *hf_qk, traditional=False))
        np.testing.assert_allclose(converted, reference, rtol=1e-4, atol=1e-3)
        unconverted = np.array(_roped_scores(x, *gguf_qk, traditional=False))
        assert not np.allclose(unconverted, reference, atol=1e-2)  # the check can fail


@pytest.mark.parametrize("ggml_type, bits, error", [(Q4_0, 4, 0.15), (Q4_1, 4, 0.15), (Q8_0, 8, 0.01)])
def test_quantized_tensors_stay_quantized_with_rows_unpermuted(tmp_path, ggml_type, bits, error):
    metadata = llama_metadata()
    hf = hf_llama_weights(np.random.default_rng(1), metadata)
    gguf_layout = to_gguf_layout(hf, metadata)
    types = {name: (ggml_type if value.ndim == 2 else F32) for name, value in gguf_layout.items()}
    stored = write_gguf(tmp_path / "q.gguf", {n: (types[n], v) for n, v in gguf_layout.items()}, metadata)

    loaded = mx.load(str(tmp_path / "q.gguf"))  # what MLX's reader makes of ggml blocks
    assert loaded["blk.0.attn_q.weight"].dtype == mx.uint32
    assert loaded["blk.0.attn_q.weight"].shape == (64, 64 * bits // 32)
    assert loaded["blk.0.attn_q.scales"].dtype == mx.float16 and loaded["blk.0.attn_q.scales"].shape == (64, 2)
    assert loaded["blk.0.attn_q.biases"].dtype == mx.float16 and loaded["blk.0.attn_q.biases"].shape == (64, 2)

    model_dir = convert_gguf(tmp_path / "q.gguf", tmp_path / "model")
    assert json.loads((model_dir / "config.json").read_text())["quantization"] == {"group_size": 32, "bits": bits}
    weights = mx.load(str(model_dir / "model.safetensors"))
    heads = {"q_proj": 4, "k_proj": 2}
    for (name, value), gguf_name in zip(hf.items(), gguf_layout):
        if value.ndim == 1:
            continue
        module = name.removesuffix(".weight")
        assert weights[name].dtype == mx.uint32 and weights[module + ".scales"].dtype == mx.float16, name
        scales, biases = weights[module + ".scales"], weights[module + ".biases"]
        converted = np.array(mx.dequantize(weights[name], scales, biases, group_size=32, bits=bits).astype(mx.float32))
        expected = stored[gguf_name]
        projection = module.rsplit(".", 1)[-1]
        if projection in heads:  # GGUF row i holds Hugging Face row order[i]
            order = llama_permute(np.arange(len(expected)), heads[projection])
            expected = np.empty_like(expected)
            expected[order] = stored[gguf_name]
        np.testing.assert_allclose(converted, expected, rtol=2e-3, atol=2e-3, err_msg=name)
        assert np.abs(converted - value).mean() < error, name  # rows in place: only quantization error left


def test_mixed_quantization_is_described_per_module(tmp_path):
    metadata = llama_metadata(layers=1)
    gguf_layout = to_gguf_layout(hf_llama_weights(np.random.default_rng(2), metadata), metadata)
    types = {name: (Q4_1 if value.ndim == 2 else F32) for name, value in gguf_layout.items()}
    types["token_embd.weight"] = Q8_0
    types["blk.0.attn_v.weight"] = F16
    write_gguf(tmp_path / "mixed.gguf", {n: (types[n], v) for n, v in gguf_layout.items()}, metadata)
    config = json.loads((convert_gguf(tmp_path / "mixed.gguf", tmp_path / "model") / "config.json").read_text())
    assert config["quantization"] == {
        "group_size": 32,
        "bits": 4,
        "model.embed_tokens": {"group_size": 32, "bits": 8},
        "model.layers.0.self_attn.v_proj": False,
    }


def test_truncated_gguf_is_a_model_load_error_naming_the_file(tmp_path):
    path, _, _ = _dense_llama(tmp_path)
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated.gguf.*past the end of the file"):
        convert_gguf(truncated, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def test_unsupported_architecture_is_named(tmp_path):
    path, _, _ = _dense_llama(tmp_path, **{"general.architecture": "mamba"})
    with pytest.raises(ModelLoadError, match=r"unsupported architecture 'mamba' in .*tiny.gguf"):
        convert_gguf(path, tmp_path / "model")


def test_unsupported_tokenizer_model_is_named(tmp_path):
    path, _, _ = _dense_llama(tmp_path, **{"tokenizer.ggml.model": "bert"})
    with pytest.raises(ModelLoadError, match=r"unsupported tokenizer model 'bert' in .*tiny.gguf"):
        convert_gguf(path, tmp_path / "model")


def test_failure_midway_leaves_no_destination(tmp_path):
    """Q and K rows do not match the heads the metadata promises: the tensors fail after the
    tokenizer files are already staged, and nothing is left behind."""
    path, _, _ = _dense_llama(tmp_path, **{"llama.attention.head_count": 5, "llama.attention.key_length": 16})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(ModelLoadError, match="has (60|24) rows, not (5|2) heads of 16"):
        convert_gguf(path, out / "model")
    assert os.listdir(out) == []


def test_existing_destination_is_refused(tmp_path):
    path, _, _ = _dense_llama(tmp_path)
    (tmp_path / "model").mkdir()
    with pytest.raises(ModelLoadError, match="already exists"):
        convert_gguf(path, tmp_path / "model")


def test_conversion_is_cached_by_content(tmp_path, cache_dir):
    path, _, _ = _dense_llama(tmp_path)
    first = convert_gguf_cached(path)
    assert first.is_relative_to(cache_dir / "gguf")
    written = (first / "model.safetensors").stat().st_mtime_ns
    renamed = tmp_path / "renamed.gguf"
    shutil.copy(path, renamed)
    assert convert_gguf_cached(renamed) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == written
    assert sorted(p.name for p in first.parent.iterdir()) == [LOCK_FILE, first.name]  # no staging leftovers


def test_missing_gguf_is_named(tmp_path, cache_dir):
    with pytest.raises(ModelLoadError, match="nope.gguf: GGUF file not found"):
        convert_gguf_cached(tmp_path / "nope.gguf")


def test_the_next_conversion_removes_what_a_killed_one_left(tmp_path, cache_dir):
    path, _, _ = _dense_llama(tmp_path)
    directory = cache_dir / "gguf" / f"v{CONVERTER_VERSION}"
    stale = directory / f".{'ab' * 32}.{'0' * 16}.partial"
    (stale / "sub").mkdir(parents=True)
    (stale / "model.safetensors").write_bytes(b"half")
    foreign = directory / ".not-ours.partial"
    foreign.mkdir()
    converted = convert_gguf_cached(path)
    assert not stale.exists() and foreign.is_dir()
    assert sorted(p.name for p in directory.iterdir()) == sorted([LOCK_FILE, foreign.name, converted.name])


def test_a_conversion_waits_for_the_process_converting_before_it(tmp_path, cache_dir):
    """The lock is real (``flock``): a second holder blocks until the first lets go, then finds
    the work done instead of doing it again."""
    path, _, _ = _dense_llama(tmp_path)
    directory = cache_dir / "gguf" / f"v{CONVERTER_VERSION}"
    said, result = io.StringIO(), []
    with conversion_lock(directory):
        waiter = threading.Thread(target=lambda: result.append(convert_gguf_cached(path, progress_stream=said)))
        waiter.start()
        waiter.join(timeout=1.0)
        assert waiter.is_alive() and said.getvalue() == f"waiting for another butter process converting into {directory}\n"
        converted = convert_gguf(path, cached_conversion_dir(file_sha256(path)))  # what the first process does
    waiter.join(timeout=30)
    assert result == [converted]
    assert len(said.getvalue().splitlines()) == 1  # it did not convert again


def test_a_conversion_shows_its_steps(tmp_path):
    said = io.StringIO()
    convert_gguf(_dense_llama(tmp_path)[0], tmp_path / "model", progress_stream=said)
    assert said.getvalue().splitlines() == [
        "converting tiny.gguf (once) [--------------------] 0/4 reading",
        "converting tiny.gguf (once) [#####---------------] 1/4 tokenizer",
        "converting tiny.gguf (once) [##########----------] 2/4 tensors",
        "converting tiny.gguf (once) [###############-----] 3/4 writing model.safetensors",
        "converting tiny.gguf (once) [####################] 4/4 done",
    ]
