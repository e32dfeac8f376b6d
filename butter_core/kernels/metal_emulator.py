"""Run kernels' Metal builds on the CPU, emulated, and compare them with their references.

``metal_check`` shows that a Metal build would compile; this shows what it computes. Each
kernel call made under ``emulated_metal()`` is rendered as MLX would render its Metal
source, but compiled by the host's C++ compiler against ``metal_emulator.h``: one fiber
per Metal thread (``emulator_threads.h``), threadgroups one after another, ``simd_shuffle``/``simd_sum``/
``threadgroup_barrier`` through barriers, ``threadgroup`` arrays as statics the
threadgroup's threads share, ``half`` as ``_Float16`` and ``bfloat16_t`` as Metal 3.1's
``bfloat`` (round to nearest even). So the code only Metal runs — the dialect's Metal
primitives, the warp reductions through ``simd_sum``, the tensor-core vocabulary's
shuffle emulation — runs against the same references as the CUDA builds do on a GPU.

It is an emulation, not Metal: no address spaces (``metal_check`` checks those), no
simdgroup scheduling or memory-ordering effects beyond what real threads and barriers
give, no threadgroup memory limit (``metal_check`` again), and exact IEEE arithmetic
where a GPU may fuse or approximate. Slow: seconds to a minute per check case.

``python -m butter_core.kernels.metal_emulator SCHEME [CHECK ...]`` runs an installed
scheme's kernel checks (those built for Metal) and exits non-zero if any fails. Needs
g++ 12 or newer (``_Float16``); compiled builds are cached under
``butter_cache_dir()/kernel-emulator``. ``cuda_emulator`` runs CUDA builds through the
same program (``kernel_parameters``, ``main_source``, ``execute``, ``check_scheme``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import numpy as np

from butter_core.kernels.kernel import Launch, executed_by
from butter_core.kernels.metal_check import ATTRIBUTES, METAL_TYPES, template_declarations
from butter_core.loading.gguf import butter_cache_dir

HEADER = Path(__file__).with_name("metal_emulator.h")

BUILD_FLAGS = ("-std=c++20", "-O1", "-w", "-U_FORTIFY_SOURCE", "-fstack-clash-protection")
"""How an emulated kernel's program is built: without glibc's checked ``longjmp``, which refuses
the fibers' switches between stacks, and with large frames probed page by page, so that a
thread past its stack reaches the guard page below it (``emulator_threads.h``)."""

ATTRIBUTE_VALUES = {
    "threadgroup_position_in_grid": "emu_tg_pos",
    "thread_position_in_threadgroup": "emu_pos_in_tg",
    "threads_per_threadgroup": "emu_tg_size",
    "threadgroups_per_grid": "emu_tgs",
    "thread_position_in_grid": "emu_pos",
    "thread_index_in_threadgroup": "emu_index",
    "thread_index_in_simdgroup": "emu_lane",
    "simdgroup_index_in_threadgroup": "emu_simd_index",
    "threads_per_simdgroup": "32u",
}
"""The emulator's value of each Metal thread attribute it supports."""

_MAIN = r"""
#include <array>
#include <fstream>
static std::vector<char> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>((std::istreambuf_iterator<char>(f)), {});
}
// argv[1]: a folder with launch.txt (grid, threadgroup, then each input's rank and
// shape), in<i> and out<i> (the outputs' initial bytes; overwritten with the results).
int main(int argc, char** argv) {
  const std::string dir = argv[1];
  std::ifstream launch(dir + "/launch.txt");
  uint gx, gy, gz, tx, ty, tz;
  launch >> gx >> gy >> gz >> tx >> ty >> tz;
  std::vector<std::vector<char>> ins(N_IN), outs(N_OUT);
  std::vector<std::array<int, 10>> shapes(N_IN);
  std::vector<int> ndims(N_IN);
  for (int i = 0; i < N_IN; ++i) {
    launch >> ndims[i];
    shapes[i].fill(0);
    for (int j = 0; j < ndims[i]; ++j) launch >> shapes[i][j];
    ins[i] = read_file(dir + "/in" + std::to_string(i));
    ins[i].resize(ins[i].size() + 64);  // an empty input still has an address
  }
  for (int i = 0; i < N_OUT; ++i) outs[i] = read_file(dir + "/out" + std::to_string(i));
  emu_dispatch(uint3{gx, gy, gz}, uint3{tx, ty, tz}, DISPATCH[&] { emulated_kernel(ARGS); });
  for (int i = 0; i < N_OUT; ++i) {
    std::ofstream f(dir + "/out" + std::to_string(i), std::ios::binary);
    f.write(outs[i].data(), outs[i].size());
  }
}
"""

_NUMPY = {mx.float32: np.float32, mx.int32: np.int32, mx.uint32: np.uint32, mx.uint8: np.uint8,
          mx.int8: np.int8, mx.int16: np.int16, mx.uint16: np.uint16, mx.int64: np.int64,
          mx.uint64: np.uint64, mx.bool_: np.bool_, mx.float16: np.uint16, mx.bfloat16: np.uint16}
"""How an array's bytes travel: 16-bit floats as their bits."""


def emulator_source(launch: Launch) -> str:
    """The C++ program that runs ``launch``'s Metal build: the emulator, the kernel's Metal
    header, the kernel as a function of plain pointers (template values as constants,
    thread attributes from the emulator), and a ``main`` that reads inputs and writes
    outputs as ``run`` lays them out."""
    build = launch.build
    kernel = build.kernel
    source = kernel.source("metal")
    params, args = kernel_parameters(launch, METAL_TYPES)
    lines = [f'#include "{HEADER}"', kernel.header("metal"), "void emulated_kernel(" + ", ".join(params) + ") {"]
    lines += template_declarations(build, METAL_TYPES)
    for name, kind in ATTRIBUTES.items():
        if name in source:
            if name not in ATTRIBUTE_VALUES:
                raise NotImplementedError(f"{kernel.name}: the emulator has no {name}")
            lines.append(f"  const {kind} {name} = {ATTRIBUTE_VALUES[name]};")
    return "\n".join([*lines, source, "}", main_source(launch, args)])


def kernel_parameters(launch: Launch, types: dict) -> tuple[list[str], list[str]]:
    """The emulated kernel function's parameters (each input as a pointer to its type in
    ``types``, then its ``_shape``/``_ndim`` where the body uses them, then the outputs) and
    the arguments ``main`` passes for them."""
    build = launch.build
    kernel = build.kernel
    source = kernel.source(build.backend)
    params, args = [], []
    for i, (name, dtype) in enumerate(zip(kernel.input_names, build.input_dtypes)):
        params.append(f"const {types[dtype]}* {name}")
        args.append(f"reinterpret_cast<const {types[dtype]}*>(ins[{i}].data())")
        if name + "_strides" in source:
            raise NotImplementedError(f"{kernel.name}: the emulator passes no strides ({name}_strides)")
        if name + "_shape" in source:
            params.append(f"const int* {name}_shape")
            args.append(f"shapes[{i}].data()")
        if name + "_ndim" in source:
            params.append(f"int {name}_ndim")
            args.append(f"ndims[{i}]")
    for i, (name, dtype) in enumerate(zip(kernel.output_names, build.output_dtypes)):
        params.append(f"{types[dtype]}* {name}")
        args.append(f"reinterpret_cast<{types[dtype]}*>(outs[{i}].data())")
    return params, args


def main_source(launch: Launch, args: list[str], dispatch: str = "") -> str:
    """The ``main`` of an emulated kernel's program: it reads the inputs and the outputs'
    initial bytes as ``execute`` lays them out, dispatches ``emulated_kernel(args)``
    (``dispatch``: more arguments of the emulator's ``emu_dispatch``) and writes the outputs."""
    kernel = launch.build.kernel
    return (_MAIN.replace("N_IN", str(len(kernel.input_names))).replace("N_OUT", str(len(kernel.output_names)))
            .replace("DISPATCH", dispatch).replace("ARGS", ", ".join(args)))


@functools.cache
def compiler_available() -> bool:
    """Whether this machine has the compiler the emulators need (g++ with ``_Float16``: 12+)."""
    if shutil.which("g++") is None:
        return False
    probe = subprocess.run(["g++", "-std=c++20", "-x", "c++", "-fsyntax-only", "-"], input="_Float16 h;",
                           capture_output=True, text=True)
    return probe.returncode == 0


def compiled(source: str) -> Path:
    """The executable built from ``source`` (g++, ``BUILD_FLAGS``), cached by the hash of the source,
    of the flags and of the emulators' headers it includes by path (so a changed header or flag
    rebuilds)."""
    folder = butter_cache_dir() / "kernel-emulator"
    folder.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(source.encode())
    key.update(" ".join(BUILD_FLAGS).encode())
    for header in sorted(HEADER.parent.glob("*.h")):
        key.update(header.read_bytes())
    executable = folder / key.hexdigest()[:24]
    if not executable.exists():
        cpp = executable.with_suffix(".cpp")
        cpp.write_text(source)
        partial = executable.with_suffix(".partial")
        done = subprocess.run(["g++", *BUILD_FLAGS, str(cpp), "-o", str(partial)], capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"g++ failed on {cpp}:\n{done.stderr[-4000:]}")
        partial.rename(executable)  # whole or absent: a killed build leaves no executable
    return executable


def run(launch: Launch) -> list[mx.array]:
    """``launch`` executed by the emulator: its outputs, as MLX's kernel would return them."""
    return execute(launch, emulator_source(launch))


def execute(launch: Launch, source: str) -> list[mx.array]:
    """``launch`` run by the program ``source`` (an emulator's, with ``main_source``'s
    ``main``): its outputs, as MLX's kernel would return them."""
    executable = compiled(source)
    with tempfile.TemporaryDirectory() as folder:
        shapes = []
        for i, x in enumerate(launch.inputs):
            shapes += [x.ndim, *x.shape]
            Path(folder, f"in{i}").write_bytes(_as_bytes(x))
        for i, (shape, dtype) in enumerate(zip(launch.output_shapes, launch.build.output_dtypes)):
            start = mx.full(shape, 0.0 if launch.init_value is None else launch.init_value, dtype)
            Path(folder, f"out{i}").write_bytes(_as_bytes(start))
        Path(folder, "launch.txt").write_text(" ".join(map(str, [*launch.grid, *launch.threadgroup, *shapes])))
        done = subprocess.run([str(executable), folder], capture_output=True, text=True)
        if done.returncode:
            fault = (" (a memory fault: an access out of bounds, or a thread past its 256 KB stack)"
                     if done.returncode == -signal.SIGSEGV else "")
            raise RuntimeError(f"emulated {launch.build.kernel.name} exited {done.returncode}{fault}: {done.stderr[-2000:]}")
        return [_from_bytes(Path(folder, f"out{i}").read_bytes(), shape, dtype)
                for i, (shape, dtype) in enumerate(zip(launch.output_shapes, launch.build.output_dtypes))]


@contextlib.contextmanager
def eager_traces() -> Iterator[None]:
    """Within this block ``mx.compile``d functions run as plain Python: an emulator evaluates a
    kernel's inputs, which a trace cannot (its inputs are placeholders), so the GPU paths that
    replay traces (``compile_by_shape``) run their kernels call by call instead."""
    _EAGER[0] += 1
    mx.disable_compile()
    try:
        yield
    finally:
        _EAGER[0] -= 1
        if not _EAGER[0] and not os.environ.get("MLX_DISABLE_COMPILE"):  # MLX's own switch, read at its start
            mx.enable_compile()


_EAGER = [0]
"""How many ``eager_traces`` blocks are open (compilation comes back when the last one closes)."""


@contextlib.contextmanager
def emulated_metal() -> Iterator[None]:
    """Within this block kernels take their Metal paths and run in the emulator (traces eagerly)."""
    with executed_by("metal", run), eager_traces():
        yield


def _as_bytes(x: mx.array) -> bytes:
    x = mx.contiguous(x)
    if x.dtype in (mx.float16, mx.bfloat16):
        x = mx.view(x, mx.uint16)
    return np.array(x).tobytes() if x.size else b""


def _from_bytes(data: bytes, shape: tuple[int, ...], dtype: mx.Dtype) -> mx.array:
    array = mx.array(np.frombuffer(data, _NUMPY[dtype]).reshape(shape))
    return mx.view(array, dtype) if dtype in (mx.float16, mx.bfloat16) else array


def main(argv: list[str] | None = None) -> int:
    return check_scheme(argv, "metal", emulated_metal, __doc__.splitlines()[0])


def check_scheme(argv: list[str] | None, backend: str, emulated, description: str) -> int:
    """The command line of an emulator: an installed scheme's kernel checks built for
    ``backend``, each case run within ``emulated()``; non-zero if any fails."""
    from butter_core.plugins import get_plugin_host  # noqa: PLC0415 - only the command needs the plugins

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("scheme", help="an installed scheme (butter plugins lists them)")
    parser.add_argument("checks", nargs="*", help=f"only these kernel checks (default: all built for {backend})")
    args = parser.parse_args(argv)
    schemes = get_plugin_host().schemes
    if args.scheme not in schemes:
        parser.error(f"no scheme {args.scheme!r}; installed: {', '.join(sorted(schemes))}")
    checks = [c for c in schemes[args.scheme].scheme.kernel_checks()
              if backend in c.backends and (not args.checks or c.name in args.checks)]
    failed = 0
    for check in checks:
        for seed, case in enumerate(check.cases):
            start = time.perf_counter()
            with emulated():
                result = check.check(seed, **case)
            failed += not result.passed
            print(f"{'ok  ' if result.passed else 'FAIL'} {check.name} {_case_text(case)} "
                  f"relative error {result.relative_error:.3g} (tolerance {result.tolerance:g}) "
                  f"{time.perf_counter() - start:.1f} s", flush=True)
    print(f"{failed} of {sum(len(c.cases) for c in checks)} cases failed")
    return 1 if failed else 0


def _case_text(case: dict) -> str:
    return re.sub(r"mlx\.core\.", "", str(case))


if __name__ == "__main__":
    sys.exit(main())
