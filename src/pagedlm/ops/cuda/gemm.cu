// y = x . W^T (+ bias) through cuBLASLt. Row-major y[M, N] is column-major y^T[N, M], so the
// call is y^T = W . x^T with W read as a transposed column-major [K, N] matrix: no copies.
// The bias epilogue adds bias[N] along y^T's rows, i.e. per output feature.

#include <cublasLt.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {

struct GemmHandle {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int last_status = 0;
  // New plans time this many of the heuristic's candidates and keep the fastest (1: take its
  // first choice untimed).
  int tune_candidates = 1;
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    // The heuristic's other choices, in its order, while the plan is still to be timed.
    std::vector<cublasLtMatmulAlgo_t> candidates;
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
  constexpr int kMaxCandidates = 16;
  cublasLtMatmulHeuristicResult_t results[kMaxCandidates] = {};
  const int wanted = std::clamp(h->tune_candidates, 1, kMaxCandidates);
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(h->lt, p.op, p.a, p.b, p.c, p.c, pref, wanted, results,
                                        &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  if (found == 0) return cleanup_fail(CUBLAS_STATUS_NOT_SUPPORTED);
  p.algo = results[0].algo;
  for (int i = 1; i < found; ++i) p.candidates.push_back(results[i].algo);
  *out = p;
  return cudaSuccess;
}

// Times the heuristic's first choice and each candidate on the call's own operands (y is
// overwritten with the same product each time) and keeps the fastest. Skipped while the stream
// is being captured; the plan then keeps the first choice.
cudaError_t tune_plan(GemmHandle* h, GemmHandle::Plan* plan, const void* x, const void* w, void* y,
                      cudaStream_t stream) {
  std::vector<cublasLtMatmulAlgo_t> algos = {plan->algo};
  algos.insert(algos.end(), plan->candidates.begin(), plan->candidates.end());
  plan->candidates.clear();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capturing);
  if (err != cudaSuccess || capturing != cudaStreamCaptureStatusNone || algos.size() < 2) {
    return err;
  }
  cudaEvent_t begin = nullptr, end = nullptr;
  err = cudaEventCreate(&begin);
  if (err == cudaSuccess) err = cudaEventCreate(&end);
  const float alpha = 1.f, beta = 0.f;
  float best_ms = -1.f;
  for (const cublasLtMatmulAlgo_t& algo : algos) {
    if (err != cudaSuccess) break;
    auto run = [&] {
      return cublasLtMatmul(h->lt, plan->op, &alpha, w, plan->a, x, plan->b, &beta, y, plan->c, y,
                            plan->c, &algo, h->workspace, h->workspace_bytes, stream);
    };
    // One untimed run (first-use costs), then a few timed: the shapes worth tuning take
    // microseconds to milliseconds each, so this costs little at start-up.
    if (run() != CUBLAS_STATUS_SUCCESS) continue;
    constexpr int kRuns = 5;
    err = cudaEventRecord(begin, stream);
    bool ok = true;
    for (int r = 0; r < kRuns && ok; ++r) ok = run() == CUBLAS_STATUS_SUCCESS;
    if (err == cudaSuccess) err = cudaEventRecord(end, stream);
    if (err == cudaSuccess) err = cudaEventSynchronize(end);
    float ms = 0.f;
    if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, begin, end);
    if (ok && err == cudaSuccess && (best_ms < 0.f || ms < best_ms)) {
      best_ms = ms;
      plan->algo = algo;
    }
  }
  if (begin) cudaEventDestroy(begin);
  if (end) cudaEventDestroy(end);
  return err;
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

void gemm_set_tuning(GemmHandle* handle, int candidates) {
  if (handle != nullptr) handle->tune_candidates = std::max(1, candidates);
}

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
  if (!p.candidates.empty()) {
    const cudaError_t err = tune_plan(h, &p, x, w, y, stream);
    if (err != cudaSuccess) return err;
  }
  const float alpha = 1.f, beta = 0.f;
  PAGEDLM_LT_TRY(h, cublasLtMatmul(h->lt, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, h->workspace, h->workspace_bytes, stream));
  return cudaSuccess;
}

}  // namespace pagedlm::cuda
