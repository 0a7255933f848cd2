// inputs.h: checks and scales of the inputs: id ranges, offsets, COO order, combiners.

#pragma once

#include "common.h"

extern "C" {


// Smallest and largest id: out[0], out[1] (n > 0). Eight independent lanes, which the compiler
// vectorizes (a single `omp simd` min / max reduction over int64 did not: 5x slower).
void ec_minmax(const i64* ids, i64 n, i64* out) {
  constexpr int V = 8;
  i64 lo[V], hi[V];
  for (int j = 0; j < V; ++j) lo[j] = hi[j] = ids[0];
  i64 i = 0;
  for (; i + V <= n; i += V)
    for (int j = 0; j < V; ++j) {
      const i64 v = ids[i + j];
      lo[j] = v < lo[j] ? v : lo[j];
      hi[j] = v > hi[j] ? v : hi[j];
    }
  for (; i < n; ++i) {
    lo[0] = std::min(lo[0], ids[i]);
    hi[0] = std::max(hi[0], ids[i]);
  }
  for (int j = 1; j < V; ++j) {
    lo[0] = std::min(lo[0], lo[j]);
    hi[0] = std::max(hi[0], hi[j]);
  }
  out[0] = lo[0];
  out[1] = hi[0];
}

// The first entry of jagged offsets (n >= 1) breaking "offsets[0] == 0, never decreasing,
// offsets[n - 1] == nnz", or -1 when they hold: 0 when offsets[0] != 0, the first i with
// offsets[i] < offsets[i - 1], else n - 1 when the last offset is not nnz.
i64 ec_offsets_error(const i64* offsets, i64 n, i64 nnz) {
  if (offsets[0] != 0) return 0;
  for (i64 i = 1; i < n; ++i)
    if (offsets[i] < offsets[i - 1]) return i;
  return offsets[n - 1] == nnz ? -1 : n - 1;
}

// The first column j >= 1 of the (k, n) row-major sparse indices that is not lexicographically
// greater than column j - 1 (out of order, or a duplicate), or -1 when the columns strictly
// increase (what a coalesced COO tensor holds). Rank 2 (the common case) first counts the bad
// columns of each block branch-free (vectorized, 3x faster); the exact search runs on failure.
i64 ec_first_unordered(const i64* idx, i64 k, i64 n) {
  constexpr i64 BLOCK = 1024;
  for (i64 j0 = 1; j0 < n; j0 += BLOCK) {
    const i64 j1 = std::min(n, j0 + BLOCK);
    if (k == 2) {
      const i64 *r0 = idx, *r1 = idx + n;
      i64 bad = 0;
#pragma omp simd reduction(+ : bad)
      for (i64 j = j0; j < j1; ++j)
        bad += (r0[j - 1] > r0[j]) | ((r0[j - 1] == r0[j]) & (r1[j - 1] >= r1[j]));
      if (!bad) continue;
    }
    for (i64 j = j0; j < j1; ++j) {
      int cmp = 0;
      for (i64 d = 0; d < k && cmp == 0; ++d) {
        const i64 a = idx[d * n + j - 1], b = idx[d * n + j];
        cmp = a < b ? 1 : (a > b ? -1 : 0);
      }
      if (cmp <= 0) return j;
    }
  }
  return -1;
}

// Per-id scales that make a weighted sum over each bag apply the combiner (docs/semantics.md
// section 2):
//   combiner 0 sum: w; 1 mean: w / sum(w); 2 sqrtn: w / sqrt(sum(w^2)); a bag whose
//   denominator is 0 gets zeros. offsets (R + 1,); weights (nnz,) or nullptr (all 1); out (nnz,).
//   No fused multiply-add: the same float32 sums as inputs.combiner_scales' torch ops, so an
//   exported program (torch ops) gives the eager module's bits for sqrtn bags too.
__attribute__((optimize("fp-contract=off"))) void ec_combiner_scales(
    const i64* offsets, i64 r_rows, const float* weights, int combiner, float* out) {
  for (i64 r = 0; r < r_rows; ++r) {
    const i64 k0 = offsets[r], k1 = offsets[r + 1];
    float denom = 1.f;
    if (combiner != 0) {
      float acc = 0.f;
      for (i64 k = k0; k < k1; ++k) {
        const float w = weights ? weights[k] : 1.f;
        acc += combiner == 1 ? w : w * w;
      }
      denom = combiner == 1 ? acc : std::sqrt(acc);
    }
    for (i64 k = k0; k < k1; ++k) {  // w / denom, not w * (1 / denom): 1 / tiny overflows
      const float w = weights ? weights[k] : 1.f;
      out[k] = combiner == 0 ? w : (denom != 0.f ? w / denom : 0.f);
    }
  }
}


// Bag of every occurrence: bags[k] = r for k in [offsets[r], offsets[r+1]).
void ec_bag_of(const i64* offsets, i64 r_rows, i64* bags) {
  for (i64 r = 0; r < r_rows; ++r)
    for (i64 k = offsets[r]; k < offsets[r + 1]; ++k) bags[k] = r;
}

}  // extern "C"
