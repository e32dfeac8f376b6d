"""Which GPU backend this process can run custom kernels on."""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import math
from collections.abc import Iterator
from typing import Literal

import attrs
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


_GPU_DEFAULT: contextvars.ContextVar[bool] = contextvars.ContextVar("butter_gpu_default", default=False)
"""Set only inside ``standing_in_for_gpu``: ``default_device_is_gpu`` answers True."""


def gpu_memory() -> int | None:
    """Bytes of memory MLX reports for its GPU (``memory_size`` on Metal, ``total_memory`` on
    CUDA), or None where it reports none (a CPU-only build)."""
    info = mx.device_info()
    memory = info.get("memory_size", info.get("total_memory"))
    return None if memory is None else int(memory)


def default_device_is_gpu() -> bool:
    """Whether MLX's default device is a GPU, i.e. ordinary mx ops run there (inside
    ``standing_in_for_gpu``: True)."""
    return _GPU_DEFAULT.get() or mx.default_device().type == mx.gpu


@contextlib.contextmanager
def standing_in_for_gpu() -> Iterator[None]:
    """Within this block ``default_device_is_gpu()`` answers True, so caches take their GPU paths
    on any machine; with ``kernels.executed_by`` standing in for the kernels, what a GPU decode
    step builds on the host can be timed without a GPU (``bench/host_build.py``)."""
    token = _GPU_DEFAULT.set(True)
    try:
        yield
    finally:
        _GPU_DEFAULT.reset(token)


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


@attrs.frozen
class GpuShape:
    """What a split plan sizes its launch by: the GPU's multiprocessors (CUDA's SMs), and
    the shared memory (bytes) and 32-bit registers each one holds."""

    multiprocessors: int
    shared_per_multiprocessor: int
    registers_per_multiprocessor: int


TUNED_ON = GpuShape(multiprocessors=132, shared_per_multiprocessor=228 * 1024, registers_per_multiprocessor=65536)
"""The NVIDIA H200's shape: what butter's split plans were measured and tuned on, and what
``gpu_shape`` answers where it cannot ask the device (Metal, whose MLX reports no core
count; ``recorded_builds``)."""

_CU_MULTIPROCESSOR_COUNT = 16
_CU_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR = 81
_CU_MAX_REGISTERS_PER_MULTIPROCESSOR = 82
"""``CUdevice_attribute`` values (cuda.h)."""


def gpu_shape() -> GpuShape:
    """The shape of MLX's GPU (device 0): on CUDA asked of the driver once per process,
    else (or where the driver cannot be asked) ``TUNED_ON``."""
    if gpu_backend() != "cuda" or _STANDING_IN.get() is not None:
        return TUNED_ON
    return _cuda_shape() or TUNED_ON


def scaled_to_gpu(blocks_on_tuned: int) -> int:
    """A threadgroup count tuned on ``TUNED_ON`` (so many per multiprocessor there), for this
    GPU's multiprocessor count: the same threadgroups per multiprocessor, so the same
    waves; unchanged on an H200."""
    return max(1, math.ceil(blocks_on_tuned * gpu_shape().multiprocessors / TUNED_ON.multiprocessors))


@functools.cache
def _cuda_shape() -> GpuShape | None:
    """Device 0's shape from the CUDA driver API (``libcuda.so.1``, which every CUDA
    process has loaded), through ctypes: MLX's ``device_info`` gives no multiprocessor
    count. None where the library or a query fails."""
    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    device = ctypes.c_int()
    if driver.cuInit(0) != 0 or driver.cuDeviceGet(ctypes.byref(device), 0) != 0:
        return None
    values = []
    for attribute in (_CU_MULTIPROCESSOR_COUNT, _CU_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                      _CU_MAX_REGISTERS_PER_MULTIPROCESSOR):
        value = ctypes.c_int()
        if driver.cuDeviceGetAttribute(ctypes.byref(value), attribute, device) != 0 or value.value <= 0:
            return None
        values.append(value.value)
    return GpuShape(*values)
