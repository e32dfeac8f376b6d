"""Tiny GGUF files written as real files for tests: a llama model with a byte-level BPE
tokenizer, dense (through ``mx.save_gguf``) or with ggml's quantized blocks (``write_gguf``,
GGUF v3 written here, since ``mx.save_gguf`` cannot write quantized tensors).

``quantize`` produces ggml's Q4_0/Q4_1/Q8_0 blocks (as llama.cpp's reference quantizers
do) together with the values they dequantize to.
"""

from __future__ import annotations

import struct
from pathlib import Path

import mlx.core as mx
import numpy as np
from tokenizers import pre_tokenizers

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


def write_dense_llama(path: Path, *, tied: bool = True, seed: int = 0, **metadata_overrides) -> tuple[dict, dict]:
    """A dense tiny llama GGUF at ``path``; returns its Hugging Face weights and its metadata."""
    metadata = llama_metadata(**metadata_overrides)
    hf = hf_llama_weights(np.random.default_rng(seed), metadata, tied=tied)
    save_gguf_mlx(path, to_gguf_layout(hf, metadata), metadata)
    return hf, metadata
