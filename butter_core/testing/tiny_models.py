"""Tiny random-weight model directories, written as real files for tests (ours and plugins').

``write_tiny_model(directory, TinySpec(...))`` writes what a Hugging Face / MLX model
directory holds — ``config.json``, safetensors weights (one file or sharded with an
index; float or MLX-quantized), ``tokenizer.json`` built with the ``tokenizers``
library, ``tokenizer_config.json`` with a ChatML template — so tests go through the
real loader. Weights are seeded and scaled so that logits are well spread: greedy
choices are not near-ties that rounding could flip.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Literal

import attrs
import mlx.core as mx
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "def add(a, b):\n    return a + b\n",
    "Butter melts on warm toast; the cache keeps every key and value.",
    "Once upon a time there was a tiny model that wrote short stories.",
    "What is the capital of France? Paris is the capital of France.",
]
TOKENIZER_VOCAB = 320
MODEL_VOCAB = 384
"""Larger than the tokenizer's vocabulary, as padded real checkpoints are."""

FAMILY_CONFIGS = {
    "llama": {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 128,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "rope_theta": 10000.0,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    },
    "qwen3": {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "rope_theta": 1000000.0,
    },
}  # fmt: skip


@attrs.frozen
class TinySpec:
    """Which tiny model to write.

    ``head_dim`` (qwen3 only) replaces the family's 32, for kernels that take wider heads;
    ``quantization``: ``(bits, group_size)`` to store every Linear and Embedding
    MLX-quantized; ``layer_types``/``sliding_window`` give layers a family sliding
    window; ``shards`` > 1 writes sharded safetensors with an index.
    """

    family: Literal["llama", "qwen3"] = "llama"
    dtype: Literal["float32", "float16", "bfloat16"] = "float32"
    quantization: tuple[int, int] | None = None
    tie_word_embeddings: bool = False
    layer_types: tuple[str, ...] | None = None
    sliding_window: int | None = None
    max_position_embeddings: int = 512
    head_dim: int | None = None
    shards: int = 1
    seed: int = 0


def write_tiny_model(directory: Path, spec: TinySpec = TinySpec()) -> Path:
    """Write the model ``spec`` describes into ``directory`` (created) and return it."""
    directory.mkdir(parents=True, exist_ok=True)
    config = tiny_config(spec)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    write_weights(directory, tiny_weights(config, spec), spec.shards)
    write_tokenizer(directory)
    return directory


def tiny_config(spec: TinySpec) -> dict:
    """The ``config.json`` contents for ``spec``."""
    config = {
        **FAMILY_CONFIGS[spec.family],
        "vocab_size": MODEL_VOCAB,
        "max_position_embeddings": spec.max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "hidden_act": "silu",
        "tie_word_embeddings": spec.tie_word_embeddings,
        "torch_dtype": spec.dtype,
        "eos_token_id": 0,
    }
    if spec.head_dim is not None:
        if "head_dim" not in config:
            raise ValueError(f"TinySpec.head_dim: the {spec.family} family's head_dim is hidden_size / heads")
        config["head_dim"] = spec.head_dim
    if spec.layer_types is not None:
        config |= {"layer_types": list(spec.layer_types), "sliding_window": spec.sliding_window}
    if spec.quantization is not None:
        bits, group_size = spec.quantization
        config["quantization"] = {"group_size": group_size, "bits": bits}
    return config


def tiny_weights(config: dict, spec: TinySpec) -> dict[str, mx.array]:
    """Seeded random tensors with Hugging Face names for ``config``, quantized if ``spec`` says so."""
    hidden, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim", hidden // heads)
    key = mx.random.key(spec.seed)
    dense: dict[str, tuple[int, int]] = {"model.embed_tokens": (vocab, hidden)}
    norms = {"model.norm.weight": hidden}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}"
        dense |= {
            f"{p}.self_attn.q_proj": (heads * head_dim, hidden),
            f"{p}.self_attn.k_proj": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.v_proj": (kv_heads * head_dim, hidden),
            f"{p}.self_attn.o_proj": (hidden, heads * head_dim),
            f"{p}.mlp.gate_proj": (inter, hidden),
            f"{p}.mlp.up_proj": (inter, hidden),
            f"{p}.mlp.down_proj": (hidden, inter),
        }
        norms |= {f"{p}.input_layernorm.weight": hidden, f"{p}.post_attention_layernorm.weight": hidden}
        if spec.family == "qwen3":
            norms |= {f"{p}.self_attn.q_norm.weight": head_dim, f"{p}.self_attn.k_norm.weight": head_dim}
    if not spec.tie_word_embeddings:
        dense["lm_head"] = (vocab, hidden)
    dtype = getattr(mx, spec.dtype)
    tensors = {}
    for name, shape in dense.items():
        key, sub = mx.random.split(key)
        std = 1.0 if name in ("model.embed_tokens", "lm_head") else 1 / math.sqrt(shape[1])
        weight = (std * mx.random.normal(shape, key=sub)).astype(dtype)
        if spec.quantization is None:
            tensors[f"{name}.weight"] = weight
        else:
            bits, group_size = spec.quantization
            packed, scales, biases = mx.quantize(weight, group_size=group_size, bits=bits)
            tensors |= {f"{name}.weight": packed, f"{name}.scales": scales.astype(dtype), f"{name}.biases": biases.astype(dtype)}
    for name, size in norms.items():
        key, sub = mx.random.split(key)
        tensors[name] = (1 + 0.1 * mx.random.normal((size,), key=sub)).astype(dtype)
    return tensors


def write_weights(directory: Path, tensors: dict[str, mx.array], shards: int = 1) -> None:
    """``model.safetensors``, or ``shards`` files plus ``model.safetensors.index.json``."""
    if shards == 1:
        mx.save_safetensors(str(directory / "model.safetensors"), tensors, metadata={"format": "mlx"})
        return
    names = sorted(tensors)
    weight_map = {}
    for shard in range(shards):
        file = f"model-{shard + 1:05d}-of-{shards:05d}.safetensors"
        part = {name: tensors[name] for name in names[shard::shards]}
        mx.save_safetensors(str(directory / file), part, metadata={"format": "mlx"})
        weight_map |= dict.fromkeys(part, file)
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def write_tokenizer(directory: Path) -> None:
    """A byte-level BPE ``tokenizer.json`` trained on ``CORPUS``, and its ``tokenizer_config.json``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer.save(str(directory / "tokenizer.json"))
    tokenizer_config = {"eos_token": EOS_TOKEN, "chat_template": CHAT_TEMPLATE}
    (directory / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
