// vocab.h: dynamic vocabularies: the raw id -> row map and admitted rows' initial values.

#pragma once

#include <atomic>

#include "common.h"
#include "pool.h"

// ---- dynamic vocabularies (ops/vocab.py's NativeVocabMap) ----------------------------------
// A shard's raw id -> row map is an open-addressing index over its rows: ``slots`` (S,) holds a
// row or -1 (empty), S a power of two >= 2 x the rows (load <= 1/2), linear probing from
// mix64(id) & (S - 1); a slot's key is row_key[slot's row]. Removal shifts the following entries
// back (no tombstones), so a probe always ends at the first empty slot.

namespace {

// The slot holding ``id``, or the empty slot where its probe ends (slots[result] == -1).
inline i64 vocab_slot(const i64* slots, i64 mask, const i64* row_key, i64 id) {
  i64 i = i64(mix64(uint64_t(id)) & uint64_t(mask));
  while (slots[i] >= 0 && row_key[slots[i]] != id) i = (i + 1) & mask;
  return i;
}

// Removes resident ``id`` (its row's row_key still holds it), shifting later entries back.
inline void vocab_erase(i64* slots, i64 mask, const i64* row_key, i64 id) {
  i64 i = vocab_slot(slots, mask, row_key, id);
  if (slots[i] < 0) return;
  i64 j = i;
  for (;;) {
    j = (j + 1) & mask;
    if (slots[j] < 0) break;
    const i64 home = i64(mix64(uint64_t(row_key[slots[j]])) & uint64_t(mask));
    // slots[j] may move to hole i when i lies on its probe path (cyclically from home to j)
    if (((j - home) & mask) >= ((j - i) & mask)) {
      slots[i] = slots[j];
      i = j;
    }
  }
  slots[i] = -1;
}

// The k-th smallest score (1 <= k <= candidates) among the resident rows not used by step t
// (row_used and last_use != t). Scores are step counts (last uses or frequencies): when their
// range is small, a count per value finds it in O(C + range); else nth_element over a copy.
inline i64 vocab_kth_score(const i64* score, const uint8_t* row_used, const i64* last_use,
                           i64 capacity, i64 t, i64 k) {
  i64 lo = INT64_MAX, hi = INT64_MIN;
  for (i64 q = 0; q < capacity; ++q) {
    if (!row_used[q] || last_use[q] == t) continue;
    lo = std::min(lo, score[q]);
    hi = std::max(hi, score[q]);
  }
  if (hi - lo <= 4 * capacity + 1024) {
    thread_local std::vector<i64> counts;
    counts.assign(size_t(hi - lo + 1), 0);
    for (i64 q = 0; q < capacity; ++q)
      if (row_used[q] && last_use[q] != t) counts[size_t(score[q] - lo)]++;
    i64 run = 0;
    for (i64 v = 0;; ++v) {
      run += counts[size_t(v)];
      if (run >= k) return lo + v;
    }
  }
  std::vector<i64> s;
  s.reserve(size_t(capacity));
  for (i64 q = 0; q < capacity; ++q)
    if (row_used[q] && last_use[q] != t) s.push_back(score[q]);
  std::nth_element(s.begin(), s.begin() + (k - 1), s.end());
  return s[size_t(k - 1)];
}

}  // namespace

extern "C" {

// rows[i] = the row of ids[i] when it is resident and last used at step >= cut (TTL: ids that
// expire at the start of this step are not found; INT64_MIN: no TTL), else ``fill``. Reads only.
//   slots (mask + 1,) the index; row_key, last_use (C,) per row.
// Returns how many are not found.
i64 ec_vocab_find(const i64* slots, i64 mask, const i64* row_key, const i64* last_use, i64 cut,
                  const i64* ids, i64 n, i64 fill, i64* rows, int nt) {
  nt = n < 65536 ? 1 : std::max(nt, 1);  // a probe is a few cache misses: threads pay off late
  const i64 chunks = chunks_for(n * 8, nt, 64);
  std::atomic<i64> missing{0};
  parallel_ranges(chunks, nt, n, nullptr, 0, [&](i64, i64 lo, i64 hi) {
    i64 miss = 0;
    for (i64 i = lo; i < hi; ++i) {
      if (i + kPrefetch < hi)
        __builtin_prefetch(slots + (mix64(uint64_t(ids[i + kPrefetch])) & uint64_t(mask)), 0, 1);
      const i64 r = slots[vocab_slot(slots, mask, row_key, ids[i])];
      const bool found = r >= 0 && last_use[r] >= cut;
      rows[i] = found ? r : fill;
      miss += !found;
    }
    missing.fetch_add(miss);
  });
  return missing.load();
}

// The two parts of a step's ids after ec_vocab_find: hit_rows (n - M,) out the rows of the found
// ids in input order; miss_ids (M,) out the other ids ascending, miss_pos (M,) out their
// positions in ``ids``. Returns M.
i64 ec_vocab_split(const i64* ids, const i64* rows, i64 n, i64* hit_rows, i64* miss_ids,
                   i64* miss_pos) {
  i64 h = 0, m = 0;
  for (i64 i = 0; i < n; ++i) {
    if (rows[i] >= 0) {
      hit_rows[h++] = rows[i];
    } else {
      miss_pos[m++] = i;
    }
  }
  std::sort(miss_pos, miss_pos + m, [ids](i64 a, i64 b) { return ids[a] < ids[b]; });
  for (i64 j = 0; j < m; ++j) miss_ids[j] = ids[miss_pos[j]];
  return m;
}

// keep[i] = whether rows[i] still holds the id it held after step ``since``: in [0, capacity),
// used, and given its id at or before ``since`` (born[row] <= since). Returns how many are kept.
i64 ec_vocab_valid(const i64* rows, i64 n, const uint8_t* row_used, const i64* born,
                   i64 capacity, i64 since, uint8_t* keep) {
  i64 kept = 0;
  for (i64 i = 0; i < n; ++i) {
    const i64 r = rows[i];
    const bool ok = r >= 0 && r < capacity && row_used[r] && born[r] <= since;
    keep[i] = ok;
    kept += ok;
  }
  return kept;
}

// The changes of one training step t, after ec_vocab_find (with the same cut) gave the rows of
// the step's resident ids (hit_rows (H,), distinct) and the caller chose the ids to admit
// (new_ids (A,), ascending, none resident). In order: hits get last_use t and frequency + 1;
// rows last used before ``cut`` expire (freed); new_ids[j] takes new_rows[j] out: the lowest
// free rows first (scanning from info[2], below which no row is free), then the rows of the
// resident ids not used by this step with the lowest (score, id), score = frequency when
// ``lfu`` else last_use, in that order; new rows get last_use t, frequency 1, born t.
// Returns 0; or -1 when A > C - H (more ids than free plus evictable rows), changing nothing and
// setting info[0] = free rows, info[1] = evictable rows. info[2] in: the free-row hint; out: the
// new hint.
// spare: when this step must evict, free up to this many more of the lowest-scored resident ids
// (not used by the step) at once, so that the following steps find free rows without a scan;
// their rows go to freed (spare,) out, their count to info[3]. 0 for the maps of raw ids.
i64 ec_vocab_step(i64* slots, i64 mask, i64* row_key, uint8_t* row_used, i64* last_use,
                  i64* frequency, i64* born, i64 capacity, const i64* hit_rows, i64 n_hit,
                  const i64* new_ids, i64 n_new, i64 t, i64 cut, int lfu, i64* new_rows,
                  i64* info, i64 spare, i64* freed) {
  info[3] = 0;
  if (n_new > capacity - n_hit) {
    i64 live = 0;
    for (i64 r = 0; r < capacity; ++r) live += row_used[r] && last_use[r] >= cut;
    info[0] = capacity - live;
    info[1] = live - n_hit;
    return -1;
  }
  for (i64 k = 0; k < n_hit; ++k) {
    const i64 r = hit_rows[k];
    last_use[r] = t;
    frequency[r] += 1;
  }
  i64 hint = std::max<i64>(info[2], 0);
  if (cut != INT64_MIN) {  // TTL: free the rows last used before cut
    for (i64 r = 0; r < capacity; ++r) {
      if (row_used[r] && last_use[r] < cut) {
        vocab_erase(slots, mask, row_key, row_key[r]);
        row_key[r] = 0;
        row_used[r] = 0;
        last_use[r] = 0;
        frequency[r] = 0;
        born[r] = -1;
        hint = std::min(hint, r);
      }
    }
  }
  if (n_new == 0) {
    info[2] = hint;
    return 0;
  }
  i64 placed = 0, r = hint;
  for (; r < capacity && placed < n_new; ++r)
    if (!row_used[r]) new_rows[placed++] = r;
  // every row below r is used now (or taken by this step)
  info[2] = r;
  const i64 k = n_new - placed;
  if (k > 0) {  // evict the k resident ids not used by this step with the lowest (score, id)
    const i64* score = lfu ? frequency : last_use;
    i64 candidates = 0;
    if (spare > 0)
      for (i64 q = 0; q < capacity; ++q) candidates += row_used[q] && last_use[q] != t;
    const i64 extra = std::max<i64>(0, std::min(spare, candidates - k));
    const i64 kth = vocab_kth_score(score, row_used, last_use, capacity, t, k + extra);
    // every candidate below the k-th score, and of those at it the smallest ids
    struct Cand {
      i64 score, id, row;
    };
    std::vector<Cand> victims, ties;
    victims.reserve(size_t(k));
    for (i64 q = 0; q < capacity; ++q) {
      if (!row_used[q] || last_use[q] == t) continue;
      if (score[q] < kth) {
        victims.push_back({score[q], row_key[q], q});
      } else if (score[q] == kth) {
        ties.push_back({score[q], row_key[q], q});
      }
    }
    const size_t need = size_t(k + extra) - victims.size();
    auto by_id = [](const Cand& a, const Cand& b) { return a.id < b.id; };
    std::nth_element(ties.begin(), ties.begin() + (need - 1), ties.end(), by_id);
    victims.insert(victims.end(), ties.begin(), ties.begin() + need);
    std::sort(victims.begin(), victims.end(), [](const Cand& a, const Cand& b) {
      return a.score < b.score || (a.score == b.score && a.id < b.id);
    });
    for (i64 j = 0; j < k + extra; ++j) vocab_erase(slots, mask, row_key, victims[j].id);
    for (i64 j = 0; j < k; ++j) new_rows[placed + j] = victims[j].row;
    for (i64 j = 0; j < extra; ++j) {  // freed now: the next steps admit into them
      const i64 q = victims[k + j].row;
      row_key[q] = 0;
      row_used[q] = 0;
      last_use[q] = 0;
      frequency[q] = 0;
      born[q] = -1;
      freed[j] = q;
      info[2] = std::min(info[2], q);
    }
    info[3] = extra;
  }
  for (i64 j = 0; j < n_new; ++j) {
    const i64 q = new_rows[j], id = new_ids[j];
    row_key[q] = id;
    row_used[q] = 1;
    last_use[q] = t;
    frequency[q] = 1;
    born[q] = t;
    slots[vocab_slot(slots, mask, row_key, id)] = q;
  }
  return 0;
}

}  // extern "C"

namespace {

// The standard normal's inverse CDF by Acklam's rational approximation (relative error below
// 1.15e-9) for p in (0, 1): a central rational function of (p - 1/2)^2, and tails in
// sqrt(-2 log p). vocabulary.py's ``inverse_normal`` is the same in torch ops, in the same
// order; contraction into fused multiply-adds would round differently, so it is switched off.
constexpr double kA[6] = {-3.969683028665376e+01, 2.209460984245205e+02, -2.759285104469687e+02,
                          1.383577518672690e+02,  -3.066479806614716e+01, 2.506628277459239e+00};
constexpr double kB[5] = {-5.447609879822406e+01, 1.615858368580409e+02, -1.556989798598866e+02,
                          6.680131188771972e+01,  -1.328068155288572e+01};
constexpr double kC[6] = {-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e+00,
                          -2.549732539343734e+00, 4.374664141464968e+00,  2.938163982698783e+00};
constexpr double kD[4] = {7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e+00,
                          3.754408661907416e+00};
constexpr double kPLow = 0.02425;

__attribute__((optimize("fp-contract=off"))) inline double inverse_normal(double p) {
  if (p < kPLow || p > 1.0 - kPLow) {
    const double tail = p < kPLow ? p : 1.0 - p;
    const double q = std::sqrt(-2.0 * std::log(tail));
    const double x = (((((kC[0] * q + kC[1]) * q + kC[2]) * q + kC[3]) * q + kC[4]) * q + kC[5]) /
                     ((((kD[0] * q + kD[1]) * q + kD[2]) * q + kD[3]) * q + 1.0);
    return p < kPLow ? x : -x;
  }
  const double q = p - 0.5;
  const double r = q * q;
  return (((((kA[0] * r + kA[1]) * r + kA[2]) * r + kA[3]) * r + kA[4]) * r + kA[5]) * q /
         (((((kB[0] * r + kB[1]) * r + kB[2]) * r + kB[3]) * r + kB[4]) * r + 1.0);
}

}  // namespace

extern "C" {

// The default initial values of admitted raw ids, written into their rows: for id ids[i] and
// column j in [c0, c1), table[rows[i], j - c0] = float(inverse_normal(lo + u * width) / div), with
// u = (bits + 0.5) * 2^-53, bits the top 53 bits of splitmix64(key + j), key =
// splitmix64(splitmix64(ids[i]) ^ seed), splitmix64(x) = mix64(x + 0x9E3779B97F4A7C15): the
// doubles of ops/hashing.py's ``uniform`` (vocabulary.py's ``initial_values``: TF's truncated
// normal, the same floats in torch ops).
//   table (N, stride) float32 row-major.
__attribute__((optimize("fp-contract=off"))) void ec_init_normal(
    i64 seed, const i64* ids, const i64* rows, i64 n, i64 c0, i64 c1, double lo, double width,
    double div, float* table, i64 stride) {
  const uint64_t gamma = 0x9E3779B97F4A7C15ULL;
  for (i64 i = 0; i < n; ++i) {
    const uint64_t key = mix64((mix64(uint64_t(ids[i]) + gamma) ^ uint64_t(seed)) + gamma);
    float* o = table + rows[i] * stride;
    for (i64 j = c0; j < c1; ++j) {
      const uint64_t bits = mix64(key + uint64_t(j) + gamma) >> 11;
      const double u = (double(bits) + 0.5) * 0x1p-53;
      o[j - c0] = float(inverse_normal(lo + u * width) / div);  // not fused: torch's rounding
    }
  }
}

// Rebuilds the index from the per-row state: slots (mask + 1,) all set, then every used row's
// id inserted.
void ec_vocab_index(i64* slots, i64 mask, const i64* row_key, const uint8_t* row_used,
                    i64 capacity) {
  std::fill(slots, slots + mask + 1, i64(-1));
  for (i64 r = 0; r < capacity; ++r)
    if (row_used[r]) slots[vocab_slot(slots, mask, row_key, row_key[r])] = r;
}

}  // extern "C"
