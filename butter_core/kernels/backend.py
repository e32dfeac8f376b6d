"""Which GPU backend this process can run custom kernels on."""

from __future__ import annotations

import contextvars
import functools
from typing import Literal

import mlx.core as mx

Backend = Literal["metal", "cuda"]

BACKENDS: frozenset[Backend] = frozenset({"metal", "cuda"})

_STANDING_IN: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("butter_standing_in", default=None)
"""A backend ``gpu_backend`` answers instead of the real one: set only while
``butter_core.kernels.recorded_builds`` records what kernels would build for it."""


def gpu_backend() -> Backend | None:
    """The GPU backend MLX was built with and can reach here, or None on a CPU-only build
    (inside ``recorded_builds(backend)``: that backend)."""
    return _STANDING_IN.get() or _detected_backend()


@functools.cache
def _detected_backend() -> Backend | None:
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def default_device_is_gpu() -> bool:
    """Whether MLX's default device is a GPU, i.e. ordinary mx ops run there."""
    return mx.default_device().type == mx.gpu


TENSOR_CORE_CAPABILITY = (8, 0)
"""The CUDA compute capability the dialect's tensor-core vocabulary needs (``mma.sync``
m16n8k16 tiles, ``cvt.rn.f16x2.f32``: Ampere and newer). MLX's CUDA wheels also run on
7.5 (Turing: T4, RTX 20xx), where kernels that use it do not compile."""


def tensor_cores_available() -> bool:
    """Whether kernels built with the tensor-core vocabulary (``Kernel(..., mma=True)``) can
    run here: on Metal (which emulates it with SIMD-group shuffles) and on CUDA devices of
    compute capability ``TENSOR_CORE_CAPABILITY`` or newer."""
    return gpu_backend() is not None and tensor_core_shortfall() is None


def tensor_core_shortfall() -> str | None:
    """Why this CUDA device cannot run the tensor-core vocabulary, or None where it can (or
    where MLX does not report a capability)."""
    if gpu_backend() != "cuda":
        return None
    capability = cuda_compute_capability()
    if capability is None or capability >= TENSOR_CORE_CAPABILITY:
        return None
    required = ".".join(map(str, TENSOR_CORE_CAPABILITY))
    return (f"tensor-core instructions (mma.sync m16n8k16) need CUDA compute capability {required} or newer; "
            f"this GPU has {capability[0]}.{capability[1]}")


def cuda_compute_capability() -> tuple[int, int] | None:
    """The compute capability of MLX's CUDA device; None where MLX does not report one, or
    inside ``recorded_builds`` (which compiles nothing)."""
    return None if _STANDING_IN.get() is not None else _device_capability()


@functools.cache
def _device_capability() -> tuple[int, int] | None:
    info = mx.device_info(mx.Device(mx.gpu, 0))
    if "compute_capability_major" not in info:
        return None
    return int(info["compute_capability_major"]), int(info.get("compute_capability_minor", 0))
