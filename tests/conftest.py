"""Shared fixtures: tiny model directories written as real files, and the raw scheme's presence."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from butter_core.plugins import get_plugin_host
from butter_core.testing.tiny_models import TinySpec, write_tiny_model, write_tokenizer

# MLX's CUDA backend multiplies float32 matrices in TF32 unless told not to (4e-4 relative
# error on an H100): a batched step's product of many rows and a single sequence's matrix-
# vector product then differ far beyond float32 rounding, and greedy tokens flip at near-ties.
# The suite holds float32 to float32 here as on a CPU or Metal (read at the first matmul).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

FAMILIES = ("llama", "qwen3")
HYBRID_DATA = Path(__file__).parent / "data" / "hybrid"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """``tiny_model(TinySpec(...))``: the directory of that tiny model, written once per session."""
    written = {}

    def make(spec: TinySpec = TinySpec()):
        if spec not in written:
            written[spec] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{spec.family}"), spec)
        return written[spec]

    return make


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="session")
def raw_scheme():
    """Skip where butter-raw is not installed (tox's ``core`` env): the model tests run their caches on it."""
    if "raw" not in get_plugin_host().schemes:
        pytest.skip("needs the raw KV cache scheme (pip install butter-raw)")



@pytest.fixture
def family_model(tmp_path):
    """``family_model(family)``: a hybrid family's ``hf`` model (``tests/data/hybrid``) with a tokenizer
    beside it, as a user's model directory."""

    def make(family: str) -> Path:
        directory = tmp_path / family
        shutil.copytree(HYBRID_DATA / family / "hf", directory)
        write_tokenizer(directory)
        return directory

    return make
