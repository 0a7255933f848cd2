// embcore's fused CPU kernels: dedup, lookup, and the sparse update straight from output gradients.
//
// Plain C++, no torch headers and no OpenMP runtime (``#pragma omp simd`` only, compiled with
// -fopenmp-simd): the library is compiled on first use by embcore/kernels/cpu/ (seconds, cached)
// and called through ctypes with raw pointers of contiguous tensors. Its threads are its own
// small pool (pool.h), sized by torch's thread count. Every kernel here has a torch-ops twin in
// ops/ and is tested against ops/reference.py and ops/reference_optim.py.
//
// Why fused: a step is bound by random row accesses into tables far larger than the caches
// (a TLB and cache miss per row), not by arithmetic. The torch-ops path touches each row several
// times (gather rows, gather slots, compute into temporaries, scatter both back); here each
// touched row and its slot row are read once and written once, in place, while the rows a few
// iterations ahead are prefetched so that many misses are in flight at once.
//
// Legend: N rows, D dim, nnz id occurrences, R output rows (bags), U unique rows.
//
// One translation unit: this file includes the kernels by concern (each header includes what it
// uses), so kernels/cpu/library.py compiles it with one compiler call into one library.
//   common.h       int64 rows, prefetching, splitting work by cost, ids' hash
//   pool.h         the thread pool and the parallel loops over it
//   dedup.h        ec_dedup, ec_concat_dedup, ec_dedup_raw, ec_dedup_raw_runs, ec_expand
//   half.h         16-bit rows: widening, rounding (to nearest, stochastic), ec_round16
//   fp8.h          8-bit rows with a scale a row: widening, the row's scale, rounding
//   lookup.h       ec_lookup
//   update.h       EcHyper, ec_hyper_*, ec_sparse_update
//   inputs.h       ec_minmax, ec_offsets_error, ec_first_unordered, ec_combiner_scales, ec_bag_of
//   rows.h         ec_copy_rows, ec_will_need, ec_copy_rows_summed (the slow tier's checksums)
//   vocab.h        ec_vocab_* (ec_vocab_find_many, ec_vocab_step_many: a stack's maps at
//                  once), ec_init_normal
//   cache_index.h  ec_cache_step, ec_row_versions, ec_set_flags
//   packed.h       ec_concat_dedup_packed, ec_lookup_packed, ec_sparse_update_packed: the
//                  hot kernels with their arguments in one array of slots
// kernels/cpu/library.py declares every exported function's arguments by name and kind (its ctypes
// signature and per-call checks come from that table): a change of a signature here changes the
// table there and bumps ABI_VERSION there.

#include "common.h"
#include "pool.h"
#include "half.h"
#include "fp8.h"
#include "dedup.h"
#include "lookup.h"
#include "update.h"
#include "inputs.h"
#include "rows.h"
#include "vocab.h"
#include "cache_index.h"
#include "packed.h"

// The ABI version has one source: kernels/cpu/library.py's ABI_VERSION, passed as
// -DEC_ABI_VERSION=N by its build (and part of the build's cache key); the loader refuses a
// library reporting another.
#ifndef EC_ABI_VERSION
#error "compile with -DEC_ABI_VERSION=N (embcore/kernels/cpu/library.py's ABI_VERSION)"
#endif

extern "C" {

int ec_abi_version() { return EC_ABI_VERSION; }

}  // extern "C"
