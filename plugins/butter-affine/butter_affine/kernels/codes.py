"""Device helpers for MLX-packed affine codes, shared by every butter-affine kernel.

``CODE_HELPERS`` is kernel-header source in butter's dialect (``butter_core.kernels``):

- ``affine_load_words<WORDS>(src, dst)``: WORDS uint32 from global memory, as 16- or
  8-byte vector loads where WORDS allows (``src`` must then be that aligned).
- ``affine_unpack<BITS, N>(words, out)``: the N codes of a run that starts on a word
  boundary, as floats, each times ``2^affine_shift<BITS>(i)`` (see below).
- ``affine_weight<BITS>(i)``: ``2^-affine_shift<BITS>(i)``, the factor that turns
  ``out[i]`` back into the code (exact: a power of two).

Why the shifted units: converting an integer to float is a slow instruction on NVIDIA
GPUs (a quarter of the FMA rate or less). ``affine_unpack`` instead ORs a code, left
where it lies in its word, into the mantissa of 2^23 and subtracts 2^23: two full-rate
instructions and an exact result, ``code * 2^bit_offset``. Offsets up to 23 - BITS fit
in place; codes higher in a word are masked in the word's upper half; a 6-bit code that
straddles two words is shifted down. Kernels fold ``affine_weight`` into the query (for
``q . k``) or apply it once at the end (for ``sum p v``), so the hot loop never does.

Rounding (``bt_rint``: half to even, as ``mx.round`` and MLX's quantizer do) and the
float bit-cast (``bt_as_float``) come from the dialect, so no line here differs between
Metal and CUDA.
"""

CODE_HELPERS = r"""
// ---- butter-affine: MLX-packed affine codes --------------------------------------
// Code i of a run starting on a word boundary lies at bit (i * BITS) % 32 of word
// (i * BITS) / 32; affine_unpack leaves it at this bit offset.
template <int BITS> BT_FUNC constexpr int affine_shift(int i) {
  return (i * BITS) % 32 + BITS > 32 ? 0
       : (i * BITS) % 32 + BITS > 23 ? (i * BITS) % 32 - 16
       : (i * BITS) % 32;
}

template <int BITS> BT_FUNC constexpr float affine_weight(int i) {
  return 1.0f / static_cast<float>(1u << affine_shift<BITS>(i));
}

template <int WORDS>
BT_FUNC void affine_load_words(const BT_GLOBAL uint32_t* src, BT_PRIVATE uint32_t* dst) {
  if (WORDS % 4 == 0) {
#pragma unroll
    for (int c = 0; c < WORDS / 4; ++c) {
      const uint4 v = reinterpret_cast<const BT_GLOBAL uint4*>(src)[c];
      dst[4 * c] = v.x;
      dst[4 * c + 1] = v.y;
      dst[4 * c + 2] = v.z;
      dst[4 * c + 3] = v.w;
    }
  } else if (WORDS % 2 == 0) {
#pragma unroll
    for (int c = 0; c < WORDS / 2; ++c) {
      const uint2 v = reinterpret_cast<const BT_GLOBAL uint2*>(src)[c];
      dst[2 * c] = v.x;
      dst[2 * c + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int c = 0; c < WORDS; ++c) {
      dst[c] = src[c];
    }
  }
}

template <int BITS, int N>
BT_FUNC void affine_unpack(const BT_PRIVATE uint32_t* words, BT_PRIVATE float* out) {
  constexpr uint32_t MASK = (1u << BITS) - 1u;
#pragma unroll
  for (int i = 0; i < N; ++i) {
    const int word = (i * BITS) / 32;
    const int off = (i * BITS) % 32;
    uint32_t field;
    if (off + BITS > 32) {         // straddles two words (6-bit codes only)
      field = ((words[word] >> off) | (words[word + 1] << ((32 - off) & 31))) & MASK;
    } else if (off + BITS > 23) {  // too high for the mantissa: use the upper half-word
      field = (words[word] >> 16) & (MASK << ((off - 16) & 31));
    } else {
      field = words[word] & (MASK << off);
    }
    out[i] = bt_as_float(field | 0x4B000000u) - 8388608.0f;
  }
}
"""
