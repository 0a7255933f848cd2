// rows.h: row moves between a cache and its slow tier, and read-ahead of mapped rows.

#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include "common.h"
#include "pool.h"

extern "C" {

// Asks the kernel to read the pages under rows rows[i] (i < n; each row_bytes long, rows
// stride bytes apart from base) of a mapped file ahead (madvise MADV_WILLNEED): the reads are
// submitted at once, so that the row moves that follow find them in flight rather than
// faulting them in one at a time. A system call per row (none for a row on the previous row's
// pages); advice only. Returns the calls made (0 where madvise is not available).
i64 ec_will_need(const char* base, i64 stride, const i64* rows, i64 n, i64 row_bytes) {
#if defined(__linux__) && defined(MADV_WILLNEED)
  const uintptr_t page = uintptr_t(sysconf(_SC_PAGESIZE));
  uintptr_t last_lo = 1, last_hi = 0;  // (an empty range)
  i64 calls = 0;
  for (i64 i = 0; i < n; ++i) {
    const uintptr_t at = uintptr_t(base + rows[i] * stride);
    const uintptr_t lo = at & ~(page - 1), hi = (at + uintptr_t(row_bytes) + page - 1) & ~(page - 1);
    if (lo >= last_lo && hi <= last_hi) continue;
    madvise(reinterpret_cast<void*>(lo), size_t(hi - lo), MADV_WILLNEED);
    last_lo = lo;
    last_hi = hi;
    ++calls;
  }
  return calls;
#else
  (void)base; (void)stride; (void)rows; (void)n; (void)row_bytes;
  return 0;
#endif
}

// Row moves between two arrays of rows (the cache and its slow tier): for i < n,
// dst[dst_rows[i]] = src[src_rows[i]], each row row_bytes long, rows src_stride / dst_stride
// bytes apart. One pass, no temporary; the rows ahead are prefetched, sources and destinations.
void ec_copy_rows(const char* src, i64 src_stride, const i64* src_rows, char* dst,
                  i64 dst_stride, const i64* dst_rows, i64 n, i64 row_bytes, int nt) {
  nt = threads_for(n * (row_bytes / 4), nt);
  const i64 chunks = chunks_for(n * (row_bytes / 4), nt);
  parallel_ranges(chunks, nt, n, nullptr, 0, [&](i64, i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        prefetch_read(reinterpret_cast<const float*>(src + src_rows[i + kPrefetch] * src_stride),
                      row_bytes / 4);
        prefetch_write(reinterpret_cast<const float*>(dst + dst_rows[i + kPrefetch] * dst_stride),
                       row_bytes / 4);
      }
      std::memcpy(dst + dst_rows[i] * dst_stride, src + src_rows[i] * src_stride,
                  size_t(row_bytes));
    }
  });
}

}  // extern "C"

// The slow tier's row checksums (ops/checksum.py defines them and is their torch-ops twin): a
// row's checksum is h = 2 * (key + version * kSumWeight) + 1 (mod 2^32, key its shard row,
// version the count of its writes the cache holds in memory), then h = (h ^ s) * kSumPrime for
// each of its arrays in order (the parameters, then the slots), s the array's row sum:
// sum_j w_j * kSumWeight * (2j + 1) (mod 2^32) over its bytes read as 32-bit words (native byte
// order; the last word zero-padded). Every step is one-to-one in the word it adds, so a row with
// one word changed, or its record of an earlier version, never keeps its checksum.
namespace {

constexpr uint32_t kSumWeight = 0x9E3779B1u;
constexpr uint32_t kSumPrime = 0x01000193u;

inline uint32_t sum_seed(i64 key, uint32_t version) {
  return uint32_t(uint64_t(key) * 2u + 1u) + version * (2u * kSumWeight);
}

inline uint32_t row_sum(const char* p, i64 bytes) {
  const i64 m = bytes / 4;
  uint32_t s = 0;
#pragma omp simd reduction(+ : s)
  for (i64 j = 0; j < m; ++j) {
    uint32_t w;
    std::memcpy(&w, p + 4 * j, 4);
    s += w * (kSumWeight * uint32_t(2 * j + 1));
  }
  if (bytes % 4) {
    uint32_t w = 0;
    std::memcpy(&w, p + 4 * m, size_t(bytes % 4));
    s += w * (kSumWeight * uint32_t(2 * m + 1));
  }
  return s;
}

}  // namespace

extern "C" {

// One array's part of a move of rows with their checksums: for i < n, when copy,
// dst[dst_rows[i]] = src[src_rows[i]] (row_bytes long, rows src_stride / dst_stride bytes apart),
// and the row's bytes are folded into its checksum acc[i] (first: started from keys[i] and its
// version versions[i], 0 where versions is null; else going on from acc[i]). The last
// array's call passes sums (indexed by keys): verify, each sums[keys[i]] must equal acc[i]; else
// it is set to acc[i]. Returns the lowest i whose checksum differs (verify), else -1. The rows ahead are prefetched, and so are their checksums in sums
// (a random 4-byte read each, in a file as large as the rows': otherwise a cache miss and a page
// walk a row that nothing overlaps).
i64 ec_copy_rows_summed(const char* src, i64 src_stride, const i64* src_rows, char* dst,
                        i64 dst_stride, const i64* dst_rows, i64 n, i64 row_bytes, int copy,
                        const i64* keys, const int32_t* versions, int32_t* acc, int first,
                        int32_t* sums, int verify, int nt) {
  nt = threads_for(n * (row_bytes / 4), nt);
  const i64 chunks = chunks_for(n * (row_bytes / 4), nt);
  std::vector<i64> bad(size_t(chunks), -1);
  parallel_ranges(chunks, nt, n, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
    for (i64 i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi) {
        prefetch_read(reinterpret_cast<const float*>(src + src_rows[i + kPrefetch] * src_stride),
                      row_bytes / 4);
        if (copy)
          prefetch_write(reinterpret_cast<const float*>(dst + dst_rows[i + kPrefetch] * dst_stride),
                         row_bytes / 4);
        if (sums != nullptr) __builtin_prefetch(sums + keys[i + kPrefetch], 0, 1);
      }
      const char* row = src + src_rows[i] * src_stride;
      if (copy) {  // (summed where it was written: in this core's cache)
        char* to = dst + dst_rows[i] * dst_stride;
        std::memcpy(to, row, size_t(row_bytes));
        row = to;
      }
      const uint32_t h0 =
          first ? sum_seed(keys[i], versions != nullptr ? uint32_t(versions[i]) : 0u)
                : uint32_t(acc[i]);
      const uint32_t h = (h0 ^ row_sum(row, row_bytes)) * kSumPrime;
      if (sums == nullptr) {
        acc[i] = int32_t(h);
      } else if (!verify) {
        sums[keys[i]] = int32_t(h);
      } else if (uint32_t(sums[keys[i]]) != h && bad[size_t(c)] < 0) {
        bad[size_t(c)] = i;
      }
    }
  });
  for (i64 b : bad)
    if (b >= 0) return b;  // (chunks in order: the first is the lowest)
  return -1;
}

}  // extern "C"
