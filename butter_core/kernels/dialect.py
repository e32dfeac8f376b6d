"""A small dialect so one kernel body builds for Metal and for CUDA.

A kernel body is the inside of a function whose signature MLX generates from the
input and output names (see "What MLX generates" below). The body, and the helper
functions it puts in its header, may use this vocabulary, which means the same on
both backends:

Locals bound by the preamble (prepended to every body):
    block_idx, thread_idx, block_dim, grid_dim, global_idx   uint3 (.x .y .z)
    thread_rank        unsigned int, linear index of the thread in its threadgroup
    lane_id, warp_id   unsigned int, index in the warp / simdgroup and of it
Macros:
    BT_SHARED          qualifier of a static shared (threadgroup) array
    BT_SHARED_PTR      address space of a pointer to shared memory in helper signatures
                       (``BT_SHARED_PTR float* buf``: Metal's ``threadgroup``, nothing on CUDA)
    BT_BARRIER         threadgroup barrier with shared-memory ordering
    BT_GLOBAL          address space of input/output pointers in helper signatures
    BT_PRIVATE         address space of a thread's own arrays in helper signatures
    BT_FUNC            qualifier of a helper function in a header
    BT_NEG_INF         -infinity as a float
    BT_WARP_SIZE       32, the warp / simdgroup width on both backends
    BT_DYNAMIC_SHARED(type, name)   CUDA only: the kernel's dynamic shared array
Functions:
    bt_to_float(x), bt_from_float<T>(f)   float32 / float16 / bfloat16 <-> float
    bt_exp(x), bt_exp2(x), bt_sqrt(x), bt_rint(x)   float; rint rounds half to even
    bt_as_float(u)                        the float whose bits are the uint32_t u
    bt_shuffle_xor(v, mask)               butterfly exchange within a warp
    bt_group_sum<W>(v), bt_group_max<W>(v)   reduce over aligned groups of W lanes
    bt_warp_sum(v), bt_warp_max(v)        reduce over the whole warp
    bt_load<N>(src, dst)                  N consecutive values from global memory into
                                          a float array (16-byte vector loads on CUDA;
                                          src must then be 16-byte aligned)

What MLX generates (read from MLX's custom-kernel sources, mlx 0.32):
- Metal: ``template <typename T, int D, ...> [[kernel]] void custom_kernel_<name>_<hash>(
  const device T* x [[buffer(i)]], const constant int* x_shape, const constant int64_t*
  x_strides, const constant int& x_ndim, ..., device U* out, <attributes>)``. An input
  with fewer than 8 elements is ``constant`` rather than ``device``; a 0-d input is
  passed by reference, not pointer, so pass scalars as shape-(1,) arrays and read x[0].
  Thread attributes are appended only when their name occurs in the *source* (not the
  header), which is why the preamble is part of the source. Attribute detection is a
  substring search: do not name a local after a Metal attribute (e.g. ``grid_size``).
- CUDA: the header is placed at global scope, then ``namespace mlx::core::cu { __global__
  void custom_kernel_<name><hash>(const T* x, const __grid_constant__ Shape x_shape,
  const __grid_constant__ Strides x_strides, const __grid_constant__ int x_ndim, ...,
  U* out) { using T = ...; constexpr int D = ...; <source> } }``. Shape and Strides are
  ``cuda::std::array<int32_t|int64_t, 10>``; dtypes map to ``float``, ``__half``,
  ``__nv_bfloat16``. MLX's own header defines the macro ``inf`` (so never use ``inf`` as a
  name); there is no ``uint`` type. It compiles with NVRTC, C++17, functions device by
  default. The kernel is cached by name and template values only, not by input dtypes:
  template on every dtype that can vary.
- On both, ``*_shape``/``*_strides``/``*_ndim`` are passed only when the source mentions
  them; grid is the total number of threads (MLX divides by the threadgroup on CUDA).
"""

from __future__ import annotations

from butter_core.kernels.backend import Backend

_METAL_PREAMBLE = """\
  const uint3 block_idx = threadgroup_position_in_grid;
  const uint3 thread_idx = thread_position_in_threadgroup;
  const uint3 block_dim = threads_per_threadgroup;
  const uint3 grid_dim = threadgroups_per_grid;
  const uint3 global_idx = thread_position_in_grid;
  const unsigned int thread_rank = thread_index_in_threadgroup;
  const unsigned int lane_id = thread_index_in_simdgroup;
  const unsigned int warp_id = simdgroup_index_in_threadgroup;
"""

_CUDA_PREAMBLE = """\
  const uint3 block_idx = blockIdx;
  const uint3 thread_idx = threadIdx;
  const uint3 block_dim = make_uint3(blockDim.x, blockDim.y, blockDim.z);
  const uint3 grid_dim = make_uint3(gridDim.x, gridDim.y, gridDim.z);
  const uint3 global_idx = make_uint3(blockIdx.x * blockDim.x + threadIdx.x,
                                      blockIdx.y * blockDim.y + threadIdx.y,
                                      blockIdx.z * blockDim.z + threadIdx.z);
  const unsigned int thread_rank =
      threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned int lane_id = thread_rank % BT_WARP_SIZE;
  const unsigned int warp_id = thread_rank / BT_WARP_SIZE;
"""

_METAL_PRIMITIVES = """\
#define BT_SHARED threadgroup
#define BT_SHARED_PTR threadgroup
#define BT_BARRIER threadgroup_barrier(mem_flags::mem_threadgroup)
#define BT_GLOBAL device
#define BT_PRIVATE thread
#define BT_FUNC inline
#define BT_WARP_SIZE 32
#define BT_NEG_INF (-metal::numeric_limits<float>::infinity())

template <typename T> BT_FUNC float bt_to_float(T x) { return static_cast<float>(x); }
template <typename T> BT_FUNC T bt_from_float(float x) { return static_cast<T>(x); }
BT_FUNC float bt_exp(float x) { return metal::exp(x); }
BT_FUNC float bt_exp2(float x) { return metal::exp2(x); }
BT_FUNC float bt_sqrt(float x) { return metal::sqrt(x); }
BT_FUNC float bt_rint(float x) { return metal::rint(x); }
BT_FUNC float bt_as_float(uint32_t u) { return as_type<float>(u); }
BT_FUNC float bt_shuffle_xor(float v, int mask) {
  return simd_shuffle_xor(v, static_cast<ushort>(mask));
}

template <int N, typename T>
BT_FUNC void bt_load(const BT_GLOBAL T* src, BT_PRIVATE float* dst) {
  for (int i = 0; i < N; ++i) {
    dst[i] = bt_to_float(src[i]);
  }
}
"""

_CUDA_PRIMITIVES = """\
#define BT_SHARED __shared__
#define BT_SHARED_PTR
#define BT_BARRIER __syncthreads()
#define BT_GLOBAL
#define BT_PRIVATE
#define BT_FUNC __device__ __forceinline__
#define BT_WARP_SIZE 32
#define BT_NEG_INF (-cuda::std::numeric_limits<float>::infinity())
#define BT_DYNAMIC_SHARED(type, name) extern __shared__ type name[]

BT_FUNC float bt_to_float(float x) { return x; }
BT_FUNC float bt_to_float(__half x) { return __half2float(x); }
BT_FUNC float bt_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> BT_FUNC T bt_from_float(float x);
template <> BT_FUNC float bt_from_float<float>(float x) { return x; }
template <> BT_FUNC __half bt_from_float<__half>(float x) { return __float2half_rn(x); }
template <> BT_FUNC __nv_bfloat16 bt_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}
BT_FUNC float bt_exp(float x) { return __expf(x); }
BT_FUNC float bt_exp2(float x) { return exp2f(x); }
BT_FUNC float bt_sqrt(float x) { return sqrtf(x); }
BT_FUNC float bt_rint(float x) { return rintf(x); }
BT_FUNC float bt_as_float(uint32_t u) { return __uint_as_float(u); }
BT_FUNC float bt_shuffle_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}

template <int N, typename T>
BT_FUNC void bt_load(const T* src, float* dst) {
  constexpr int bytes = N * static_cast<int>(sizeof(T));
  if constexpr (bytes % 16 == 0) {
    constexpr int per_vector = 16 / static_cast<int>(sizeof(T));
#pragma unroll
    for (int c = 0; c < bytes / 16; ++c) {
      const uint4 raw = reinterpret_cast<const uint4*>(src)[c];
      const T* elems = reinterpret_cast<const T*>(&raw);
#pragma unroll
      for (int j = 0; j < per_vector; ++j) {
        dst[c * per_vector + j] = bt_to_float(elems[j]);
      }
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = bt_to_float(src[i]);
    }
  }
}
"""

_GROUP_REDUCTIONS = """\
template <int W> BT_FUNC float bt_group_sum(float v) {
  for (int offset = W / 2; offset > 0; offset /= 2) {
    v += bt_shuffle_xor(v, offset);
  }
  return v;
}
template <int W> BT_FUNC float bt_group_max(float v) {
  for (int offset = W / 2; offset > 0; offset /= 2) {
    const float other = bt_shuffle_xor(v, offset);
    v = other > v ? other : v;
  }
  return v;
}
"""

_METAL_WARP_REDUCTIONS = """\
BT_FUNC float bt_warp_sum(float v) { return simd_sum(v); }
BT_FUNC float bt_warp_max(float v) { return simd_max(v); }
"""

_CUDA_WARP_REDUCTIONS = """\
BT_FUNC float bt_warp_sum(float v) { return bt_group_sum<BT_WARP_SIZE>(v); }
BT_FUNC float bt_warp_max(float v) { return bt_group_max<BT_WARP_SIZE>(v); }
"""

PREAMBLE: dict[Backend, str] = {"metal": _METAL_PREAMBLE, "cuda": _CUDA_PREAMBLE}
"""Binds the dialect's thread-index locals; prepended to every kernel body."""

HEADER: dict[Backend, str] = {
    "metal": _METAL_PRIMITIVES + _GROUP_REDUCTIONS + _METAL_WARP_REDUCTIONS,
    "cuda": _CUDA_PRIMITIVES + _GROUP_REDUCTIONS + _CUDA_WARP_REDUCTIONS,
}
"""Macros and helper functions of the dialect; put before a kernel's own helpers."""


def kernel_source(backend: Backend, body: str) -> str:
    """The source MLX receives for a kernel body: the preamble, then the body."""
    return PREAMBLE[backend] + body


def kernel_header(backend: Backend, helpers: str = "") -> str:
    """The header MLX receives: the dialect, then the kernel's own helper functions."""
    return HEADER[backend] + helpers
