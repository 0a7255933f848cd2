// half.h: 16-bit rows (float16, bfloat16): widening to float32, rounding back to nearest or
// stochastically, and the counter-based random bits of stochastic rounding.
//
// The rules (docs/semantics.md section 14; numerics/rounding.py is their torch reference, bit for bit):
//   - widening is exact (every 16-bit value is a float32);
//   - to nearest: IEEE round-to-nearest-even, as torch's .to(float16 / bfloat16) (a NaN stays a
//     NaN; the payload is not kept);
//   - stochastically: x rounds to one of the two 16-bit values around it, the one away from zero
//     with probability |x - toward-zero| / ulp, decided by 32 random bits u: bfloat16 adds the
//     high 16 bits of u to the float32 bits below its mantissa and truncates; float16 adds
//     u >> 19 (13 bits) below a normal result's mantissa and truncates, and a subnormal result
//     (|x| < 2**-14) is |x| + (u >> 8) * 2**-48 in float32 truncated to a multiple of 2**-24.
//     Magnitudes from 65536 (float16) are infinite, as are those that carry into it.
//   - the random bits of row r, column c, at step s of a table: with I the row's identity
//     (the table's key + its logical row, or + the raw id of a dynamic table),
//       k = splitmix64(splitmix64(I) ^ splitmix64(s)),  k32 = low32(k) ^ high32(k),
//       u = lowbias32(k32 + c * 0x9E3779B9 mod 2**32)
//     a function of the table, the step, the row and the column only: the same whatever the
//     threads, sharding, stacking, budget or pipelining.
// Loads widen with F16C's vcvtph2ps where the build has it (-march=native on x86-64), else with
// integer steps; bfloat16 is a shift. Stores round 16 columns at a time with AVX-512F, 8 with
// AVX2 + F16C (the random bits of every column computed in SIMD too): float16 to nearest with the
// conversion to nearest, stochastically with the conversion toward zero after the random bits are
// added; bfloat16 with integer steps. The rare lanes (a float16 subnormal result, |x| above
// 65504, infinities, NaN) are fixed behind a branch taken only by a block that holds one. Other
// builds and the columns past the last full block use the scalar rules, written without
// branches so that the compiler vectorizes them. Every build gives the same bits (tests: the
// native, an AVX2 + F16C and a plain x86-64 build). 128 columns stochastically, one thread, on
// the AMD EPYC (Zen 5) machine: float16 11 ns with AVX-512, 23 with AVX2 (258 before its SIMD
// path), 190 plain x86-64; bfloat16 8, 19 and 113.
// AVX-512 BF16's conversion is not used: it flushes subnormals to zero, which torch's rounding
// does not.

#pragma once

#include "common.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The row types of the kernels that read or write rows (the codes of numerics/rounding.py's ROW_TYPES).
enum RowType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

inline uint32_t f32_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

inline float bits_f32(uint32_t b) {
  float x;
  std::memcpy(&x, &b, 4);
  return x;
}

constexpr uint64_t kGamma = 0x9E3779B97F4A7C15ULL;

inline uint64_t splitmix64(uint64_t x) { return mix64(x + kGamma); }

// Chris Wellons' lowbias32: a 32-bit bijection with good avalanche.
inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352dU;
  x ^= x >> 15;
  x *= 0x846ca68bU;
  x ^= x >> 16;
  return x;
}

// k32 of a row: identity ``ident`` (uint64 bits), ``step_key`` = splitmix64(step).
inline uint32_t row_key32(uint64_t ident, uint64_t step_key) {
  const uint64_t k = splitmix64(splitmix64(ident) ^ step_key);
  return uint32_t(k) ^ uint32_t(k >> 32);
}

inline uint32_t column_bits(uint32_t key32, uint32_t col) {
  return lowbias32(key32 + col * 0x9E3779B9U);
}

// ---------------------------------------------------------------------------------- widening
inline float bf16_to_f32(uint16_t h) { return bits_f32(uint32_t(h) << 16); }

inline float f16_to_f32_int(uint16_t h) {
  const uint32_t sign = (uint32_t(h) & 0x8000U) << 16;
  const uint32_t em = uint32_t(h) & 0x7FFFU;
  uint32_t normal = (em << 13) + 0x38000000U;  // rebias 15 -> 127
  normal += em >= 0x7C00U ? 0x38000000U : 0U;   // infinities and NaNs: exponent all ones
  const float sub = float(em) * 5.9604644775390625e-8f;  // em * 2**-24, exact
  const uint32_t mag = em < 0x0400U ? f32_bits(sub) : normal;
  return bits_f32(sign | mag);
}

// dst[c] = float32(src[c]) for c < d.
inline void widen_f16(const uint16_t* src, float* dst, i64 d) {
  i64 c = 0;
#if defined(__F16C__)
  for (; c + 8 <= d; c += 8)
    _mm256_storeu_ps(dst + c, _mm256_cvtph_ps(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + c))));
#endif
#pragma omp simd
  for (i64 k = c; k < d; ++k) dst[k] = f16_to_f32_int(src[k]);
}

inline void widen_bf16(const uint16_t* src, float* dst, i64 d) {
#pragma omp simd
  for (i64 c = 0; c < d; ++c) dst[c] = bf16_to_f32(src[c]);
}

template <int T>
inline void widen(const void* src, float* dst, i64 d) {
  if constexpr (T == kF16) {
    widen_f16(static_cast<const uint16_t*>(src), dst, d);
  } else if constexpr (T == kBF16) {
    widen_bf16(static_cast<const uint16_t*>(src), dst, d);
  } else {
    std::memcpy(dst, src, sizeof(float) * d);
  }
}

// --------------------------------------------------------------------------------- rounding
inline uint16_t bf16_nearest(float x) {
  const uint32_t b = f32_bits(x);
  const uint32_t r = (b + 0x7FFFU + ((b >> 16) & 1U)) >> 16;
  return (b & 0x7FFFFFFFU) > 0x7F800000U ? uint16_t(0x7FC0U) : uint16_t(r);
}

inline uint16_t bf16_stochastic(float x, uint32_t u) {
  const uint32_t b = f32_bits(x);
  const uint32_t r = (b + (u >> 16)) >> 16;
  return (b & 0x7FFFFFFFU) > 0x7F800000U ? uint16_t(0x7FC0U) : uint16_t(r);
}

// float16 from float32 by adding ``below`` under the kept bits and truncating (to nearest: half
// an ulp less one, plus the kept lowest bit; stochastically: random bits). A normal result
// (|x| >= 2**-14): 13 bits dropped, the exponent rebiased 127 -> 15, 65536 and up infinite. A
// subnormal one (multiples of 2**-24): ``sub`` is |x| with what is added already added, as a
// float32; truncated to a count of 2**-24 (y * 2**24 is exact: a power of two). Every choice is
// a select of integers (no branch), so that loops of it vectorize in every build.
inline uint16_t f16_from(uint32_t b, uint32_t below_n, float sub) {
  const uint32_t sign = (b >> 16) & 0x8000U;
  const uint32_t a = b & 0x7FFFFFFFU;
  const uint32_t hn = std::min(((a + below_n) >> 13) - 0x1C000U, 0x7C00U);  // (a >= 65536: inf)
  // (a subnormal result's sub < 2**-13; other lanes' capped there: a defined conversion)
  const float small = bits_f32(std::min(f32_bits(sub), 0x39000000U));
  const uint32_t hs = uint32_t(int32_t(small * 16777216.0f));
  const uint32_t h = a > 0x7F800000U ? 0x7E00U : (a >= 0x38800000U ? hn : hs);
  return uint16_t(sign | h);
}

inline uint16_t f16_nearest_int(float x) {
  const uint32_t b = f32_bits(x);
  // a subnormal result to nearest even: the count |x| * 2**24 (exact; capped at 2**11 for the
  // other lanes) rounded to an integer by adding and taking away 2**23 (float32's own rounding
  // to nearest even: nearbyint without a call)
  const float count = bits_f32(std::min(b & 0x7FFFFFFFU, 0x39000000U)) * 16777216.0f;
  const float rounded = (count + 8388608.0f) - 8388608.0f;
  return f16_from(b, 0xFFFU + ((b >> 13) & 1U), rounded * 5.9604644775390625e-8f);
}

// Stochastic: a normal result adds u >> 19 (13 random bits) under its mantissa; a subnormal one
// adds (u >> 8) * 2**-48 (24 random bits, a fraction of 2**-24) to |x| in float32 arithmetic (the
// sum rounded to float32, then truncated to 2**-24's multiples: unbiased to within float32's
// rounding of the sum, 2**-14 of an ulp at most).
inline uint16_t f16_stochastic(float x, uint32_t u) {
  const uint32_t b = f32_bits(x);
  const float a = bits_f32(b & 0x7FFFFFFFU);
  const float sub = a + float(u >> 8) * 3.552713678800501e-15f;  // 2**-48
  return f16_from(b, u >> 19, sub);
}

// ------------------------------------------------------------------- rounding, 8 or 16 columns
// The SIMD paths below compute the random bits of 8 (AVX2) or 16 (AVX-512F) columns at once (the
// hash inputs key32 + c * golden stepped by addition) and round them by the rules above; each
// returns the first column it did not do (d rounded down to its width), the rest going through
// the scalar rules. float16: the float32 whose truncation the rule takes (a normal result's bits
// + (u >> 19), a subnormal one's |x| + (u >> 8) * 2**-48; overflow and NaN set first) converted
// toward zero by F16C / AVX-512F. bfloat16: integer steps. To nearest, float16: the conversion
// to nearest even, register to register (a conversion stored straight to memory is several
// times slower on AMD's Zen 4 and 5).
constexpr uint32_t kGolden32 = 0x9E3779B9U;

#if defined(__AVX512F__)
inline __m512i lowbias32_x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// key32 + (c0 + c) * golden for lanes c = 0..15
inline __m512i hash_inputs_x16(uint32_t key32, uint32_t c0) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  return _mm512_add_epi32(_mm512_set1_epi32(int32_t(key32 + c0 * kGolden32)),
                          _mm512_mullo_epi32(lanes, _mm512_set1_epi32(int32_t(kGolden32))));
}

// 16 float32 values (x's lanes) rounded to float16 stochastically with the random bits u: the
// lanes that overflowed (finite, rounded to an infinity) are or-ed into *overflow.
inline __m256i f16_stochastic_v16(__m512 x, __m512i u, __mmask16* overflow) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  const __m512i b = _mm512_castps_si512(x);
  const __m512i a = _mm512_and_si512(b, abs_mask);
  const __m512i t = _mm512_add_epi32(a, _mm512_srli_epi32(u, 19));  // a normal result
  __m512i y = t;
  const __mmask16 normal = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x387FFFFF));
  if (normal != 0xFFFF) {  // a subnormal result (a branch: most rows have none)
    const __m512 sub = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(u, 8)),
                                       _mm512_set1_ps(3.552713678800501e-15f),  // 2**-48
                                       _mm512_castsi512_ps(a));  // (an exact product)
    y = _mm512_mask_blend_epi32(normal, _mm512_castps_si512(sub), t);
  }
  // |x| above 65504 (infinities and NaN too): 65536 and up infinite, NaN a quiet NaN
  if (_mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x477FE000))) {
    const __mmask16 inf = _mm512_cmpgt_epi32_mask(t, _mm512_set1_epi32(0x477FFFFF));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000));
    *overflow |= inf & _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x7F800000));  // (finite)
    y = _mm512_mask_mov_epi32(y, inf, _mm512_set1_epi32(0x7F800000));
    y = _mm512_mask_mov_epi32(y, nan, _mm512_set1_epi32(0x7FC00000));
  }
  y = _mm512_ternarylogic_epi32(b, y, abs_mask, 0xD8);  // y's magnitude, b's sign
  return _mm512_cvtps_ph(_mm512_castsi512_ps(y), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
}

inline i64 f16_stochastic_x16(const float* src, uint16_t* dst, i64 d, uint32_t key32,
                              uint32_t c0, bool* over) {
  __mmask16 overflow = 0;
  __m512i input = hash_inputs_x16(key32, c0);
  const __m512i step = _mm512_set1_epi32(int32_t(16U * kGolden32));
  i64 c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512i u = lowbias32_x16(input);
    input = _mm512_add_epi32(input, step);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        f16_stochastic_v16(_mm512_loadu_ps(src + c), u, &overflow));
  }
  *over = overflow != 0;
  return c;
}

inline i64 bf16_stochastic_x16(const float* src, uint16_t* dst, i64 d, uint32_t key32,
                               uint32_t c0) {
  __m512i input = hash_inputs_x16(key32, c0);
  const __m512i step = _mm512_set1_epi32(int32_t(16U * kGolden32));
  // b + (u >> 16), a NaN's lane the quiet NaN's bits: the result is its high 16 bits
  auto sum = [&](const float* x) {
    const __m512i u = lowbias32_x16(input);
    input = _mm512_add_epi32(input, step);
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(x));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(
        _mm512_and_si512(b, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
    return _mm512_mask_mov_epi32(_mm512_add_epi32(b, _mm512_srli_epi32(u, 16)), nan,
                                 _mm512_set1_epi32(0x7FC00000));
  };
  i64 c = 0;
#if defined(__AVX512BW__)
  // 32 columns: the high halves of two vectors' lanes gathered by one permutation
  const __m512i odd = _mm512_setr_epi32(
      0x00030001, 0x00070005, 0x000B0009, 0x000F000D, 0x00130011, 0x00170015, 0x001B0019,
      0x001F001D, 0x00230021, 0x00270025, 0x002B0029, 0x002F002D, 0x00330031, 0x00370035,
      0x003B0039, 0x003F003D);
  for (; c + 32 <= d; c += 32) {
    const __m512i lo = sum(src + c), hi = sum(src + c + 16);
    _mm512_storeu_si512(dst + c, _mm512_permutex2var_epi16(lo, odd, hi));
  }
#endif
  for (; c + 16 <= d; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        _mm512_cvtepi32_epi16(_mm512_srli_epi32(sum(src + c), 16)));
  return c;
}

// 16 float32 values rounded to float16 to nearest even; the lanes that overflowed (65520 and
// up, finite) are or-ed into *overflow.
inline __m256i f16_nearest_v16(__m512 x, __mmask16* overflow) {
  const __m512i a = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32(0x7FFFFFFF));
  *overflow |= _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x477FEFFF)) &  // 65520 and up,
               _mm512_cmplt_epi32_mask(a, _mm512_set1_epi32(0x7F800000));   // finite
  __m256i h = _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
  __asm__("" : "+v"(h));  // kept in a register: no conversion stored straight to memory
  return h;
}

inline i64 f16_nearest_x16(const float* src, uint16_t* dst, i64 d, bool* over) {
  __mmask16 overflow = 0;
  i64 c = 0;
  for (; c + 16 <= d; c += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        f16_nearest_v16(_mm512_loadu_ps(src + c), &overflow));
  *over = overflow != 0;
  return c;
}
#elif defined(__AVX2__) && defined(__F16C__)
inline __m256i lowbias32_x8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(int32_t(0x846ca68bU)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

inline __m256i hash_inputs_x8(uint32_t key32, uint32_t c0) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  return _mm256_add_epi32(_mm256_set1_epi32(int32_t(key32 + c0 * kGolden32)),
                          _mm256_mullo_epi32(lanes, _mm256_set1_epi32(int32_t(kGolden32))));
}

// (signed compares: a <= 0x7FFFFFFF; a NaN's t may wrap negative, and its lane is set last)
inline i64 f16_stochastic_x8(const float* src, uint16_t* dst, i64 d, uint32_t key32,
                             uint32_t c0, bool* over) {
  __m256i overflow = _mm256_setzero_si256();
  const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF);
  __m256i input = hash_inputs_x8(key32, c0);
  const __m256i step = _mm256_set1_epi32(int32_t(8U * kGolden32));
  const __m256 two_m48 = _mm256_set1_ps(3.552713678800501e-15f);
  i64 c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256i u = lowbias32_x8(input);
    input = _mm256_add_epi32(input, step);
    const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + c));
    const __m256i a = _mm256_and_si256(b, abs_mask);
    const __m256i t = _mm256_add_epi32(a, _mm256_srli_epi32(u, 19));
    __m256i y = t;
    const __m256i normal = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x387FFFFF));
    if (_mm256_movemask_ps(_mm256_castsi256_ps(normal)) != 0xFF) {
      const __m256 sub = _mm256_add_ps(_mm256_castsi256_ps(a),  // (an exact product)
                                       _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(u, 8)),
                                                     two_m48));
      y = _mm256_blendv_epi8(_mm256_castps_si256(sub), t, normal);
    }
    const __m256i big = _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x477FE000));
    if (!_mm256_testz_si256(big, big)) {
      const __m256i inf = _mm256_cmpgt_epi32(t, _mm256_set1_epi32(0x477FFFFF));
      const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), a);
      overflow = _mm256_or_si256(overflow, _mm256_and_si256(inf, finite));
      y = _mm256_blendv_epi8(y, _mm256_set1_epi32(0x7F800000), inf);
      y = _mm256_blendv_epi8(y, _mm256_set1_epi32(0x7FC00000),
                             _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7F800000)));
    }
    y = _mm256_or_si256(y, _mm256_andnot_si256(abs_mask, b));
    __m128i h = _mm256_cvtps_ph(_mm256_castsi256_ps(y), _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC);
    __asm__("" : "+x"(h));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c), h);
  }
  *over = !_mm256_testz_si256(overflow, overflow);
  return c;
}

inline i64 bf16_stochastic_x8(const float* src, uint16_t* dst, i64 d, uint32_t key32,
                              uint32_t c0) {
  __m256i input = hash_inputs_x8(key32, c0);
  const __m256i step = _mm256_set1_epi32(int32_t(8U * kGolden32));
  i64 c = 0;
  for (; c + 16 <= d; c += 16) {
    __m256i r[2];
    for (int k = 0; k < 2; ++k) {
      const __m256i u = lowbias32_x8(input);
      input = _mm256_add_epi32(input, step);
      const __m256i b = _mm256_castps_si256(_mm256_loadu_ps(src + c + 8 * k));
      const __m256i h = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_srli_epi32(u, 16)), 16);
      const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7FFFFFFF)),
                                             _mm256_set1_epi32(0x7F800000));
      r[k] = _mm256_blendv_epi8(h, _mm256_set1_epi32(0x7FC0), nan);
    }
    // (values below 2**16: packing saturates nothing; the packs interleave 128-bit halves)
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), packed);
  }
  return c;
}

inline i64 f16_nearest_x8(const float* src, uint16_t* dst, i64 d, bool* over) {
  __m256i overflow = _mm256_setzero_si256();
  i64 c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 x = _mm256_loadu_ps(src + c);
    const __m256i a = _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF));
    overflow = _mm256_or_si256(overflow, _mm256_and_si256(  // 65520 and up, finite
        _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x477FEFFF)),
        _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), a)));
    __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT);
    __asm__("" : "+x"(h));  // kept in a register: no conversion stored straight to memory
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c), h);
  }
  *over = !_mm256_testz_si256(overflow, overflow);
  return c;
}
#endif

// The widest SIMD path of this build for each rounding: the columns [0, returned) done. *over:
// whether one of them overflowed (a float16 value rounded to an infinity where it was finite);
// the bfloat16 paths leave it false (they do not check).
template <int T>
inline i64 narrow_simd(const float* src, uint16_t* dst, i64 d, bool stochastic, uint32_t key32,
                       uint32_t c0, bool* over) {
  *over = false;
#if defined(__AVX512F__)
  if (stochastic)
    return T == kF16 ? f16_stochastic_x16(src, dst, d, key32, c0, over)
                     : bf16_stochastic_x16(src, dst, d, key32, c0);
  return T == kF16 ? f16_nearest_x16(src, dst, d, over) : 0;
#elif defined(__AVX2__) && defined(__F16C__)
  if (stochastic)
    return T == kF16 ? f16_stochastic_x8(src, dst, d, key32, c0, over)
                     : bf16_stochastic_x8(src, dst, d, key32, c0);
  return T == kF16 ? f16_nearest_x8(src, dst, d, over) : 0;
#else
  (void)src, (void)dst, (void)d, (void)stochastic, (void)key32, (void)c0;
  return 0;
#endif
}

// dst[c] = round(src[c]) for c in [from, d) by the scalar rules (vectorized by the compiler).
template <int T>
inline void narrow_scalar(const float* src, uint16_t* dst, i64 from, i64 d, bool stochastic,
                          uint32_t key32, uint32_t c0) {
  if (stochastic) {
#pragma omp simd
    for (i64 k = from; k < d; ++k) {
      const uint32_t u = column_bits(key32, c0 + uint32_t(k));
      dst[k] = T == kF16 ? f16_stochastic(src[k], u) : bf16_stochastic(src[k], u);
    }
    return;
  }
#pragma omp simd
  for (i64 k = from; k < d; ++k)
    dst[k] = T == kF16 ? f16_nearest_int(src[k]) : bf16_nearest(src[k]);
}

// dst[c] = round(src[c]) for c < d: to nearest, or stochastically with the bits of row key
// ``key32`` and columns col0 + c.
template <int T>
inline void narrow(const float* src, void* dst_, i64 d, bool stochastic, uint32_t key32,
                   i64 col0) {
  if constexpr (T == kF32) {
    std::memcpy(dst_, src, sizeof(float) * d);
  } else {
    uint16_t* dst = static_cast<uint16_t*>(dst_);
    bool over;
    const i64 c = narrow_simd<T>(src, dst, d, stochastic, key32, uint32_t(col0), &over);
    narrow_scalar<T>(src, dst, c, d, stochastic, key32, uint32_t(col0));
  }
}

// Whether a 16-bit row ``h`` (d values, just rounded from ``x``) holds an infinity or NaN where
// its float32 value ``x`` is finite: the rounding overflowed the row's type.
template <int T>
inline bool overflowed(const uint16_t* h, const float* x, i64 d) {
  constexpr uint32_t e16 = T == kF16 ? 0x7C00U : 0x7F80U;  // the 16-bit exponent, all ones
  uint32_t bad = 0;
#pragma omp simd reduction(| : bad)
  for (i64 c = 0; c < d; ++c)
    bad |= uint32_t((uint32_t(h[c]) & e16) == e16) &
           uint32_t((f32_bits(x[c]) & 0x7F800000U) != 0x7F800000U);
  return bad != 0;
}

// The largest finite 16-bit value of row type T, as a float32: values all within it cannot
// overflow when rounded (to nearest or stochastically).
template <int T>
constexpr float kTop16 = T == kF16 ? 65504.f : 3.3895313892515355e38f;

// max |x[c]| over c < d (a NaN may or may not show: callers test !(m <= top)).
inline float max_abs(const float* x, i64 d) {
  float m = 0.f;
#pragma omp simd reduction(max : m)
  for (i64 c = 0; c < d; ++c) m = std::max(m, std::fabs(x[c]));
  return m;
}

// narrow() into ``dst`` (a row aside), and whether the rounding overflowed (overflowed()): the
// float16 SIMD paths find it as they round; other columns are checked when their largest
// magnitude is beyond the type's largest finite value (or NaN).
template <int T>
inline bool narrow_overflowed(const float* src, uint16_t* dst, i64 d, bool stochastic,
                              uint32_t key32, i64 col0) {
  bool over;
  const i64 c = narrow_simd<T>(src, dst, d, stochastic, key32, uint32_t(col0), &over);
  narrow_scalar<T>(src, dst, c, d, stochastic, key32, uint32_t(col0));
  const i64 from = T == kF16 ? c : 0;  // (the bfloat16 paths do not check)
  return over || (!(max_abs(src + from, d - from) <= kTop16<T>) &&
                  overflowed<T>(dst + from, src + from, d - from));
}

// The identities of the rows of a table's shard: segment t covers shard rows
// [starts[t], starts[t + 1]); row k of it has identity bases[t] + (k - starts[t]) * muls[t]
// (uint64 arithmetic). A dynamic table passes its raw ids as the rows, with one segment starting
// at 0: the identity is then the table's key + the raw id.
struct Segments {
  const i64* starts;  // (n + 1,)
  const i64* bases;   // (n,)
  const i64* muls;    // (n,)
  i64 n;

  uint64_t identity(i64 k) const {
    i64 t = 0;
    if (n > 1) t = i64(std::upper_bound(starts, starts + n, k) - starts) - 1;
    if (t < 0) t = 0;
    return uint64_t(bases[t]) + uint64_t(k - starts[t]) * uint64_t(muls[t]);
  }
};

}  // namespace

extern "C" {

// The rounding of float32 values (n,) into 16-bit row type ``type`` (kF16, kBF16): to nearest
// (bits nullptr) or with the random bits ``bits`` (n,), for numerics/rounding.py's tests.
void ec_round16(int type, const float* src, const int32_t* bits, uint16_t* dst, i64 n) {
  for (i64 i = 0; i < n; ++i) {
    const uint32_t u = bits ? uint32_t(bits[i]) : 0U;
    if (type == kF16)
      dst[i] = bits ? f16_stochastic(src[i], u) : f16_nearest_int(src[i]);
    else
      dst[i] = bits ? bf16_stochastic(src[i], u) : bf16_nearest(src[i]);
  }
}

}  // extern "C"
