"""The files of a Hugging Face / MLX model directory: ``config.json`` and safetensors headers.

Nothing here reads tensor data. Headers are parsed by hand (8-byte length, JSON) so
that a truncated or inconsistent file is reported, naming it, before MLX touches it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import attrs

from butter_core.errors import ModelLoadError

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

ITEM_SIZES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1,
    "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
    "U32": 4, "I32": 4, "F32": 4,
    "U64": 8, "I64": 8, "F64": 8,
}  # fmt: skip
FLOAT_DTYPES = ("F16", "BF16", "F32")


@attrs.frozen
class TensorEntry:
    """Where one tensor lives and what its header says about it."""

    name: str
    file: Path
    dtype: str
    shape: tuple[int, ...]


def read_config(model_dir: Path) -> tuple[dict[str, Any], Path]:
    """The parsed ``config.json`` of ``model_dir`` and its path."""
    path = model_dir / CONFIG_FILE
    return _read_json(path, what="model config"), path


def read_tensor_index(model_dir: Path) -> dict[str, TensorEntry]:
    """Every tensor of the checkpoint by name: ``model.safetensors``, the sharded index, or all ``*.safetensors``."""
    index_path = model_dir / INDEX_FILE
    if index_path.exists():
        return _read_sharded(index_path)
    files = [model_dir / SINGLE_FILE] if (model_dir / SINGLE_FILE).exists() else sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir}: no weights found (expected {SINGLE_FILE} or {INDEX_FILE})")
    entries: dict[str, TensorEntry] = {}
    for file in files:
        for name, entry in read_header(file).items():
            if name in entries:
                raise ModelLoadError(f"{file}: tensor {name!r} is also in {entries[name].file.name}")
            entries[name] = entry
    return entries


def _read_sharded(index_path: Path) -> dict[str, TensorEntry]:
    weight_map = _read_json(index_path, what="safetensors index").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path}: 'weight_map' must map tensor names to shard files")
    headers: dict[str, dict[str, TensorEntry]] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        if not shard_path.exists():
            raise ModelLoadError(f"{index_path}: shard {shard} is listed but {shard_path} does not exist")
        headers[shard] = read_header(shard_path)
    entries = {}
    for name, shard in weight_map.items():
        if name not in headers[shard]:
            raise ModelLoadError(f"{index_path.parent / shard}: tensor {name!r} listed in {index_path.name} is missing")
        entries[name] = headers[shard][name]
    return entries


def read_header(path: Path) -> dict[str, TensorEntry]:
    """The tensors a safetensors file declares, after checking the file holds all their bytes."""
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ModelLoadError(f"{path}: {size} bytes is too short for a safetensors file (truncated?)")
        header_size = int.from_bytes(prefix, "little")
        if 8 + header_size > size:
            raise ModelLoadError(
                f"{path}: header claims {header_size} bytes but the file has {size}: truncated or not safetensors"
            )
        try:
            header = json.loads(f.read(header_size))
        except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
            raise ModelLoadError(f"{path}: safetensors header is not valid JSON ({exc}); is this a safetensors file?") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path}: safetensors header must be a JSON object")
    entries, data_end = {}, 0
    for name, info in header.items():
        if name == "__metadata__":
            continue
        entry, end = _parse_entry(path, name, info)
        entries[name] = entry
        data_end = max(data_end, end)
    if 8 + header_size + data_end > size:
        raise ModelLoadError(
            f"{path}: truncated: its tensors need {8 + header_size + data_end} bytes but the file has {size}"
        )
    return entries


def _parse_entry(path: Path, name: str, info: Any) -> tuple[TensorEntry, int]:
    try:
        dtype, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
    except (TypeError, KeyError, ValueError) as exc:
        raise ModelLoadError(f"{path}: malformed header entry for tensor {name!r}: {info!r}") from exc
    if not all(_natural(value) for value in (*shape, begin, end)) or begin > end:
        raise ModelLoadError(
            f"{path}: tensor {name!r}: shape {info['shape']!r} and data_offsets {info['data_offsets']!r} must be "
            "non-negative integers, the offsets in order"
        )
    if not isinstance(dtype, str) or dtype not in ITEM_SIZES:
        raise ModelLoadError(f"{path}: tensor {name!r} has unknown dtype {dtype!r}")
    if end - begin != math.prod(shape) * ITEM_SIZES[dtype]:
        raise ModelLoadError(
            f"{path}: tensor {name!r} of shape {list(shape)} {dtype} spans {end - begin} bytes, "
            f"expected {math.prod(shape) * ITEM_SIZES[dtype]}"
        )
    return TensorEntry(name, path, dtype, shape), end


def _natural(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_json(path: Path, *, what: str) -> dict[str, Any]:
    if not path.exists():
        raise ModelLoadError(f"{path}: {what} not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"{path}: {what} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path}: {what} must be a JSON object")
    return data
