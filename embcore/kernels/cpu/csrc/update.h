// update.h: the sparse update straight from output gradients, and its hyper-parameters.

#pragma once

#include "common.h"
#include "fp8.h"
#include "half.h"
#include "pool.h"

// The optimizer hyper-parameters of ec_sparse_update, mirrored by embcore/kernels/cpu/args.py's
// ``Hyper`` (ctypes.Structure: same names, same order). Infinities mean no bound; the options'
// "off" values are gradient_multiplier 1, clip_min / weight_min -inf, clip_max / weight_max +inf,
// weight_decay 0. kernels/cpu/library.py checks at load time that both sides agree (ec_hyper_size,
// ec_hyper_field_name, ec_hyper_field); a change here bumps kernels/cpu/library.py's ABI_VERSION.
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

}  // namespace

extern "C" {

// sizeof(EcHyper), for kernels/cpu/library.py's layout check.
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
// Optimizer rules of ec_sparse_update (docs/semantics.md section 4), numbered by
// kernels/rules.py (the build passes -DEC_RULE_<NAME>).
#if !defined(EC_RULE_SGD) || !defined(EC_RULE_ADAGRAD) || !defined(EC_RULE_ROWWISE_ADAGRAD)
#error "build with kernels/rules.py's DEFINES"
#endif
enum Rule : int {
  kSGD = EC_RULE_SGD,
  kAdagrad = EC_RULE_ADAGRAD,
  kRowwiseAdagrad = EC_RULE_ROWWISE_ADAGRAD
};

}  // extern "C"

namespace {

// How the update's float32 results become 16-bit rows: stochastically (the bits of each row's
// identity, the step and the column: half.h) or to nearest.
struct Rounding {
  bool stochastic;
  const i64* key_rows;  // (n_keys,) per table row, where its identity comes from (rows from
  i64 n_keys;           // n_keys on, and every row when nullptr: the row itself)
  Segments segments;
  i64 col0;             // the shard's first column (a column split)
  uint64_t step_key;    // splitmix64(step)
};

// dst[c] = src[c] for c < n (a row-wise accumulator: one float, no call to memcpy).
inline void copy_floats(float* dst, const float* src, i64 n) {
  if (n == 1)
    dst[0] = src[0];
  else
    std::memcpy(dst, src, sizeof(float) * size_t(n));
}

// One row's rule with its step size known (row-wise Adagrad's from the whole gradient), its
// weight decay and weight clipping: update_rows's steps 3-5, on a block of a 16-bit row.
struct RowStep {
  int rule;
  float lr;
  float root;    // kRowwiseAdagrad: the root of the row's new accumulator
  bool stepped;  // kRowwiseAdagrad: whether the row steps (its new accumulator is not 0)
  float wd, wmin, wmax;
  bool decayed, bounded;
};

// Columns of a 16-bit row widened, stepped and rounded together: they stay in registers (or L1)
// between the three, where whole-row passes wrote and read a float32 copy of the row.
constexpr i64 kBlock = 32;

// Steps 3-5 on columns [0, n) (n <= kBlock): x the row's values in float32 (updated in place), g
// its gradient, a its Adagrad accumulators (kAdagrad; updated in place). The same float
// arithmetic, in the same order, as update_rows's float32 rows.
inline void step_columns(const RowStep& s, float* x, const float* g, float* a, i64 n) {
  float before[kBlock];
  if (s.decayed)
    for (i64 c = 0; c < n; ++c) before[c] = x[c];
  if (s.rule == kSGD) {
#pragma omp simd
    for (i64 c = 0; c < n; ++c) x[c] -= s.lr * g[c];
  } else if (s.rule == kAdagrad) {
#pragma omp simd
    for (i64 c = 0; c < n; ++c) {
      const float an = a[c] + g[c] * g[c];
      a[c] = an;
      const float empty = float(an <= 0.f);  // (as update_rows: a zero step, no branch)
      x[c] -= s.lr * (g[c] / std::sqrt(an + empty));
    }
  } else if (s.stepped) {  // kRowwiseAdagrad
#pragma omp simd
    for (i64 c = 0; c < n; ++c) x[c] -= s.lr * (g[c] / s.root);
  }
  if (s.decayed)
    for (i64 c = 0; c < n; ++c) x[c] -= s.wd * before[c];
  if (s.bounded)
    for (i64 c = 0; c < n; ++c) x[c] = std::min(std::max(x[c], s.wmin), s.wmax);
}

// Columns [c0, c0 + n) of a 16-bit row: widened, stepped and rounded back in place; with
// ``before``, the row's 16-bit values are kept there first. Returns whether the rounding
// overflowed (narrow_overflowed; checked only with ``before``).
template <int T>
inline bool fused_block(const RowStep& s, uint16_t* row, const float* g, float* a, i64 c0,
                        i64 n, bool stochastic, uint32_t key32, i64 col0, uint16_t* before) {
  float x[kBlock];
  if (before) std::memcpy(before + c0, row + c0, sizeof(uint16_t) * size_t(n));
  widen<T>(row + c0, x, n);
  step_columns(s, x, g + c0, a ? a + c0 : nullptr, n);
  if (before) return narrow_overflowed<T>(x, row + c0, n, stochastic, key32, col0 + c0);
  narrow<T>(x, row + c0, n, stochastic, key32, col0 + c0);
  return false;
}

#if defined(__AVX512F__)
// fused_block on the float16 columns [c, c + 16) with AVX-512, in registers: step_columns's
// arithmetic (x - lr * q is one fused multiply-add there too, as the compiler contracts it;
// std::max(x, lo) is max(lo, x), NaN kept) and f16_*_v16's rounding. ``input``: the random
// bits' hash inputs of the 16 columns (stochastic). Returns the lanes that overflowed.
inline __mmask16 fused_f16_x16(const RowStep& s, uint16_t* row, const float* g, float* a, i64 c,
                               bool stochastic, __m512i input, uint16_t* before) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + c));
  if (before) _mm256_storeu_si256(reinterpret_cast<__m256i*>(before + c), h);
  const __m512 w = _mm512_cvtph_ps(h);  // (exact)
  const __m512 gv = _mm512_loadu_ps(g + c);
  const __m512 lr = _mm512_set1_ps(s.lr);
  __m512 x = w;
  if (s.rule == kSGD) {
    x = _mm512_fnmadd_ps(lr, gv, x);
  } else if (s.rule == kAdagrad) {
    const __m512 an = _mm512_fmadd_ps(gv, gv, _mm512_loadu_ps(a + c));
    _mm512_storeu_ps(a + c, an);
    const __m512 empty = _mm512_maskz_mov_ps(
        _mm512_cmp_ps_mask(an, _mm512_setzero_ps(), _CMP_LE_OQ), _mm512_set1_ps(1.f));
    x = _mm512_fnmadd_ps(lr, _mm512_div_ps(gv, _mm512_sqrt_ps(_mm512_add_ps(an, empty))), x);
  } else if (s.stepped) {  // kRowwiseAdagrad
    x = _mm512_fnmadd_ps(lr, _mm512_div_ps(gv, _mm512_set1_ps(s.root)), x);
  }
  if (s.decayed) x = _mm512_fnmadd_ps(_mm512_set1_ps(s.wd), w, x);
  if (s.bounded)
    x = _mm512_min_ps(_mm512_set1_ps(s.wmax), _mm512_max_ps(_mm512_set1_ps(s.wmin), x));
  __mmask16 over = 0;
  const __m256i r = stochastic ? f16_stochastic_v16(x, lowbias32_x16(input), &over)
                               : f16_nearest_v16(x, &over);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + c), r);
  return over;
}
#endif

// Steps 3-6 on a 16-bit row (d columns) in one pass, kBlock columns at a time: the same bits as
// widening the whole row, stepping it and rounding it back (the random bits of column col0 + c
// are column c's whatever the block). ``before`` (d,): the guard's copy of the row, nullptr
// for none. Returns whether the rounding overflowed (with ``before`` only); the caller restores
// the row from ``before`` then.
template <int T>
inline bool fused_row16(const RowStep& s, uint16_t* row, const float* g, float* a, i64 d,
                        bool stochastic, uint32_t key32, i64 col0, uint16_t* before) {
  bool over = false;
  i64 c0 = 0;
#if defined(__AVX512F__)
  if constexpr (T == kF16) {  // 16 columns at a time in registers
    __mmask16 lanes = 0;
    __m512i input = hash_inputs_x16(key32, uint32_t(col0));
    const __m512i step = _mm512_set1_epi32(int32_t(16U * kGolden32));
    for (; c0 + 16 <= d; c0 += 16) {
      lanes |= fused_f16_x16(s, row, g, a, c0, stochastic, input, before);
      input = _mm512_add_epi32(input, step);
    }
    over = before != nullptr && lanes != 0;
  }
#endif
  for (; c0 + kBlock <= d; c0 += kBlock)  // whole blocks (their width a constant)
    over |= fused_block<T>(s, row, g, a, c0, kBlock, stochastic, key32, col0, before);
  if (c0 < d)
    over |= fused_block<T>(s, row, g, a, c0, d - c0, stochastic, key32, col0, before);
  return over;
}

// Steps 3-6 on an 8-bit row (d codes, its scale *scale) in one pass over the row: widened into
// x (d,) (code * scale), stepped a block at a time (step_columns: the 16-bit rows' arithmetic),
// then its new scale and codes (fp8.h), the random bits of column col0 + c.
template <int T>
inline void fused_row8(const RowStep& s, uint8_t* row, float* scale, const float* g, float* a,
                       i64 d, bool stochastic, uint32_t key32, i64 col0, float* x) {
  const float old = *scale;
  fp8_widen<T>(row, x, d, old);
  for (i64 c0 = 0; c0 < d; c0 += kBlock)
    step_columns(s, x + c0, g + c0, a ? a + c0 : nullptr, std::min(kBlock, d - c0));
  const float fresh = fp8_scale<T>(x, d);
  fp8_narrow<T>(x, fresh, row, d, stochastic, key32, col0);
  *scale = fresh;
}

template <int T>
i64 update_rows(int rule, void* w_, float* acc, float* wscale, i64 d, const i64* rows, i64 u_rows,
                const i64* uoff, const i64* order, const i64* bags, const float* scales,
                const float* const* slices, const i64* starts, const i64* strides,
                i64 nslices, const EcHyper* hyper, const Rounding& rounding,
                uint8_t* overflow, int nt) {
  constexpr bool eight = T == kE4M3 || T == kE5M2;
  constexpr i64 esize = T == kF32 ? 4 : (eight ? 1 : 2);
  const bool guarded = T != kF32 && !eight && overflow != nullptr;
  i64 overflows = 0;
  char* w = static_cast<char*>(w_);

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
    thread_local std::vector<float> gbuf, wbuf, acc_before;
    thread_local std::vector<uint16_t> row_before;
    gbuf.resize(static_cast<size_t>(d));
    if ((decayed && T == kF32) || eight) wbuf.resize(static_cast<size_t>(d));
    if (guarded) {
      row_before.resize(static_cast<size_t>(d));
      acc_before.resize(static_cast<size_t>(d));
    }
    i64 mine = 0;  // rows of this range left alone (overflow)
    float* g = gbuf.data();
    for (i64 u = lo; u < hi; ++u) {
      if (u + kPrefetch < hi) {
        const i64 ahead = rows[u + kPrefetch];
        prefetch_write(reinterpret_cast<const float*>(w + ahead * d * esize),
                       (d * esize + 3) / 4);
        if (eight) prefetch_write(wscale + ahead, 1);
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
      void* stored = w + rows[u] * d * esize;
      float* a_row = acc ? acc + rows[u] * acc_d : nullptr;
      if (guarded && a_row)  // the accumulators before, kept in case the row overflows
        copy_floats(acc_before.data(), a_row, acc_d);
      if constexpr (T != kF32) {
        // 3-6 for a 16-bit row in one pass (fused_row16): row-wise Adagrad's step size first,
        // from the whole gradient
        RowStep step{rule, lr, 1.f, true, wd, wmin, wmax, decayed, bounded};
        if (rule == kRowwiseAdagrad) {
          float sq = 0.f;
#pragma omp simd reduction(+ : sq)
          for (i64 c = 0; c < d; ++c) sq += g[c] * g[c];
          const float an = a_row[0] + sq / float(d);
          a_row[0] = an;
          // (a NaN accumulator steps too: NaN propagates, as in every path)
          step.stepped = !(an <= 0.f);
          if (step.stepped) step.root = std::sqrt(an);
        }
        uint32_t key32 = 0;
        if (rounding.stochastic) {
          const i64 r = rows[u];
          const i64 k = r < rounding.n_keys ? rounding.key_rows[r] : r;
          key32 = row_key32(rounding.segments.identity(k), rounding.step_key);
        }
        if constexpr (eight) {
          fused_row8<T>(step, static_cast<uint8_t*>(stored), wscale + rows[u], g,
                        rule == kAdagrad ? a_row : nullptr, d, rounding.stochastic, key32,
                        rounding.col0, wbuf.data());
          continue;
        }
        uint16_t* row = static_cast<uint16_t*>(stored);
        const bool over = fused_row16<T>(step, row, g, rule == kAdagrad ? a_row : nullptr, d,
                                         rounding.stochastic, key32, rounding.col0,
                                         guarded ? row_before.data() : nullptr);
        if (over) {  // the row left as it was, its accumulators restored
          std::memcpy(row, row_before.data(), sizeof(uint16_t) * size_t(d));
          if (a_row) copy_floats(a_row, acc_before.data(), acc_d);
          ++mine;
        }
        if (guarded) overflow[u] = uint8_t(over);
        continue;
      }
      float* wr = static_cast<float*>(stored);  // the row in float32
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
        if (!(an <= 0.f)) {  // (a NaN accumulator steps too: NaN propagates, as in every path)
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
    if (mine) __atomic_fetch_add(&overflows, mine, __ATOMIC_RELAXED);
  });
  return overflows;
}

}  // namespace

extern "C" {

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
// Rows of 16-bit type ``type`` (kF16, kBF16; kF32: float32) are widened, updated in float32 and
// rounded back (half.h) in one pass, a block of columns at a time (fused_row16): stochastically when ``stochastic``, the identity of row rows[u] from
// key_rows[rows[u]] (rows[u] itself from n_keys on; key_rows nullptr: n_keys 0) through the
// segments (seg_starts
// (nseg + 1,), seg_bases, seg_muls (nseg,)), columns col0 + c and ``step_key`` =
// splitmix64(step); else to nearest.
// ``overflow`` (U,) (16-bit rows; nullptr: none) guards the rows: a row whose rounded result holds
// an infinity or NaN where its float32 result is finite (the rounding overflowed the 16-bit type)
// is left as it was, its accumulators too, and flagged (overflow[u] = 1; every other row's 0).
// Returns how many rows were left so (0 without ``overflow``).
// Rows of 8-bit type kE4M3 / kE5M2 (fp8.h) have a float32 scale each, ``row_scales`` (N,):
// widened (code * scale), updated in float32, then a new scale and codes (to nearest or
// stochastically, as 16-bit rows), in one pass over the row; no guard (a scaled row does not
// overflow). nullptr row_scales with them: nothing is written, -1 returned.
i64 ec_sparse_update(int rule, int type, void* w, float* acc, float* row_scales, i64 d, const i64* rows,
                      i64 u_rows, const i64* uoff, const i64* order, const i64* bags,
                      const float* scales, const float* const* slices, const i64* starts,
                      const i64* strides, i64 nslices, const EcHyper* hyper, int stochastic,
                      const i64* key_rows, i64 n_keys, const i64* seg_starts,
                      const i64* seg_bases,
                      const i64* seg_muls, i64 nseg, i64 col0, i64 step_key,
                      uint8_t* overflow, int nt) {
  const Rounding rounding{stochastic != 0, key_rows, key_rows ? n_keys : 0,
                          Segments{seg_starts, seg_bases, seg_muls, nseg}, col0,
                          uint64_t(step_key)};
  if (type == kE4M3 || type == kE5M2) {
    if (row_scales == nullptr) return -1;  // (kernels/cpu/update.py checks it first)
    if (type == kE4M3)
      return update_rows<kE4M3>(rule, w, acc, row_scales, d, rows, u_rows, uoff, order, bags,
                                scales, slices, starts, strides, nslices, hyper, rounding,
                                nullptr, nt);
    return update_rows<kE5M2>(rule, w, acc, row_scales, d, rows, u_rows, uoff, order, bags,
                              scales, slices, starts, strides, nslices, hyper, rounding,
                              nullptr, nt);
  }
  if (type == kF16)
    return update_rows<kF16>(rule, w, acc, nullptr, d, rows, u_rows, uoff, order, bags, scales,
                             slices, starts, strides, nslices, hyper, rounding, overflow, nt);
  if (type == kBF16)
    return update_rows<kBF16>(rule, w, acc, nullptr, d, rows, u_rows, uoff, order, bags, scales,
                              slices, starts, strides, nslices, hyper, rounding, overflow, nt);
  return update_rows<kF32>(rule, w, acc, nullptr, d, rows, u_rows, uoff, order, bags, scales,
                           slices, starts, strides, nslices, hyper, rounding, overflow, nt);
}

}  // extern "C"
