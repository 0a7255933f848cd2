// Single-thread memory floors of one W2 step's row accesses (run by benchmarks/studies/floor.py).
//
// Reads the step's ids (int64, bag order, tables stacked) and their distinct rows (sorted) from
// two files, then times, on one thread, with rows 16 ahead prefetched as embcore's kernels do:
//   bag order:  read every id's row in bag order and sum it (what any lookup must read);
//   sorted:     read each distinct row once, in row order;
//   rmw:        read and write each distinct row once, in row order (what an update must touch,
//               without forming its gradient).
// The table is on transparent huge pages (as embcore's), the caches flushed before each timing.
// Usage: floor IDS_FILE UNIQUE_FILE ROWS DIM
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static int64_t* load(const char* path, long* n) {
  FILE* f = fopen(path, "rb");
  if (!f) { perror(path); exit(1); }
  fseek(f, 0, SEEK_END);
  *n = ftell(f) / 8;
  fseek(f, 0, SEEK_SET);
  int64_t* v = malloc(*n * 8);
  if (fread(v, 8, *n, f) != (size_t)*n) { perror(path); exit(1); }
  fclose(f);
  return v;
}

#define AHEAD 16

// Sums rows[0..n) of t (D floats each) into acc, the rows AHEAD further on prefetched.
static void read_rows(const float* restrict t, long d, const int64_t* restrict rows, long n,
                      float* restrict acc) {
  for (long k = 0; k < n; ++k) {
    if (k + AHEAD < n)
      for (long o = 0; o < d; o += 16) __builtin_prefetch(t + rows[k + AHEAD] * d + o, 0, 1);
    const float* restrict r = t + rows[k] * d;
    for (long c = 0; c < d; ++c) acc[c] += r[c];
  }
}

int main(int argc, char** argv) {
  if (argc != 5) { fprintf(stderr, "usage: floor IDS UNIQUE ROWS DIM\n"); return 2; }
  long n, u;
  int64_t* ids = load(argv[1], &n);
  int64_t* uq = load(argv[2], &u);
  const long rows = atol(argv[3]), d = atol(argv[4]);
  const size_t bytes = (size_t)rows * d * 4;
  float* t = aligned_alloc(1 << 21, (bytes + (1 << 21) - 1) & ~(size_t)((1 << 21) - 1));
  madvise(t, bytes, MADV_HUGEPAGE);
  for (size_t i = 0; i < (size_t)rows * d; ++i) t[i] = 1e-3f * (float)(i % 97);
  const size_t flush_bytes = 64u << 20;
  char* flush = malloc(flush_bytes);
  if (d > 1024 || d % 16) { fprintf(stderr, "DIM must be a multiple of 16, at most 1024\n"); return 2; }
  float acc[1024] = {0};
  double best[3] = {1e9, 1e9, 1e9};
  for (int rep = 0; rep < 7; ++rep) {
    double s[3];
    memset(flush, rep, flush_bytes);
    double t0 = now();
    read_rows(t, d, ids, n, acc);
    s[0] = now() - t0;
    memset(flush, rep + 1, flush_bytes);
    t0 = now();
    read_rows(t, d, uq, u, acc);
    s[1] = now() - t0;
    memset(flush, rep + 2, flush_bytes);
    t0 = now();
    for (long k = 0; k < u; ++k) {
      if (k + AHEAD < u)
        for (long o = 0; o < d; o += 16) __builtin_prefetch(t + uq[k + AHEAD] * d + o, 1, 1);
      float* restrict r = t + uq[k] * d;
      for (long c = 0; c < d; ++c) r[c] -= 1e-6f * r[c];
    }
    s[2] = now() - t0;
    for (int i = 0; i < 3; ++i) best[i] = s[i] < best[i] ? s[i] : best[i];
  }
  printf("{\"ids\": %ld, \"distinct\": %ld, \"bag_order_ms\": %.3f, \"sorted_read_ms\": %.3f, "
         "\"sorted_rmw_ms\": %.3f, \"checksum\": %g}\n",
         n, u, best[0] * 1e3, best[1] * 1e3, best[2] * 1e3, (double)acc[1]);
  return 0;
}
