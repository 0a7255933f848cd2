// common.h: what every kernel uses: int64 rows, prefetching, splitting work by cost, ids' hash.
//
// Legend: N rows, D dim, nnz id occurrences, R output rows (bags), U unique rows.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

typedef int64_t i64;

namespace {

constexpr i64 kPrefetch = 16;             // table rows ahead whose cache lines are requested early
constexpr i64 kPrefetchOccurrences = 16;  // output gradient rows ahead (backward)
constexpr i64 kSerialWork = 16384;  // below this many floats touched, one thread

inline void prefetch_read(const float* p, i64 d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (i64 o = 0; o < d * 4; o += 64) __builtin_prefetch(c + o, 0, 1);
}

inline void prefetch_write(const float* p, i64 d) {
  const char* c = reinterpret_cast<const char*>(p);
  for (i64 o = 0; o < d * 4; o += 64) __builtin_prefetch(c + o, 1, 1);
}

// Splits [0, n) into nt contiguous parts of about equal cost, cost(i) = weight[i] + i * per_item
// for an ascending cumulative ``weight`` (nullptr: cost(i) = i). Returns the start of part t.
inline i64 split_point(const i64* cumulative, i64 n, i64 per_item, int t, int nt) {
  if (t <= 0) return 0;
  if (t >= nt) return n;
  if (cumulative == nullptr) return n * t / nt;
  const double total = double(cumulative[n] - cumulative[0]) + double(n) * per_item;
  const double target = total * t / nt;
  i64 lo = 0, hi = n;
  while (lo < hi) {  // first i whose cost reaches the target
    i64 mid = (lo + hi) / 2;
    double cost = double(cumulative[mid] - cumulative[0]) + double(mid) * per_item;
    if (cost < target) lo = mid + 1; else hi = mid;
  }
  return lo;
}

inline int threads_for(i64 work, int nt) { return work < kSerialWork ? 1 : std::max(nt, 1); }

// SplitMix64's finalizer (numerics/hashing.py's splitmix64 without the increment): spreads ids.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace
