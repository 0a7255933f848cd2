// embcore's fused CPU kernels: dedup, lookup, and the sparse update straight from output gradients.
//
// Plain C++, no torch headers and no OpenMP runtime (``#pragma omp simd`` only, compiled with
// -fopenmp-simd): the library is compiled on first use by embcore/ops/native.py (seconds, cached)
// and called through ctypes with raw pointers of contiguous tensors. Its threads are its own
// small pool (below), sized by torch's thread count. Every kernel here has a torch-ops twin in
// ops/ and is tested against ops/reference.py and ops/reference_optim.py.
//
// Why fused: a step is bound by random row accesses into tables far larger than the caches
// (a TLB and cache miss per row), not by arithmetic. The torch-ops path touches each row several
// times (gather rows, gather slots, compute into temporaries, scatter both back); here each
// touched row and its slot row are read once and written once, in place, while the rows a few
// iterations ahead are prefetched so that many misses are in flight at once.
//
// Legend: N rows, D dim, nnz id occurrences, R output rows (bags), U unique rows.

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

typedef int64_t i64;

// The optimizer hyper-parameters of ec_sparse_update, mirrored by embcore/ops/native.py's
// ``Hyper`` (ctypes.Structure: same names, same order). Infinities mean no bound; the options'
// "off" values are gradient_multiplier 1, clip_min / weight_min -inf, clip_max / weight_max +inf,
// weight_decay 0. native.py checks at load time that both sides agree (ec_hyper_size,
// ec_hyper_field_name, ec_hyper_field); a change here bumps ec_abi_version.
struct EcHyper {
  double learning_rate, gradient_multiplier, clip_min, clip_max, weight_decay, weight_min,
      weight_max;
};

namespace {

struct HyperField {
  const char* name;
  size_t offset;
};
#define EC_HYPER_FIELD(f) HyperField{#f, offsetof(EcHyper, f)}
// Every field of EcHyper, in declaration order: its name and where it lives.
constexpr HyperField kHyperFields[] = {
    EC_HYPER_FIELD(learning_rate), EC_HYPER_FIELD(gradient_multiplier), EC_HYPER_FIELD(clip_min),
    EC_HYPER_FIELD(clip_max),      EC_HYPER_FIELD(weight_decay),        EC_HYPER_FIELD(weight_min),
    EC_HYPER_FIELD(weight_max)};
#undef EC_HYPER_FIELD
constexpr int kHyperFieldCount = int(sizeof(kHyperFields) / sizeof(kHyperFields[0]));
static_assert(sizeof(EcHyper) == kHyperFieldCount * sizeof(double),
              "kHyperFields must list every field of EcHyper");

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

// ---- the thread pool -----------------------------------------------------------------------
// Why not OpenMP: an OpenMP parallel region ends at a barrier that waits for every thread of its
// team, and libgomp's waiting threads spin (by default about 300,000 iterations, milliseconds)
// before they sleep. When another process keeps a core busy, a team thread is often off its
// core: each region then waits for it, and the waiting thread spins on the very core the late
// one could run on (measured: a W1 step 16 ms quiet, 43-45 ms beside one busy process, most of
// it in the radix sort's six barriers; benchmarks/RESULTS.md, issue 15).
//
// Here a kernel's work is cut into chunks that threads claim one at a time, in any order. The
// calling thread claims chunks too and then waits only for chunks already claimed by others,
// never for a helper that has not started: a late helper finds no chunk left and goes back to
// waiting. Every wait spins briefly (the caller 50 us, a helper between jobs 300 us), yielding
// the core every 64 turns, then sleeps, so that a descheduled helper holding a chunk gets the
// core back soon. Chunk boundaries do not change results: every kernel computes each output
// from one chunk in a fixed order (tested: 1 to 4 threads, same bits).

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins until ready() or ``us`` microseconds have passed; returns ready(). Every 64 turns it
// yields the core, so that a thread waiting for it (the one it waits for, or another
// process's) runs at once; on an idle core yielding returns at once.
template <class Ready>
inline bool spin_until(Ready ready, int us) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (int k = 0;; ++k) {
    if (ready()) return true;
    cpu_relax();
    if ((k & 63) == 63) {
      if (std::chrono::steady_clock::now() >= end) return ready();
      std::this_thread::yield();
    }
  }
}

constexpr int kHelperSpinUs = 300; // a helper's wait for the next job before it sleeps
constexpr int kCallerSpinUs = 50;  // the caller's wait for claimed chunks before it sleeps
constexpr uint64_t kClosed = 0xffffffffULL;  // chunk cursor of a finished job
// A caller that waited for helpers longer than kLateNs and than a quarter of its own share of
// the job found a helper holding a chunk off its core (another process has it; it gets the
// core back after a time slice, milliseconds). The following jobs then run on the caller alone
// for kSoloFirstNs, doubled (up to kSoloMostNs) each time the next job with helpers finds the
// same, and back to kSoloFirstNs once helpers are on time: under a lasting neighbour nearly
// every job runs alone, a passing one costs a few milliseconds at one thread. Results do not
// depend on it (nor on the thread count).
constexpr int64_t kLateNs = 200'000;
constexpr int64_t kSoloFirstNs = 5'000'000;
constexpr int64_t kSoloMostNs = 320'000'000;

inline int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

class Pool {
 public:
  explicit Pool(pid_t pid) : pid_(pid) {}
  pid_t pid() const { return pid_; }

  // Runs fn(ctx, c) for every c in [0, n), on the caller and up to nt - 1 helpers. If another
  // thread is running a job, runs them all on the caller (no waiting for the pool).
  void run(i64 n, int nt, void (*fn)(void*, i64), void* ctx) {
    std::unique_lock<std::mutex> busy(run_lock_, std::try_to_lock);
    const int64_t start = busy.owns_lock() && nt > 1 && n > 1 ? now_ns() : 0;
    if (start == 0 || start < solo_until_) {  // (solo: helpers were late, see kLateNs)
      for (i64 c = 0; c < n; ++c) fn(ctx, c);
      return;
    }
    start_helpers(nt - 1);
    fn_.store(fn);
    ctx_.store(ctx);
    n_.store(n);
    finished_.store(0);
    helpers_.store(nt - 1);
    const uint64_t gen = ++gen_ & kClosed;
    state_.store(gen << 32);  // published: claims may start
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(m_);
      work_cv_.notify_all();
    }
    i64 mine = 0, c;
    while (claim(gen, n, &c)) {
      fn(ctx, c);
      ++mine;
    }
    const i64 before = finished_.fetch_add(mine) + mine;
    if (before < n) {
      const int64_t own = now_ns();
      if (!spin_until([&] { return finished_.load() == n; }, kCallerSpinUs)) {
        std::unique_lock<std::mutex> lk(m_);
        caller_waiting_.store(true);
        done_cv_.wait(lk, [&] { return finished_.load() == n; });
        caller_waiting_.store(false);
      }
      const int64_t end = now_ns(), waited = end - own;
      if (waited > kLateNs && 4 * waited > own - start) {  // a helper was off its core
        solo_until_ = end + solo_ns_;
        solo_ns_ = std::min(2 * solo_ns_, kSoloMostNs);
      } else {
        solo_ns_ = kSoloFirstNs;
      }
    } else {
      solo_ns_ = kSoloFirstNs;
    }
    state_.store(gen << 32 | kClosed);  // no claim succeeds from here on
  }

 private:
  // Claims the next chunk of job ``gen`` (of n chunks) into *c; false when none is left.
  bool claim(uint64_t gen, i64 n, i64* c) {
    uint64_t s = state_.load();
    for (;;) {
      if ((s >> 32) != gen || i64(s & kClosed) >= n) return false;
      if (state_.compare_exchange_weak(s, s + 1)) {
        *c = i64(s & kClosed);
        return true;
      }
    }
  }

  void start_helpers(int want) {
    while (started_ < want) {
      try {
        std::thread(&Pool::helper, this, started_).detach();
      } catch (...) {
        return;  // no more threads: fewer helpers
      }
      ++started_;
    }
  }

  void helper(int index) {
    uint64_t seen = state_.load() >> 32;
    bool woke_caller = false;
    for (;;) {
      auto fresh = [&] { return (state_.load() >> 32) != seen; };
      // A helper that had to wake the caller was late (another process holds the cores):
      // it sleeps at once instead of spinning beside the caller it just woke.
      if (woke_caller || !spin_until(fresh, kHelperSpinUs)) {
        std::unique_lock<std::mutex> lk(m_);
        sleepers_.fetch_add(1);
        work_cv_.wait(lk, fresh);
        sleepers_.fetch_sub(1);
      }
      seen = state_.load() >> 32;
      if (index >= helpers_.load()) continue;  // this job wants fewer helpers
      // What follows reads the job's fields after seeing its generation; a claim succeeds only
      // while that generation is open, so a chunk never runs with another job's fields.
      void (*fn)(void*, i64) = fn_.load();
      void* ctx = ctx_.load();
      const i64 n = n_.load();
      i64 mine = 0, c;
      while (claim(seen, n, &c)) {
        fn(ctx, c);
        ++mine;
      }
      woke_caller = false;
      if (mine == 0) continue;
      if (finished_.fetch_add(mine) + mine == n && caller_waiting_.load()) {
        std::lock_guard<std::mutex> lk(m_);
        done_cv_.notify_one();
        woke_caller = true;
      }
    }
  }

  const pid_t pid_;
  std::mutex run_lock_;  // one job at a time
  int started_ = 0;      // helpers started (under run_lock_)
  uint64_t gen_ = 0;     // the last job's generation (under run_lock_)
  int64_t solo_until_ = 0;         // now_ns() before which jobs run on the caller alone
  int64_t solo_ns_ = kSoloFirstNs;  // the next solo period (both under run_lock_)
  std::atomic<uint64_t> state_{0};  // generation << 32 | next chunk to claim (kClosed: done)
  std::atomic<void (*)(void*, i64)> fn_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<i64> n_{0};
  std::atomic<i64> finished_{0};  // chunks done
  std::atomic<int> helpers_{0};   // helpers wanted by the current job
  std::atomic<int> sleepers_{0};
  std::atomic<bool> caller_waiting_{false};
  std::mutex m_;
  std::condition_variable work_cv_, done_cv_;
};

// The process's pool, made on first use; a forked child (whose helper threads did not survive
// the fork) makes its own. Never destroyed: its detached helpers wait on it until exit.
Pool* pool() {
  static std::atomic<Pool*> current{nullptr};
  Pool* p = current.load();
  const pid_t pid = getpid();
  if (p != nullptr && p->pid() == pid) return p;
  Pool* fresh = new Pool(pid);
  if (current.compare_exchange_strong(p, fresh)) return fresh;
  delete fresh;
  return current.load();
}

// Runs f(c) for c in [0, chunks) on up to nt threads (see Pool).
template <class F>
void parallel_chunks(i64 chunks, int nt, F&& f) {
  using Fn = std::remove_reference_t<F>;
  if (nt <= 1 || chunks <= 1) {
    for (i64 c = 0; c < chunks; ++c) f(c);
    return;
  }
  pool()->run(chunks, nt, [](void* ctx, i64 c) { (*static_cast<Fn*>(ctx))(c); },
              const_cast<void*>(static_cast<const void*>(&f)));
}

// Runs f(c, lo, hi) for each chunk c of [0, n), [lo, hi) cut by split_point(cumulative, n,
// per_item, ...): chunks of about equal cost.
template <class F>
void parallel_ranges(i64 chunks, int nt, i64 n, const i64* cumulative, i64 per_item, F&& f) {
  parallel_chunks(chunks, nt, [&](i64 c) {
    f(c, split_point(cumulative, n, per_item, int(c), int(chunks)),
      split_point(cumulative, n, per_item, int(c) + 1, int(chunks)));
  });
}

// How many chunks a kernel of ``work`` floats touched cuts its work into on nt threads: 1 on
// one thread, else about kChunkWork each, at least 4 per thread (so that a late thread's share
// is small) and at most ``most``.
constexpr i64 kChunkWork = 32768;
inline i64 chunks_for(i64 work, int nt, i64 most = 256) {
  if (nt <= 1) return 1;
  return std::min(most, std::max(i64(4) * nt, work / kChunkWork));
}

// The radix sort's per-chunk digit counts, kept per calling thread across calls (small).
thread_local std::vector<i64> radix_counts;


// ---- dynamic vocabularies (ops/vocab.py's NativeVocabMap) ----------------------------------
// A shard's raw id -> row map is an open-addressing index over its rows: ``slots`` (S,) holds a
// row or -1 (empty), S a power of two >= 2 x the rows (load <= 1/2), linear probing from
// mix64(id) & (S - 1); a slot's key is row_key[slot's row]. Removal shifts the following entries
// back (no tombstones), so a probe always ends at the first empty slot.

// SplitMix64's finalizer (ops/hashing.py's splitmix64 without the increment): spreads ids.
inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

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

// The column block of a bag sum for rows of d floats: the largest of 128, 64, 32, 16, 8 that
// divides d (0: none does; the sum runs over whole rows in memory).
inline i64 bag_block(i64 d) {
  for (i64 b = 128; b >= 8; b /= 2)
    if (d % b == 0) return b;
  return 0;
}

// One bag's sum o = sum_{k in [k0, k1)} scales[k] * table[ids[k]], BW columns at a time held in
// registers (no store per occurrence); each column still sums 0 + s * row + s * row + ... in
// bag order, as the plain loop does. The first block prefetches the rows kPrefetch ahead.
template <i64 BW>
inline void bag_sum(const float* table, i64 d, const i64* ids, const float* scales, i64 k0,
                    i64 k1, i64 k_end, float* o) {
  for (i64 c0 = 0; c0 < d; c0 += BW) {
    float acc[BW] = {};
    for (i64 k = k0; k < k1; ++k) {
      if (c0 == 0 && k + kPrefetch < k_end) prefetch_read(table + ids[k + kPrefetch] * d, d);
      const float s = scales ? scales[k] : 1.f;
      const float* row = table + ids[k] * d + c0;
#pragma omp simd
      for (i64 c2 = 0; c2 < BW; ++c2) acc[c2] += s * row[c2];
    }
    for (i64 c2 = 0; c2 < BW; ++c2) o[c0 + c2] = acc[c2];
  }
}

// Hash-dedup's scratch index, kept per calling thread across calls.
thread_local std::vector<i64> dedup_slots;

}  // namespace

extern "C" {

int ec_abi_version() { return 10; }

// sizeof(EcHyper), for native.py's layout check.
i64 ec_hyper_size() { return i64(sizeof(EcHyper)); }

// The name of EcHyper's field i (declaration order), nullptr past the last one.
const char* ec_hyper_field_name(int i) {
  return i >= 0 && i < kHyperFieldCount ? kHyperFields[i].name : nullptr;
}

// The value of EcHyper's field i in *h, read by the field's name (offsetof), NaN past the last.
double ec_hyper_field(const EcHyper* h, int i) {
  if (i < 0 || i >= kHyperFieldCount) return std::nan("");
  double v;
  std::memcpy(&v, reinterpret_cast<const char*>(h) + kHyperFields[i].offset, sizeof(double));
  return v;
}

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

// Weighted bag sums: out[r] = sum_{k in [offsets[r], offsets[r+1])} scales[k] * table[ids[k]].
//   table (N, D) row-major; ids (nnz,); offsets (R + 1,) or nullptr (bag r is id r alone,
//   scale 1); scales (nnz,) or nullptr (all 1); out (R, D).
void ec_lookup(const float* table, i64 d, const i64* ids, const i64* offsets, const float* scales,
               i64 r_rows, float* out, int nt) {
  const i64 nnz = offsets ? offsets[r_rows] : r_rows;
  nt = threads_for(nnz * d, nt);
  const i64 chunks = chunks_for(nnz * d, nt);
  // chunks of bags of about equal cost
  parallel_ranges(chunks, nt, r_rows, offsets, 1, [&](i64, i64 lo, i64 hi) {
    if (offsets == nullptr) {
      for (i64 r = lo; r < hi; ++r) {
        if (r + kPrefetch < hi) prefetch_read(table + ids[r + kPrefetch] * d, d);
        std::memcpy(out + r * d, table + ids[r] * d, sizeof(float) * d);
      }
    } else {
      const i64 k_end = offsets[hi];
      const i64 bw = bag_block(d);
      for (i64 r = lo; r < hi; ++r) {
        float* o = out + r * d;
        const i64 k0 = offsets[r], k1 = offsets[r + 1];
        switch (bw) {
          case 128: bag_sum<128>(table, d, ids, scales, k0, k1, k_end, o); break;
          case 64: bag_sum<64>(table, d, ids, scales, k0, k1, k_end, o); break;
          case 32: bag_sum<32>(table, d, ids, scales, k0, k1, k_end, o); break;
          case 16: bag_sum<16>(table, d, ids, scales, k0, k1, k_end, o); break;
          case 8: bag_sum<8>(table, d, ids, scales, k0, k1, k_end, o); break;
          default:
            for (i64 c2 = 0; c2 < d; ++c2) o[c2] = 0.f;
            for (i64 k = k0; k < k1; ++k) {
              if (k + kPrefetch < k_end) prefetch_read(table + ids[k + kPrefetch] * d, d);
              const float s = scales ? scales[k] : 1.f;
              const float* row = table + ids[k] * d;
#pragma omp simd
              for (i64 c2 = 0; c2 < d; ++c2) o[c2] += s * row[c2];
            }
        }
      }
    }
  });
}

// Optimizer rules (DESIGN 2.3-2.4) of ec_sparse_update.
enum Rule : int { kSGD = 0, kAdagrad = 1, kRowwiseAdagrad = 2 };

// Sparse update of the touched rows, each exactly once, in place.
//   w (N, D) parameters; acc (N, D) or (N, 1) accumulators (rule kAdagrad / kRowwiseAdagrad) or
//   nullptr (kSGD); rows (U,) distinct rows to update.
// The summed gradient of rows[u] comes from one of two sources:
//   - occurrences (uoff != nullptr): g = sum over j in [uoff[u], uoff[u+1]) of
//     scale(order[j]) * grad_row(bag(order[j])), in that order, where bag(k) = bags[k] (or k when
//     bags is nullptr), scale(k) = scales[k] (or 1), and grad_row(b) is row b of the output
//     gradient, split across ``nslices`` tensors: rows [starts[i], starts[i+1]) live in
//     slices[i], row r of it at slices[i] + r * strides[i] (D consecutive floats; strides
//     nullptr: D, the slices are contiguous);
//   - direct (uoff == nullptr): g = slices[0] row u.
// Then, per row, with the fields of *hyper (EcHyper, built by embcore/ops/update.py):
// g *= gradient_multiplier; g = clip(g, clip_min, clip_max); the rule (learning_rate);
// w -= weight_decay * w_before; w = clip(w, weight_min, weight_max). Adagrad variants with a zero
// accumulator take no step (0 / 0).
void ec_sparse_update(int rule, float* w, float* acc, i64 d, const i64* rows, i64 u_rows,
                      const i64* uoff, const i64* order, const i64* bags, const float* scales,
                      const float* const* slices, const i64* starts, const i64* strides,
                      i64 nslices, const EcHyper* hyper, int nt) {
  const float lr = float(hyper->learning_rate), gmul = float(hyper->gradient_multiplier);
  const float clo = float(hyper->clip_min), chi = float(hyper->clip_max);
  const float wd = float(hyper->weight_decay);
  const float wmin = float(hyper->weight_min), wmax = float(hyper->weight_max);
  const bool scaled = gmul != 1.f, clipped = std::isfinite(clo) || std::isfinite(chi);
  const bool decayed = wd != 0.f, bounded = std::isfinite(wmin) || std::isfinite(wmax);
  const i64 acc_d = rule == kRowwiseAdagrad ? 1 : d;
  const i64 occurrences = uoff ? uoff[u_rows] - uoff[0] : u_rows;
  nt = threads_for((u_rows * 2 + occurrences) * d, nt);

  // Several slices: the address of every output row, written once here, so an occurrence
  // costs one load rather than a binary search over the slices (30 ns an occurrence with 26
  // slices, a quarter of the update's time).
  thread_local std::vector<const float*> row_address;
  const float* const* row_at = nullptr;
  if (uoff && nslices > 1) {
    row_address.resize(static_cast<size_t>(starts[nslices]));
    for (i64 i = 0; i < nslices; ++i) {
      const i64 step = strides ? strides[i] : d;
      const float* p = slices[i];
      for (i64 b = starts[i]; b < starts[i + 1]; ++b, p += step) row_address[size_t(b)] = p;
    }
    row_at = row_address.data();
  }
  const i64 stride0 = strides ? strides[0] : d;
  auto grad_row = [&](i64 b) -> const float* {
    return row_at ? row_at[b] : slices[0] + b * stride0;
  };

  const i64 chunks = chunks_for((u_rows * 2 + occurrences) * d, nt);
  // chunks of rows of about equal cost
  parallel_ranges(chunks, nt, u_rows, uoff, 2, [&](i64, i64 lo, i64 hi) {
    const i64 j_end = uoff ? uoff[hi] : 0;
    thread_local std::vector<float> gbuf, wbuf;
    gbuf.resize(static_cast<size_t>(d));
    if (decayed) wbuf.resize(static_cast<size_t>(d));
    float* g = gbuf.data();
    for (i64 u = lo; u < hi; ++u) {
      if (u + kPrefetch < hi) {
        const i64 ahead = rows[u + kPrefetch];
        prefetch_write(w + ahead * d, d);
        if (acc) prefetch_write(acc + ahead * acc_d, acc_d);
        if (!uoff) prefetch_read(slices[0] + (u + kPrefetch) * d, d);
      }
      // 1. the summed gradient
      if (uoff) {
        for (i64 c = 0; c < d; ++c) g[c] = 0.f;
        for (i64 j = uoff[u]; j < uoff[u + 1]; ++j) {
          if (j + 2 * kPrefetchOccurrences < j_end) {  // bag and scale of a later occurrence
            const i64 kb = order[j + 2 * kPrefetchOccurrences];
            if (bags) __builtin_prefetch(bags + kb, 0, 1);
            if (scales) __builtin_prefetch(scales + kb, 0, 1);
          }
          if (j + kPrefetchOccurrences < j_end) {  // the source row of a nearer one
            const i64 ka = order[j + kPrefetchOccurrences];
            prefetch_read(grad_row(bags ? bags[ka] : ka), d);
          }
          const i64 k = order[j];
          const float s = scales ? scales[k] : 1.f;
          const float* src = grad_row(bags ? bags[k] : k);
#pragma omp simd
          for (i64 c = 0; c < d; ++c) g[c] += s * src[c];
        }
      } else {
        std::memcpy(g, slices[0] + u * d, sizeof(float) * d);
      }
      // 2. multiplier and clipping
      if (scaled)
        for (i64 c = 0; c < d; ++c) g[c] *= gmul;
      if (clipped)
        for (i64 c = 0; c < d; ++c) g[c] = std::min(std::max(g[c], clo), chi);
      float* wr = w + rows[u] * d;
      if (decayed) std::memcpy(wbuf.data(), wr, sizeof(float) * d);
      // 3. the rule
      if (rule == kSGD) {
#pragma omp simd
        for (i64 c = 0; c < d; ++c) wr[c] -= lr * g[c];
      } else if (rule == kAdagrad) {
        float* a = acc + rows[u] * d;
#pragma omp simd
        for (i64 c = 0; c < d; ++c) {
          const float an = a[c] + g[c] * g[c];
          a[c] = an;
          // an == 0 implies g == 0 (a >= 0): dividing by sqrt(0 + 1) then gives the rule's zero
          // step; arithmetic, not a branch, keeps the loop vectorized
          const float empty = float(an <= 0.f);
          wr[c] -= lr * (g[c] / std::sqrt(an + empty));
        }
      } else {  // kRowwiseAdagrad
        float* a = acc + rows[u];
        float sq = 0.f;
#pragma omp simd reduction(+ : sq)
        for (i64 c = 0; c < d; ++c) sq += g[c] * g[c];
        const float an = a[0] + sq / float(d);
        a[0] = an;
        if (an > 0.f) {
          const float root = std::sqrt(an);
#pragma omp simd
          for (i64 c = 0; c < d; ++c) wr[c] -= lr * (g[c] / root);
        }
      }
      // 4-5. decoupled weight decay, weight clipping
      if (decayed)
        for (i64 c = 0; c < d; ++c) wr[c] -= wd * wbuf[c];
      if (bounded)
        for (i64 c = 0; c < d; ++c) wr[c] = std::min(std::max(wr[c], wmin), wmax);
    }
  });
}

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

// Per-id scales that make a weighted sum over each bag apply the combiner (DESIGN 2.2):
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

// Each distinct row's value at its occurrences: out[order[j]] = values[u] for j in
// [uoff[u], uoff[u+1]) (a Dedup's layout: the cache rows of a batch's ids from its distinct
// rows' ones).
void ec_expand(const i64* values, const i64* order, const i64* uoff, i64 n_unique, i64* out) {
  for (i64 u = 0; u < n_unique; ++u)
    for (i64 j = uoff[u]; j < uoff[u + 1]; ++j) out[order[j]] = values[u];
}

// Bag of every occurrence: bags[k] = r for k in [offsets[r], offsets[r+1]).
void ec_bag_of(const i64* offsets, i64 r_rows, i64* bags) {
  for (i64 r = 0; r < r_rows; ++r)
    for (i64 k = offsets[r]; k < offsets[r + 1]; ++k) bags[k] = r;
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

// ---- the cache's index (ops/cache_index.py) ------------------------------------------------
// One step of a write-back cache's index over a shard of N rows with C cache rows. State:
// where (N,) int32: the cache row holding each shard row, or -1; owner (C,): the shard row each
// cache row holds, or -1; stamp (C,): the clock of its last use; dirty, fresh (C,) uint8 flags;
// free (C,): a stack of the free cache rows, io[0] of them.
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
                  uint8_t* dirty, uint8_t* fresh, i64* free_rows, i64 capacity, i64 clock,
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
        where[owner[s]] = -1;
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

// flags[idx[i]] = value for i < n.
void ec_set_flags(uint8_t* flags, const i64* idx, i64 n, int value) {
  for (i64 i = 0; i < n; ++i) flags[idx[i]] = uint8_t(value);
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
