// fp8.h: 8-bit rows (float8_e4m3fn, float8_e5m2) with a float32 scale per row: widening a code
// to float32, and rounding a quotient x / scale back to a code, to nearest or stochastically.
//
// The rules (numerics/rounding.py's quantize and _round_fp8 are their torch reference, bit for
// bit): a code's value is float32(code) * scale; a row's new scale is max|x| / max_finite over
// its finite values (1 where that is not > 0); each value x / scale, clamped to +-max_finite
// where finite, rounds to nearest even, or stochastically with the random bits u of its column
// (half.h's): u >> 12 (e4m3fn) or u >> 11 (e5m2) added below a normal result's kept bits and
// the rest truncated; a subnormal result (below 2**-6, 2**-14) is |q| + (u >> 8) * 2**-24 *
// spacing in float32 floored to a multiple of the spacing (2**-9, 2**-16); a carry past
// max_finite is clamped to it; the sign is the quotient's (q < 0). NaN keeps its sign; an
// infinity is an infinity of its sign in e5m2 and a positive NaN in e4m3fn (which has none).

#pragma once

#include <cmath>

#include "half.h"

namespace {

// The 8-bit row types (RowType's codes after kBF16; kernels/cpu/update.py's ROW_TYPES8).
enum RowType8 : int { kE4M3 = 3, kE5M2 = 4 };

// The format's constants: float32 bits dropped below a normal value's mantissa, the smallest
// normal, the subnormal spacing, the largest finite value, the exponent bias.
template <int T>
struct Fp8 {
  static constexpr int drop = T == kE4M3 ? 20 : 21;
  static constexpr float normal = T == kE4M3 ? 0.015625f : 6.103515625e-05f;  // 2**-6, 2**-14
  static constexpr float spacing = T == kE4M3 ? 0.001953125f : 1.52587890625e-05f;
  static constexpr float top = T == kE4M3 ? 448.f : 57344.f;
  static constexpr uint32_t rebias = T == kE4M3 ? (127U - 7U) << 3 : (127U - 15U) << 2;
};

// float32(code), exact (NaN keeps its sign).
template <int T>
inline float fp8_to_f32(uint8_t h) {
  if constexpr (T == kE5M2) {
    return f16_to_f32_int(uint16_t(uint16_t(h) << 8));
  } else {
    const uint32_t sign = uint32_t(h & 0x80U) << 24;
    const uint32_t em = h & 0x7FU;
    if (em == 0x7FU) return bits_f32(sign | 0x7FF00000U);  // (torch's NaN bits)
    const uint32_t mag = em < 8U ? f32_bits(float(em) * Fp8<T>::spacing)
                                 : ((em + Fp8<T>::rebias) << Fp8<T>::drop);
    return bits_f32(sign | mag);
  }
}

// float32(code) of every code, built once (a table look-up: the widening's branches out of the
// row loops).
template <int T>
struct Fp8Values {
  float v[256];
  Fp8Values() {
    for (int h = 0; h < 256; ++h) v[h] = fp8_to_f32<T>(uint8_t(h));
  }
};

template <int T>
inline const float* fp8_values() {
  static const Fp8Values<T> table;
  return table.v;
}

// dst[c] = float32(codes[c]) * scale for c < n (one rounding: torch's code.float() * scale).
template <int T>
inline void fp8_widen(const uint8_t* codes, float* dst, i64 n, float scale) {
  const float* v = fp8_values<T>();
  for (i64 c = 0; c < n; ++c) dst[c] = v[codes[c]] * scale;
}

// The code of float32 q to nearest even: q finite within +-top, an infinity or NaN.
template <int T>
inline uint8_t fp8_nearest(float q) {
  const uint32_t b = f32_bits(q);
  const uint32_t sign = (b >> 24) & 0x80U;
  const uint32_t a = b & 0x7FFFFFFFU;
  if (a > 0x7F800000U) return uint8_t(0x7FU | sign);
  if (a == 0x7F800000U) return T == kE4M3 ? uint8_t(0x7FU) : uint8_t(0x7CU | sign);
  constexpr int drop = Fp8<T>::drop;
  uint32_t code;
  if (bits_f32(a) >= Fp8<T>::normal) {
    code = ((a + (1U << (drop - 1)) - 1U + ((a >> drop) & 1U)) >> drop) - Fp8<T>::rebias;
  } else {  // a count of the spacing, to nearest even (float32's own rounding: exact below 2**23)
    const float count = bits_f32(a) / Fp8<T>::spacing;
    code = uint32_t((count + 8388608.f) - 8388608.f);
  }
  return uint8_t(sign | code);
}

// The code of float32 q stochastically with the random bits u (q as fp8_nearest's).
template <int T>
inline uint8_t fp8_stochastic(float q, uint32_t u) {
  const uint32_t a = f32_bits(q) & 0x7FFFFFFFU;
  if (a >= 0x7F800000U) return fp8_nearest<T>(q);
  const float mag = bits_f32(a);
  float out;
  if (mag >= Fp8<T>::normal) {
    constexpr int drop = Fp8<T>::drop;
    out = bits_f32(((a + (u >> (32 - drop))) >> drop) << drop);
  } else {  // (an exact product: 24 bits times a power of two)
    const float sub = mag + float(u >> 8) * (5.9604644775390625e-08f * Fp8<T>::spacing);
    out = std::floor(sub / Fp8<T>::spacing) * Fp8<T>::spacing;
  }
  out = std::min(out, Fp8<T>::top);
  return fp8_nearest<T>(q < 0.f ? -out : out);  // (a value of the format: exact)
}

// A row's new scale from its float32 values x (d): max|x| / top over the finite ones, 1 where
// that is not > 0.
template <int T>
inline float fp8_scale(const float* x, i64 d) {
  float m = 0.f;
  for (i64 c = 0; c < d; ++c) {
    const float v = std::fabs(x[c]);
    if (v <= 3.4028234663852886e38f) m = std::max(m, v);
  }
  const float s = m / Fp8<T>::top;
  return s > 0.f ? s : 1.f;
}

// codes[c] of x[c] / scale for c < d (x's values clamped to +-top where finite), to nearest or
// stochastically with the bits of row key ``key32`` and columns col0 + c.
template <int T>
inline void fp8_narrow(const float* x, float scale, uint8_t* codes, i64 d, bool stochastic,
                       uint32_t key32, i64 col0) {
  constexpr float top = Fp8<T>::top;
  constexpr i64 kB = 64;  // columns a block: quotients and random bits first (vectorized)
  float q[kB];
  uint32_t u[kB];
  for (i64 c0 = 0; c0 < d; c0 += kB) {
    const i64 n = std::min(kB, d - c0);
#pragma omp simd
    for (i64 c = 0; c < n; ++c) {
      const float v = x[c0 + c] / scale;  // (NaN and infinities kept: the clamp's select)
      const bool finite = (f32_bits(v) & 0x7F800000U) != 0x7F800000U;
      q[c] = finite ? std::min(std::max(v, -top), top) : v;
    }
    // a normal finite quotient's code without a branch (vectorized): the kept bits after
    // adding the random bits (or half an ulp less one plus the lowest kept bit), rebiased,
    // capped at top's code, the quotient's sign; the other lanes (subnormal, infinite, NaN:
    // rare) redone by the scalar rules after
    constexpr int drop = Fp8<T>::drop;
    constexpr uint32_t normal_bits = T == kE4M3 ? 0x3C800000U : 0x38800000U;
    constexpr uint32_t top_code = T == kE4M3 ? 0x7EU : 0x7BU;
    uint32_t rare = 0;
    if (stochastic) {
#pragma omp simd
      for (i64 c = 0; c < n; ++c) u[c] = column_bits(key32, uint32_t(col0 + c0 + c));
    }
#pragma omp simd reduction(| : rare)
    for (i64 c = 0; c < n; ++c) {
      const uint32_t b = f32_bits(q[c]), a = b & 0x7FFFFFFFU;
      const uint32_t below = stochastic ? u[c] >> (32 - drop)
                                        : (1U << (drop - 1)) - 1U + ((a >> drop) & 1U);
      const uint32_t code = std::min(((a + below) >> drop) - Fp8<T>::rebias, top_code);
      codes[c0 + c] = uint8_t(((b >> 24) & 0x80U) | code);
      rare |= uint32_t(a < normal_bits) | uint32_t(a >= 0x7F800000U);
    }
    if (rare)
      for (i64 c = 0; c < n; ++c) {
        const uint32_t a = f32_bits(q[c]) & 0x7FFFFFFFU;
        if (a < normal_bits || a >= 0x7F800000U)
          codes[c0 + c] = stochastic ? fp8_stochastic<T>(q[c], u[c]) : fp8_nearest<T>(q[c]);
      }
  }
}

}  // namespace
