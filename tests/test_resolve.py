"""Resolving what a user names as a model (directory, .gguf, Hugging Face repo id) into a
model directory; every failure a ModelLoadError naming the path or repo."""

from __future__ import annotations

import json

import pytest

from butter_core.errors import ModelLoadError
from butter_core.loading.resolve import resolve_model

REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_model_dir(path, *, tokenizer=True):
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (path / "model.safetensors").write_bytes(b"")
    if tokenizer:
        (path / "tokenizer.json").write_text("{}")
    return path


def make_hub_cache(cache, repo_id):
    """A Hugging Face hub cache holding one snapshot of ``repo_id``, as the hub lays it out."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(REVISION)
    return make_model_dir(repo / "snapshots" / REVISION)


def test_a_model_directory_is_itself(tmp_path):
    model = make_model_dir(tmp_path / "model")
    assert resolve_model(str(model)) == model


def test_a_directory_without_tokenizer_is_refused(tmp_path):
    model = make_model_dir(tmp_path / "model", tokenizer=False)
    with pytest.raises(ModelLoadError, match="model: missing tokenizer.json"):
        resolve_model(model)


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        resolve_model(tmp_path)


def test_a_missing_gguf_is_named(tmp_path):
    with pytest.raises(ModelLoadError, match="absent.gguf: GGUF file not found"):
        resolve_model(tmp_path / "absent.gguf")


def test_a_truncated_gguf_is_named(tmp_path, monkeypatch):
    monkeypatch.setenv("BUTTER_CACHE_DIR", str(tmp_path / "cache"))
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF\x03\x00\x00\x00")
    with pytest.raises(ModelLoadError, match=r"broken.gguf: not a GGUF file \(8 bytes; a GGUF header alone takes 24\)"):
        resolve_model(broken)


def test_another_file_is_refused(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="weights.bin: not a model directory or a .gguf file"):
        resolve_model(tmp_path / "weights.bin")


def test_a_name_that_is_neither_path_nor_repo_id(tmp_path):
    with pytest.raises(ModelLoadError, match="not a Hugging Face repo id"):
        resolve_model("no-such-model")


def test_offline_repo_id_comes_from_the_hub_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshot = make_hub_cache(tmp_path / "hub", "someone/tiny-model")
    assert resolve_model("someone/tiny-model", hf_cache_dir=tmp_path / "hub") == snapshot


def test_offline_repo_id_not_in_the_cache_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    message = "someone/absent: not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
    with pytest.raises(ModelLoadError, match=message):
        resolve_model("someone/absent", hf_cache_dir=tmp_path / "hub")
