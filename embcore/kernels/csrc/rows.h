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
