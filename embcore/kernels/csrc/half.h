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
// integer steps; bfloat16 is a shift. float16 stores to nearest use F16C's vcvtps2ph where present;
// stochastic ones AVX-512F's conversion toward zero after the random bits are added where present;
// integer steps (vectorized) otherwise, and for bfloat16. Every build gives the same bits.
// AVX-512 BF16's conversion is not used: it flushes subnormals to zero, which torch's rounding
// does not.

#pragma once

#include "common.h"

#if defined(__F16C__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

// The row types of the kernels that read or write rows (the codes of native.py's ROW_TYPES).
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
// float32; truncated to a count of 2**-24 (y * 2**24 is exact: a power of two).
inline uint16_t f16_from(uint32_t b, uint32_t below_n, float sub) {
  const uint32_t sign = (b >> 16) & 0x8000U;
  const uint32_t a = b & 0x7FFFFFFFU;
  uint32_t hn = ((a + below_n) >> 13) - 0x1C000U;
  hn = hn > 0x7C00U ? 0x7C00U : hn;  // (also every a >= 65536: infinite)
  const float small = sub < 1.220703125e-4f ? sub : 0.f;  // (< 2**-13: a defined conversion)
  const uint32_t hs = uint32_t(int32_t(small * 16777216.0f));
  const uint32_t h = a > 0x7F800000U ? 0x7E00U : (a >= 0x38800000U ? hn : hs);
  return uint16_t(sign | h);
}

inline uint16_t f16_nearest_int(float x) {
  const uint32_t b = f32_bits(x);
  const float a = bits_f32(b & 0x7FFFFFFFU);
  // a subnormal result to nearest even: the count a * 2**24 (exact) rounded to nearest even
  const float count = std::nearbyint(a * 16777216.0f);
  return f16_from(b, 0xFFFU + ((b >> 13) & 1U), count * 5.9604644775390625e-8f);
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

#if defined(__AVX512F__)
inline __m512i lowbias32_x16(__m512i x) {
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x7feb352d));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(int32_t(0x846ca68bU)));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 16));
}

// f16_stochastic on 16 columns at a time with AVX-512F's conversion (round toward zero) of the
// float32 whose truncation the rule takes: a normal result's bits + (u >> 19), a subnormal one's
// |x| + (u >> 8) * 2**-48 (the same bits; overflow and NaN set first; the columns' hash inputs
// stepped by addition). 36 ns a 128-wide row on the Zen 4 machine, against 56 for the plain
// vectorized loop. Returns the first column it did not do (d rounded down to a multiple of 16).
inline i64 f16_stochastic_x16(const float* src, uint16_t* dst, i64 d, uint32_t key32,
                              uint32_t c0) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i input = _mm512_add_epi32(  // key32 + (c0 + c) * golden, lane by lane
      _mm512_set1_epi32(int32_t(key32 + c0 * 0x9E3779B9U)),
      _mm512_mullo_epi32(lanes, _mm512_set1_epi32(int32_t(0x9E3779B9U))));
  const __m512i step = _mm512_set1_epi32(int32_t(16U * 0x9E3779B9U));
  const __m512 two_m48 = _mm512_set1_ps(3.552713678800501e-15f);
  i64 c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512i u = lowbias32_x16(input);
    input = _mm512_add_epi32(input, step);
    const __m512i b = _mm512_castps_si512(_mm512_loadu_ps(src + c));
    const __m512i a = _mm512_and_si512(b, abs_mask);
    const __m512i sign = _mm512_andnot_si512(abs_mask, b);
    const __m512i t = _mm512_add_epi32(a, _mm512_srli_epi32(u, 19));  // a normal result
    const __m512 sub = _mm512_add_ps(_mm512_castsi512_ps(a),            // a subnormal one
                                     _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(u, 8)),
                                                   two_m48));
    const __mmask16 normal = _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x387FFFFF));
    __m512i y = _mm512_mask_blend_epi32(normal, _mm512_castps_si512(sub), t);
    y = _mm512_mask_mov_epi32(y, _mm512_cmpgt_epi32_mask(t, _mm512_set1_epi32(0x477FFFFF)),
                              _mm512_set1_epi32(0x7F800000));  // 65536 and up: infinite
    y = _mm512_mask_mov_epi32(y, _mm512_cmpgt_epi32_mask(a, _mm512_set1_epi32(0x7F800000)),
                              _mm512_set1_epi32(0x7FC00000));  // NaN: a quiet NaN
    y = _mm512_or_si512(y, sign);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c),
                        _mm512_cvtps_ph(_mm512_castsi512_ps(y),
                                        _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC));
  }
  return c;
}
#endif

// dst[c] = round(src[c]) for c < d: to nearest, or stochastically with the bits of row key
// ``key32`` and columns col0 + c.
template <int T>
inline void narrow(const float* src, void* dst_, i64 d, bool stochastic, uint32_t key32,
                   i64 col0) {
  if constexpr (T == kF32) {
    std::memcpy(dst_, src, sizeof(float) * d);
  } else {
    uint16_t* dst = static_cast<uint16_t*>(dst_);
    const uint32_t c0 = uint32_t(col0);
    if (stochastic) {
      i64 c = 0;
#if defined(__AVX512F__)
      if constexpr (T == kF16) c = f16_stochastic_x16(src, dst, d, key32, c0);
#endif
#pragma omp simd
      for (i64 k = c; k < d; ++k) {
        const uint32_t u = column_bits(key32, c0 + uint32_t(k));
        dst[k] = T == kF16 ? f16_stochastic(src[k], u) : bf16_stochastic(src[k], u);
      }
      return;
    }
    i64 c = 0;
    if constexpr (T == kF16) {
#if defined(__F16C__)
      for (; c + 8 <= d; c += 8)
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + c),
                         _mm256_cvtps_ph(_mm256_loadu_ps(src + c), _MM_FROUND_TO_NEAREST_INT));
#endif
    }
#pragma omp simd
    for (i64 k = c; k < d; ++k)
      dst[k] = T == kF16 ? f16_nearest_int(src[k]) : bf16_nearest(src[k]);
  }
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
