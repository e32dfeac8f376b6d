"""Llama 3.x and SmolLM2 (Hugging Face ``LlamaForCausalLM``).

The plain pre-norm decoder of ``base``: GQA attention with RoPE (optionally Llama 3.1's
``rope_scaling``), SwiGLU MLP, RMSNorm, an LM head or tied embeddings.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from butter_core.models.base import DecoderModel, parse_args

ARCHITECTURES = ("LlamaForCausalLM",)
MODEL_TYPES = ("llama",)

# Hugging Face LlamaConfig's defaults for keys a config.json may leave out.
DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048, "tie_word_embeddings": False}


def build(config: dict[str, Any], source: Path) -> DecoderModel:
    """A Llama model shaped by ``config`` (read from ``source``), with uninitialised weights."""
    return DecoderModel(parse_args(config, source, defaults=DEFAULTS))
