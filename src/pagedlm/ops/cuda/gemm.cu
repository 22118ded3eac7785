// y = x . W^T (+ bias) through cuBLASLt. Row-major y[M, N] is column-major y^T[N, M], so the
// call is y^T = W . x^T with W read as a transposed column-major [K, N] matrix: no copies.
// The bias epilogue adds bias[N] along y^T's rows, i.e. per output feature.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>
#include <tuple>

#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {

struct GemmHandle {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int last_status = 0;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
  };
  // Keyed by (m, n, k, has_bias, y_f32): descriptors and the heuristic's algorithm are built
  // once.
  std::map<std::tuple<int, int, int, bool, bool>, Plan> plans;
};

namespace {

cudaError_t fail(GemmHandle* h, cublasStatus_t status) {
  h->last_status = static_cast<int>(status);
  return cudaErrorUnknown;
}

#define PAGEDLM_LT_TRY(h, expr)                              \
  do {                                                       \
    cublasStatus_t st_ = (expr);                             \
    if (st_ != CUBLAS_STATUS_SUCCESS) return fail((h), st_); \
  } while (0)

void destroy_plan(GemmHandle::Plan& p) {
  if (p.a) cublasLtMatrixLayoutDestroy(p.a);
  if (p.b) cublasLtMatrixLayoutDestroy(p.b);
  if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  if (p.op) cublasLtMatmulDescDestroy(p.op);
  p = GemmHandle::Plan{};
}

cudaError_t make_plan(GemmHandle* h, int m, int n, int k, bool has_bias, bool y_f32,
                      GemmHandle::Plan* out) {
  GemmHandle::Plan p;
  auto cleanup_fail = [&](cublasStatus_t st) {
    destroy_plan(p);
    return fail(h, st);
  };
  cublasStatus_t st = cublasLtMatmulDescCreate(&p.op, CUBLAS_COMPUTE_32F, CUDA_R_32F);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  const cublasOperation_t trans_a = CUBLAS_OP_T, trans_b = CUBLAS_OP_N;
  st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSA, &trans_a, sizeof(trans_a));
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_TRANSB, &trans_b, sizeof(trans_b));
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  if (has_bias) {
    const cublasLtEpilogue_t epi = CUBLASLT_EPILOGUE_BIAS;
    st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof(epi));
    if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
    const cudaDataType_t bias_type = CUDA_R_16BF;
    st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type,
                                        sizeof(bias_type));
    if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  }
  // A = W: column-major [K, N] (ld K), used transposed; B = x: column-major [K, M];
  // C = y: column-major [N, M], bf16 or f32.
  st = cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, k, n, k);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, k, m, k);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatrixLayoutCreate(&p.c, y_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, n);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);

  cublasLtMatmulPreference_t pref = nullptr;
  st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &h->workspace_bytes, sizeof(h->workspace_bytes));
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(h->lt, p.op, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  if (found == 0) return cleanup_fail(CUBLAS_STATUS_NOT_SUPPORTED);
  p.algo = result.algo;
  *out = p;
  return cudaSuccess;
}

}  // namespace

cudaError_t gemm_create(GemmHandle** handle, size_t workspace_bytes) {
  auto* h = new GemmHandle;
  cublasStatus_t st = cublasLtCreate(&h->lt);
  if (st != CUBLAS_STATUS_SUCCESS) {
    delete h;
    return cudaErrorUnknown;
  }
  if (workspace_bytes > 0) {
    const cudaError_t err = cudaMalloc(&h->workspace, workspace_bytes);
    if (err != cudaSuccess) {
      cublasLtDestroy(h->lt);
      delete h;
      return err;
    }
  }
  h->workspace_bytes = workspace_bytes;
  *handle = h;
  return cudaSuccess;
}

void gemm_destroy(GemmHandle* handle) {
  if (handle == nullptr) return;
  for (auto& [key, plan] : handle->plans) destroy_plan(plan);
  if (handle->workspace) cudaFree(handle->workspace);
  if (handle->lt) cublasLtDestroy(handle->lt);
  delete handle;
}

int gemm_last_status(const GemmHandle* handle) { return handle ? handle->last_status : 0; }

cudaError_t launch_gemm_bf16(GemmHandle* h, const void* x, const void* w, const void* bias, void* y,
                             bool y_f32, int m, int n, int k, cudaStream_t stream) {
  if (h == nullptr || m < 0 || n <= 0 || k <= 0) return cudaErrorInvalidValue;
  if (y_f32 && bias != nullptr) return cudaErrorNotSupported;
  if (m == 0) return cudaSuccess;
  const auto key = std::make_tuple(m, n, k, bias != nullptr, y_f32);
  auto it = h->plans.find(key);
  if (it == h->plans.end()) {
    GemmHandle::Plan plan;
    const cudaError_t err = make_plan(h, m, n, k, bias != nullptr, y_f32, &plan);
    if (err != cudaSuccess) return err;
    it = h->plans.emplace(key, plan).first;
  }
  GemmHandle::Plan& p = it->second;
  if (bias != nullptr) {
    PAGEDLM_LT_TRY(h, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  }
  const float alpha = 1.f, beta = 0.f;
  PAGEDLM_LT_TRY(h, cublasLtMatmul(h->lt, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, h->workspace, h->workspace_bytes, stream));
  return cudaSuccess;
}

}  // namespace pagedlm::cuda
