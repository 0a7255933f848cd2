// lookup.h: the forward lookup: weighted bag sums of table rows.

#pragma once

#include "common.h"
#include "fp8.h"
#include "half.h"
#include "pool.h"

namespace {

// The bytes of a value of row type T (float32, 16-bit, 8-bit).
template <int T>
constexpr i64 kRowBytes = T == kF32 ? 4 : (T == kE4M3 || T == kE5M2 ? 1 : 2);

// dst[c] = the value of row ``src``'s column c, c < n, as float32: 16-bit rows widened (exact),
// 8-bit ones widened and multiplied by the row's scale ``scale`` (one rounding: torch's
// ``float32(code) * scale``).
template <int T>
inline void widen_row(const void* src, float* dst, i64 n, float scale) {
  if constexpr (T == kE4M3 || T == kE5M2) {
    fp8_widen<T>(static_cast<const uint8_t*>(src), dst, n, scale);
  } else {
    (void)scale;
    widen<T>(src, dst, n);
  }
}

// The column block of a bag sum for rows of d floats: the largest of 128, 64, 32, 16, 8 that
// divides d (0: none does; the sum runs over whole rows in memory).
inline i64 bag_block(i64 d) {
  for (i64 b = 128; b >= 8; b /= 2)
    if (d % b == 0) return b;
  return 0;
}

// One bag's sum o = sum_{k in [k0, k1)} scales[k] * table[ids[k]], BW columns at a time held in
// registers (no store per occurrence); each column still sums 0 + s * row + s * row + ... in
// bag order, as the plain loop does, each step one fused multiply-add, fma(s, row, acc): rounded
// once, as torch's embedding_bag (FBGEMM) rounds, on every build (a build without FMA
// instructions would otherwise round the product and the sum apart: an ulp off at times). The first block prefetches the rows kPrefetch ahead. Rows
// of 16-bit type T are widened to float32 (exact) as they are read; 8-bit ones widened and
// multiplied by their row's scale in ``row_scales`` (widen_row).
template <int T, i64 BW>
inline void bag_sum(const void* table_, i64 d, const i64* ids, const float* scales, i64 k0,
                    i64 k1, i64 k_end, float* o, const float* row_scales) {
  constexpr i64 esize = kRowBytes<T>;
  const char* table = static_cast<const char*>(table_);
  for (i64 c0 = 0; c0 < d; c0 += BW) {
    float acc[BW] = {};
    for (i64 k = k0; k < k1; ++k) {
      if (c0 == 0 && k + kPrefetch < k_end)
        prefetch_read(reinterpret_cast<const float*>(table + ids[k + kPrefetch] * d * esize),
                      (d * esize + 3) / 4);
      const float s = scales ? scales[k] : 1.f;
      const void* at = table + (ids[k] * d + c0) * esize;
      const float* row;
      float wide[BW];
      if constexpr (T == kF32) {
        row = static_cast<const float*>(at);
      } else {
        widen_row<T>(at, wide, BW, row_scales ? row_scales[ids[k]] : 1.f);
        row = wide;
      }
#pragma omp simd
      for (i64 c2 = 0; c2 < BW; ++c2) acc[c2] = std::fma(s, row[c2], acc[c2]);
    }
    for (i64 c2 = 0; c2 < BW; ++c2) o[c0 + c2] = acc[c2];
  }
}

template <int T>
void lookup_rows(const void* table_, i64 d, const i64* ids, const i64* offsets,
                 const float* scales, i64 r_rows, float* out, int nt,
                 const float* row_scales = nullptr) {
  constexpr i64 esize = kRowBytes<T>;
  const char* table = static_cast<const char*>(table_);
  auto row_at = [&](i64 id) { return table + id * d * esize; };
  auto ahead = [&](i64 id) {
    prefetch_read(reinterpret_cast<const float*>(row_at(id)), (d * esize + 3) / 4);
  };
  const i64 nnz = offsets ? offsets[r_rows] : r_rows;
  nt = threads_for(nnz * d, nt);
  const i64 chunks = chunks_for(nnz * d, nt);
  // chunks of bags of about equal cost
  parallel_ranges(chunks, nt, r_rows, offsets, 1, [&](i64, i64 lo, i64 hi) {
    if (offsets == nullptr) {
      for (i64 r = lo; r < hi; ++r) {
        if (r + kPrefetch < hi) ahead(ids[r + kPrefetch]);
        widen_row<T>(row_at(ids[r]), out + r * d, d, row_scales ? row_scales[ids[r]] : 1.f);
      }
    } else {
      const i64 k_end = offsets[hi];
      const i64 bw = bag_block(d);
      thread_local std::vector<float> wide;
      if (bw == 0 && T != kF32) wide.resize(size_t(d));
      for (i64 r = lo; r < hi; ++r) {
        float* o = out + r * d;
        const i64 k0 = offsets[r], k1 = offsets[r + 1];
        switch (bw) {
          case 128: bag_sum<T, 128>(table, d, ids, scales, k0, k1, k_end, o, row_scales); break;
          case 64: bag_sum<T, 64>(table, d, ids, scales, k0, k1, k_end, o, row_scales); break;
          case 32: bag_sum<T, 32>(table, d, ids, scales, k0, k1, k_end, o, row_scales); break;
          case 16: bag_sum<T, 16>(table, d, ids, scales, k0, k1, k_end, o, row_scales); break;
          case 8: bag_sum<T, 8>(table, d, ids, scales, k0, k1, k_end, o, row_scales); break;
          default:
            for (i64 c2 = 0; c2 < d; ++c2) o[c2] = 0.f;
            for (i64 k = k0; k < k1; ++k) {
              if (k + kPrefetch < k_end) ahead(ids[k + kPrefetch]);
              const float s = scales ? scales[k] : 1.f;
              const float* row;
              if constexpr (T == kF32) {
                row = reinterpret_cast<const float*>(row_at(ids[k]));
              } else {
                widen_row<T>(row_at(ids[k]), wide.data(), d,
                             row_scales ? row_scales[ids[k]] : 1.f);
                row = wide.data();
              }
#pragma omp simd
              for (i64 c2 = 0; c2 < d; ++c2) o[c2] = std::fma(s, row[c2], o[c2]);
            }
        }
      }
    }
  });
}

}  // namespace

extern "C" {

// Weighted bag sums: out[r] = sum_{k in [offsets[r], offsets[r+1])} scales[k] * table[ids[k]].
//   type the table's row type (kF32, kF16, kBF16: rows widened to float32); table (N, D)
//   row-major; ids (nnz,); offsets (R + 1,) or nullptr (bag r is id r alone, scale 1); scales
//   (nnz,) or nullptr (all 1); out (R, D) float32.
//   8-bit types (kE4M3, kE5M2): a row's value is float32(code) * row_scales[row] (row_scales
//   (N,); nullptr with them: nothing is written).
void ec_lookup(int type, const void* table, const float* row_scales, i64 d, const i64* ids,
               const i64* offsets, const float* scales, i64 r_rows, float* out, int nt) {
  if (type == kE4M3 || type == kE5M2) {
    if (row_scales == nullptr) return;  // (kernels/cpu/batch.py checks it first)
    if (type == kE4M3)
      lookup_rows<kE4M3>(table, d, ids, offsets, scales, r_rows, out, nt, row_scales);
    else
      lookup_rows<kE5M2>(table, d, ids, offsets, scales, r_rows, out, nt, row_scales);
  } else if (type == kF16)
    lookup_rows<kF16>(table, d, ids, offsets, scales, r_rows, out, nt);
  else if (type == kBF16)
    lookup_rows<kBF16>(table, d, ids, offsets, scales, r_rows, out, nt);
  else
    lookup_rows<kF32>(table, d, ids, offsets, scales, r_rows, out, nt);
}

}  // extern "C"
