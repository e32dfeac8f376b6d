"""Turn what a user names as a model into a local MLX model directory.

``resolve_model`` accepts nothing (the built-in default model), a model directory, a
``.gguf`` file (converted once, see ``butter_core.loading.gguf``) or a Hugging Face repo
id such as ``mlx-community/SmolLM2-135M-Instruct-8bit`` (fetched into the Hugging Face
cache, or found there when ``HF_HUB_OFFLINE`` is set or the Hub is out of reach). Every
failure is a ``ModelLoadError`` that names the path or repo and the problem.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TextIO

from huggingface_hub import snapshot_download
from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

from butter_core.default_model import default_model_dir
from butter_core.errors import ModelLoadError
from butter_core.loading.gguf import convert_gguf_cached

HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja"]
_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def resolve_model(
    path_or_id: str | os.PathLike | None,
    *,
    hf_cache_dir: str | os.PathLike | None = None,
    progress_stream: TextIO | None = None,
) -> Path:
    """The model directory for ``path_or_id`` (see the module docstring).

    ``hf_cache_dir`` overrides the Hugging Face cache location (default: the hub's own,
    ``HF_HUB_CACHE`` or ``HF_HOME/hub``); a GGUF conversion shows its progress on
    ``progress_stream`` (None: silent).
    """
    if path_or_id is None:
        return default_model_dir(progress_stream)
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return check_model_dir(path)
    is_gguf = path.suffix.lower() == ".gguf"
    if path.is_file():
        if not is_gguf:
            raise ModelLoadError(f"{path}: not a model directory or a .gguf file")
        return convert_gguf_cached(path, progress_stream=progress_stream)
    if is_gguf:
        raise ModelLoadError(f"{path}: GGUF file not found")
    if _REPO_ID.fullmatch(str(path_or_id)):
        return check_model_dir(_hub_snapshot(str(path_or_id), hf_cache_dir))
    raise ModelLoadError(
        f"{path_or_id}: no such model directory or .gguf file, and not a Hugging Face repo id (owner/name)"
    )


def check_model_dir(path: Path) -> Path:
    """``path`` if it holds a config, safetensors weights and a tokenizer; else ModelLoadError."""
    if not (path / "config.json").is_file():
        raise ModelLoadError(f"{path}: not a model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path}: no *.safetensors weights (butter reads safetensors only)")
    if not (path / "tokenizer.json").is_file():
        raise ModelLoadError(f"{path}: missing tokenizer.json; butter needs a Hugging Face fast tokenizer")
    return path


def _hub_snapshot(repo_id: str, cache_dir: str | os.PathLike | None) -> Path:
    offline = os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        return Path(
            snapshot_download(
                repo_id, allow_patterns=HUB_FILE_PATTERNS, cache_dir=cache_dir, local_files_only=offline
            )
        )
    except LocalEntryNotFoundError as error:
        why = "HF_HUB_OFFLINE is set" if offline else "the Hugging Face Hub could not be reached"
        raise ModelLoadError(f"{repo_id}: not in the local Hugging Face cache and {why} ({error})") from error
    except (HfHubHTTPError, OSError, ValueError) as error:
        raise ModelLoadError(f"{repo_id}: could not fetch from the Hugging Face Hub ({error})") from error
