"""Qwen3 (Hugging Face ``Qwen3ForCausalLM``).

Llama's decoder plus an RMSNorm over each head's queries and keys before RoPE; GQA,
an explicit ``head_dim``, tied embeddings in the small sizes, and optional
sliding-window layers (``layer_types`` or ``use_sliding_window``/``max_window_layers``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from butter_core.models.base import Attention, DecoderModel, ModelArgs, parse_args

ARCHITECTURES = ("Qwen3ForCausalLM",)
MODEL_TYPES = ("qwen3",)

# Hugging Face Qwen3Config's defaults for keys a config.json may leave out.
DEFAULTS = {
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "head_dim": 128,
}


class Qwen3Attention(Attention):
    """Attention with per-head RMSNorm on queries and keys."""

    def __init__(self, args: ModelArgs):
        super().__init__(args)
        self.q_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(args.head_dim, eps=args.rms_norm_eps)

    def project(self, x: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        queries, keys, values = super().project(x)
        return self.q_norm(queries), self.k_norm(keys), values


def build(config: dict[str, Any], source: Path) -> DecoderModel:
    """A Qwen3 model shaped by ``config`` (read from ``source``), with uninitialised weights."""
    return DecoderModel(parse_args(config, source, defaults=DEFAULTS), attention=Qwen3Attention)
