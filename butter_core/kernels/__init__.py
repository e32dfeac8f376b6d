"""The kernel layer: write a kernel body once, run it as a Metal or CUDA MLX kernel.

- ``backend``: which GPU backend this process has, and whether it runs the tensor-core
  vocabulary (CUDA: compute capability 8.0 or newer); ``standing_in_for_gpu``, under
  which caches take their GPU paths on any machine.
- ``dialect``: the vocabulary kernel bodies are written in, per backend.
- ``kernel``: ``Kernel``, a lazily built custom kernel; output poisoning; ``executed_by``,
  which hands kernel calls to another executor as if on a given backend, and
  ``recorded_builds``, which records what they would build there and runs nothing.
- ``metal_check``: kernels' Metal sources checked by clang's front end where no Metal
  compiler runs (needs libclang).
- ``metal_emulator``: kernels' Metal builds run on the CPU by a C++ emulation of Metal's
  execution model, against their references (needs g++ 12+).
- ``cuda_emulator``: the same for kernels' CUDA builds, the tensor-core vocabulary's PTX
  replaced by software, so kernels only a CUDA GPU runs are checked on any machine.
- ``cuda_binaries``: the default on CUDA (``BUTTER_CUDA_BINARIES=0`` turns it off): builds compiled once per
  install with NVRTC and run through ``mx.fast.precompiled_cuda_kernel``;
  ``cuda_compile_check`` compiles a scheme's builds that way without a GPU.
- ``checks``: ``KernelCheck``, a kernel paired with its pure-mx reference;
  ``recorded_check_builds``, the builds its cases make on a backend.
- ``split_k``: the split-K (flash-decoding) helpers, launch plan and merge kernel that
  every fused single-query attention kernel shares.
- ``params``: ``kernel_params``, a kernel's per-call parameters (a live length, a scale)
  as arrays it reads from device memory, made once per value.
- ``mma``: the fragment bookkeeping of tensor-core split-K decode kernels (query
  fragments, online softmax, partials), on the dialect's ``bt_mma_16x8x16``.
"""

from butter_core.kernels.backend import (
    Backend,
    default_device_is_gpu,
    gpu_backend,
    standing_in_for_gpu,
    tensor_cores_available,
)
from butter_core.kernels.checks import CheckResult, KernelCheck, attention_inputs, paged_attention_inputs, relative_error, scattered_pages
from butter_core.kernels.kernel import (
    Build,
    Kernel,
    KernelUnavailableError,
    Launch,
    executed_by,
    poisoned_outputs,
    recorded_builds,
)
from butter_core.kernels.params import kernel_params
from butter_core.kernels import mma, split_k

__all__ = [
    "Backend",
    "Build",
    "CheckResult",
    "Kernel",
    "KernelCheck",
    "KernelUnavailableError",
    "Launch",
    "default_device_is_gpu",
    "executed_by",
    "gpu_backend",
    "kernel_params",
    "attention_inputs",
    "paged_attention_inputs",
    "scattered_pages",
    "mma",
    "poisoned_outputs",
    "recorded_builds",
    "relative_error",
    "split_k",
    "standing_in_for_gpu",
    "tensor_cores_available",
]
