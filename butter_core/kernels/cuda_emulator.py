"""Run kernels' CUDA builds on the CPU, emulated, and compare them with their references.

The CUDA twin of ``metal_emulator``: each kernel call made under ``emulated_cuda()`` is
rendered from its CUDA header and body, but compiled by the host's C++ compiler against
``cuda_emulator.h`` (one fiber per CUDA thread, blocks one after another, warp
shuffles, votes and ``__syncthreads`` through barriers, ``__shared__`` arrays as statics
the block shares, dynamic shared memory per block, ``__half`` as ``_Float16``,
``__nv_bfloat16`` rounding to nearest even) and run on the call's inputs. The dialect's
tensor-core vocabulary, inline PTX on a GPU, is replaced by ``SOFTWARE_MMA``: the same
per-lane contract in plain C++ (``mma.sync`` gathered lane by lane through shuffles:
the dialect's ``SHUFFLED_MMA``, as the Metal build does). So kernels only a CUDA GPU
runs — butter-aura's and butter-affine's tensor-core decode — are checked against their
references on any machine, CI included.

It is an emulation, not a GPU: no warp scheduling or memory-ordering effects beyond what
real threads and barriers give, exact IEEE arithmetic where the GPU approximates (the
tensor cores' sums in another order; ``ex2.approx`` in the dialect's ``bt_exp2``, which
keeps an exact branch for hosts without ``__CUDA_ARCH__``), no shared-memory or register
limits, no speed.

``python -m butter_core.kernels.cuda_emulator SCHEME [CHECK ...]`` runs an installed
scheme's kernel checks built for CUDA and exits non-zero if any fails (g++ 12 or newer;
builds cached with the Metal emulator's).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx

from butter_core.kernels.cuda_binaries import CUDA_TYPES
from butter_core.kernels.dialect import MMA_HEADER, SHUFFLED_MMA, compact
from butter_core.kernels.kernel import Launch, executed_by
from butter_core.kernels.metal_check import template_declarations
from butter_core.kernels.metal_emulator import check_scheme, eager_traces, execute, kernel_parameters, main_source

HEADER = Path(__file__).with_name("cuda_emulator.h")

SOFTWARE_MMA = r"""
// ---- tensor-core vocabulary (emulated: the per-lane contract in plain C++) ----
BT_FUNC bool bt_any(bool p) { return __any_sync(0xffffffffu, p); }
BT_FUNC uint32_t bt_shuffle_u32(uint32_t v, int src_lane) { return __shfl_sync(0xffffffffu, v, src_lane); }
BT_FUNC _Float16 emu_half(uint32_t x, int i) {
  uint16_t b = static_cast<uint16_t>(x >> (16 * i)); _Float16 h; std::memcpy(&h, &b, 2); return h;
}
BT_FUNC uint32_t emu_bits(_Float16 h) { uint16_t b; std::memcpy(&b, &h, 2); return b; }
BT_FUNC uint32_t bt_half2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d = 0;
  for (int i = 0; i < 2; ++i) {  // exact in double, rounded once to half
    const double r = static_cast<double>(emu_half(a, i)) * static_cast<double>(emu_half(b, i)) +
                     static_cast<double>(emu_half(c, i));
    d |= emu_bits(static_cast<_Float16>(r)) << (16 * i);
  }
  return d;
}
BT_FUNC uint32_t bt_pack_half2(float lo, float hi) {
  return emu_bits(static_cast<_Float16>(lo)) | (emu_bits(static_cast<_Float16>(hi)) << 16);
}
BT_FUNC uint32_t bt_byte_perm(uint32_t x, uint32_t y, uint32_t s) { return __byte_perm(x, y, s); }
BT_FUNC float bt_half2_dot(uint32_t x, uint32_t y) {
  return static_cast<float>(emu_half(x, 0)) * static_cast<float>(emu_half(y, 0)) +
         static_cast<float>(emu_half(x, 1)) * static_cast<float>(emu_half(y, 1));
}
""" + SHUFFLED_MMA
"""Replaces the dialect's inline-PTX tensor-core vocabulary (``MMA_HEADER["cuda"]``): its
primitives in plain C++, then the dialect's ``SHUFFLED_MMA``, as Metal's."""

_DYNAMIC_SHARED = (
    "#define BT_DYNAMIC_SHARED(type, name) extern __shared__ type name[]",
    "#define BT_DYNAMIC_SHARED(type, name) type* name = reinterpret_cast<type*>(emu_dynamic_shared)",
)


def emulator_source(launch: Launch) -> str:
    """The C++ program that runs ``launch``'s CUDA build: the emulator, the kernel's CUDA
    header (tensor-core vocabulary and dynamic shared memory emulated), the kernel as a
    function of plain pointers (template values as constants) and ``main_source``'s main."""
    build = launch.build
    kernel = build.kernel
    header = kernel.header("cuda")
    if kernel.mma:
        ptx = compact(MMA_HEADER["cuda"])
        if ptx not in header:
            raise RuntimeError(f"{kernel.name}: its header does not hold the dialect's tensor-core block")
        header = header.replace(ptx, SOFTWARE_MMA)
    header = header.replace(*_DYNAMIC_SHARED)
    params, args = kernel_parameters(launch, CUDA_TYPES)
    lines = [f'#include "{HEADER}"', header, "void emulated_kernel(" + ", ".join(params) + ") {"]
    lines += template_declarations(build, CUDA_TYPES)
    return "\n".join([*lines, kernel.source("cuda"), "}", main_source(launch, args, f"{kernel.shared_memory}u, ")])


def run(launch: Launch) -> list[mx.array]:
    """``launch`` executed by the emulator: its outputs, as MLX's kernel would return them."""
    return execute(launch, emulator_source(launch))


@contextlib.contextmanager
def emulated_cuda() -> Iterator[None]:
    """Within this block kernels take their CUDA paths and run in the emulator (traces eagerly)."""
    with executed_by("cuda", run), eager_traces():
        yield


def main(argv: list[str] | None = None) -> int:
    return check_scheme(argv, "cuda", emulated_cuda, __doc__.splitlines()[0])


if __name__ == "__main__":
    sys.exit(main())
