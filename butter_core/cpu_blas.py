"""A fast BLAS for mlx-cpu on Linux: load OpenBLAS before MLX does.

The mlx-cpu wheel links a bundled reference BLAS (``mlx_cpu.libs/libblas-*.so``), so
installing a system BLAS changes nothing by itself. But MLX's ``cblas_*`` calls resolve
through the process's global symbol namespace first: a library loaded there with
``RTLD_GLOBAL`` before ``mlx.core`` is imported wins. With Debian's OpenBLAS
(``apt-get install libopenblas0-pthread``) float32 matmul runs many times faster;
bf16/fp16 and quantized matmuls do not use BLAS and do not change.

Importing this module does it, so it must be imported before anything imports
``mlx.core``. ``BUTTER_BLAS`` chooses: unset or ``openblas`` (the default: OpenBLAS if
installed), ``reference`` (keep the bundled one), or a library file name or path.

Before loading it, ``OPENBLAS_THREAD_TIMEOUT`` defaults to 4 (unless set): OpenBLAS's
idle worker threads then sleep after 2^4 cycles instead of spinning on ``sched_yield``
for up to 2^28, which on 2 cores took the core MLX's own threads (the stream thread
running non-BLAS ops, Python building the next step). Measurements of both:
docs/benchmarks.md, "butter_core/cpu_blas.py".
"""

from __future__ import annotations

import ctypes
import os
import sys

BLAS_ENV = "BUTTER_BLAS"
OPENBLAS_LIBRARIES = ("libopenblas.so.0", "libopenblas.so")
OPENBLAS_THREAD_TIMEOUT = "4"


def preload_blas() -> str | None:
    """Load the chosen BLAS globally; returns the library loaded, or None (not Linux,
    ``reference`` chosen, MLX already imported, or no such library installed)."""
    choice = os.environ.get(BLAS_ENV, "openblas").strip() or "openblas"
    if sys.platform != "linux" or choice == "reference" or "mlx.core" in sys.modules:
        return None
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", OPENBLAS_THREAD_TIMEOUT)  # read when OpenBLAS loads
    for library in OPENBLAS_LIBRARIES if choice == "openblas" else (choice,):
        try:
            ctypes.CDLL(library, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            continue
        return library
    return None


LOADED_BLAS = preload_blas()
"""The library loaded when butter was imported, or None (MLX uses its bundled BLAS)."""


def fast_blas_in_use() -> bool:
    """Whether MLX's float32 matmuls run on a fast BLAS: loaded here, or preloaded by the user."""
    return LOADED_BLAS is not None or "openblas" in os.environ.get("LD_PRELOAD", "")
