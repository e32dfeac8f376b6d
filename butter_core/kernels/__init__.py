"""The kernel layer: write a kernel body once, run it as a Metal or CUDA MLX kernel.

- ``backend``: which GPU backend this process has.
- ``dialect``: the vocabulary kernel bodies are written in, per backend.
- ``kernel``: ``Kernel``, a lazily built custom kernel; output poisoning; ``recorded_builds``,
  which records what kernels would build for a backend instead of running them.
- ``metal_check``: kernels' Metal sources checked by clang's front end where no Metal
  compiler runs (needs libclang).
- ``checks``: ``KernelCheck``, a kernel paired with its pure-mx reference.
- ``split_k``: the split-K (flash-decoding) helpers, launch plan and merge kernel that
  every fused single-query attention kernel shares.
- ``mma``: the fragment bookkeeping of tensor-core split-K decode kernels (query
  fragments, online softmax, partials), on the dialect's ``bt_mma_16x8x16``.
"""

from butter_core.kernels.backend import Backend, default_device_is_gpu, gpu_backend
from butter_core.kernels.checks import CheckResult, KernelCheck, relative_error
from butter_core.kernels.kernel import Build, Kernel, KernelUnavailableError, poisoned_outputs, recorded_builds
from butter_core.kernels import mma, split_k

__all__ = [
    "Backend",
    "Build",
    "CheckResult",
    "Kernel",
    "KernelCheck",
    "KernelUnavailableError",
    "default_device_is_gpu",
    "gpu_backend",
    "mma",
    "poisoned_outputs",
    "recorded_builds",
    "relative_error",
    "split_k",
]
