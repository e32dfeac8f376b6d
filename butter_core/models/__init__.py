"""Model families, and choosing one from a ``config.json``.

Each family is a module with ``ARCHITECTURES`` (Hugging Face class names),
``MODEL_TYPES`` and ``build(config, source)``, which returns a model with the interface of
``LanguageModel`` (``hidden_states``, ``logits``, ``layer_specs``, ``layer_windows``, ``describe``...).
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType
from typing import Any

from butter_core.errors import ModelLoadError
from butter_core.models import granitemoehybrid, llama, mamba2, nemotron_h, qwen3, qwen3_next
from butter_core.models.base import DecoderModel, ModelArgs

FAMILIES: tuple[ModuleType, ...] = (
    llama,
    qwen3,
    mamba2,
    qwen3_next,
    granitemoehybrid,
    nemotron_h,
)


def supported_architectures() -> list[str]:
    """``Architecture (model_type)`` for every family, for error messages and docs."""
    return [f"{arch} ({family.MODEL_TYPES[0]})" for family in FAMILIES for arch in family.ARCHITECTURES]


def family_for(config: dict[str, Any], source: Path) -> ModuleType:
    """The family module for ``config``: by its ``architectures``, else its ``model_type``."""
    architectures = config.get("architectures") or []
    model_type = config.get("model_type")
    for family in FAMILIES:
        if any(arch in family.ARCHITECTURES for arch in architectures):
            return family
    for family in FAMILIES:
        if model_type in family.MODEL_TYPES:
            return family
    named = ", ".join(architectures) or f"model_type {model_type!r}"
    raise ModelLoadError(
        f"{source}: unsupported architecture {named}; supported: {', '.join(supported_architectures())}"
    )


def build_model(config: dict[str, Any], source: Path) -> DecoderModel:
    """The model ``config`` (read from ``source``) describes, with uninitialised weights."""
    return family_for(config, source).build(config, source)


__all__ = ["DecoderModel", "FAMILIES", "ModelArgs", "build_model", "family_for", "supported_architectures"]
