// Memory bandwidth of this machine with a given number of threads, the yardstick for a
// memory-bound decode step (scripts/cpu_peer_bench.py compiles and runs it).
//
//   cc -O3 -march=native -fopenmp bench/copy_bandwidth.c -o copy_bandwidth
//   ./copy_bandwidth THREADS [MIB_PER_BUFFER]
//
// Three kernels over buffers far larger than any cache, each thread on its own contiguous
// slice (first touched by that thread): memcpy, a STREAM-style copy loop (b[i] = a[i]) and a
// read-only sum. Copies count the bytes read plus the bytes written, as STREAM does (the
// write-allocate read of the destination is not counted); the sum counts the bytes read.
// The best of the repetitions is reported, as STREAM does, so that a neighbour's burst on a
// shared machine lowers the figure as little as possible. Output: one line of JSON.
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

enum { kRepeats = 10 };

static double now_s(void) { return omp_get_wtime(); }

int main(int argc, char** argv) {
  if (argc < 2 || argc > 3) {
    fprintf(stderr, "usage: %s THREADS [MIB_PER_BUFFER (default 512)]\n", argv[0]);
    return 2;
  }
  char* end = NULL;
  const long threads = strtol(argv[1], &end, 10);
  if (*end != '\0' || threads < 1 || threads > 4096) {
    fprintf(stderr, "THREADS must be a whole number from 1 to 4096, not '%s'\n", argv[1]);
    return 2;
  }
  long mib = 512;
  if (argc == 3) {
    mib = strtol(argv[2], &end, 10);
    if (*end != '\0' || mib < 16 || mib > 65536) {
      fprintf(stderr, "MIB_PER_BUFFER must be a whole number from 16 to 65536, not '%s'\n",
              argv[2]);
      return 2;
    }
  }
  omp_set_dynamic(0);
  omp_set_num_threads((int)threads);
  const size_t n = (size_t)mib * 1024 * 1024 / sizeof(double);
  double* a = aligned_alloc(64, n * sizeof(double));
  double* b = aligned_alloc(64, n * sizeof(double));
  if (a == NULL || b == NULL) {
    fprintf(stderr, "cannot allocate two buffers of %ld MiB\n", mib);
    return 1;
  }
  // Each thread touches the slice it later copies, so pages sit where that thread runs.
#pragma omp parallel for schedule(static)
  for (size_t i = 0; i < n; ++i) {
    a[i] = (double)(i & 1023);
    b[i] = 0.0;
  }

  double best_memcpy = 1e30, best_copy = 1e30, best_read = 1e30;
  double checksum = 0.0;
  for (int rep = 0; rep < kRepeats; ++rep) {
    double t = now_s();
#pragma omp parallel
    {
      const size_t nt = (size_t)omp_get_num_threads(), id = (size_t)omp_get_thread_num();
      const size_t lo = n * id / nt, hi = n * (id + 1) / nt;
      memcpy(b + lo, a + lo, (hi - lo) * sizeof(double));
    }
    double dt = now_s() - t;
    if (dt < best_memcpy) best_memcpy = dt;

    t = now_s();
#pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; ++i) a[i] = b[i];
    dt = now_s() - t;
    if (dt < best_copy) best_copy = dt;

    double sum = 0.0;
    t = now_s();
#pragma omp parallel for simd schedule(static) reduction(+ : sum)
    for (size_t i = 0; i < n; ++i) sum += a[i];
    dt = now_s() - t;
    if (dt < best_read) best_read = dt;
    checksum += sum;  // keeps the read loop from being optimized away
  }
  const double bytes = (double)n * sizeof(double);
  printf(
      "{\"threads\": %ld, \"mib_per_buffer\": %ld, \"memcpy_gb_s\": %.2f, \"copy_gb_s\": %.2f, "
      "\"read_gb_s\": %.2f, \"checksum\": %.1f}\n",
      threads, mib, 2 * bytes / best_memcpy / 1e9, 2 * bytes / best_copy / 1e9,
      bytes / best_read / 1e9, checksum);
  free(a);
  free(b);
  return 0;
}
