"""Device helpers for MLX-packed affine codes, shared by every butter-affine kernel.

``CODE_HELPERS`` is kernel-header source in butter's dialect (``butter_core.kernels``):

- ``affine_load_words<WORDS, READ_ONLY>(src, dst)``: WORDS uint32 from global memory, as
  16- or 8-byte vector loads where WORDS allows (``src`` must then be that aligned);
  through the read-only path when ``READ_ONLY`` (``bt_read_if``).
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

``MMA_CODE_HELPERS`` (needs ``Kernel(..., mma=True)``) turns 4-, 6- and 8-bit code
words into float16 pairs for the tensor-core decode kernel (``decode_mma``), the
magic-number way: a code OR-ed into the mantissa of the float16 1024 (0x6400) is the float16
``1024 + code`` exactly, so a pair of codes, one in each 16-bit half of a word, becomes
a half2 with one AND-OR (one ``lop3``) or one byte permute; one ``bt_half2_fma`` takes
off the 1024 exactly (a code in bits 4..7 gives ``1024 + 16 code``: times 1/16 minus 64)
and a second gives ``code * scale + bias`` rounded once to float16, the nearest float16
to the float32 reference's value. (Folding the 1024 into the bias, ``(1024 + code) *
scale + (bias - 1024 scale)``, would save that instruction but round ``bias - 1024
scale`` to float16 first: an error up to half a quantization step, and overflow once
``scale`` >= 64.)

Codes come in *units* of ``AffineUnit<BITS>::WORDS`` words, ``CODES`` codes each: one
word (8 or 4 codes) at 4 and 8 bits; at 6 bits three words, 16 codes in four 3-byte
triples (MLX's byte packing), since no smaller run of 6-bit codes starts on a word.

- ``AffineKPerm<BITS>``: the order ``affine_key_pairs`` emits a key's dimensions in, as
  ``butter_core.kernels.mma`` wants it (``lo(r)``, ``hi(r)``: the two dimensions of pair
  ``r``, relative to the lane's run of words).
- ``affine_key_pairs<BITS>(words, scale2, bias2, out)``: one unit of one key as
  ``CODES / 2`` half2 (4 at 4 bits: dims (0,4), (1,5), (2,6), (3,7) of the word; 2 at
  8 bits: (0,2), (1,3); 8 at 6 bits: per triple, dims (0,2), (1,3)); ``scale2``/``bias2``
  hold the key's group's scale/bias in both halves.
- ``affine_value_pairs<BITS>(words_a, words_b, scale2, bias2, out)``: the same unit of
  two keys, interleaved: ``out[i]`` = (key a, key b) at dimension ``i`` of the unit
  (``CODES`` of them); ``scale2``/``bias2`` = (key a's, key b's).
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

template <int WORDS, bool READ_ONLY = false, typename In>
BT_FUNC void affine_load_words(In src, BT_PRIVATE uint32_t* dst) {
  if (WORDS % 4 == 0) {
    const auto vectors = bt_reinterpret<uint4>(src);
#pragma unroll
    for (int c = 0; c < WORDS / 4; ++c) {
      const uint4 v = bt_read_if<READ_ONLY>(vectors + c);
      dst[4 * c] = v.x;
      dst[4 * c + 1] = v.y;
      dst[4 * c + 2] = v.z;
      dst[4 * c + 3] = v.w;
    }
  } else if (WORDS % 2 == 0) {
    const auto vectors = bt_reinterpret<uint2>(src);
#pragma unroll
    for (int c = 0; c < WORDS / 2; ++c) {
      const uint2 v = bt_read_if<READ_ONLY>(vectors + c);
      dst[2 * c] = v.x;
      dst[2 * c + 1] = v.y;
    }
  } else {
#pragma unroll
    for (int c = 0; c < WORDS; ++c) {
      dst[c] = bt_read_if<READ_ONLY>(src + c);
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

MMA_CODE_HELPERS = r"""
// ---- butter-affine: code words -> float16 pairs for tensor cores -----------------
#define AFFINE_MAGIC2 0x64006400u       // float16 1024 in both halves
#define AFFINE_MAGIC_BYTES 0x64646464u  // its high byte, four times (for byte permutes)
#define AFFINE_ONE2 0x3C003C00u         // 1.0
#define AFFINE_NEG1024_2 0xE400E400u    // -1024.0
#define AFFINE_SIXTEENTH2 0x2C002C00u   // 0.0625
#define AFFINE_NEG64_2 0xD400D400u      // -64.0

template <int BITS> struct AffineUnit {
  static constexpr int WORDS = BITS == 6 ? 3 : 1;
  static constexpr int CODES = WORDS * 32 / BITS;
};

template <int BITS> struct AffineKPerm;
template <> struct AffineKPerm<4> {
  static BT_FUNC constexpr int lo(int r) { return 8 * (r / 4) + r % 4; }
  static BT_FUNC constexpr int hi(int r) { return 8 * (r / 4) + r % 4 + 4; }
};
template <> struct AffineKPerm<8> {
  static BT_FUNC constexpr int lo(int r) { return 4 * (r / 2) + r % 2; }
  static BT_FUNC constexpr int hi(int r) { return 4 * (r / 2) + r % 2 + 2; }
};
template <> struct AffineKPerm<6> {  // per 3-byte triple of four codes: (0,2), (1,3)
  static BT_FUNC constexpr int lo(int r) { return 4 * (r / 2) + r % 2; }
  static BT_FUNC constexpr int hi(int r) { return 4 * (r / 2) + r % 2 + 2; }
};

// Codes at bits 0..3 (or 0..7) of each half, as 1024 + code: to code * scale + bias.
BT_FUNC uint32_t affine_scale_low(uint32_t magic, uint32_t scale2, uint32_t bias2) {
  return bt_half2_fma(bt_half2_fma(magic, AFFINE_ONE2, AFFINE_NEG1024_2), scale2, bias2);
}
// Codes at bits 4..7 of each half, as 1024 + 16 code.
BT_FUNC uint32_t affine_scale_high(uint32_t magic, uint32_t scale2, uint32_t bias2) {
  return bt_half2_fma(bt_half2_fma(magic, AFFINE_SIXTEENTH2, AFFINE_NEG64_2), scale2, bias2);
}

// Four 4-bit codes in each half of x (the half-words' nibbles 0..3): out[0..3].
BT_FUNC void affine_nibble_pairs(uint32_t x, uint32_t scale2, uint32_t bias2, BT_PRIVATE uint32_t* out) {
  const uint32_t x8 = x >> 8;
  out[0] = affine_scale_low((x & 0x000F000Fu) | AFFINE_MAGIC2, scale2, bias2);
  out[1] = affine_scale_high((x & 0x00F000F0u) | AFFINE_MAGIC2, scale2, bias2);
  out[2] = affine_scale_low((x8 & 0x000F000Fu) | AFFINE_MAGIC2, scale2, bias2);
  out[3] = affine_scale_high((x8 & 0x00F000F0u) | AFFINE_MAGIC2, scale2, bias2);
}

// The four 3-byte triples of a unit of three words (bytes 0-2, 3-5, 6-8, 9-11), each in
// bits 0..23 of t[i] (bits 24..31 are not read): code c of a triple at bits 6c..6c+5.
BT_FUNC void affine_triples(const BT_PRIVATE uint32_t* words, BT_PRIVATE uint32_t* t) {
  t[0] = words[0];
  t[1] = bt_byte_perm(words[0], words[1], 0x0543u);
  t[2] = bt_byte_perm(words[1], words[2], 0x0432u);
  t[3] = words[2] >> 8;
}

// A 6-bit code at bits 0..5 of lo and one at bits 16..21 of hi, as 1024 + code in a half2.
BT_FUNC uint32_t affine_six_magic(uint32_t lo, uint32_t hi) {
  return (lo & 0x3Fu) | (hi & 0x3F0000u) | AFFINE_MAGIC2;
}

template <int BITS>
BT_FUNC void affine_key_pairs(const BT_PRIVATE uint32_t* words, uint32_t scale2, uint32_t bias2,
                              BT_PRIVATE uint32_t* out) {
  if (BITS == 4) {  // half-words hold codes 0..3 and 4..7: pairs (0,4), (1,5), (2,6), (3,7)
    affine_nibble_pairs(words[0], scale2, bias2, out);
  } else if (BITS == 8) {  // bytes 0 and 2, then 1 and 3
    out[0] = affine_scale_low(bt_byte_perm(words[0], AFFINE_MAGIC_BYTES, 0x4240u), scale2, bias2);
    out[1] = affine_scale_low(bt_byte_perm(words[0], AFFINE_MAGIC_BYTES, 0x4341u), scale2, bias2);
  } else {  // per triple, codes 0 and 2, then 1 and 3
    uint32_t t[4];
    affine_triples(words, t);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[2 * i] = affine_scale_low(affine_six_magic(t[i], t[i] << 4), scale2, bias2);
      out[2 * i + 1] = affine_scale_low(affine_six_magic(t[i] >> 6, t[i] >> 2), scale2, bias2);
    }
  }
}

template <int BITS>
BT_FUNC void affine_value_pairs(const BT_PRIVATE uint32_t* words_a, const BT_PRIVATE uint32_t* words_b,
                                uint32_t scale2, uint32_t bias2, BT_PRIVATE uint32_t* out) {
  if (BITS == 6) {  // code c of triple i: key a's shifted down to bit 0, key b's to bit 16
    uint32_t a[4], b[4];
    affine_triples(words_a, a);
    affine_triples(words_b, b);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      out[4 * i] = affine_scale_low(affine_six_magic(a[i], b[i] << 16), scale2, bias2);
      out[4 * i + 1] = affine_scale_low(affine_six_magic(a[i] >> 6, b[i] << 10), scale2, bias2);
      out[4 * i + 2] = affine_scale_low(affine_six_magic(a[i] >> 12, b[i] << 4), scale2, bias2);
      out[4 * i + 3] = affine_scale_low(affine_six_magic(a[i] >> 18, b[i] >> 2), scale2, bias2);
    }
    return;
  }
  const uint32_t low = bt_byte_perm(words_a[0], words_b[0], 0x5410u);   // a's bytes 0, 1 | b's bytes 0, 1
  const uint32_t high = bt_byte_perm(words_a[0], words_b[0], 0x7632u);  // a's bytes 2, 3 | b's bytes 2, 3
  if (BITS == 4) {
    affine_nibble_pairs(low, scale2, bias2, out);
    affine_nibble_pairs(high, scale2, bias2, out + 4);
  } else {
    out[0] = affine_scale_low(bt_byte_perm(low, AFFINE_MAGIC_BYTES, 0x4240u), scale2, bias2);
    out[1] = affine_scale_low(bt_byte_perm(low, AFFINE_MAGIC_BYTES, 0x4341u), scale2, bias2);
    out[2] = affine_scale_low(bt_byte_perm(high, AFFINE_MAGIC_BYTES, 0x4240u), scale2, bias2);
    out[3] = affine_scale_low(bt_byte_perm(high, AFFINE_MAGIC_BYTES, 0x4341u), scale2, bias2);
  }
}
"""
