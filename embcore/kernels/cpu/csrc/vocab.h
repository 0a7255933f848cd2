// vocab.h: dynamic vocabularies: the raw id -> row map and admitted rows' initial values.

#pragma once

#include <atomic>

#include "common.h"
#include "pool.h"

// ---- dynamic vocabularies (state/vocab/native_map.py's NativeVocabMap) ------------------------
// A shard's raw id -> row map holds, per row of the first A rows (A <= C, the capacity; the rows
// beyond A were never used): ``row_key`` int64 the id it holds (0 when free), ``last_use``,
// ``frequency`` and ``born`` (-1 when free: a row is used iff born >= 0), the three of type
// ``Step``: int32 while every step and frequency fits, else int64. The index over them is
// ``slots`` (S,) of type ``Slot`` (int32 when the rows fit, else int64): -1 (empty) or an entry,
// a row in its low b bits (b = the bits of A - 1) and above them a fingerprint of its id (the low
// bits of mix64(id) that fit below the sign bit), S > the resident ids (the caller keeps S > 5A/2:
// load <= 2/5), linear probing from the multiply-shift reduction of mix64(id) to [0, S) (S need
// not be a power of two); an entry's id is row_key[its row], read only where the fingerprint
// matches. Removal shifts the following entries back (no tombstones), so a probe always ends at
// the first empty slot. The index is rebuilt whenever A changes.

namespace {

// rows from which ec_vocab_find prefetches the entries' rows too: a map of fewer stays in the
// caches between steps; a larger one does not, once a step's table rows have passed through them
// (in W1-raw's step, 26 maps of 100k rows: 35% less time finding)
constexpr i64 kVocabDeep = i64(1) << 14;

// The index: ``size`` slots over ``n_rows`` rows.
template <class Slot>
struct VocabIndex {
  Slot* slots;
  i64 size;
  int bits;        // of a row
  Slot rows_mask;  // the row's bits
  Slot tag_mask;   // the fingerprint's bits (above the row's, below the sign bit)

  VocabIndex(void* s, i64 size_, i64 n_rows) : slots(static_cast<Slot*>(s)), size(size_) {
    bits = 1;
    while (bits < 62 && (i64(1) << bits) < n_rows) ++bits;
    const int top = int(sizeof(Slot)) * 8 - 1;  // the bits below the sign bit
    rows_mask = Slot((uint64_t(1) << bits) - 1);
    tag_mask = Slot(((uint64_t(1) << top) - 1) & ~uint64_t(rows_mask));
  }
  // mix64(id) * size / 2^64: the home slot of an id of hash h
  i64 home(uint64_t h) const { return i64((unsigned __int128)h * uint64_t(size) >> 64); }
  Slot tag(uint64_t h) const { return Slot((h << bits) & uint64_t(tag_mask)); }
  i64 row(Slot v) const { return i64(v & rows_mask); }
  i64 next(i64 i) const { return i + 1 == size ? 0 : i + 1; }

  // The slot holding ``id``, or the empty slot where its probe ends (slots[result] < 0).
  i64 find(const i64* row_key, i64 id) const {
    return find_hashed(row_key, id, mix64(uint64_t(id)));
  }
  // find() of ``id`` whose hash mix64(id) is ``h``
  i64 find_hashed(const i64* row_key, i64 id, uint64_t h) const {
    const Slot t = tag(h);
    for (i64 i = home(h);; i = next(i)) {
      const Slot v = slots[i];
      if (v < 0 || ((v & tag_mask) == t && row_key[row(v)] == id)) return i;
    }
  }
  // Places ``id`` (not indexed) at row ``r``.
  void insert(i64 id, i64 r) { insert_hashed(mix64(uint64_t(id)), r); }
  // insert() of an id whose hash mix64(id) is ``h``
  void insert_hashed(uint64_t h, i64 r) {
    i64 i = home(h);
    while (slots[i] >= 0) i = next(i);
    slots[i] = Slot(tag(h) | Slot(r));
  }
  // Removes indexed ``id`` (its row's row_key still holds it), shifting later entries back.
  void erase(const i64* row_key, i64 id) {
    i64 i = find(row_key, id);
    if (slots[i] < 0) return;
    auto behind = [this](i64 a, i64 b) { return a >= b ? a - b : a - b + size; };  // a-b mod S
    i64 j = i;
    for (;;) {
      j = next(j);
      if (slots[j] < 0) break;
      const i64 h = home(mix64(uint64_t(row_key[row(slots[j])])));
      // slots[j] may move to hole i when i lies on its probe path (cyclically from h to j)
      if (behind(j, h) >= behind(j, i)) {
        slots[i] = slots[j];
        i = j;
      }
    }
    slots[i] = Slot(-1);
  }
};

// Calls f(Slot{}, Step{}) with the types the flags name (int64 when set, else int32).
template <class F>
inline i64 vocab_types(int wide_slots, int wide_steps, F&& f) {
  if (wide_slots) return wide_steps ? f(i64{}, i64{}) : f(i64{}, int32_t{});
  return wide_steps ? f(int32_t{}, i64{}) : f(int32_t{}, int32_t{});
}

// The k-th smallest score (1 <= k <= candidates) among the resident rows not used by step t
// (born >= 0 and last_use != t) of the first ``n_rows``, and in ``at`` how many candidates have
// it. Scores are step counts (last uses or frequencies): when their range is small, a count per
// value finds it in O(A + range); else nth_element over a copy.
template <class Step>
inline i64 vocab_kth_score(const Step* score, const Step* born, const Step* last_use, i64 n_rows,
                           i64 t, i64 k, i64* at) {
  i64 lo = INT64_MAX, hi = INT64_MIN;
  for (i64 q = 0; q < n_rows; ++q) {
    if (born[q] < 0 || last_use[q] == t) continue;
    lo = std::min<i64>(lo, score[q]);
    hi = std::max<i64>(hi, score[q]);
  }
  if (hi - lo <= 4 * n_rows + 1024) {
    thread_local std::vector<i64> counts;
    counts.assign(size_t(hi - lo + 1), 0);
    for (i64 q = 0; q < n_rows; ++q)
      if (born[q] >= 0 && last_use[q] != t) counts[size_t(score[q] - lo)]++;
    i64 run = 0;
    for (i64 v = 0;; ++v) {
      run += counts[size_t(v)];
      if (run >= k) {
        *at = counts[size_t(v)];
        return lo + v;
      }
    }
  }
  std::vector<i64> s;
  s.reserve(size_t(n_rows));
  for (i64 q = 0; q < n_rows; ++q)
    if (born[q] >= 0 && last_use[q] != t) s.push_back(score[q]);
  std::nth_element(s.begin(), s.begin() + (k - 1), s.end());
  const i64 kth = s[size_t(k - 1)];
  *at = std::count(s.begin(), s.end(), kth);
  return kth;
}

// Sets every slot of ``ix`` to -1, then inserts every used row's id (born >= 0) of the first
// n_rows. Returns how many rows are used.
template <class Slot, class Step>
inline i64 vocab_build_index(VocabIndex<Slot>& ix, const i64* row_key, const Step* born,
                             i64 n_rows) {
  std::fill(ix.slots, ix.slots + ix.size, Slot(-1));
  // the rows' hashes, computed once, P ahead: their home slots are requested then
  constexpr i64 kRing = 2 * kPrefetch;
  uint64_t hash[kRing];
  for (i64 r = 0; r < std::min(n_rows, kPrefetch); ++r)
    hash[r % kRing] = mix64(uint64_t(row_key[r]));
  i64 used = 0;
  for (i64 r = 0; r < n_rows; ++r) {
    if (r + kPrefetch < n_rows) {
      const uint64_t h = mix64(uint64_t(row_key[r + kPrefetch]));
      hash[(r + kPrefetch) % kRing] = h;
      __builtin_prefetch(ix.slots + ix.home(h), 1, 1);
    }
    if (born[r] < 0) continue;
    ix.insert_hashed(hash[r % kRing], r);
    ++used;
  }
  return used;
}

}  // namespace

extern "C" {

// rows[i] = the row of ids[i] when it is resident and last used at step >= cut (TTL: ids that
// expire at the start of this step are not found; INT64_MIN: no TTL, last_use is not read), else
// ``fill``. Reads only.
//   slots (size,) the index, int64 when wide_slots else int32; row_key (n_rows,) int64;
//   last_use (n_rows,) int64 when wide_steps else int32.
// Returns how many are not found.
i64 ec_vocab_find(const void* slots, i64 size, int wide_slots, const i64* row_key, i64 n_rows,
                  const void* last_use, int wide_steps, i64 cut, const i64* ids, i64 n, i64 fill,
                  i64* rows, int nt) {
  return vocab_types(wide_slots, wide_steps, [&](auto slot_type, auto step_type) -> i64 {
    using Slot = decltype(slot_type);
    using Step = decltype(step_type);
    const VocabIndex<Slot> ix(const_cast<void*>(slots), size, n_rows);
    const Step* lu = static_cast<const Step*>(last_use);
    const bool ttl = cut != INT64_MIN;
    // beyond the caches, the rows of the entries are requested ahead too (kVocabDeep)
    const bool deep = n_rows >= kVocabDeep;
    nt = n < 65536 ? 1 : std::max(nt, 1);  // a probe is a few cache misses: threads pay late
    const i64 chunks = chunks_for(n * 8, nt, 64);
    std::atomic<i64> missing{0};
    parallel_ranges(chunks, nt, n, nullptr, 0, [&](i64, i64 lo, i64 hi) {
      // the ids' hashes, computed once, 2P ahead: the home slot of id i + 2P is requested,
      // then (deep) the row of id i + P's first entry, where its fingerprint matches
      constexpr i64 kRing = 4 * kPrefetch;
      uint64_t hash[kRing];
      for (i64 i = lo; i < std::min(hi, lo + 2 * kPrefetch); ++i)
        hash[i % kRing] = mix64(uint64_t(ids[i]));
      i64 miss = 0;
      for (i64 i = lo; i < hi; ++i) {
        if (i + 2 * kPrefetch < hi) {
          const uint64_t h = mix64(uint64_t(ids[i + 2 * kPrefetch]));
          hash[(i + 2 * kPrefetch) % kRing] = h;
          __builtin_prefetch(ix.slots + ix.home(h), 0, 1);
        }
        if (deep && i + kPrefetch < hi) {
          const uint64_t h = hash[(i + kPrefetch) % kRing];
          const Slot v = ix.slots[ix.home(h)];
          if (v >= 0 && (v & ix.tag_mask) == ix.tag(h)) {
            __builtin_prefetch(row_key + ix.row(v), 0, 1);
            if (ttl) __builtin_prefetch(lu + ix.row(v), 0, 1);
          }
        }
        const Slot v = ix.slots[ix.find_hashed(row_key, ids[i], hash[i % kRing])];
        const bool found = v >= 0 && (!ttl || i64(lu[ix.row(v)]) >= cut);
        rows[i] = found ? ix.row(v) : fill;
        miss += !found;
      }
      missing.fetch_add(miss);
    });
    return missing.load();
  });
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

// keep[i] = whether rows[i] still holds the id it held after step ``since``: in [0, n_rows),
// used, and given its id at or before ``since`` (0 <= born[row] <= since). Rows from n_rows on
// (up to the capacity) were never used. born (n_rows,) int64 when wide_steps else int32.
// Returns how many are kept.
i64 ec_vocab_valid(const i64* rows, i64 n, const void* born, int wide_steps, i64 n_rows,
                   i64 since, uint8_t* keep) {
  return vocab_types(0, wide_steps, [&](auto, auto step_type) -> i64 {
    using Step = decltype(step_type);
    const Step* b = static_cast<const Step*>(born);
    i64 kept = 0;
    for (i64 i = 0; i < n; ++i) {
      const i64 r = rows[i];
      const bool ok = r >= 0 && r < n_rows && b[r] >= 0 && i64(b[r]) <= since;
      keep[i] = ok;
      kept += ok;
    }
    return kept;
  });
}

// The changes of one training step t, after ec_vocab_find (with the same cut) gave the rows of
// the step's resident ids (hit_rows (H,), distinct) and the caller chose the ids to admit
// (new_ids (A,), ascending, none resident). In order: hits get last_use t and frequency + 1;
// rows last used before ``cut`` expire (freed); new_ids[j] takes new_rows[j] out: the lowest
// free rows first (scanning from info[2], below which no row is free), then the rows of the
// resident ids not used by this step with the lowest (score, id), score = frequency when
// ``lfu`` else last_use, in that order; new rows get last_use t, frequency 1, born t.
//   The per-row arrays hold the first n_rows rows of the capacity's: rows n_rows.. are free
//   (never used). The caller holds n_rows == capacity or n_rows >= the resident ids (info[4])
//   plus A, so that the admissions fit in the rows held without evicting; -2 otherwise (a
//   caller's error), changing nothing. The types as ec_vocab_find's.
// Returns 0; or -1 when A > capacity - H (more ids than free plus evictable rows), changing
// nothing and setting info[0] = free rows, info[1] = evictable rows. info[2] in: the free-row
// hint; out: the new hint. info[4] in: the resident ids; out: after the step.
// spare: when this step must evict, free up to this many more of the lowest-scored resident ids
// (not used by the step) at once, so that the following steps find free rows without a scan;
// their rows go to freed (spare,) out, their count to info[3]. 0 for the maps of raw ids.
// queue (queue_cap, 3) in/out, or nullptr: an LRU map's queue of eviction candidates (row, last
// use, born), info[5] of them held, the next at info[6]: a step that evicts takes its victims
// from the queue's entries that still hold; when too few do, the scan that chooses them refills
// it with the lowest queue_cap candidates (so that the next steps evict without a scan). Exact:
// the victims are those of a scan. A caller that changes the rows otherwise sets info[5] = 0.
i64 ec_vocab_step(void* slots, i64 size, int wide_slots, i64* row_key, void* last_use,
                  void* frequency, void* born, int wide_steps, i64 n_rows, i64 capacity,
                  const i64* hit_rows, i64 n_hit, const i64* new_ids, i64 n_new, i64 t, i64 cut,
                  int lfu, i64* new_rows, i64* info, i64 spare, i64* freed, i64* queue,
                  i64 queue_cap) {
  return vocab_types(wide_slots, wide_steps, [&](auto slot_type, auto step_type) -> i64 {
    using Slot = decltype(slot_type);
    using Step = decltype(step_type);
    VocabIndex<Slot> ix(slots, size, n_rows);
    Step* lu = static_cast<Step*>(last_use);
    Step* fr = static_cast<Step*>(frequency);
    Step* bo = static_cast<Step*>(born);
    i64 resident = info[4];
    info[3] = 0;
    if (n_new > capacity - n_hit) {
      i64 live = 0;
      for (i64 r = 0; r < n_rows; ++r) live += bo[r] >= 0 && i64(lu[r]) >= cut;
      info[0] = capacity - live;
      info[1] = live - n_hit;
      return i64(-1);
    }
    if (n_rows < capacity && n_rows - resident < n_new) return i64(-2);
    for (i64 k = 0; k < n_hit; ++k) {
      if (k + kPrefetch < n_hit) {
        __builtin_prefetch(lu + hit_rows[k + kPrefetch], 1, 1);
        __builtin_prefetch(fr + hit_rows[k + kPrefetch], 1, 1);
      }
      const i64 r = hit_rows[k];
      lu[r] = Step(t);
      fr[r] += 1;
    }
    i64 hint = std::max<i64>(info[2], 0);
    if (cut != INT64_MIN) {  // TTL: free the rows last used before cut
      for (i64 r = 0; r < n_rows; ++r) {
        if (bo[r] >= 0 && i64(lu[r]) < cut) {
          ix.erase(row_key, row_key[r]);
          row_key[r] = 0;
          lu[r] = 0;
          fr[r] = 0;
          bo[r] = -1;
          hint = std::min(hint, r);
          --resident;
        }
      }
    }
    info[4] = resident + n_new;
    if (n_new == 0) {
      info[2] = hint;
      return i64(0);
    }
    i64 placed = 0, r = hint;
    for (; r < n_rows && placed < n_new; ++r)
      if (bo[r] < 0) new_rows[placed++] = r;
    // every row below r is used now (or taken by this step)
    info[2] = r;
    const i64 k = n_new - placed;
    if (k > 0) {  // evict the k resident ids not used by this step with the lowest (score, id)
      const Step* score = lfu ? fr : lu;
      struct Cand {
        i64 score, id, row;
      };
      std::vector<Cand> victims;
      // LRU's queue: the lowest candidates of the last scan, in (score, id) order; an entry
      // still holds while its row keeps the id and last use it had then (a last use only grows,
      // new ids come in at the step's, so every row outside the queue still ranks above it)
      const bool queued = queue != nullptr && queue_cap > 0 && !lfu && spare == 0;
      if (queued) {
        victims.reserve(size_t(k));
        i64 e = info[6];
        for (; e < info[5] && i64(victims.size()) < k; ++e) {
          const i64 q = queue[3 * e];
          if (i64(bo[q]) == queue[3 * e + 2] && i64(lu[q]) == queue[3 * e + 1])
            victims.push_back({queue[3 * e + 1], row_key[q], q});
        }
        if (i64(victims.size()) == k) {
          info[6] = e;
        } else {
          victims.clear();
        }
      }
      i64 extra = 0;
      if (victims.empty()) {  // a scan of every row
        i64 candidates = 0;
        if (spare > 0 || queued)
          for (i64 q = 0; q < n_rows; ++q) candidates += bo[q] >= 0 && i64(lu[q]) != t;
        extra = std::max<i64>(0, std::min(spare, candidates - k));
        const i64 want = queued ? std::max(k, std::min(queue_cap, candidates)) : k + extra;
        i64 at = 0;
        const i64 kth = vocab_kth_score(score, bo, lu, n_rows, t, want, &at);
        // every candidate below the k-th score, and of those at it the smallest ids
        std::vector<Cand> ties;
        victims.reserve(size_t(want));
        ties.reserve(size_t(at));
        for (i64 q = 0; q < n_rows; ++q) {
          if (bo[q] < 0 || i64(lu[q]) == t) continue;
          if (score[q] < kth) {
            victims.push_back({score[q], row_key[q], q});
          } else if (score[q] == kth) {
            ties.push_back({score[q], row_key[q], q});
          }
        }
        const size_t need = size_t(want) - victims.size();
        auto by_id = [](const Cand& a, const Cand& b) { return a.id < b.id; };
        std::nth_element(ties.begin(), ties.begin() + (need - 1), ties.end(), by_id);
        victims.insert(victims.end(), ties.begin(), ties.begin() + need);
        std::sort(victims.begin(), victims.end(), [](const Cand& a, const Cand& b) {
          return a.score < b.score || (a.score == b.score && a.id < b.id);
        });
        if (queued) {  // the lowest candidates (as many as it holds), the first k taken now
          const i64 keep = std::min(want, queue_cap);
          for (i64 j = 0; j < keep; ++j) {
            const i64 q = victims[size_t(j)].row;
            queue[3 * j] = q;
            queue[3 * j + 1] = i64(lu[q]);
            queue[3 * j + 2] = i64(bo[q]);
          }
          info[5] = keep;
          info[6] = std::min(k, keep);
        }
      }
      for (i64 j = 0; j < k + extra; ++j) {
        if (j + kPrefetch < k + extra)
          __builtin_prefetch(ix.slots + ix.home(mix64(uint64_t(victims[j + kPrefetch].id))), 1, 1);
        ix.erase(row_key, victims[j].id);
      }
      for (i64 j = 0; j < k; ++j) new_rows[placed + j] = victims[j].row;
      for (i64 j = 0; j < extra; ++j) {  // freed now: the next steps admit into them
        const i64 q = victims[k + j].row;
        row_key[q] = 0;
        lu[q] = 0;
        fr[q] = 0;
        bo[q] = -1;
        freed[j] = q;
        info[2] = std::min(info[2], q);
      }
      info[3] = extra;
      info[4] -= k + extra;
    }
    for (i64 j = 0; j < n_new; ++j) {
      if (j + kPrefetch < n_new)
        __builtin_prefetch(ix.slots + ix.home(mix64(uint64_t(new_ids[j + kPrefetch]))), 1, 1);
      const i64 q = new_rows[j], id = new_ids[j];
      row_key[q] = id;
      lu[q] = Step(t);
      fr[q] = 1;
      bo[q] = Step(t);
      ix.insert(id, q);
    }
    return i64(0);
  });
}

// Rebuilds the index from the per-row state: slots (size,) all set to -1, then every used row's
// id (born >= 0) of the first n_rows inserted. The types as ec_vocab_find's. Returns how many
// rows are used.
i64 ec_vocab_index(void* slots, i64 size, int wide_slots, const i64* row_key, const void* born,
                   int wide_steps, i64 n_rows) {
  return vocab_types(wide_slots, wide_steps, [&](auto slot_type, auto step_type) -> i64 {
    using Slot = decltype(slot_type);
    using Step = decltype(step_type);
    VocabIndex<Slot> ix(slots, size, n_rows);
    return vocab_build_index(ix, row_key, static_cast<const Step*>(born), n_rows);
  });
}

// A map's rows held grow: the first ``held`` rows of row_key (int64) and last_use, frequency,
// born (int64 when wide_old else int32) are copied into the new arrays of n_rows >= held rows
// (int64 when wide_steps else int32; every value fits), the rows after them free (id 0, last
// use 0, frequency 0, born -1), and the index ``slots`` (size,) is rebuilt over them (as
// ec_vocab_index). One thread: it is a copy. Returns how many rows are used.
i64 ec_vocab_grow(const i64* old_key, const void* old_last, const void* old_freq,
                  const void* old_born, i64 held, int wide_old, i64* row_key, void* last_use,
                  void* frequency, void* born, int wide_steps, i64 n_rows, void* slots, i64 size,
                  int wide_slots) {
  return vocab_types(wide_slots, wide_steps, [&](auto slot_type, auto step_type) -> i64 {
    using Slot = decltype(slot_type);
    using Step = decltype(step_type);
    Step* lu = static_cast<Step*>(last_use);
    Step* fr = static_cast<Step*>(frequency);
    Step* bo = static_cast<Step*>(born);
    std::memcpy(row_key, old_key, size_t(held) * sizeof(i64));
    std::fill(row_key + held, row_key + n_rows, i64(0));
    vocab_types(0, wide_old, [&](auto, auto old_type) -> i64 {
      using Old = decltype(old_type);
      const Old* ol = static_cast<const Old*>(old_last);
      const Old* of = static_cast<const Old*>(old_freq);
      const Old* ob = static_cast<const Old*>(old_born);
      for (i64 r = 0; r < held; ++r) {
        lu[r] = Step(ol[r]);
        fr[r] = Step(of[r]);
        bo[r] = Step(ob[r]);
      }
      return i64(0);
    });
    std::fill(lu + held, lu + n_rows, Step(0));
    std::fill(fr + held, fr + n_rows, Step(0));
    std::fill(bo + held, bo + n_rows, Step(-1));
    VocabIndex<Slot> ix(slots, size, n_rows);
    return vocab_build_index(ix, row_key, static_cast<const Step*>(bo), n_rows);
  });
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
// doubles of numerics/hashing.py's ``uniform`` (vocabulary.py's ``initial_values``: TF's truncated
// normal, the same floats in torch ops).
//   table (N, stride) float32 row-major.
__attribute__((optimize("fp-contract=off"))) void ec_init_normal(
    i64 seed, const i64* ids, const i64* rows, i64 n, i64 c0, i64 c1, double lo, double width,
    double div, float* table, i64 stride) {
  const uint64_t gamma = 0x9E3779B97F4A7C15ULL;
  // A row's columns go in blocks whose loops vectorize: the probabilities, then every value by
  // the central branch, then (rarely: 0.3% of the default's values) the tails' in scalar code.
  constexpr i64 kBlock = 64;
  double p[kBlock];
  for (i64 i = 0; i < n; ++i) {
    const uint64_t key = mix64((mix64(uint64_t(ids[i]) + gamma) ^ uint64_t(seed)) + gamma);
    float* o = table + rows[i] * stride - c0;
    for (i64 j0 = c0; j0 < c1; j0 += kBlock) {
      const i64 m = std::min(kBlock, c1 - j0);
      for (i64 k = 0; k < m; ++k) {  // the top 53 bits: an int64 converts exactly
        const i64 bits = i64(mix64(key + uint64_t(j0 + k) + gamma) >> 11);
        p[k] = lo + ((double(bits) + 0.5) * 0x1p-53) * width;
      }
      for (i64 k = 0; k < m; ++k) {
        const double q = p[k] - 0.5;
        const double r = q * q;
        const double x =
            (((((kA[0] * r + kA[1]) * r + kA[2]) * r + kA[3]) * r + kA[4]) * r + kA[5]) * q /
            (((((kB[0] * r + kB[1]) * r + kB[2]) * r + kB[3]) * r + kB[4]) * r + 1.0);
        o[j0 + k] = float(x / div);  // not fused: torch's rounding
      }
      i64 tails = 0;
      for (i64 k = 0; k < m; ++k) tails += (p[k] < kPLow) | (p[k] > 1.0 - kPLow);
      if (tails)
        for (i64 k = 0; k < m; ++k)
          if (p[k] < kPLow || p[k] > 1.0 - kPLow) o[j0 + k] = float(inverse_normal(p[k]) / div);
    }
  }
}

}  // extern "C"

// ---- the maps of stacked dynamic tables, stepped together ----------------------------------
// Several maps (the members of one physical table, state/vocab/native_map.py's ``train_steps``) are
// described by ``maps`` (M, kMapFields) int64, a row per map: the addresses and sizes of its
// arrays (as ec_vocab_step takes them), its capacity, this step t, its cut, lfu, the member's
// first shard row and its table's seed. Member m's distinct ids are ids[offsets[m],
// offsets[m + 1]). The members run on the threads, one member per chunk.

namespace {

constexpr i64 kInfo = 7;  // ec_vocab_step's info

enum MapField : int {
  kSlots, kSize, kWideSlots, kRowKey, kNRows, kLastUse, kFrequency, kBorn, kWideSteps,
  kCapacity, kStep, kCut, kLfu, kStart, kSeed, kQueue, kQueueCap, kMapFields
};

// f(m) for each member m (``every``: also those without ids) on the threads
template <class F>
inline void each_member(i64 n_maps, const i64* offsets, int nt, bool every, F&& f) {
  nt = offsets[n_maps] < 4096 ? 1 : std::max(nt, 1);
  parallel_chunks(n_maps, nt, [&](i64 m) {
    if (every || offsets[m + 1] > offsets[m]) f(m);
  });
}

}  // namespace

extern "C" {

// ec_vocab_find of each map over its ids with its cut, rows[i] its row or -1 (``shard``: its
// shard row, the map's start plus its row, or ``fill``); missing (M,) out: how many of each
// map's are not found. Reads only.
void ec_vocab_find_many(const i64* maps, i64 n_maps, const i64* ids, const i64* offsets,
                        i64* rows, i64* missing, i64 fill, int shard, int nt) {
  std::fill(missing, missing + n_maps, i64(0));
  each_member(n_maps, offsets, nt, false, [&](i64 m) {
    const i64* d = maps + m * kMapFields;
    const i64 a = offsets[m];
    missing[m] = ec_vocab_find(reinterpret_cast<const void*>(d[kSlots]), d[kSize],
                               int(d[kWideSlots]), reinterpret_cast<const i64*>(d[kRowKey]),
                               d[kNRows], reinterpret_cast<const void*>(d[kLastUse]),
                               int(d[kWideSteps]), d[kCut], ids + a, offsets[m + 1] - a, -1,
                               rows + a, 1);
    if (!shard) return;
    const i64 start = d[kStart];
    for (i64 i = a; i < offsets[m + 1]; ++i) rows[i] = rows[i] < 0 ? fill : rows[i] + start;
  });
}

// After ec_vocab_find_many (the rows it wrote in ``rows``), the training step of each map (those
// without ids too: their TTLs expire) admitting every id not found (admit_after 1):
// ec_vocab_split, then ec_vocab_step, the caller having held the rows they take (no map can
// fail: it checked each map's admissions fit, and reserved them). Then rows[i] becomes a shard
// row (the member's start plus its row), and member m's admitted ids and their shard rows go to
// new_ids, new_rows [new_offsets[m], new_offsets[m + 1]) (its missing count). With a ``table``,
// their default initial values are written there (ec_init_normal with the member's seed), and
// their rows of each of the n_slots optimizer slots (float32, slot_addrs[s] the address of a
// (N, slot_widths[s]) row-major array) set to slot_values[s]. info (M, kInfo): ec_vocab_step's,
// per map.
// Returns 0, or -1 - m when map m's step failed (a caller's error: its map unchanged; maps
// processed on other threads may have stepped).
i64 ec_vocab_step_many(const i64* maps, i64 n_maps, const i64* ids, const i64* offsets,
                       i64* rows, const i64* new_offsets, i64* new_ids, i64* new_rows,
                       i64* info, float* table, i64 stride, i64 c0, i64 c1, double lo,
                       double width, double div, const i64* slot_addrs, const i64* slot_widths,
                       const double* slot_values, i64 n_slots, int nt) {
  std::atomic<i64> failed{0};
  each_member(n_maps, offsets, nt, true, [&](i64 m) {  // (a map without ids steps too)
    const i64* d = maps + m * kMapFields;
    const i64 a = offsets[m], n = offsets[m + 1] - a;
    const i64 n_miss = new_offsets[m + 1] - new_offsets[m];
    thread_local std::vector<i64> hit, pos;
    hit.resize(size_t(n - n_miss));
    pos.resize(size_t(n_miss));
    i64* ids_out = new_ids + new_offsets[m];
    i64* rows_out = new_rows + new_offsets[m];
    if (ec_vocab_split(ids + a, rows + a, n, hit.data(), ids_out, pos.data()) != n_miss) {
      failed.store(-1 - m);
      return;
    }
    const i64 r = ec_vocab_step(
        reinterpret_cast<void*>(d[kSlots]), d[kSize], int(d[kWideSlots]),
        reinterpret_cast<i64*>(d[kRowKey]), reinterpret_cast<void*>(d[kLastUse]),
        reinterpret_cast<void*>(d[kFrequency]), reinterpret_cast<void*>(d[kBorn]),
        int(d[kWideSteps]), d[kNRows], d[kCapacity], hit.data(), n - n_miss, ids_out, n_miss,
        d[kStep], d[kCut], int(d[kLfu]), rows_out, info + kInfo * m, 0, nullptr,
        reinterpret_cast<i64*>(d[kQueue]), d[kQueueCap]);
    if (r != 0) {
      failed.store(-1 - m);
      return;
    }
    const i64 start = d[kStart];
    for (i64 j = 0; j < n_miss; ++j) rows[a + pos[size_t(j)]] = rows_out[j];
    for (i64 i = a; i < a + n; ++i) rows[i] += start;
    for (i64 j = 0; j < n_miss; ++j) rows_out[j] += start;
    if (table == nullptr) return;
    ec_init_normal(d[kSeed], ids_out, rows_out, n_miss, c0, c1, lo, width, div, table, stride);
    for (i64 k = 0; k < n_slots; ++k) {
      float* slot = reinterpret_cast<float*>(slot_addrs[k]);
      const i64 w = slot_widths[k];
      const float v = float(slot_values[k]);
      for (i64 j = 0; j < n_miss; ++j) std::fill_n(slot + rows_out[j] * w, w, v);
    }
  });
  return failed.load();
}

}  // extern "C"
