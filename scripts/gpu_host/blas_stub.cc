// The GPU host has no OpenBLAS: the CPU path only serves as a reference there, so a plain
// loop stands in for the one BLAS call the CPU linear op makes.
#include <cblas.h>

extern "C" {

// Column-major C = alpha * A^T * B + beta * C, the only form ops/linear_cpu.cc uses.
void cblas_sgemm(const enum CBLAS_ORDER, const enum CBLAS_TRANSPOSE, const enum CBLAS_TRANSPOSE,
                 const blasint M, const blasint N, const blasint K, const float alpha,
                 const float* A, const blasint lda, const float* B, const blasint ldb,
                 const float beta, float* C, const blasint ldc) {
  for (blasint j = 0; j < N; ++j) {
    for (blasint i = 0; i < M; ++i) {
      float sum = 0;
      for (blasint k = 0; k < K; ++k) sum += A[k + i * lda] * B[k + j * ldb];
      C[i + j * ldc] = alpha * sum + (beta == 0 ? 0 : beta * C[i + j * ldc]);
    }
  }
}

int openblas_get_num_threads(void) { return 1; }
void openblas_set_num_threads(int) {}

}  // extern "C"
