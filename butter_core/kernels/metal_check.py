"""Check kernels' Metal sources on a machine without Metal, through clang's front end.

No Metal compiler runs outside macOS, yet a kernel written in the dialect builds for
Metal too, and Metal's rules differ from CUDA's where it matters most: every pointer has
an address space, and ``device``, ``constant``, ``threadgroup`` and ``thread`` pointers do
not convert. MLX passes an input of fewer than 8 elements as ``constant``, any other as
``device`` (``butter_core.kernels.dialect``), so a helper written for one fails to
compile for a call whose input is small — an error that only shows on a Mac, with
particular sizes.

This module renders the translation unit MLX would compile for a kernel call, as C++ for
OpenCL (``-cl-std=clc++2021``), whose address spaces ``__global``, ``__constant``,
``__local`` and ``__private`` follow the same rules as Metal's ``device``, ``constant``,
``threadgroup`` and ``thread``, with a shim of the Metal standard library the dialect
uses (``SHIM``), and parses it with libclang (``pip install libclang``). It reports
clang's errors: syntax, undeclared names, type and overload errors, and address-space
mismatches; and threadgroup arrays beyond Metal's 32 KiB (sized by clang). Each call is rendered twice: with its inputs' address spaces as MLX would
pass them, and with every input ``constant``, so that one call stands for any sizes.

It is a front-end check, not a Metal compile: no code is generated, and the shim stands
in for ``metal_stdlib`` (``bfloat16_t`` is clang's ``__bf16``, as Metal 3.1's ``bfloat``;
``half2`` is a struct, since clang's vector types do not parse Metal's ``half2(x, y)``).

- ``metal_builds(checks)``: the distinct ``Build``s that a scheme's kernel checks make on
  Metal (every case run under ``recorded_builds("metal")``: nothing executes).
- ``translation_unit(build, all_constant)``: the source checked.
- ``metal_errors(build)``: clang's errors for both renderings, each with its source line.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import mlx.core as mx

from butter_core.kernels.checks import KernelCheck, recorded_check_builds
from butter_core.kernels.kernel import Build

MAX_CONSTANT_ELEMENTS = 8
"""MLX passes an input of fewer elements in Metal's ``constant`` address space."""

MAX_THREADGROUP_MEMORY = 32 * 1024
"""Bytes of threadgroup memory a Metal kernel may use on Apple GPUs
(``maxThreadgroupMemoryLength``): more fails when the pipeline is made."""

METAL_TYPES = {
    mx.float32: "float",
    mx.float16: "float16_t",
    mx.bfloat16: "bfloat16_t",
    mx.bool_: "bool",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
}
"""MLX's names for dtypes in Metal kernel signatures."""

ATTRIBUTES = {
    "dispatch_quadgroups_per_threadgroup": "uint",
    "dispatch_simdgroups_per_threadgroup": "uint",
    "dispatch_threads_per_threadgroup": "uint3",
    "grid_origin": "uint3",
    "grid_size": "uint3",
    "quadgroup_index_in_threadgroup": "uint",
    "quadgroups_per_threadgroup": "uint",
    "simdgroup_index_in_threadgroup": "uint",
    "simdgroups_per_threadgroup": "uint",
    "thread_execution_width": "uint",
    "thread_index_in_quadgroup": "uint",
    "thread_index_in_simdgroup": "uint",
    "thread_index_in_threadgroup": "uint",
    "thread_position_in_grid": "uint3",
    "thread_position_in_threadgroup": "uint3",
    "threadgroup_position_in_grid": "uint3",
    "threadgroups_per_grid": "uint3",
    "threads_per_grid": "uint3",
    "threads_per_simdgroup": "uint",
    "threads_per_threadgroup": "uint3",
}
"""The thread attributes MLX appends to a Metal kernel's signature when its source names them."""

CLANG_ARGS = (
    "-x", "cl", "-cl-std=clc++2021", "-cl-no-stdinc",
    # No generic address space: a pointer declared without one cannot stand for the others.
    "-cl-ext=-__opencl_c_generic_address_space,+cl_khr_fp16",
)

SHIM = r"""
// The Metal standard library, as much as butter's dialect uses, for C++ for OpenCL.
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#define device __global
#define threadgroup __local
#define thread __private
#define constant __constant
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef signed char int8_t;
typedef short int16_t;
typedef int int32_t;
typedef long int64_t;
typedef unsigned char uint8_t;
typedef unsigned short uint16_t;
typedef unsigned int uint32_t;
typedef unsigned long uint64_t;
typedef uint uint2 __attribute__((ext_vector_type(2)));
typedef uint uint3 __attribute__((ext_vector_type(3)));
typedef uint uint4 __attribute__((ext_vector_type(4)));
typedef int int2 __attribute__((ext_vector_type(2)));
typedef float float2 __attribute__((ext_vector_type(2)));
typedef float float4 __attribute__((ext_vector_type(4)));
typedef ushort ushort2 __attribute__((ext_vector_type(2)));
struct half2 {  // a struct: clang's vector types do not parse Metal's half2(x, y)
  half x, y;
  half2() = default;
  half2(half a, half b) : x(a), y(b) {}
};
typedef half float16_t;
typedef __bf16 bfloat16_t;  // Metal 3.1's bfloat, which MLX names bfloat16_t
template <typename T, typename U> T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type needs types of one size");
  T t;
  __builtin_memcpy(&t, &x, sizeof(T));
  return t;
}
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2 };
void threadgroup_barrier(mem_flags);
void simdgroup_barrier(mem_flags);
template <typename T> T simd_shuffle(T, ushort);
template <typename T> T simd_shuffle_xor(T, ushort);
template <typename T> T simd_shuffle_down(T, ushort);
template <typename T> T simd_shuffle_up(T, ushort);
template <typename T> T simd_sum(T);
template <typename T> T simd_max(T);
template <typename T> T simd_min(T);
bool simd_any(bool);
bool simd_all(bool);
namespace metal {
float exp(float); float exp2(float); float log(float); float log2(float); float sqrt(float);
float rsqrt(float); float rint(float); float floor(float); float ceil(float); float abs(float);
float fabs(float); float fmax(float, float); float fma(float, float, float); half2 fma(half2, half2, half2);
template <typename T> T max(T, T);
template <typename T> T min(T, T);
template <typename T> T clamp(T, T, T);
template <typename T> struct numeric_limits { static T infinity(); static T max(); static T lowest(); };
namespace fast { float exp(float); float exp2(float); }
}
template <typename T> T bt_shim_attribute();
"""


def metal_builds(checks: Iterable[KernelCheck]) -> list[Build]:
    """The distinct Metal builds of every case of ``checks`` built for Metal: each case's
    inputs made, its kernel called under ``recorded_builds("metal")``. A kernel the case
    calls that cannot run on Metal (dynamic shared memory) raises, as it would there."""
    builds: dict[str, Build] = {}
    for build in recorded_check_builds(checks, "metal"):
        builds.setdefault(translation_unit(build) + translation_unit(build, all_constant=True), build)
    return list(builds.values())


def translation_unit(build: Build, all_constant: bool = False) -> str:
    """What MLX would compile for ``build`` on Metal, as C++ for OpenCL: the shim, the
    kernel's header, and the kernel with the signature MLX writes (inputs ``constant``
    below ``MAX_CONSTANT_ELEMENTS`` elements, or all ``constant`` with ``all_constant``).

    C++ for OpenCL kernels cannot be templates, so the template values become constants
    and type aliases at the top of the body (as MLX's CUDA kernels have them), and the
    thread attributes become locals."""
    if build.backend != "metal":
        raise ValueError(f"build of {build.kernel.name!r} is for {build.backend}, not metal")
    kernel = build.kernel
    source = kernel.source("metal")
    params = []
    for name, dtype, shape in zip(kernel.input_names, build.input_dtypes, build.input_shapes):
        space = "constant" if all_constant or math.prod(shape) < MAX_CONSTANT_ELEMENTS else "device"
        params.append(f"const {space} {METAL_TYPES[dtype]}{'&' if not shape else '*'} {name}")
        if shape:
            params += [
                declaration
                for suffix, declaration in (
                    ("_shape", f"const constant int* {name}_shape"),
                    ("_strides", f"const constant int64_t* {name}_strides"),
                    ("_ndim", f"const int {name}_ndim"),
                )
                if name + suffix in source
            ]
    params += [f"device {METAL_TYPES[dtype]}* {name}" for name, dtype in zip(kernel.output_names, build.output_dtypes)]
    lines = [SHIM, kernel.header("metal"), f"__kernel void {kernel.name}(" + ", ".join(params) + ") {"]
    lines += template_declarations(build)
    lines += [f"  const {kind} {name} = bt_shim_attribute<{kind}>();" for name, kind in ATTRIBUTES.items() if name in source]
    lines += [source, "}", ""]
    return "\n".join(lines)


def template_declarations(build: Build, types: dict = METAL_TYPES) -> list[str]:
    """``build``'s template values as the declarations that open a kernel body instead of
    template parameters (``constexpr int D = 128;``, ``using T = bfloat16_t;``), dtypes named
    as ``types`` names them."""
    lines = []
    for name, value in build.template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {name} = {str(value).lower()};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {name} = {value};")
        else:
            lines.append(f"  using {name} = {types[value]};")
    return lines


def metal_errors(build: Build) -> list[str]:
    """clang's errors for ``build`` rendered both ways (``translation_unit``), each as
    ``kernel (inputs as passed|all constant):line: message`` followed by the source line,
    and threadgroup arrays beyond ``MAX_THREADGROUP_MEMORY`` bytes; empty when both parse
    cleanly. Needs libclang (``pip install libclang``)."""
    from clang import cindex  # noqa: PLC0415 - optional: only this check needs libclang

    index = cindex.Index.create()
    errors = []
    for all_constant in (False, True):
        text = translation_unit(build, all_constant)
        path = f"{build.kernel.name}.clcpp"
        unit = index.parse(path, args=list(CLANG_ARGS), unsaved_files=[(path, text)])
        lines = text.splitlines()
        variant = "all constant" if all_constant else "inputs as passed"
        for diagnostic in unit.diagnostics:
            if diagnostic.severity < cindex.Diagnostic.Error:
                continue
            line = diagnostic.location.line
            notes = "".join(f"\n    note: {note.spelling}" for note in diagnostic.children)
            errors.append(f"{build.kernel.name} ({variant}):{line}: {diagnostic.spelling}\n"
                          f"    {lines[line - 1].strip() if 0 < line <= len(lines) else ''}{notes}")
        arrays = {
            cursor.spelling: cursor.type.get_size()
            for cursor in unit.cursor.walk_preorder()
            if cursor.kind == cindex.CursorKind.VAR_DECL and "__local" in cursor.type.spelling
        }
        if sum(arrays.values()) > MAX_THREADGROUP_MEMORY:
            errors.append(f"{build.kernel.name} ({variant}): {sum(arrays.values())} bytes of threadgroup memory, "
                          f"more than Metal's {MAX_THREADGROUP_MEMORY}: {arrays}")
    return errors


__all__ = ["metal_builds", "metal_errors", "template_declarations", "translation_unit"]
