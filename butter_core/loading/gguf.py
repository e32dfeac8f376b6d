"""Convert a GGUF file, once, into an MLX model directory.

The directory is what butter loads from Hugging Face or mlx-community: ``model.safetensors``
with Hugging Face tensor names, ``config.json`` in Hugging Face form, ``tokenizer.json``
and ``tokenizer_config.json`` (rebuilt from the GGUF metadata by ``gguf_tokenizer``).

What MLX's GGUF reader (``mx.load(path, return_metadata=True)``) gives, from
``mlx/io/gguf.cpp`` and ``gguf_quants.cpp`` and checked by the tests:

- ``Q4_0``, ``Q4_1`` and ``Q8_0`` tensors come back as MLX's affine quantization triplet:
  ``NAME.weight`` (uint32, 4- or 8-bit values packed along the input dim, lowest bits
  first), ``NAME.scales`` and ``NAME.biases`` (float16, one per group of 32 inputs), so
  ``w = scales * q + biases`` with group size 32 (Q4_0's bias is ``-8 * scale``, Q8_0's
  ``-128 * scale``). Those tensors stay quantized; ``config.json`` then carries
  ``quantization: {group_size: 32, bits}`` plus, mlx-lm style, an entry per module whose
  bits differ (``{group_size, bits}``) or that is dense (``false``).
- F32 and F16 tensors come back as they are; every other type (k-quants...) is
  dequantized to float16 by MLX and written dense.

llama.cpp's converter permutes the rows of Q and K of ``llama`` models so that its
interleaved RoPE computes what Hugging Face's rotate-half RoPE computes;
``unpermute_rope_rows`` undoes that, on every row-aligned tensor (weight, scales, biases).

``convert_gguf_cached`` converts into the butter cache (``BUTTER_CACHE_DIR``, default
``$XDG_CACHE_HOME/butter`` or ``~/.cache/butter``) keyed by the file's sha256; every
conversion is written into a temporary directory beside the destination and renamed into
place, so a failure never leaves a half-written model. In the cache, conversions hold a
lock on their directory (``LOCK_FILE``), so two processes never convert at once, and the
one holding it removes what a killed conversion left (``.SHA256.RANDOM.partial``).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
from collections import Counter
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import mlx.core as mx
import numpy as np

from butter_core.errors import ModelLoadError
from butter_core.loading.gguf_header import check_gguf
from butter_core.loading.gguf_tokenizer import build_tokenizer_files, eos_token_ids
from butter_core.progress import Progress

GGUF_GROUP_SIZE = 32
CONVERTER_VERSION = 1  # bump when the converted directory changes, to leave stale conversions behind


@dataclass(frozen=True)
class _Architecture:
    """A GGUF ``general.architecture`` butter converts, and what it becomes."""

    hf_architecture: str
    model_type: str
    permuted_qk: bool  # llama.cpp permuted Q/K rows for its interleaved RoPE


_ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen3": _Architecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)")
_SUFFIXES = ("weight", "scales", "biases", "bias")


def butter_cache_dir() -> Path:
    """Where butter keeps what it derives once: ``BUTTER_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/butter``, else ``~/.cache/butter``."""
    if os.environ.get("BUTTER_CACHE_DIR"):
        return Path(os.environ["BUTTER_CACHE_DIR"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "butter"


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def cached_conversion_dir(sha256: str) -> Path:
    """Where the conversion of the GGUF with this sha256 lives in the butter cache."""
    return butter_cache_dir() / "gguf" / f"v{CONVERTER_VERSION}" / sha256


def convert_gguf_cached(
    gguf_path: str | Path, *, sha256: str | None = None, progress_stream: TextIO | None = None
) -> Path:
    """The model directory converted from ``gguf_path``, converting only on first use.

    ``sha256`` is the file's digest when the caller already knows it (it is computed
    otherwise); the cache is keyed by it, so a renamed or moved file is not converted again.
    A conversion shows its progress on ``progress_stream`` (None: silent).
    """
    gguf_path = _existing(Path(gguf_path))
    destination = cached_conversion_dir(sha256 or file_sha256(gguf_path))
    if destination.is_dir():
        return destination
    with conversion_lock(destination.parent, progress_stream):
        if destination.is_dir():  # another process converted it while this one waited
            return destination
        remove_stale_partials(destination.parent)
        return convert_gguf(gguf_path, destination, progress_stream=progress_stream)


def convert_gguf(gguf_path: str | Path, destination: str | Path, *, progress_stream: TextIO | None = None) -> Path:
    """Convert ``gguf_path`` into a new model directory ``destination`` (which must not exist),
    showing its progress on ``progress_stream`` (None: silent)."""
    gguf_path, destination = Path(gguf_path), Path(destination)
    if destination.exists():
        raise ModelLoadError(f"{destination}: already exists; refusing to convert {gguf_path} over it")
    check_gguf(_existing(gguf_path))  # MLX's reader trusts every length in the file
    progress = Progress(4, f"converting {gguf_path.name} (once)", progress_stream)
    progress.step("reading")
    tensors, metadata = _read_gguf(gguf_path)
    architecture = _architecture(metadata, gguf_path)
    config = _hf_config(metadata, tensors, architecture, gguf_path)
    progress.step("tokenizer")
    tokenizer_files = build_tokenizer_files(metadata, gguf_path)
    with _atomic_directory(destination) as staging:
        tokenizer_files.write(staging)
        progress.step("tensors")
        weights = _hf_tensors(tensors, config, architecture, gguf_path)
        quantization = _quantization_config(weights)
        if quantization:
            config["quantization"] = quantization
        (staging / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
        progress.step("writing model.safetensors")
        mx.save_safetensors(str(staging / "model.safetensors"), weights, metadata={"format": "mlx"})
    progress.finish()
    return destination


LOCK_FILE = ".lock"
"""The file in a cache directory that conversions into it hold a lock on."""

_STALE_PARTIAL = re.compile(r"\.[0-9a-f]{64}\.[0-9a-f]{16}\.partial")
"""The staging directories of cached conversions (``_atomic_directory`` of a sha256 name)."""


@contextmanager
def conversion_lock(directory: Path, progress_stream: TextIO | None = None):
    """Hold an exclusive lock on ``directory``'s ``LOCK_FILE`` (made if missing) for the ``with``
    block; waiting for another process that holds it is said on ``progress_stream``. The
    lock goes with the process, so a killed conversion never leaves it held."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / LOCK_FILE, "a+b") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if progress_stream is not None:
                print(f"waiting for another butter process converting into {directory}", file=progress_stream)
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def remove_stale_partials(directory: Path) -> list[Path]:
    """Remove the staging directories that killed conversions left in ``directory`` (only
    those named as ``_atomic_directory`` names them for a sha256); call it holding
    ``conversion_lock`` on ``directory``, so none of them is in use. Returns what it removed."""
    stale = [path for path in directory.iterdir() if path.is_dir() and _STALE_PARTIAL.fullmatch(path.name)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def unpermute_rope_rows(rows: mx.array, n_heads: int) -> mx.array:
    """Undo llama.cpp's Q/K row permutation (``LlamaModel.permute`` in ``convert_hf_to_gguf.py``).

    Within each head of ``d`` rows, GGUF row ``2 * i + j`` is Hugging Face row
    ``j * d / 2 + i``. Only rows move, so a quantized tensor's weight, scales and biases
    (groups run along the input dim) are each unpermuted exactly by this function.
    """
    n_rows = rows.shape[0]
    half = n_rows // n_heads // 2
    if half * 2 * n_heads != n_rows:
        raise ValueError(f"{n_rows} rows do not split into {n_heads} heads of an even size")
    return rows.reshape(n_heads, half, 2, *rows.shape[1:]).swapaxes(1, 2).reshape(rows.shape)


def _existing(path: Path) -> Path:
    if not path.is_file():
        raise ModelLoadError(f"{path}: GGUF file not found")
    return path


def _read_gguf(path: Path) -> tuple[dict[str, mx.array], dict]:
    """Tensors and plain-Python metadata of a GGUF file that ``check_gguf`` passed, or a
    ModelLoadError naming it."""
    try:
        tensors, metadata = mx.load(str(path), format="gguf", return_metadata=True)
    except Exception as error:  # MLX raises RuntimeError/ValueError with a "[load_gguf]" prefix
        raise ModelLoadError(f"{path}: not a readable GGUF file ({error})") from error
    return tensors, {key: _plain(value) for key, value in metadata.items()}


def _plain(value):
    """A GGUF metadata value as plain Python: scalars, lists, strings."""
    if not isinstance(value, mx.array):
        return value
    if value.ndim:
        return value.tolist()
    if value.dtype == mx.float32:  # the shortest decimal that reads back to this float32
        return float(str(np.float32(value.item())))
    return value.item()


def _architecture(metadata: Mapping, source: Path) -> _Architecture:
    name = metadata.get("general.architecture")
    if name not in _ARCHITECTURES:
        known = ", ".join(sorted(_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {name!r} in {source}; butter converts GGUF {known}")
    return _ARCHITECTURES[name]


def _hf_config(metadata: Mapping, tensors: Mapping, architecture: _Architecture, source: Path) -> dict:
    """``config.json`` of the converted model (without ``quantization``, added later)."""
    arch = metadata["general.architecture"]

    def required(key: str, default=None, kind: type = int):
        """``{arch}.{key}``: a positive int (or a positive number, for ``kind=float``)."""
        value = metadata.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{source}: missing GGUF metadata {arch}.{key}")
        if isinstance(value, list):
            raise ModelLoadError(f"{source}: per-layer {arch}.{key} is not supported")
        valid = int if kind is int else (int, float)
        if not isinstance(value, valid) or isinstance(value, bool) or not value > 0:
            raise ModelLoadError(f"{source}: GGUF metadata {arch}.{key} must be a positive {kind.__name__}, got {value!r}")
        return value

    hidden = required("embedding_length")
    heads = required("attention.head_count")
    kv_heads = required("attention.head_count_kv", heads)
    head_dim = required("attention.key_length", hidden // heads if hidden >= heads else None)
    if head_dim % 2:
        raise ModelLoadError(f"{source}: head dim {head_dim} is odd; rotary embeddings need an even one")
    if metadata.get(f"{arch}.attention.value_length", head_dim) != head_dim:
        raise ModelLoadError(f"{source}: keys and values of different sizes are not supported")
    if metadata.get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
        raise ModelLoadError(f"{source}: partial rotary embeddings (rope.dimension_count < head dim) are not supported")
    if "token_embd.weight" not in tensors:
        raise ModelLoadError(f"{source}: no token_embd.weight tensor")
    blocks = {int(match[1]) for name in tensors if (match := _BLOCK_NAME.match(name))}
    if required("block_count") != (max(blocks) + 1 if blocks else 0):
        raise ModelLoadError(
            f"{source}: {arch}.block_count is {required('block_count')}, but the file holds "
            + (f"blocks 0..{max(blocks)}" if blocks else "no blocks")
        )
    if "rope_freqs.weight" in tensors:
        raise ModelLoadError(f"{source}: llama3-style RoPE frequency scaling (rope_freqs) is not supported yet")

    eos_ids = eos_token_ids(metadata)
    return {
        "architectures": [architecture.hf_architecture],
        "model_type": architecture.model_type,
        "hidden_size": hidden,
        "intermediate_size": required("feed_forward_length"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "num_hidden_layers": required("block_count"),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": required("attention.layer_norm_rms_epsilon", kind=float),
        "rope_theta": required("rope.freq_base", 10000.0, kind=float),
        "rope_scaling": _rope_scaling(metadata, arch, source),
        "max_position_embeddings": required("context_length"),
        "vocab_size": tensors["token_embd.weight"].shape[0],
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "mlp_bias": False,
        "bos_token_id": metadata.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids or None,
        "butter_gguf_source": {"file": source.name, "converter_version": CONVERTER_VERSION},
    }


def _rope_scaling(metadata: Mapping, arch: str, source: Path) -> dict | None:
    kind = metadata.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": metadata[f"{arch}.rope.scaling.factor"]}
    raise ModelLoadError(f"{source}: RoPE scaling {kind!r} is not supported (only linear)")


def _hf_tensors(
    tensors: Mapping[str, mx.array], config: Mapping, architecture: _Architecture, source: Path
) -> dict[str, mx.array]:
    """The GGUF tensors under Hugging Face names, Q/K rows restored to Hugging Face order."""
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    head_dim = config["head_dim"]
    converted = {}
    for name, value in tensors.items():
        base, _, suffix = name.rpartition(".")
        if suffix not in _SUFFIXES:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r}")
        block = _BLOCK_NAME.fullmatch(base)
        role = block.group(2) if block else base
        hf_base = _BLOCK_TENSORS.get(role) if block else _GLOBAL_TENSORS.get(role)
        if hf_base is None:
            raise ModelLoadError(f"{source}: unexpected tensor {name!r}; butter does not know where it goes")
        if block:
            hf_base = f"model.layers.{block.group(1)}.{hf_base}"
        if role in heads and value.shape[0] != heads[role] * head_dim:
            raise ModelLoadError(
                f"{source}: tensor {name!r} has {value.shape[0]} rows, not {heads[role]} heads of {head_dim}"
            )
        if architecture.permuted_qk and role in heads:
            value = unpermute_rope_rows(value, heads[role])
        converted[f"{hf_base}.{suffix}"] = value
    return converted


def _quantization_config(weights: Mapping[str, mx.array]) -> dict | None:
    """mlx-lm's ``quantization`` entry for the quantized tensors in ``weights``, or None."""
    bits_by_module: dict[str, int | None] = {}
    for name, value in weights.items():
        module, _, suffix = name.rpartition(".")
        if suffix == "weight" and value.ndim == 2:
            scales = weights.get(f"{module}.scales")
            bits_by_module[module] = None if scales is None else value.shape[-1] // scales.shape[-1]
    counts = Counter(bits for bits in bits_by_module.values() if bits is not None)
    if not counts:
        return None
    default_bits = counts.most_common(1)[0][0]
    quantization: dict = {"group_size": GGUF_GROUP_SIZE, "bits": default_bits}
    for module, bits in sorted(bits_by_module.items()):
        if bits is None:
            quantization[module] = False
        elif bits != default_bits:
            quantization[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
    return quantization


@contextmanager
def _atomic_directory(destination: Path):
    """Yield a staging directory beside ``destination``; rename it into place on success,
    delete it on failure."""
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = destination.parent / f".{destination.name}.{secrets.token_hex(8)}.partial"
    staging.mkdir()  # unlike mkdtemp's 0700, the umask decides, as for any other directory
    try:
        yield staging
        try:
            os.rename(staging, destination)
        except OSError:
            if not destination.is_dir():
                raise
            shutil.rmtree(staging)  # another process finished the same conversion first
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
