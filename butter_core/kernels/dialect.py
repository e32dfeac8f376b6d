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
    BT_GLOBAL          address space of output pointers in helper signatures (for input
                       pointers see "Inputs' address space" below)
    BT_PRIVATE         address space of a thread's own arrays in helper signatures
    BT_FUNC            qualifier of a helper function in a header
    BT_NEG_INF         -infinity as a float
    BT_WARP_SIZE       32, the warp / simdgroup width on both backends
    BT_DYNAMIC_SHARED(type, name)   CUDA only: the kernel's dynamic shared array
Functions:
    bt_to_float(x), bt_from_float<T>(f)   float32 / float16 / bfloat16 <-> float
    bt_exp(x), bt_exp2(x), bt_sqrt(x), bt_rint(x)   float; rint rounds half to even; on
                                          CUDA exp and exp2 are the hardware's approximations
                                          (about 2 ulp, results below 2^-126 flush to zero)
    bt_max(a, b)                          the larger float (one instruction; a NaN loses)
    bt_as_float(u)                        the float whose bits are the uint32_t u
    bt_shuffle_xor(v, mask)               butterfly exchange within a warp
    bt_group_sum<W>(v), bt_group_max<W>(v)   reduce over aligned groups of W lanes
    bt_warp_sum(v), bt_warp_max(v)        reduce over the whole warp
    bt_read(p)                            ``*p`` for a pointer to an input the kernel
                                          never writes, through the read-only data path
                                          (CUDA: ``__ldg``; Metal: a plain load)
    bt_read_if<RO>(p)                     ``bt_read(p)`` when ``RO``, else a plain ``*p`` (for
                                          kernels that make the read-only path a tunable)
    bt_prefetch_l2(p)                     a hint that the cache line holding ``p`` (an
                                          input's address) is read soon: CUDA fetches it
                                          into L2 (``prefetch.global.L2``, nothing held in
                                          registers); Metal and the emulators do nothing
    bt_reinterpret<V>(p)                  ``p``, a pointer to an input, as a pointer to ``V``
                                          in the same address space (e.g. ``uint4`` for
                                          16-byte loads)
    bt_load<N>(src, dst)                  N consecutive values from global memory into
                                          a float array (16-byte vector loads on CUDA;
                                          src must then be 16-byte aligned)

Tensor-core vocabulary, in kernels built with ``Kernel(..., mma=True)`` only (so no other
kernel's source changes). ``half2`` values travel as ``uint32_t``: the lower 16 bits hold
the first, lower-index element, as CUDA's ``__half2`` and Metal's ``half2`` do.
    bt_any(p)                             whether ``p`` holds in any lane of the warp
                                          (every lane must call it)
    bt_shuffle_u32(v, src_lane)           the uint32_t ``v`` of lane ``src_lane`` (every
                                          lane must call it)
    bt_half2_fma(a, b, c)                 per half: a * b + c, rounded once to float16
    bt_pack_half2(lo, hi)                 two floats rounded to float16, as a half2
    bt_byte_perm(x, y, s)                 CUDA's ``__byte_perm``: byte n of the result is
                                          byte ``(s >> 4n) & 7`` of the 8 bytes ``y:x``
                                          (x's bytes are 0..3); selector nibbles must be < 8
    bt_mma_16x8x16(c, a, b, lane)         ``D = A B + C`` for A 16x16 and B 16x8 in float16,
                                          C/D 16x8 in float32, spread over the warp's 32
                                          lanes exactly as CUDA's ``mma.sync.aligned.m16n8k16
                                          .row.col.f32.f16.f16.f32`` spreads them. Every lane
                                          of the warp must call it (uniform control flow).
                                          With g = lane / 4 and q = lane % 4:
                                            a[0] = A[g][2q, 2q+1]      a[1] = A[g+8][2q, 2q+1]
                                            a[2] = A[g][2q+8, 2q+9]    a[3] = A[g+8][2q+8, 2q+9]
                                            b[0] = B[2q, 2q+1][g]      b[1] = B[2q+8, 2q+9][g]
                                            c[0], c[1] = C[g][2q], C[g][2q+1]
                                            c[2], c[3] = C[g+8][2q], C[g+8][2q+1]
                                          (a[i], b[i]: half2 of the two elements named; ``c``
                                          is updated in place; ``lane`` is ``lane_id``).
                                          On CUDA it is one tensor-core instruction (products
                                          exact, sums in float32 with the hardware's own
                                          order and rounding). On Metal it is a plain,
                                          slow emulation of the same per-lane contract with
                                          ``simd_shuffle`` (32 shuffles and 64 float FMAs per
                                          lane), written to be correct, never compiled or
                                          run here (no Apple GPU): a Metal kernel that wants
                                          speed should use ``simdgroup_matrix`` instead.
    bt_transpose_8x8(v, lane)             the transpose of the 8x8 matrix of halves the
                                          warp holds one half2 per lane, lane (g, q) row g,
                                          columns 2q, 2q+1 (the layout of each register of
                                          ``bt_mma_16x8x16``'s B operand and of each half of
                                          its C): lane (g, q) gets M[2q][g], M[2q+1][g].
                                          Every lane must call it. On CUDA one
                                          ``movmatrix`` instruction; elsewhere two shuffles
                                          and a byte permute.

Inputs' address space. On Metal an input of fewer than 8 elements arrives in the
``constant`` address space, any other in ``device`` (below), and the two do not convert:
so a kernel never names an input's address space. A helper that takes a pointer to an
input deduces its type (``template <typename In> BT_FUNC float f(In p)``) and a local
pointer into an input is declared ``auto`` (``const auto row = codes + i * W;``). Every
tiny input is then handled alike: a 2-element parameter array, an empty ring of slots,
a cache of one short row. ``butter_core.kernels.metal_check`` checks this, among other
things, where no Metal compiler is at hand.

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
  default. By default (``BUTTER_CUDA_BINARIES`` not ``0``) ``Kernel`` instead renders a CUDA build itself
  (``cuda_binaries``: the same body, template constants and ``<name>_shape`` locals, under
  an ``extern "C"`` signature of its own, without MLX's header), compiles it once per
  install and runs it through ``mx.fast.precompiled_cuda_kernel``. Through MLX's
  JIT ``Kernel`` adds a template value ``BT_BUILD`` digesting the source and the inputs' and
  outputs' dtypes (``kernel.BUILD_KEY``), so never name anything ``BT_BUILD``.
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
#ifdef BT_EMULATED  // butter_core.kernels.metal_emulator: a threadgroup's threads share statics
#define BT_SHARED static
#else
#define BT_SHARED threadgroup
#endif
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
BT_FUNC float bt_max(float a, float b) { return metal::fmax(a, b); }
BT_FUNC float bt_as_float(uint32_t u) { return as_type<float>(u); }
BT_FUNC float bt_shuffle_xor(float v, int mask) {
  return simd_shuffle_xor(v, static_cast<ushort>(mask));
}
template <typename T> BT_FUNC T bt_read(const device T* p) { return *p; }
template <bool RO, typename T> BT_FUNC T bt_read_if(const device T* p) { return *p; }
template <typename P> BT_FUNC void bt_prefetch_l2(P) {}
template <typename V, typename T> BT_FUNC const device V* bt_reinterpret(const device T* p) {
  return reinterpret_cast<const device V*>(p);
}
#ifndef BT_EMULATED  // without address spaces these would repeat the device overloads
template <typename T> BT_FUNC T bt_read(const constant T* p) { return *p; }
template <bool RO, typename T> BT_FUNC T bt_read_if(const constant T* p) { return *p; }
template <typename V, typename T> BT_FUNC const constant V* bt_reinterpret(const constant T* p) {
  return reinterpret_cast<const constant V*>(p);
}
#endif

template <int N, typename In>
BT_FUNC void bt_load(In src, BT_PRIVATE float* dst) {
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
// 2^x by the hardware's approximation (ex2.approx.ftz: about 2 ulp, results below 2^-126
// flush to zero, 2 to the minus infinity is +0), as bt_exp's __expf is; exp2f where the
// source is not compiled for a GPU (the CPU emulator).
BT_FUNC float bt_exp2(float x) {
#ifdef __CUDA_ARCH__
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
#else
  return exp2f(x);
#endif
}
BT_FUNC float bt_sqrt(float x) { return sqrtf(x); }
BT_FUNC float bt_rint(float x) { return rintf(x); }
BT_FUNC float bt_max(float a, float b) { return fmaxf(a, b); }
BT_FUNC float bt_as_float(uint32_t u) { return __uint_as_float(u); }
BT_FUNC float bt_shuffle_xor(float v, int mask) {
  return __shfl_xor_sync(0xffffffffu, v, mask);
}
template <typename T> BT_FUNC T bt_read(const T* p) { return __ldg(p); }
template <bool RO, typename T> BT_FUNC T bt_read_if(const T* p) { return RO ? __ldg(p) : *p; }
BT_FUNC void bt_prefetch_l2(const void* p) {
#ifdef __CUDA_ARCH__
  asm volatile("prefetch.global.L2 [%0];" : : "l"(p));
#endif
}
template <typename V, typename T> BT_FUNC const V* bt_reinterpret(const T* p) {
  return reinterpret_cast<const V*>(p);
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

_CUDA_MMA = r"""
// ---- tensor-core vocabulary (CUDA: PTX) ----
BT_FUNC bool bt_any(bool p) { return __any_sync(0xffffffffu, p); }
BT_FUNC uint32_t bt_shuffle_u32(uint32_t v, int src_lane) {
  return __shfl_sync(0xffffffffu, v, src_lane);
}
BT_FUNC uint32_t bt_half2_fma(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
BT_FUNC uint32_t bt_pack_half2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));  // first operand -> upper half
  return d;
}
BT_FUNC uint32_t bt_byte_perm(uint32_t x, uint32_t y, uint32_t s) { return __byte_perm(x, y, s); }
BT_FUNC void bt_mma_16x8x16(float* c, const uint32_t* a, const uint32_t* b, unsigned int lane) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
      "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
BT_FUNC uint32_t bt_transpose_8x8(uint32_t v, unsigned int) {
  uint32_t d;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(v));
  return d;
}
"""
"""The CUDA implementation of the tensor-core vocabulary: inline PTX. Kept as one block
so a CPU emulator of the CUDA dialect can replace it with software versions."""

_METAL_MMA = r"""
// ---- tensor-core vocabulary (Metal: a plain emulation of CUDA's per-lane contract) ----
BT_FUNC bool bt_any(bool p) { return simd_any(p); }
BT_FUNC uint32_t bt_shuffle_u32(uint32_t v, int src_lane) {
  return simd_shuffle(v, static_cast<ushort>(src_lane));
}
BT_FUNC uint32_t bt_half2_fma(uint32_t a, uint32_t b, uint32_t c) {
  return as_type<uint32_t>(metal::fma(as_type<half2>(a), as_type<half2>(b), as_type<half2>(c)));
}
BT_FUNC uint32_t bt_pack_half2(float lo, float hi) {
  return as_type<uint32_t>(half2(static_cast<half>(lo), static_cast<half>(hi)));
}
BT_FUNC uint32_t bt_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
  uint32_t r = 0;
  for (int n = 0; n < 4; ++n) {
    const uint32_t i = (s >> (4 * n)) & 7u;
    const uint32_t byte = ((i < 4 ? x >> (8 * i) : y >> (8 * (i - 4)))) & 0xFFu;
    r |= byte << (8 * n);
  }
  return r;
}
BT_FUNC float bt_half2_dot(uint32_t x, uint32_t y) {
  const half2 hx = as_type<half2>(x);
  const half2 hy = as_type<half2>(y);
  return static_cast<float>(hx.x) * static_cast<float>(hy.x) + static_cast<float>(hx.y) * static_cast<float>(hy.y);
}
"""
"""Metal's tensor-core vocabulary, before ``SHUFFLED_MMA``: correct per-lane semantics, no
speed; not compiled here (no Apple GPU)."""

SHUFFLED_MMA = r"""
BT_FUNC void bt_mma_16x8x16(BT_PRIVATE float* c, const BT_PRIVATE uint32_t* a, const BT_PRIVATE uint32_t* b,
                            unsigned int lane) {
  // Lane (g, q) needs rows g and g+8 of A (held by lanes 4g..4g+3) and columns 2q and
  // 2q+1 of B (held by lanes 8q..8q+3 and 8q+4..8q+7): gather them k-slice by k-slice.
  const int g = static_cast<int>(lane / 4);
  const int q = static_cast<int>(lane % 4);
  for (int s = 0; s < 4; ++s) {  // the k columns 2s, 2s+1, 2s+8, 2s+9
    const int row_lane = g * 4 + s;
    const int col0_lane = (2 * q) * 4 + s;
    const int col1_lane = (2 * q + 1) * 4 + s;
    const uint32_t a0 = bt_shuffle_u32(a[0], row_lane), a1 = bt_shuffle_u32(a[1], row_lane);
    const uint32_t a2 = bt_shuffle_u32(a[2], row_lane), a3 = bt_shuffle_u32(a[3], row_lane);
    const uint32_t b00 = bt_shuffle_u32(b[0], col0_lane), b01 = bt_shuffle_u32(b[1], col0_lane);
    const uint32_t b10 = bt_shuffle_u32(b[0], col1_lane), b11 = bt_shuffle_u32(b[1], col1_lane);
    c[0] += bt_half2_dot(a0, b00) + bt_half2_dot(a2, b01);
    c[1] += bt_half2_dot(a0, b10) + bt_half2_dot(a2, b11);
    c[2] += bt_half2_dot(a1, b00) + bt_half2_dot(a3, b01);
    c[3] += bt_half2_dot(a1, b10) + bt_half2_dot(a3, b11);
  }
}
BT_FUNC uint32_t bt_transpose_8x8(uint32_t v, unsigned int lane) {
  // M[2q][g] and M[2q+1][g] are half g % 2 of lanes 8q + g/2 and 8q + 4 + g/2.
  const int g = static_cast<int>(lane / 4);
  const int q = static_cast<int>(lane % 4);
  const uint32_t row0 = bt_shuffle_u32(v, 8 * q + g / 2);
  const uint32_t row1 = bt_shuffle_u32(v, 8 * q + 4 + g / 2);
  return bt_byte_perm(row0, row1, g % 2 ? 0x7632u : 0x5410u);
}
"""
"""``bt_mma_16x8x16`` without tensor cores: each lane gathers its rows and columns through
``bt_shuffle_u32`` and sums ``bt_half2_dot`` products in float32; ``bt_transpose_8x8``
through two shuffles. Metal's vocabulary and
the CUDA emulator's (``cuda_emulator.SOFTWARE_MMA``) both end with it."""

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

MMA_HEADER: dict[Backend, str] = {"metal": _METAL_MMA + SHUFFLED_MMA, "cuda": _CUDA_MMA}
"""The tensor-core vocabulary (and ``bt_any``, ``bt_shuffle_u32``): added after ``HEADER``
only for kernels built with ``mma=True``, so no other kernel's source changes."""


def kernel_source(backend: Backend, body: str) -> str:
    """The source MLX receives for a kernel body: the preamble, then the body, ``compact``."""
    return compact(PREAMBLE[backend] + body)


def kernel_header(backend: Backend, helpers: str = "", *, mma: bool = False) -> str:
    """The header MLX receives: the dialect (with the tensor-core vocabulary when ``mma``),
    then the kernel's own helper functions, ``compact``."""
    return compact(HEADER[backend] + (MMA_HEADER[backend] if mma else "") + helpers)


def compact(source: str) -> str:
    """``source`` without its ``//`` comments, indentation and blank lines; lines, and so
    preprocessor directives and macro continuations, stay as they are.

    MLX copies a custom kernel's whole source into every call and hashes it again when
    the call is evaluated, so a shorter source makes a cheaper call (measurements:
    docs/benchmarks.md, "butter_core/kernels/dialect.py"). Kernel sources hold no string
    literals, so a ``//`` always starts a comment; one that ends in a line continuation
    (which would swallow the next line) is refused."""
    lines = []
    for line in source.splitlines():
        code, slashes, comment = line.partition("//")
        if slashes and comment.rstrip().endswith("\\"):
            raise ValueError(f"a // comment ends in a line continuation: {line.strip()!r}")
        if code.strip():
            lines.append(code.strip() + "\n")
    return "".join(lines)
