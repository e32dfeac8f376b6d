"""``kernel_params``: a kernel's per-call parameters, in memory the kernel reads quickly.

A decode kernel reads a few numbers that change from step to step or not at all: the
live length, the softmax scale, which slots a ring holds. Made the plain way, with
``mx.array([length])``, such an array lands where MLX's CUDA allocator puts every array
of 8 bytes or less: a pool of host memory the GPU reads across the bus (larger arrays
made from host data go to managed memory instead, which migrates to the GPU on its
first touch). Every warp that reads the parameter waits on that read, which made
butter's decode calls measurably slower (measurements: docs/benchmarks.md,
"butter_core/kernels/params.py").

``kernel_params`` makes each distinct parameter tuple once and keeps the most recent
ones, so the layers of a decode step share one array: one small GPU op per step instead
of a slow read per warp and layer. On CUDA it pads the values past 8 bytes and adds zero
on the GPU, whose output is in device memory, then hands out a view of the values. On
Metal, whose memory is unified, it is a plain array of the values (there an input of
fewer than 8 elements goes to the ``constant`` address space, which kernels read fast).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import mlx.core as mx

from butter_core.kernels.backend import Backend, gpu_backend

KEPT = 256
"""Parameter arrays kept: a decode step makes one or two new ones (its length, a ring's
slots) that every layer shares; the rest (scales) last the whole generation."""

HOST_POOL_BYTES = 8
"""MLX's CUDA allocator keeps arrays of this many bytes or fewer in host memory."""


def kernel_params(values: Sequence[int | float], dtype: mx.Dtype) -> mx.array:
    """``values`` as a 1-D ``dtype`` array for a custom kernel to read. The same array is
    returned for the same values, dtype and backend while it is among the ``KEPT`` most
    recent, so the layers of a step share it; treat it as read-only. Call it outside
    ``mx.compile``d functions (a trace would keep a placeholder)."""
    return _made(tuple(values), dtype, gpu_backend())


@functools.lru_cache(maxsize=KEPT)
def _made(values: tuple[int | float, ...], dtype: mx.Dtype, backend: Backend | None) -> mx.array:
    if backend != "cuda":
        return mx.array(values, dtype=dtype)
    # Padded past the host pool's size, then one add: its output is in device memory (or,
    # where MLX donates the input's buffer to it, managed memory the add moved to the GPU).
    elements = max(len(values), HOST_POOL_BYTES // dtype.size + 1)
    padded = mx.array(values + (0,) * (elements - len(values)), dtype=dtype)
    return (padded + mx.array(0, dtype=dtype))[: len(values)]
