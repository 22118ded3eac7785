// The float32 multiply-add rate one core sustains, the yardstick for a compute-bound CPU step in
// float32 (the exact mode's prefill panels, ops/linear_cpu.cc), as bench/copy_bandwidth.c is
// for a memory-bound one.
//
//   cc -O2 -march=native -fopenmp bench/fma_peak.c -o fma_peak
//   ./fma_peak THREADS
//
// Each thread runs twelve independent chains of vector FMAs (more than an FMA's latency times
// the pipes that issue it, on the x86-64 cores measured so far), kept in registers by an empty
// asm statement, for about half a second; the best of five repetitions is reported in GMAC/s
// (one multiply-add of two float32 = one MAC). The vectors are AVX-512's 16 floats when the
// build has it, else AVX2's 8 (FMA3). Output: one line of JSON.
#include <immintrin.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

enum { kRepeats = 5, kChains = 12 };
static const long kSteps = 50000000;

#if defined(__AVX512F__)
typedef __m512 Vec;
#define LANES 16
#define SET1(x) _mm512_set1_ps(x)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ADD(a, b) _mm512_add_ps(a, b)
static float first_lane(Vec v) { return _mm512_cvtss_f32(v); }
#elif defined(__AVX2__) && defined(__FMA__)
typedef __m256 Vec;
#define LANES 8
#define SET1(x) _mm256_set1_ps(x)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ADD(a, b) _mm256_add_ps(a, b)
static float first_lane(Vec v) { return _mm256_cvtss_f32(v); }
#else
#error "fma_peak needs AVX2 with FMA3, or AVX-512"
#endif

// kSteps steps of kChains FMAs; returns a value that depends on every chain.
static float run_chains(void) {
  const Vec b = SET1(0.9999999f), c = SET1(1e-7f);
  Vec a0 = SET1(1.f), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;
  Vec a6 = a0, a7 = a0, a8 = a0, a9 = a0, a10 = a0, a11 = a0;
  for (long i = 0; i < kSteps; ++i) {
    a0 = FMA(a0, b, c);
    a1 = FMA(a1, b, c);
    a2 = FMA(a2, b, c);
    a3 = FMA(a3, b, c);
    a4 = FMA(a4, b, c);
    a5 = FMA(a5, b, c);
    a6 = FMA(a6, b, c);
    a7 = FMA(a7, b, c);
    a8 = FMA(a8, b, c);
    a9 = FMA(a9, b, c);
    a10 = FMA(a10, b, c);
    a11 = FMA(a11, b, c);
    // The chains stay in registers and no step is folded away.
    __asm__ volatile(""
                     : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6),
                       "+x"(a7), "+x"(a8), "+x"(a9), "+x"(a10), "+x"(a11));
  }
  const Vec s = ADD(ADD(ADD(ADD(a0, a1), ADD(a2, a3)), ADD(ADD(a4, a5), ADD(a6, a7))),
                    ADD(ADD(a8, a9), ADD(a10, a11)));
  return first_lane(s);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s THREADS\n", argv[0]);
    return 2;
  }
  char* end = NULL;
  const long threads = strtol(argv[1], &end, 10);
  if (*end != '\0' || threads < 1 || threads > 4096) {
    fprintf(stderr, "THREADS must be a whole number from 1 to 4096, not '%s'\n", argv[1]);
    return 2;
  }
  omp_set_dynamic(0);
  omp_set_num_threads((int)threads);
  double best = 1e30, checksum = 0.0;
  for (int rep = 0; rep < kRepeats; ++rep) {
    const double t = omp_get_wtime();
    double sum = 0.0;
#pragma omp parallel reduction(+ : sum)
    sum += run_chains();
    const double dt = omp_get_wtime() - t;
    if (dt < best) best = dt;
    checksum += sum;
  }
  const double macs = (double)threads * kSteps * kChains * LANES;
  printf("{\"threads\": %ld, \"lanes\": %d, \"gmac_s\": %.1f, \"checksum\": %.3f}\n", threads,
         LANES, macs / best / 1e9, checksum);
  return 0;
}
