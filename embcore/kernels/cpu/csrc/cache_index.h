// cache_index.h: the index of a write-back cache over a shard (state/tier/index.py).

#pragma once

#include "common.h"
#include "pool.h"

extern "C" {

// One step of a write-back cache's index over a shard of N rows with C cache rows. State:
// where (N,) int32: the cache row holding each shard row, or -1 - v for a row not cached (v its
// version: state/tier/cache.py); owner (C,): the shard row each cache row holds, or -1; stamp (C,):
// the clock of its last use; dirty, fresh (C,) uint8 flags; version (C,) int32: the version of
// the row each cache row holds (kept by the caller, moved here: a miss takes its row's v from
// where, an evicted row gives it back); free (C,): a stack of the free cache rows, io[0] of
// them.
//
// rows (U,) are distinct shard rows (U <= C); slots (U,) out: their cache rows. Cached rows
// (hits) get stamp = clock. When the rows not cached (misses) outnumber the free cache rows,
// the least recently used cache rows not used at this clock are evicted, by (stamp, cache row),
// need + spare of them (or every one there is): the dirty ones are listed in out_rows / out_slots
// (to be written back now; flag cleared), and every evicted cache row joins the free stack, the
// lower ones on top. Misses take cache rows from the top of the stack in their order and are
// listed in miss_rows / miss_slots (to be read now). With counts (3T,) given, each row is
// counted for its member table (bounds (T-1,): the first row of members 1..T-1): a miss in
// misses, a hit on a fresh row in news (the flag cleared), any other hit in hits.
// io: [n_free (in/out), n_miss, n_out, n_evicted] (out). Returns 0, or -1 when U > C
// (nothing changed).
//
// On nt threads each phase runs in chunks: of the rows (hits and misses; the misses' cache
// rows), of the cache rows (the ages' histogram; the choice of victims), of the victims (their
// release). A chunk writes its part of a list at its own offset (known from the chunks before
// it, or compacted after), so the result is the one-thread result, bit for bit.
namespace {
thread_local std::vector<i64> cache_hist;   // per chunk: kBins + 1 counts
thread_local std::vector<i64> cache_parts;  // per chunk of rows: counts, misses, offsets
thread_local std::vector<i64> cache_out_parts;  // per chunk of victims: offsets, lengths
constexpr i64 kFreeStamp = INT64_MAX;  // the stamp of a free cache row
constexpr i64 kBins = 4096;            // ages' histogram: 1 .. kBins - 2, the last bin older
thread_local std::vector<std::pair<i64, i64>> cache_ties;

// The bin of a cache row's age (clock - stamp): kBins for rows used now or free (not
// candidates), else min(age, kBins - 1).
inline i64 age_bin(i64 clock, i64 stamp) {
  const i64 age = clock - stamp;
  return age < 1 ? kBins : std::min(age, kBins - 1);
}

// Moves the parts [lo_c, lo_c + len_c) of arrays a and b (chunk c's list, written at its
// chunk's start) together, in chunk order; returns the total length.
inline i64 compact(i64* a, i64* b, const i64* lo, const i64* len, i64 chunks) {
  i64 at = 0;
  for (i64 c = 0; c < chunks; ++c) {
    if (at != lo[c]) {
      std::memmove(a + at, a + lo[c], size_t(len[c]) * sizeof(i64));
      if (b != nullptr) std::memmove(b + at, b + lo[c], size_t(len[c]) * sizeof(i64));
    }
    at += len[c];
  }
  return at;
}
}  // namespace

i64 ec_cache_step(const i64* rows, i64 n_rows, int32_t* where, i64* owner, i64* stamp,
                  uint8_t* dirty, uint8_t* fresh, int32_t* version, i64* free_rows,
                  i64 capacity, i64 clock,
                  i64 spare, i64* slots, i64* miss_rows, i64* miss_slots, i64* out_rows,
                  i64* out_slots, const i64* bounds, i64 n_bounds, i64* counts, i64* io,
                  int nt) {
  if (n_rows > capacity) return -1;
  i64 n_free = io[0], n_out = 0, n_evicted = 0;
  const i64 members = n_bounds + 1, per = 3 * members;
  // Phase 1, chunks of rows: hits stamped and counted; each chunk's misses listed at its start.
  const int t_rows = threads_for(n_rows * 8, nt);
  const i64 rc = chunks_for(n_rows * 8, t_rows, 64);
  cache_parts.assign(size_t(rc * (per + 3)), 0);
  i64* part_counts = cache_parts.data();          // (rc, 3T)
  i64* row_lo = part_counts + rc * per;            // (rc,) chunk starts
  i64* miss_len = row_lo + rc;                     // (rc,) misses per chunk
  i64* miss_at = miss_len + rc;                    // (rc,) the chunk's first miss
  parallel_ranges(rc, t_rows, n_rows, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
    i64* cnt = part_counts + c * per;
    i64 n_miss = 0;
    for (i64 u = lo; u < hi; ++u) {
      if (u + kPrefetch < hi) __builtin_prefetch(where + rows[u + kPrefetch]);
      const i64 r = rows[u];
      const int32_t s = where[r];
      i64 m = 0;
      if (counts != nullptr && n_bounds > 0) {  // the member: bounds <= r, searched branch-free
        const i64* base = bounds;               // (a fixed trip count: no mispredictions)
        for (i64 len = n_bounds; len > 1; len -= len / 2)
          base = base[len / 2] <= r ? base + len / 2 : base;
        m = i64(base - bounds) + (*base <= r);
      }
      if (s >= 0) {
        stamp[s] = clock;
        slots[u] = s;
        if (counts != nullptr) {
          if (fresh[s]) {
            fresh[s] = 0;
            ++cnt[2 * members + m];
          } else {
            ++cnt[m];
          }
        }
      } else {
        slots[u] = -1;
        miss_rows[lo + n_miss++] = r;
        if (counts != nullptr) ++cnt[members + m];
      }
    }
    row_lo[c] = lo;
    miss_len[c] = n_miss;
  });
  if (counts != nullptr)
    for (i64 c = 0; c < rc; ++c)
      for (i64 i = 0; i < per; ++i) counts[i] += part_counts[c * per + i];
  for (i64 c = 0, at = 0; c < rc; ++c) {
    miss_at[c] = at;
    at += miss_len[c];
  }
  const i64 n_miss = compact(miss_rows, nullptr, row_lo, miss_len, rc);

  if (n_miss > n_free) {  // Phase 2: evict the least recently used rows not used now
    // A histogram of the candidates' ages gives the age bin b of the k-th oldest; its ties go
    // by cache row. Should the last bin (ages >= kBins - 1) hold more than k, its rows are
    // ordered exactly.
    const int t_cache = threads_for(capacity * 2, nt);
    const i64 cc = chunks_for(capacity * 2, t_cache, 16);
    cache_hist.assign(size_t(cc * (kBins + 1) + 2 * cc), 0);
    i64* chunk_hist = cache_hist.data();                 // (cc, kBins + 1)
    i64* chunk_lo = chunk_hist + cc * (kBins + 1);       // (cc,)
    i64* chunk_take = chunk_lo + cc;                     // (cc,) victims per chunk
    parallel_ranges(cc, t_cache, capacity, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
      i64* h = chunk_hist + c * (kBins + 1);
      for (i64 s = lo; s < hi; ++s) ++h[age_bin(clock, stamp[s])];
      chunk_lo[c] = lo;
    });
    std::vector<i64> hist(size_t(kBins + 1), 0);
    for (i64 c = 0; c < cc; ++c)
      for (i64 b = 0; b <= kBins; ++b) hist[size_t(b)] += chunk_hist[c * (kBins + 1) + b];
    const i64 candidates = capacity - hist[kBins];
    const i64 k = std::min(n_miss - n_free + spare, candidates);
    i64 b = kBins - 1, above = 0;  // above: the candidates older than bin b
    while (b > 1 && above + hist[size_t(b)] < k) above += hist[size_t(b--)];
    const i64 ties = k - above;  // the lowest cache rows of bin b, or its oldest (last bin)
    i64* top = free_rows + n_free + k - 1;  // victims in ascending order: the lowest on top
    if (b == kBins - 1 && ties < hist[size_t(b)]) {  // the last bin's oldest, in order (rare)
      cache_ties.clear();
      for (i64 s = 0; s < capacity; ++s)
        if (stamp[s] < clock && clock - stamp[s] >= kBins - 1) cache_ties.emplace_back(stamp[s], s);
      std::nth_element(cache_ties.begin(), cache_ties.begin() + (ties - 1), cache_ties.end());
      const std::pair<i64, i64> last = cache_ties[size_t(ties - 1)];
      for (i64 s = 0; s < capacity && n_evicted < k; ++s)
        if (stamp[s] < clock && std::make_pair(stamp[s], s) <= last) *(top - n_evicted++) = s;
    } else {
      // Chunk c takes its rows older than bin b and the ties that the chunks before it left.
      for (i64 c = 0, tied = 0, at = 0; c < cc; ++c) {
        const i64* h = chunk_hist + c * (kBins + 1);
        i64 older = 0;
        for (i64 a = b + 1; a < kBins; ++a) older += h[a];
        const i64 mine = std::max(i64(0), std::min(h[b], ties - tied));
        tied += h[b];
        chunk_take[c] = older + mine;
        chunk_lo[c] = at;  // (now: the chunk's first victim)
        at += older + mine;
      }
      parallel_chunks(cc, t_cache, [&](i64 c) {
        const i64 lo = split_point(nullptr, capacity, 0, int(c), int(cc));
        const i64 hi = split_point(nullptr, capacity, 0, int(c) + 1, int(cc));
        const i64 want = chunk_take[c];
        const i64* h = chunk_hist + c * (kBins + 1);
        i64 older = 0;
        for (i64 a = b + 1; a < kBins; ++a) older += h[a];
        const i64 tie_quota = want - older;
        i64* at = top - chunk_lo[c];
        i64 n = 0, taken = 0;  // (branch-free: which rows go is not predictable)
        for (i64 s = lo; s < hi && n < want; ++s) {
          const i64 bin = age_bin(clock, stamp[s]);
          const bool tie = bin == b, take = (bin > b && bin < kBins) || (tie && taken < tie_quota);
          taken += tie & take;
          *(at - n) = s;
          n += take;
        }
      });
      n_evicted = k;
    }
    // The victims released, in chunks of the free stack's new part; each chunk's dirty rows
    // listed at its start, then compacted.
    const int t_out = threads_for(k * 8, nt);
    const i64 oc = chunks_for(k * 8, t_out, 64);
    cache_out_parts.assign(size_t(2 * oc), 0);
    i64* out_lo = cache_out_parts.data();
    i64* out_len = out_lo + oc;
    i64* victims = free_rows + n_free;
    parallel_ranges(oc, t_out, k, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
      i64 n = 0;
      for (i64 j = lo; j < hi; ++j) {  // (the shard rows' entries: random writes, prefetched)
        if (j + kPrefetch < hi) __builtin_prefetch(where + owner[victims[j + kPrefetch]], 1);
        const i64 s = victims[j];
        if (dirty[s]) {
          out_rows[lo + n] = owner[s];
          out_slots[lo + n++] = s;
          dirty[s] = 0;
        }
        where[owner[s]] = -1 - version[s];
        owner[s] = -1;
        stamp[s] = kFreeStamp;
        fresh[s] = 0;
      }
      out_lo[c] = lo;
      out_len[c] = n;
    });
    n_out = compact(out_rows, out_slots, out_lo, out_len, oc);
    n_free += k;
  }
  // Phase 3, the chunks of phase 1: the misses take cache rows from the top of the stack.
  i64* stack_top = free_rows + n_free - 1;  // the j-th miss takes *(stack_top - j)
  parallel_ranges(rc, t_rows, n_rows, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
    i64 j = miss_at[c];
    if (miss_len[c] == 0) return;
    for (i64 u = lo; u < hi; ++u) {
      if (slots[u] >= 0) continue;
      const i64 s = *(stack_top - j), r = rows[u];
      version[s] = -1 - where[r];
      where[r] = int32_t(s);
      owner[s] = r;
      stamp[s] = clock;
      dirty[s] = 0;
      fresh[s] = 0;
      slots[u] = s;
      miss_slots[j++] = s;
    }
  });
  io[0] = n_free - n_miss;
  io[1] = n_miss;
  io[2] = n_out;
  io[3] = n_evicted;
  return 0;
}

// The versions of distinct shard rows keys[i] (i < n; where and version as in ec_cache_step:
// version[where[r]] for a cached row, else -1 - where[r]) into out[i]; advance: each first
// advanced by one (mod 2^31) and kept there. One pass; the rows' entries prefetched ahead.
void ec_row_versions(int32_t* where, int32_t* version, const i64* keys, i64 n, int32_t* out,
                     int advance) {
  for (i64 i = 0; i < n; ++i) {
    if (i + kPrefetch < n) __builtin_prefetch(where + keys[i + kPrefetch], 1);
    const i64 r = keys[i];
    const int32_t w = where[r];
    int32_t v = w >= 0 ? version[w] : -1 - w;
    if (advance) {
      v = int32_t((uint32_t(v) + 1u) & 0x7FFFFFFFu);
      if (w >= 0)
        version[w] = v;
      else
        where[r] = -1 - v;
    }
    out[i] = v;
  }
}

// flags[idx[i]] = value for i < n.
void ec_set_flags(uint8_t* flags, const i64* idx, i64 n, int value) {
  for (i64 i = 0; i < n; ++i) flags[idx[i]] = uint8_t(value);
}

}  // extern "C"
