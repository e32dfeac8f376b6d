"""Checkpoint tensors into a model: validation, MLX quantization, dequantize-or-keep, dtype.

Before any tensor data is read, every tensor the model expects is checked against the
safetensors headers: present, of the right shape for ``config.json``, of a sensible
dtype, and nothing unexpected. Quantized checkpoints (MLX's affine format: ``.weight``
packed into uint32 with ``.scales`` and ``.biases`` per group, config
``quantization: {group_size, bits}``, optionally per module) either stay quantized
(``nn.QuantizedLinear`` / ``QuantizedEmbedding``) or are dequantized at load.

Which is faster depends on the backend. On a GPU weights stay as stored. On the CPU
they become float32 (quantized scales included: fp16 scales make MLX's CPU quantized
matmul far slower still), and are dequantized only when a fast BLAS is in use
(``butter_core.cpu_blas``): on OpenBLAS dequantized float32 prefills and decodes much
faster than quantized weights; on MLX's bundled reference BLAS it is no faster and takes
more memory (measurements: docs/benchmarks.md, "butter_core/loading/weights.py").
"""

from __future__ import annotations

import re
from pathlib import Path
from collections.abc import Callable
from typing import Any

import attrs
import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from butter_core.cpu_blas import fast_blas_in_use
from butter_core.errors import ConfigError, ModelLoadError
from butter_core.kernels.backend import default_device_is_gpu
from butter_core.loading.checkpoint import FLOAT_DTYPES, TensorEntry, read_config, read_tensor_index
from butter_core.models import DecoderModel, build_model

QUANT_BITS = (2, 3, 4, 5, 6, 8)
QUANT_GROUP_SIZES = (32, 64, 128)
WEIGHT_DTYPES = ("float32", "float16", "bfloat16")
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER_NAME = re.compile(r"(?:model|backbone)\.layers\.(\d+)\.")
"""Tensors some checkpoints carry that the model recomputes."""


def _one_of(valid: tuple):
    def check(instance, attribute, value):
        if value is not None and value not in valid:
            raise ConfigError(f"WeightOptions.{attribute.name} must be None or one of {valid}; got {value!r}")

    return check


@attrs.frozen
class WeightOptions:
    """How checkpoint weights become parameters; ``None`` picks the backend's fast choice.

    ``dequantize``: expand quantized weights to dense at load (default: on the CPU
    when a fast BLAS is in use). ``dtype``: the float dtype of every float parameter,
    scales included (default: float32 on the CPU, as stored on a GPU).
    """

    dequantize: bool | None = attrs.field(default=None, validator=_one_of((True, False)))
    dtype: str | None = attrs.field(default=None, validator=_one_of(WEIGHT_DTYPES))

    def resolve(self) -> tuple[bool, mx.Dtype | None]:
        """(dequantize, dtype or None for as-stored) for the current default device."""
        on_gpu = default_device_is_gpu()
        dequantize = (not on_gpu and fast_blas_in_use()) if self.dequantize is None else self.dequantize
        dtype = self.dtype or (None if on_gpu else "float32")
        return dequantize, None if dtype is None else getattr(mx, dtype)


@attrs.frozen
class Quantization:
    """MLX affine quantization of one module: ``bits`` per weight, one scale and bias per ``group_size``."""

    group_size: int
    bits: int

    def packed_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] * self.bits // 32)

    def group_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        return (*shape[:-1], shape[-1] // self.group_size)

    def __str__(self) -> str:
        return f"{self.bits}-bit g{self.group_size}"


@attrs.frozen
class QuantizationConfig:
    """A config's ``quantization``: a default plus per-module overrides (``None``: left dense)."""

    default: Quantization
    overrides: dict[str, Quantization | None] = attrs.field(factory=dict, hash=False)

    def for_module(self, path: str) -> Quantization | None:
        return self.overrides.get(path, self.default)


@attrs.frozen
class WeightSummary:
    """What was loaded: the checkpoint's quantization and what the parameters became."""

    quantization: str | None
    dequantized: bool
    dtype: str
    nbytes: int

    def __str__(self) -> str:
        size = f"{self.nbytes / 2**20:.1f} MiB"
        if self.quantization is None:
            return f"dense {self.dtype} weights ({size})"
        if self.dequantized:
            return f"{self.quantization} quantized weights dequantized to {self.dtype} ({size})"
        return f"{self.quantization} quantized weights with {self.dtype} scales ({size})"


def parse_quantization(config: dict[str, Any], source: Path) -> QuantizationConfig | None:
    """The MLX ``quantization`` entry of ``config`` (``source``), or None for a dense checkpoint."""
    spec = config.get("quantization")
    if spec is None and "quantization_config" in config:
        spec = config["quantization_config"]
        if not (isinstance(spec, dict) and {"group_size", "bits"} <= spec.keys()):
            method = spec.get("quant_method") if isinstance(spec, dict) else spec
            raise ModelLoadError(
                f"{source}: quantization_config (quant_method {method!r}) is not supported; "
                "supported: MLX affine quantization ('quantization': {group_size, bits})"
            )
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ModelLoadError(f"{source}: 'quantization' must be an object with group_size and bits, got {spec!r}")
    default = _parse_one(spec, source, "quantization")
    overrides = {
        path: None if value is False else _parse_one(value, source, f"quantization[{path!r}]")
        for path, value in spec.items()
        if isinstance(value, dict) or value is False
    }
    return QuantizationConfig(default, overrides)


def _parse_one(spec: dict[str, Any], source: Path, where: str) -> Quantization:
    mode = spec.get("mode", "affine")
    if mode != "affine":
        raise ModelLoadError(f"{source}: {where} mode {mode!r} is not supported; supported: affine")
    bits, group_size = spec.get("bits"), spec.get("group_size")
    if bits not in QUANT_BITS or group_size not in QUANT_GROUP_SIZES:
        raise ModelLoadError(
            f"{source}: unknown {where} bits={bits!r} group_size={group_size!r}; "
            f"supported: bits in {QUANT_BITS}, group_size in {QUANT_GROUP_SIZES}"
        )
    return Quantization(group_size=group_size, bits=bits)


def load_network(model_dir: Path, options: WeightOptions) -> tuple[DecoderModel, WeightSummary]:
    """The model of ``model_dir`` (``config.json`` + safetensors) with its weights loaded."""
    config, config_path = read_config(model_dir)
    entries = {name: e for name, e in read_tensor_index(model_dir).items() if not name.endswith(IGNORED_SUFFIXES)}
    _check_layer_count(config, entries, config_path)
    model = build_model(config, config_path)
    return model, load_weights(model, entries, config, config_path, options)


def _check_layer_count(config: dict[str, Any], entries: dict[str, TensorEntry], config_path: Path) -> None:
    """``num_hidden_layers`` must be the layers the weights hold, checked before the model is
    built (a layer count of 2**32 - 1 took minutes and gigabytes to build before any
    tensor was compared with it)."""
    held = {int(match[1]) for name in entries if (match := _LAYER_NAME.match(name))}
    layers = config.get("num_hidden_layers")
    if held and layers != max(held) + 1:
        raise ModelLoadError(
            f"{config_path}: num_hidden_layers is {layers!r}, but the weights hold layers 0..{max(held)}"
        )


def load_weights(
    model: DecoderModel, entries: dict[str, TensorEntry], config: dict[str, Any], config_path: Path,
    options: WeightOptions,
) -> WeightSummary:
    """Fill ``model``'s parameters from the checkpoint tensors ``entries`` (``read_tensor_index``),
    validating first."""
    if model.args.tie_word_embeddings:
        entries = {name: e for name, e in entries.items() if not name.startswith("lm_head.")}
    entries, derived = _adapted(model, entries)
    quantization = parse_quantization(config, config_path)
    plan = _quantized_modules(model, entries, quantization, config_path)
    _check_tensors(entries, _expected_tensors(model, plan), config_path, model.args.model_type)
    dequantize, dtype = options.resolve()
    arrays = _read_arrays(entries, derived)
    if plan and dequantize:
        arrays = _dequantized(arrays, plan, dtype)
    elif plan:
        nn.quantize(model, class_predicate=lambda path, _: attrs.asdict(plan[path]) if path in plan else False)
    if dtype is not None:
        arrays = {name: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a for name, a in arrays.items()}
    model.load_weights(list(arrays.items()))
    mx.eval(model.parameters())
    nbytes = sum(a.nbytes for _, a in tree_flatten(model.parameters()))
    stored = ", ".join(sorted({str(q) for q in plan.values()})) or None
    return WeightSummary(stored, bool(plan) and dequantize, str(model.dtype).removeprefix("mlx.core."), nbytes)


def _quantized_modules(
    model: DecoderModel, entries: dict[str, TensorEntry], quantization: QuantizationConfig | None, config_path: Path
) -> dict[str, Quantization]:
    """The modules stored quantized (those with ``.scales``), each with its parameters."""
    plan = {}
    for path, module in model.named_modules():
        scales = entries.get(f"{path}.scales")
        if scales is None or not hasattr(module, "to_quantized"):
            continue
        q = quantization.for_module(path) if quantization else None
        if q is None:
            raise ModelLoadError(
                f"{scales.file}: {path} is stored quantized ({scales.name}) but {config_path} gives it no "
                "'quantization' (group_size, bits)"
            )
        in_features = module.weight.shape[-1]
        if in_features % q.group_size or (in_features * q.bits) % 32:
            raise ModelLoadError(
                f"{config_path}: {path} has {in_features} inputs, which {q} quantization cannot pack "
                f"(needs a multiple of group_size {q.group_size})"
            )
        plan[path] = q
    return plan


def _expected_tensors(model: DecoderModel, plan: dict[str, Quantization]) -> dict[str, tuple[tuple[int, ...], bool]]:
    """Name → (shape, packed) of every tensor the checkpoint must hold."""
    expected = {name: (tuple(p.shape), False) for name, p in tree_flatten(model.parameters())}
    for path, q in plan.items():
        shape, _ = expected[f"{path}.weight"]
        expected[f"{path}.weight"] = (q.packed_shape(shape), True)
        expected[f"{path}.scales"] = expected[f"{path}.biases"] = (q.group_shape(shape), False)
    return expected


def _check_tensors(
    entries: dict[str, TensorEntry], expected: dict[str, tuple[tuple[int, ...], bool]], config_path: Path, model_type: str
) -> None:
    files = ", ".join(sorted({str(e.file) for e in entries.values()})) or str(config_path.parent)
    missing = sorted(expected.keys() - entries.keys())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ModelLoadError(f"{files}: missing tensor {missing[0]!r}{more}, which {config_path} requires")
    for name, entry in entries.items():
        if name not in expected:
            raise ModelLoadError(
                f"{entry.file}: unexpected tensor {name!r}: not part of a {model_type} model shaped by {config_path}"
            )
        shape, packed = expected[name]
        if entry.shape != shape:
            raise ModelLoadError(
                f"{entry.file}: tensor {name!r} has shape {list(entry.shape)} but {config_path} implies {list(shape)}"
            )
        valid = ("U32",) if packed else FLOAT_DTYPES
        if entry.dtype not in valid:
            raise ModelLoadError(f"{entry.file}: tensor {name!r} has dtype {entry.dtype}; expected one of {valid}")


@attrs.frozen
class Derived:
    """A tensor the model holds that a checkpoint layout stores otherwise (a family's
    ``checkpoint_layout``): computed by ``combine`` from the arrays of ``sources``."""

    sources: tuple[TensorEntry, ...]
    combine: Callable[[list[mx.array]], mx.array]


def _adapted(model, entries: dict[str, TensorEntry]) -> tuple[dict[str, TensorEntry], dict[str, Derived]]:
    """The checkpoint's tensors by the model's names: a family whose checkpoints come in
    several layouts (Hugging Face's, mlx-lm's) maps them with ``checkpoint_layout(entries)``,
    which returns, per tensor of the model, the entry it is read from (whose ``name`` is the
    stored one) or a ``(TensorEntry, Derived)`` pair: the entry as the model sees it (its
    shape and dtype are validated), and how to compute it."""
    layout = getattr(model, "checkpoint_layout", None)
    if layout is None:
        return entries, {}
    adapted, derived = {}, {}
    for name, source in layout(entries).items():
        if isinstance(source, tuple):
            adapted[name], derived[name] = source
        else:
            adapted[name] = source
    return adapted, derived


def _read_arrays(entries: dict[str, TensorEntry], derived: dict[str, Derived]) -> dict[str, mx.array]:
    wanted = {}
    for name, entry in entries.items():
        for source in derived[name].sources if name in derived else (entry,):
            wanted.setdefault(source.file, set()).add(source.name)
    stored = {}
    for file in sorted(wanted):
        try:
            loaded = mx.load(str(file))
        except (RuntimeError, ValueError) as exc:
            raise ModelLoadError(f"{file}: could not read tensors: {exc}") from exc
        stored.update({name: a for name, a in loaded.items() if name in wanted[file]})
    return {
        name: derived[name].combine([stored[s.name] for s in derived[name].sources]) if name in derived
        else stored[entry.name]
        for name, entry in entries.items()
    }


def _dequantized(arrays: dict[str, mx.array], plan: dict[str, Quantization], dtype: mx.Dtype | None) -> dict[str, mx.array]:
    """``arrays`` with each quantized module's triplet replaced by its dense weight in ``dtype`` (default:
    the scales' dtype), computed in float32 and evaluated module by module."""
    arrays = dict(arrays)
    for path, q in plan.items():
        packed, scales, biases = (arrays.pop(f"{path}.{part}") for part in ("weight", "scales", "biases"))
        weight = mx.dequantize(
            packed, scales.astype(mx.float32), biases.astype(mx.float32), group_size=q.group_size, bits=q.bits
        ).astype(dtype or scales.dtype)
        mx.eval(weight)
        arrays[f"{path}.weight"] = weight
    return arrays
