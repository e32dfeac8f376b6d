"""CUDA kernels compiled once per install: butter compiles each build itself and hands MLX
the binary by name.

``mx.fast.cuda_kernel`` compiles a kernel with NVRTC the first time a process calls it
(1.6-5 s per build on an H200) and keeps the binary only in that process, so every process
paid seconds of compilation before its first token. It also re-assembles and hashes the
whole source (header and body, tens of KB) on every call, a host cost that grows with the
source. This module takes the other road MLX offers, ``mx.fast.precompiled_cuda_kernel``:

- ``render`` writes a build as one stand-alone CUDA translation unit: the dialect's header,
  an ``extern "C"`` kernel whose parameters are the inputs, the outputs, and each input's
  shape as ``int`` scalars where the body reads ``<name>_shape`` (it gets a local array of
  that name), template values as constants. Its symbol carries a digest of all of it.
- ``compile_source`` compiles it with NVRTC (the library MLX loaded; through ctypes) for
  this device, with the options MLX uses for its own custom kernels, so results match.
- The binary is kept under ``butter_cache_dir()/cuda-kernels`` (survives reboots) and
  placed in MLX's kernel directory (``MLX_PTX_CACHE_DIR``, else ``<tmp>/mlx/<version>/ptx``)
  under the module name MLX derives for the call: ``<symbol>_<std::hash of the source
  argument>``. The source argument passed on each call is the symbol itself, a few dozen
  bytes; MLX looks in that directory before it would compile, finds the binary and loads it.

That last step relies on how MLX 0.32 loads precompiled kernels (``JitModule`` reads its
directory first; the module name is ``name_hash``; a precompiled kernel's parameters are
the inputs, the outputs, then the scalars), not on a documented contract. So once per
install butter runs a probe kernel this way in a child process (a kernel launched with the
wrong parameters faults the GPU and leaves that process's CUDA context unusable) and
compares its output; if anything fails — another MLX, no NVRTC, an unwritable directory —
butter warns once and every kernel takes ``mx.fast.cuda_kernel`` as before. The path is
the default on CUDA; ``BUTTER_CUDA_BINARIES=0`` turns it off (measured on an H100:
docs/benchmarks.md, "Issue 32 and 33 on an H100, fourth session").
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import os
import re
import subprocess
import sys
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import mlx.core as mx

from butter_core.kernels.backend import cuda_compute_capability
from butter_core.loading.gguf import butter_cache_dir

if TYPE_CHECKING:
    from butter_core.kernels.kernel import Build, Kernel, TemplateArg

ENV_SWITCH = "BUTTER_CUDA_BINARIES"
"""``0`` compiles every kernel through ``mx.fast.cuda_kernel`` in each process; unset or
anything else runs kernels from binaries compiled once per install (docs/architecture.md)."""

CUDA_TYPES = {
    mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.bool_: "bool",
    mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t", mx.uint8: "uint8_t",
    mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
}
"""The CUDA type of each dtype, as MLX's CUDA kernels declare it."""

PRELUDE = """\
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace cg = cooperative_groups;
"""
"""What a stand-alone build includes before the kernel's header: the headers MLX's own
custom-kernel prelude (``mlx/backend/cuda/device/utils.cuh``) brings in and the dialect
relies on."""

COMPILE_OPTIONS = ("--device-as-default-execution-space", "-std=c++17")
"""NVRTC options besides the architecture and include paths: MLX's for custom kernels."""

_STD_HASH_SEED = 0xC70F6907
"""libstdc++'s seed for ``std::hash<std::string>`` (``std::_Hash_bytes``)."""


class CudaBinaryError(RuntimeError):
    """Raised when a build cannot be compiled or placed where MLX loads it."""


@attrs.frozen
class Rendered:
    """One build as a stand-alone translation unit: its ``extern "C"`` symbol, the
    source, and the input names whose shapes it takes as scalars (in parameter order)."""

    symbol: str
    source: str
    shaped_inputs: tuple[int, ...]


def render(kernel: Kernel, template: Sequence[TemplateArg], input_dtypes: Sequence[mx.Dtype],
           input_ndims: Sequence[int], output_dtypes: Sequence[mx.Dtype]) -> Rendered:
    """``kernel``'s build for these template values and dtypes as one CUDA source (see the
    module's docstring); the symbol is ``bt_<name>_<digest of source, options and NVRTC>``."""
    from butter_core.kernels.metal_check import template_declarations  # noqa: PLC0415 - cycle via kernel
    from butter_core.kernels.kernel import Build  # noqa: PLC0415

    body = kernel.source("cuda")
    params, scalars, shape_locals, shaped = [], [], [], []
    for i, (name, dtype, ndim) in enumerate(zip(kernel.input_names, input_dtypes, input_ndims)):
        params.append(f"const {CUDA_TYPES[dtype]}* {name}")
        if re.search(rf"\b{name}_strides\b", body):
            raise CudaBinaryError(f"kernel {kernel.name!r} reads {name}_strides, which a precompiled build is not passed")
        if re.search(rf"\b{name}_shape\b", body):
            scalars += [f"int {name}_shape_{d}" for d in range(ndim)]
            dims = ", ".join(f"{name}_shape_{d}" for d in range(ndim))
            shape_locals.append(f"  const int {name}_shape[{max(ndim, 1)}] = {{{dims}}};")
            shaped.append(i)
        if re.search(rf"\b{name}_ndim\b", body):
            shape_locals.append(f"  constexpr int {name}_ndim = {ndim};")
    params += [f"{CUDA_TYPES[dtype]}* {name}" for name, dtype in zip(kernel.output_names, output_dtypes)]
    params += scalars
    build = Build(kernel=kernel, backend="cuda", template=tuple(template), input_dtypes=tuple(input_dtypes),
                  input_shapes=(), output_dtypes=tuple(output_dtypes))
    lines = [PRELUDE, kernel.header("cuda"), 'extern "C" __global__ void BT_SYMBOL(',
             "    " + ",\n    ".join(params) + ") {", *shape_locals, *template_declarations(build, CUDA_TYPES),
             body, "}", ""]
    source = "\n".join(lines)
    digest = hashlib.sha256("\n".join([source, *COMPILE_OPTIONS, _nvrtc_version_text()]).encode()).hexdigest()
    symbol = f"bt_{kernel.name}_{digest[:20]}"
    return Rendered(symbol=symbol, source=source.replace("BT_SYMBOL", symbol), shaped_inputs=tuple(shaped))


def render_build(build: Build) -> Rendered:
    """``render`` for a recorded ``Build`` (its inputs' ranks from their shapes)."""
    return render(build.kernel, build.template, build.input_dtypes, [len(s) for s in build.input_shapes],
                  build.output_dtypes)


# ---- NVRTC -------------------------------------------------------------------------------


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    """The NVRTC library MLX compiles with: the one already mapped into this process, else
    the first found on the usual paths."""
    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates += sorted({line.split()[-1] for line in maps if "libnvrtc.so" in line and "builtins" not in line})
    except OSError:
        pass
    candidates += ["libnvrtc.so.13", "libnvrtc.so.12", ctypes.util.find_library("nvrtc") or "libnvrtc.so"]
    for root in {Path(mx.__file__).resolve().parents[1], Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))}:
        candidates += sorted(str(p) for p in root.glob("nvidia/*/lib/libnvrtc.so*"))
        candidates += sorted(str(p) for p in root.glob("lib64/libnvrtc.so*"))
    for candidate in candidates:
        try:
            library = ctypes.CDLL(candidate)
        except OSError:
            continue
        library.nvrtcGetErrorString.restype = ctypes.c_char_p
        return library
    raise CudaBinaryError("no NVRTC library (libnvrtc.so) found; tried " + ", ".join(candidates))


def _check(result: int, what: str) -> None:
    if result != 0:
        raise CudaBinaryError(f"{what} failed: {_nvrtc().nvrtcGetErrorString(result).decode()}")


@functools.cache
def _nvrtc_version() -> tuple[int, int]:
    """The NVRTC library's (major, minor) version."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(_nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


@functools.cache
def _nvrtc_version_text() -> str:
    """NVRTC's version and the device's compute capability: part of every build's digest."""
    cc = cuda_compute_capability()
    if cc is None:
        return "no-device"
    major, minor = _nvrtc_version()
    return f"nvrtc {major}.{minor} sm {cc[0]}.{cc[1]}"


@functools.cache
def include_paths() -> tuple[str, ...]:
    """The directories NVRTC searches, as MLX's JIT gives them: MLX's bundled headers and
    CCCL, then the CUDA runtime headers of the NVIDIA Python packages, ``CUDA_HOME`` /
    ``CUDA_PATH``, or ``/usr/local/cuda`` (each with its ``cccl`` folder, where CUDA 13 keeps
    ``cuda/std``)."""
    mlx_root = Path(mx.__file__).resolve().parents[0]
    if mlx_root.name == "core":
        mlx_root = mlx_root.parent
    found = [mlx_root / "include"]
    found += [mlx_root.parent / "nvidia" / name / "include" for name in ("cu13", "cuda_runtime")]
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            found.append(Path(os.environ[env]) / "include")
    found.append(Path("/usr/local/cuda/include"))
    return tuple(dict.fromkeys(str(path) for root in found for path in (root, root / "cccl") if path.is_dir()))


def compile_source(source: str, symbol: str, capability: tuple[int, int] | None = None) -> bytes:
    """``source`` compiled by NVRTC for ``capability`` (default: this device's): a cubin
    (``sm_XY``, ``sm_XYa`` from 9.0, as MLX targets), or PTX where this NVRTC predates 11.8.
    Raises ``CudaBinaryError`` with NVRTC's log when it does not compile."""
    nvrtc = _nvrtc()
    cc = capability or cuda_compute_capability()
    if cc is None:
        raise CudaBinaryError("no CUDA device compute capability reported by MLX")
    cubin = _nvrtc_version() >= (11, 8)
    arch = f"--gpu-architecture={'sm' if cubin else 'compute'}_{cc[0]}{cc[1]}{'a' if cc[0] >= 9 else ''}"
    options = [arch, *COMPILE_OPTIONS, *(f"--include-path={path}" for path in include_paths())]
    program = ctypes.c_void_p()
    _check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), f"{symbol}.cu".encode(), 0, None, None),
           "nvrtcCreateProgram")
    try:
        encoded = [option.encode() for option in options]
        result = nvrtc.nvrtcCompileProgram(program, len(encoded), (ctypes.c_char_p * len(encoded))(*encoded))
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise CudaBinaryError(f"NVRTC could not compile {symbol}:\n{log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        get_size, get = ("nvrtcGetCUBINSize", "nvrtcGetCUBIN") if cubin else ("nvrtcGetPTXSize", "nvrtcGetPTX")
        _check(getattr(nvrtc, get_size)(program, ctypes.byref(size)), get_size)
        binary = ctypes.create_string_buffer(size.value)
        _check(getattr(nvrtc, get)(program, binary), get)
        return binary.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


# ---- where MLX looks ---------------------------------------------------------------------


def mlx_kernel_dir() -> Path:
    """The directory MLX's CUDA JIT reads compiled modules from: ``MLX_PTX_CACHE_DIR``, else
    ``<temp>/mlx/<MLX version>/ptx`` with ``<temp>`` as C++'s ``temp_directory_path``
    (``TMPDIR``, ``TMP``, ``TEMP``, ``TEMPDIR``, else ``/tmp``)."""
    if os.environ.get("MLX_PTX_CACHE_DIR"):
        return Path(os.environ["MLX_PTX_CACHE_DIR"]).absolute()
    temp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(temp).absolute() / "mlx" / mx.__version__ / "ptx"


@functools.cache
def _hash_bytes() -> ctypes._CFuncPtr:
    function = ctypes.CDLL("libstdc++.so.6")._ZSt11_Hash_bytesPKvmm
    function.restype = ctypes.c_size_t
    function.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return function


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` of ``data``, as MLX computes it to name a module."""
    return _hash_bytes()(data, len(data), _STD_HASH_SEED)


def module_path(symbol: str) -> Path:
    """Where MLX looks for the module of a precompiled kernel called ``symbol`` whose source
    argument is the symbol itself."""
    return mlx_kernel_dir() / f"{symbol}_{std_hash(symbol.encode()):x}.ptx"


def binary_store() -> Path:
    """butter's own copy of every binary it compiled, kept across reboots."""
    return butter_cache_dir() / "cuda-kernels" / mx.__version__


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    partial.write_bytes(data)
    os.replace(partial, path)


_LOCK = threading.Lock()
_PLACED: set[str] = set()


def place(rendered: Rendered) -> None:
    """Make sure MLX will find ``rendered``'s binary: in this process only the first time;
    from butter's store, else compiled now (and stored)."""
    if rendered.symbol in _PLACED:
        return
    with _LOCK:
        if rendered.symbol in _PLACED:
            return
        target = module_path(rendered.symbol)
        if not target.exists():
            stored = binary_store() / f"{rendered.symbol}.bin"
            if stored.exists():
                binary = stored.read_bytes()
            else:
                binary = compile_source(rendered.source, rendered.symbol)
                _write_atomically(stored, binary)
                _write_atomically(stored.with_suffix(".cu"), rendered.source.encode())
            # MLX reads the symbol table (.txt) after it finds the binary (.ptx): write it first.
            _write_atomically(target.with_suffix(".txt"), f"{rendered.symbol}\t{rendered.symbol}\n".encode())
            _write_atomically(target, binary)
        _PLACED.add(rendered.symbol)


def launch(rendered: Rendered, *, inputs: Sequence[mx.array], output_shapes: Sequence[Sequence[int]],
           output_dtypes: Sequence[mx.Dtype], grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
           shared_memory: int, init_value: float | None) -> list[mx.array]:
    """Run ``rendered`` (placed) on the GPU stream, as ``mx.fast.cuda_kernel`` would run
    the same build."""
    scalars = [dim for i in rendered.shaped_inputs for dim in inputs[i].shape]
    return mx.fast.precompiled_cuda_kernel(
        name=rendered.symbol, compiled_source=rendered.symbol.encode(), inputs=list(inputs),
        output_shapes=[tuple(s) for s in output_shapes], output_dtypes=list(output_dtypes), scalars=scalars,
        grid=grid, threadgroup=threadgroup, shared_memory=shared_memory, init_value=init_value,
        ensure_row_contiguous=True, stream=mx.gpu)


# ---- whether this process uses them -------------------------------------------------------


_PROBE_BODY = """\
  const int i = static_cast<int>(global_idx.x);
  if (i < values_shape[0]) {
    out[i] = values[i] * static_cast<float>(SCALE) + static_cast<float>(values_shape[0]);
  }
"""

PROBE_TIMEOUT_S = 300
"""How long the probe's own process may take (it compiles one small kernel)."""


def _probe() -> Rendered:
    """The probe kernel rendered (not yet placed or run)."""
    from butter_core.kernels.kernel import Kernel  # noqa: PLC0415 - cycle

    probe = Kernel("butter_cuda_binary_probe", ["values"], ["out"], _PROBE_BODY)
    return render(probe, [("SCALE", 3)], [mx.float32], [1], [mx.float32])


def run_probe() -> None:
    """Place the probe kernel, run it from its binary in this process and check its answer;
    raises where any of it fails. A kernel launched with the wrong arguments can fault the GPU
    and leave this process's CUDA context unusable, so butter runs this in a process of its own."""
    rendered = _probe()
    place(rendered)
    values = mx.arange(7, dtype=mx.float32)
    (out,) = launch(rendered, inputs=[values], output_shapes=[(7,)], output_dtypes=[mx.float32],
                    grid=(32, 1, 1), threadgroup=(32, 1, 1), shared_memory=0, init_value=None)
    if not mx.array_equal(out, values * 3 + 7).item():
        raise CudaBinaryError(f"the probe kernel computed {out.tolist()}")


def _probe_elsewhere() -> str | None:
    """Run ``run_probe`` in a child process; None where it passed, else why it failed."""
    try:
        child = subprocess.run([sys.executable, "-m", __name__], capture_output=True, text=True,
                               timeout=PROBE_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"the probe process did not finish: {error}"
    if child.returncode == 0:
        return None
    lines = (child.stderr or child.stdout).strip().splitlines()
    return lines[-1] if lines else f"the probe process exited with status {child.returncode}"


@functools.cache
def available() -> bool:
    """Whether kernels run from binaries compiled here: MLX has CUDA, ``BUTTER_CUDA_BINARIES``
    is not ``0``, and the probe kernel run that way gave the right answer, in a process of its own,
    once per install (a marker beside the binaries records it). Warns once, naming the reason,
    where the probe fails."""
    if os.environ.get(ENV_SWITCH) == "0" or not mx.cuda.is_available():
        return False
    try:
        marker = binary_store() / f"{_probe().symbol}.passed"
        if marker.exists():
            return True
        reason = _probe_elsewhere()
        if reason is None:
            _write_atomically(marker, b"")
    except (CudaBinaryError, OSError) as error:
        reason = str(error)
    if reason is not None:
        warnings.warn(f"butter: CUDA kernels compile in every process (mx.fast.cuda_kernel), because running a "
                      f"precompiled kernel failed: {reason}. Set {ENV_SWITCH}=0 to silence this.", stacklevel=2)
        return False
    return True


if __name__ == "__main__":
    run_probe()
