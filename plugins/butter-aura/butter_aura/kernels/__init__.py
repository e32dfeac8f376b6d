"""AURA's GPU kernels, written once in butter's dialect for Metal and CUDA.

* ``encode`` (``encode.py``): rotate and code appended keys and values (one launch).
* ``decode_attention`` (``attention.py``): one query token over the codes, flash-decoding
  split-K, no key or value materialised (two launches); on CUDA a cache calls it traced
  once per buffer shape and replayed (``traced_decode_attention``), with the token's write
  into the full-precision rows in the same trace (``DecodeStep``). Its partials run on tensor cores
  (``attention_mma.py``) on CUDA wherever that kernel serves the configuration (aura4v2,
  aura4v4, aura8v4, aura8v8 with one scale per vector, float16/bfloat16 queries), else on
  the SIMT kernel in ``attention.py``.
* ``dequantize`` (``dequantize.py``): stored keys and values in the model's domain, for
  two-phase prefill and the window decorator's wrap-around path (one launch).

Each has the same signature as its pure-mx reference in ``butter_aura.reference``;
``ops_for`` picks, once per cache, which set a cache uses. ``KERNEL_CHECKS`` pairs them
for the conformance suite and ``bench/gpu_aura.py``.
"""

from __future__ import annotations

import types

from butter_core.plugin_api import LayerSpec, default_device_is_gpu

from butter_aura import cpu
from butter_aura.kernels import attention, dequantize, encode
from butter_aura.kernels.checks import KERNEL_CHECKS

GPU_OPS = types.SimpleNamespace(
    encode=encode.encode, encode_rows=encode.encode_rows, decode_attention=attention.traced_decode_attention,
    dequantize=dequantize.dequantize, decode_step=attention.DecodeStep, encode_into=encode.traced_encode_into,
)
"""The kernel implementations, shaped like the ``reference`` module, and where calls are traced
(``attention.traces``) two traced calls of ``AuraCache``'s: ``decode_step``, what a cache makes once
(``attention.DecodeStep``) to run a decode step's write into the full-precision rows and its
attention in one call, and ``encode_into``, the codes of the tokens decode steps deferred
written in one call (``encode.traced_encode_into``)."""


def available() -> bool:
    """Whether AURA's kernels can run here (a Metal or CUDA build of MLX)."""
    return encode.available()


def ops_for(spec: LayerSpec):
    """The kernels where MLX's default device is a GPU that runs them and ``head_dim`` is one they
    serve (64, 128); the pure-mx CPU path (``butter_aura.cpu``) otherwise. Decided once, when a
    cache is made."""
    if default_device_is_gpu() and available() and spec.head_dim in attention.SUPPORTED_HEAD_DIMS:
        return GPU_OPS
    return cpu


__all__ = ["GPU_OPS", "KERNEL_CHECKS", "available", "ops_for"]
