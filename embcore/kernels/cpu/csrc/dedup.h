// dedup.h: sorting and deduplicating ids (radix dedup of rows, hash dedup of raw ids).

#pragma once

#include "common.h"
#include "pool.h"

namespace {

// The radix sort's per-chunk digit counts, kept per calling thread across calls (small).
thread_local std::vector<i64> radix_counts;

// Hash-dedup's scratch index, kept per calling thread across calls.
thread_local std::vector<i64> dedup_slots;

}  // namespace

extern "C" {

// Stable sort of ``ids`` with run-length encoding of equal ids.
//   ids (n,) in [0, 2^bits); order (n,) out: positions sorted by id, ties in position order;
//   unique (<= n,) out: the distinct ids ascending; uoff (<= n + 1,) out: unique[u]'s
//   occurrences are order[uoff[u]:uoff[u+1]]. Returns U.
// Each id and its position are packed into one 64-bit word (id above the position bits) and
// sorted by an LSD radix sort over the id's digits (at most 8 bits each). Each pass is split
// over threads, thread t owning a contiguous part of the input and its items of a digit placed
// after those of threads < t, so equal ids keep their order (stable).
i64 ec_dedup(const i64* ids, i64 n, int bits, i64* order, i64* unique, i64* uoff, int nt) {
  if (n == 0) { uoff[0] = 0; return 0; }
  bits = std::max(bits, 1);
  int pbits = 1;
  while ((i64(1) << pbits) < n) ++pbits;
  // The two radix buffers are the outputs ``order`` and ``unique`` themselves (no scratch as
  // large as the batch): the run-length encoding below reads word j before writing order[j]
  // and writes unique[u] only for u <= j, so either may hold the sorted words.
  uint64_t* key_in = reinterpret_cast<uint64_t*>(unique);
  uint64_t* key_out = reinterpret_cast<uint64_t*>(order);
  if (n <= 64 || bits + pbits > 64) {  // insertion sort / std::stable_sort of positions by id
    for (i64 i = 0; i < n; ++i) order[i] = i;
    if (n <= 64) {
      for (i64 i = 1; i < n; ++i) {
        const i64 v = order[i];
        i64 j = i;
        for (; j > 0 && ids[order[j - 1]] > ids[v]; --j) order[j] = order[j - 1];
        order[j] = v;
      }
    } else {
      std::stable_sort(order, order + n, [ids](i64 a, i64 b) { return ids[a] < ids[b]; });
    }
    for (i64 j = 0; j < n; ++j) key_in[j] = uint64_t(ids[order[j]]) << pbits | uint64_t(order[j]);
    // key_in is ``unique``: the encoding below rewrites order[j] with the same position
  } else {
    const int passes = (bits + 7) / 8;  // 256 buckets: few enough write streams
    const int width = (bits + passes - 1) / passes;
    const i64 buckets = i64(1) << width;
    const uint64_t mask = uint64_t(buckets - 1);
    nt = threads_for(n * 4, nt);
    // Each pass: a histogram per chunk (in parallel), an exclusive prefix over (digit, chunk)
    // on the caller, then each chunk scatters its items after those of earlier chunks with
    // the same digit (in parallel), so equal ids keep their order (stable).
    const i64 chunks = chunks_for(n * 4, nt, 32);
    radix_counts.assign(size_t(chunks) * buckets, 0);
    i64* hist = radix_counts.data();
    for (int p = 0; p < passes; ++p) {
      const int shift = pbits + p * width;
      const uint64_t* src = p == 0 ? key_out : key_in;
      uint64_t* dst = p == 0 ? key_in : key_out;
      parallel_ranges(chunks, nt, n, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
        i64* h = hist + c * buckets;
        std::fill(h, h + buckets, 0);
        if (p == 0) {
          for (i64 i = lo; i < hi; ++i) {
            const uint64_t k = uint64_t(ids[i]) << pbits | uint64_t(i);
            key_out[i] = k;  // packed here, sorted from key_out below
            h[(k >> shift) & mask]++;
          }
        } else {
          for (i64 i = lo; i < hi; ++i) h[(src[i] >> shift) & mask]++;
        }
      });
      i64 run = 0;  // exclusive prefix over (digit, chunk)
      for (i64 b = 0; b < buckets; ++b)
        for (i64 q = 0; q < chunks; ++q) {
          const i64 count = hist[q * buckets + b];
          hist[q * buckets + b] = run;
          run += count;
        }
      parallel_ranges(chunks, nt, n, nullptr, 0, [&](i64 c, i64 lo, i64 hi) {
        i64* h = hist + c * buckets;
        for (i64 i = lo; i < hi; ++i) {
          const uint64_t k = src[i];
          dst[h[(k >> shift) & mask]++] = k;
        }
      });
      if (p > 0) std::swap(key_in, key_out);  // pass 0 sorted key_out into key_in
    }
  }
  // Run-length encoding over the sorted words: positions, distinct ids, run starts.
  const uint64_t pmask = (uint64_t(1) << pbits) - 1;
  i64 u = 0;
  const uint64_t first = key_in[0];  // read before unique[0] / order[0] may overwrite it
  uint64_t prev = first >> pbits;
  order[0] = i64(first & pmask);
  unique[0] = i64(prev);
  uoff[0] = 0;
  for (i64 j = 1; j < n; ++j) {
    const uint64_t k = key_in[j];
    order[j] = i64(k & pmask);
    const uint64_t id = k >> pbits;
    if (id != prev) {
      uoff[++u] = j;
      unique[u] = i64(id);
      prev = id;
    }
  }
  uoff[++u] = n;
  return u;
}

// The ids of several features reading one physical table, each shifted by its table's first
// row, concatenated into ids_out (sum of lens,), then deduplicated as ec_dedup. Returns U.
// steps (nparts,) or nullptr (all 1): part p's id i is parts[p][i * steps[p]] (a column of a
// wider batch is read where it is). limits (nparts,) or nullptr: part p's ids must lie in
// [0, limits[p]); when one does not, nothing is deduplicated and the result is -1 - p for the
// first such part (the caller then reports it: the check costs nothing beside the copy, which
// reads every id anyway).
i64 ec_concat_dedup(const i64* const* parts, const i64* lens, const i64* steps, const i64* adds,
                    const i64* limits, i64 nparts, int bits, i64* ids_out, i64* order,
                    i64* unique, i64* uoff, int nt) {
  i64 n = 0;
  for (i64 p = 0; p < nparts; ++p) {
    const i64* src = parts[p];
    const i64 add = adds[p], len = lens[p], step = steps ? steps[p] : 1;
    i64* dst = ids_out + n;
    if (step != 1) {
      for (i64 i = 0; i < len; ++i) dst[i] = src[i * step];
      src = dst;  // (then shifted and checked in place below)
    }
    if (limits != nullptr) {
      // one unsigned compare per id: a negative id wraps to a huge value
      const std::uint64_t lim = std::uint64_t(limits[p]);
      std::uint64_t bad = 0;
#pragma omp simd reduction(|:bad)
      for (i64 i = 0; i < len; ++i) {
        bad |= std::uint64_t(std::uint64_t(src[i]) >= lim);
        dst[i] = src[i] + add;
      }
      if (bad) return -1 - p;
    } else {
#pragma omp simd
      for (i64 i = 0; i < len; ++i) dst[i] = src[i] + add;
    }
    n += len;
  }
  return ec_dedup(ids_out, n, bits, order, unique, uoff, nt);
}

// Each distinct row's value at its occurrences: out[order[j]] = values[u] for j in
// [uoff[u], uoff[u+1]) (a Dedup's layout: the cache rows of a batch's ids from its distinct
// rows' ones).
void ec_expand(const i64* values, const i64* order, const i64* uoff, i64 n_unique, i64* out) {
  for (i64 u = 0; u < n_unique; ++u)
    for (i64 j = uoff[u]; j < uoff[u + 1]; ++j) out[order[j]] = values[u];
}


// Deduplication of raw ids (any int64) by hashing, in O(n): unique (<= n,) out: the distinct
// ids in order of first occurrence; inverse (n,) out: unique[inverse[i]] == ids[i]; order (n,)
// out and uoff (<= n + 1,) out: unique[u]'s occurrences are order[uoff[u]:uoff[u+1]], ascending
// (the layout of ec_dedup, whose ``unique`` is sorted instead). Returns U.
i64 ec_dedup_raw(const i64* ids, i64 n, i64* unique, i64* inverse, i64* order, i64* uoff) {
  uoff[0] = 0;
  if (n == 0) return 0;
  i64 size = 16;
  while (size < 2 * n) size <<= 1;
  const i64 mask = size - 1;
  dedup_slots.assign(size_t(size), -1);  // distinct index of the id in each slot
  i64* slots = dedup_slots.data();
  i64 u = 0;
  for (i64 i = 0; i < n; ++i) {
    const i64 id = ids[i];
    i64 h = i64(mix64(uint64_t(id)) & uint64_t(mask));
    while (slots[h] >= 0 && unique[slots[h]] != id) h = (h + 1) & mask;
    if (slots[h] < 0) {
      slots[h] = u;
      unique[u] = id;
      uoff[u + 1] = 0;
      ++u;
    }
    inverse[i] = slots[h];
    uoff[slots[h] + 1]++;  // counts, made offsets below
  }
  for (i64 k = 0; k < u; ++k) uoff[k + 1] += uoff[k];
  // Counting sort of positions by distinct index (stable); uoff[k] is used as a cursor, then
  // restored from the next run's start.
  for (i64 i = 0; i < n; ++i) order[uoff[inverse[i]]++] = i;
  for (i64 k = u; k > 0; --k) uoff[k] = uoff[k - 1];
  uoff[0] = 0;
  return u;
}


// The raw ids of several runs of parts (stacked dynamic tables' features, a run per member)
// concatenated into ids_out (n,) and deduplicated run by run (one run's id is not another's):
// run r holds parts [run_parts[r], run_parts[r + 1]), contiguous. unique (<= n,), inverse (n,),
// order (n,), uoff (<= n + 1,) out as ec_dedup_raw's over the whole (run r's distinct ids a
// block, in order of first occurrence; positions and distinct indices global); run_unique (R,)
// out: each run's distinct ids. The runs go over the threads. Returns U, the distinct ids of
// all runs.
i64 ec_dedup_raw_runs(const i64* const* parts, const i64* lens, const i64* run_parts,
                      i64 nruns, i64* ids_out, i64* unique, i64* inverse, i64* order,
                      i64* uoff, i64* run_unique, int nt) {
  std::vector<i64> at(size_t(nruns) + 1, 0);  // each run's first position
  for (i64 r = 0; r < nruns; ++r) {
    at[size_t(r) + 1] = at[size_t(r)];
    for (i64 p = run_parts[r]; p < run_parts[r + 1]; ++p) at[size_t(r) + 1] += lens[p];
  }
  const i64 n = at[size_t(nruns)];
  // each run on its own (a run per chunk, over the threads): its distinct ids and offsets in a
  // scratch block at its first position (a run has at most as many distinct ids as ids)
  thread_local std::vector<i64> scratch;
  scratch.resize(size_t(2 * n + nruns));
  i64* s_unique = scratch.data();
  i64* s_uoff = scratch.data() + n;  // run r's at at[r] + r
  parallel_chunks(nruns, n < 16384 ? 1 : nt, [&](i64 r) {
    const i64 a = at[size_t(r)];
    i64 k = a;
    for (i64 p = run_parts[r]; p < run_parts[r + 1]; ++p) {
      std::memcpy(ids_out + k, parts[p], size_t(lens[p]) * sizeof(i64));
      k += lens[p];
    }
    run_unique[r] = ec_dedup_raw(ids_out + a, k - a, s_unique + a, inverse + a, order + a,
                                 s_uoff + a + r);
  });
  std::vector<i64> u0(size_t(nruns) + 1, 0);  // each run's first distinct index
  for (i64 r = 0; r < nruns; ++r) u0[size_t(r) + 1] = u0[size_t(r)] + run_unique[r];
  parallel_chunks(nruns, n < 16384 ? 1 : nt, [&](i64 r) {  // into place, shifted
    const i64 a = at[size_t(r)], b = at[size_t(r) + 1], u = u0[size_t(r)], c = run_unique[r];
    std::memcpy(unique + u, s_unique + a, size_t(c) * sizeof(i64));
    for (i64 k = 0; k < c; ++k) uoff[u + k] = s_uoff[a + r + k] + a;  // (the end: below)
    for (i64 i = a; i < b; ++i) {
      inverse[i] += u;
      order[i] += a;
    }
  });
  uoff[u0[size_t(nruns)]] = n;
  return u0[size_t(nruns)];
}

}  // extern "C"
