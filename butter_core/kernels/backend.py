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
