"""Which GPU backend this process can run custom kernels on."""

from __future__ import annotations

from typing import Literal

import mlx.core as mx

Backend = Literal["metal", "cuda"]


def gpu_backend() -> Backend | None:
    """The GPU backend MLX was built with and can reach here, or None on a CPU-only build."""
    if mx.metal.is_available():
        return "metal"
    if mx.cuda.is_available():
        return "cuda"
    return None


def default_device_is_gpu() -> bool:
    """Whether MLX's default device is a GPU, i.e. ordinary mx ops run there."""
    return mx.default_device().type == mx.gpu
