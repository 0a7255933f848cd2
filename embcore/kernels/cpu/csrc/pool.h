// pool.h: the kernels' own thread pool and the parallel loops over it.

#pragma once

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <type_traits>

#include "common.h"

#ifdef EC_POOL_OMP
#include <omp.h>
#endif

namespace {

// ---- the thread pool -----------------------------------------------------------------------
// Why not OpenMP: an OpenMP parallel region ends at a barrier that waits for every thread of its
// team, and libgomp's waiting threads spin (by default about 300,000 iterations, milliseconds)
// before they sleep. When another process keeps a core busy, a team thread is often off its
// core: each region then waits for it, and the waiting thread spins on the very core the late
// one could run on (measured: a W1 step 16 ms quiet, 43-45 ms beside one busy process, most of
// it in the radix sort's six barriers; benchmarks/RESULTS.md).
//
// Here a kernel's work is cut into chunks that threads claim one at a time, in any order. The
// calling thread claims chunks too and then waits only for chunks already claimed by others,
// never for a helper that has not started: a late helper finds no chunk left and goes back to
// waiting. Every wait spins briefly (the caller 50 us, a helper between jobs 300 us), yielding
// the core every 64 turns, then sleeps, so that a descheduled helper holding a chunk gets the
// core back soon. Chunk boundaries do not change results: every kernel computes each output
// from one chunk in a fixed order (tested: 1 to 4 threads, same bits).
//
// The other backend (EMBCORE_NATIVE_POOL=omp, below) runs the same chunk claims in OpenMP
// regions on torch's own runtime and threads, so that no helper of ours competes with torch's
// workers spinning after its ops. Measured on 2 cores (benchmarks/RESULTS.md, 2026-11-28) it
// did not beat this pool inside a training step (layer + loss, W1 + MLP) nor beside a busy
// process: this pool stays the default.

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

#ifdef EC_POOL_OMP
// ---- the OpenMP backend (built with -fopenmp -DEC_POOL_OMP) ----------------------------------
// The library then binds to the OpenMP runtime already loaded by torch (libgomp.so.1): a job is
// a parallel region on the calling thread's team, the same threads torch's parallel ops use, so
// that a worker still spinning after torch's last op takes the kernel's chunks instead of
// holding the core a helper of our own would need. The chunks are claimed as above; the region's
// end still waits for every team thread, so the caller measures how long it waited after its
// own last chunk and, when a thread was off its core, runs the following jobs alone (kLateNs).
struct OmpSolo {
  int64_t until = 0, next = kSoloFirstNs;  // as Pool's solo_until_ and solo_ns_, per thread
};
thread_local OmpSolo omp_solo;
// The process that loaded the library. A forked child's libgomp still holds the parent's
// teams, whose threads did not survive the fork: there every job runs on the caller alone.
const pid_t omp_process = getpid();

template <class F>
void omp_chunks(i64 chunks, int nt, F& f) {
  OmpSolo& solo = omp_solo;
  const int64_t start = getpid() == omp_process && !omp_in_parallel() ? now_ns() : 0;
  if (start == 0 || start < solo.until) {
    for (i64 c = 0; c < chunks; ++c) f(c);
    return;
  }
  std::atomic<i64> next{0};
  int64_t own = 0;
#pragma omp parallel num_threads(nt)
  {
    for (i64 c = next.fetch_add(1); c < chunks; c = next.fetch_add(1)) f(c);
    if (omp_get_thread_num() == 0) own = now_ns();
  }
  const int64_t end = now_ns(), waited = end - own;
  if (waited > kLateNs && 4 * waited > own - start) {
    solo.until = end + solo.next;
    solo.next = std::min(2 * solo.next, kSoloMostNs);
  } else {
    solo.next = kSoloFirstNs;
  }
}
#endif

// Runs f(c) for c in [0, chunks) on up to nt threads (see Pool).
template <class F>
void parallel_chunks(i64 chunks, int nt, F&& f) {
  if (nt <= 1 || chunks <= 1) {
    for (i64 c = 0; c < chunks; ++c) f(c);
    return;
  }
#ifdef EC_POOL_OMP
  omp_chunks(chunks, nt, f);
#else
  using Fn = std::remove_reference_t<F>;
  pool()->run(chunks, nt, [](void* ctx, i64 c) { (*static_cast<Fn*>(ctx))(c); },
              const_cast<void*>(static_cast<const void*>(&f)));
#endif
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

}  // namespace
