// y = x . W^T (+ bias) through cuBLASLt. Row-major y[M, N] is column-major y^T[N, M], so the
// call is y^T = W . x^T with W read as a transposed column-major [K, N] matrix: no copies.
// The bias epilogue adds bias[N] along y^T's rows, i.e. per output feature.
//
// Tuning (start-up only, gemm_set_tuning): a new prefill-sized shape's plan times cuBLASLt's
// first eight candidates and keeps the fastest. Candidates run on the call's weights and a
// scratch x of pseudo-random values: zeros, or the padding rows a warm-up step holds, draw less
// power than real activations and rank the algorithms differently (a first version timed them
// on the warm-up's own operands and picked slower ones). Rounds alternate the candidates so
// that clock changes under load fall on all of them alike. Decode-sized shapes (fewer than
// kTuneMinRows rows) keep the first choice: repeated for timing, their weights stay in the L2
// (a Llama-3.1-8B q/k/v matrix is 50 MB), which a model's step never sees, and tuning them made
// the Llama decode steps slower (docs/PERF.md).
//
// FP8 (launch_gemm_fp8): the same call with e4m3 operands, which cuBLASLt runs on Hopper only in
// this "TN" form (A transposed, B not), which is ours. The per-feature weight scales are A's
// scale vector (op(A)'s rows: y^T's rows, the output features) and the per-token input scales
// B's (op(B)'s columns: the tokens), both in CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F mode,
// so the sums are scaled in cuBLASLt's epilogue, before the bias. Where the library has no
// kernel for that mode (its heuristic finds none), the plan multiplies unscaled into the bf16 y
// and launch_fp8_scale_epilogue scales it in place: one more rounding to bf16 and one more pass
// over y. FP8 plans are not tuned (the timing harness feeds bf16 inputs).

#include <cublasLt.h>
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <map>
#include <tuple>
#include <vector>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {

struct GemmHandle {
  cublasLtHandle_t lt = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  int last_status = 0;
  bool tuning = false;        // new plans time the heuristic's candidates (gemm_set_tuning)
  bool fp8_epilogue = false;  // new FP8 plans scale in the epilogue kernel (tests)
  struct Plan {
    cublasLtMatmulDesc_t op = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    // The heuristic's choices after the first, in its order, until the plan has been timed.
    std::vector<cublasLtMatmulAlgo_t> candidates;
    // FP8: cuBLASLt leaves the scales (and the bias) to launch_fp8_scale_epilogue.
    bool scale_in_epilogue = false;
  };
  // Keyed by (m, n, k, has_bias, y_f32, fp8): descriptors and the heuristic's algorithm are
  // built once.
  std::map<std::tuple<int, int, int, bool, bool, bool>, Plan> plans;
};

namespace {

constexpr int kTuneCandidates = 8;
constexpr int kTuneRounds = 3;
constexpr int kTuneMinRows = 4096;
// A candidate replaces the heuristic's first choice only when this much faster (timing noise).
constexpr float kTuneMargin = 0.01f;

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

// The operands' types and how an FP8 plan is scaled.
struct PlanFormat {
  bool fp8 = false;
  bool outer_vec_scales = false;  // FP8: cuBLASLt scales by A's and B's vectors
};

cudaError_t make_plan(GemmHandle* h, int m, int n, int k, bool has_bias, bool y_f32,
                      PlanFormat format, GemmHandle::Plan* out) {
  GemmHandle::Plan p;
  const bool tuned = h->tuning && m >= kTuneMinRows && !format.fp8;
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
  if (format.outer_vec_scales) {
    const cublasLtMatmulMatrixScale_t mode = CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F;
    st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_MODE, &mode,
                                        sizeof(mode));
    if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
    st = cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_MODE, &mode,
                                        sizeof(mode));
    if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  }
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
  const cudaDataType_t in_type = format.fp8 ? CUDA_R_8F_E4M3 : CUDA_R_16BF;
  st = cublasLtMatrixLayoutCreate(&p.a, in_type, k, n, k);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatrixLayoutCreate(&p.b, in_type, k, m, k);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatrixLayoutCreate(&p.c, y_f32 ? CUDA_R_32F : CUDA_R_16BF, n, m, n);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);

  cublasLtMatmulPreference_t pref = nullptr;
  st = cublasLtMatmulPreferenceCreate(&pref);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  st = cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                            &h->workspace_bytes, sizeof(h->workspace_bytes));
  cublasLtMatmulHeuristicResult_t results[kTuneCandidates] = {};
  int found = 0;
  if (st == CUBLAS_STATUS_SUCCESS) {
    st = cublasLtMatmulAlgoGetHeuristic(h->lt, p.op, p.a, p.b, p.c, p.c, pref,
                                        tuned ? kTuneCandidates : 1, results, &found);
  }
  cublasLtMatmulPreferenceDestroy(pref);
  if (st != CUBLAS_STATUS_SUCCESS) return cleanup_fail(st);
  if (found == 0) return cleanup_fail(CUBLAS_STATUS_NOT_SUPPORTED);
  p.algo = results[0].algo;
  for (int i = 1; i < found; ++i) p.candidates.push_back(results[i].algo);
  *out = p;
  return cudaSuccess;
}

// Pseudo-random bf16 values in [-1, 1): a tuning run's x.
__global__ void fill_tuning_input(__nv_bfloat16* x, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint64_t bits = detail::splitmix64(i) >> 40;  // 24 random bits
    x[i] = __float2bfloat16(static_cast<float>(bits) * (2.f / 16777216.f) - 1.f);
  }
}

// Mean milliseconds of `runs` calls of `algo` (negative when it fails).
float time_algo(GemmHandle* h, const GemmHandle::Plan& plan, const cublasLtMatmulAlgo_t& algo,
                const void* x, const void* w, void* y, int runs, cudaEvent_t begin, cudaEvent_t end,
                cudaStream_t stream) {
  const float alpha = 1.f, beta = 0.f;
  if (cudaEventRecord(begin, stream) != cudaSuccess) return -1.f;
  for (int r = 0; r < runs; ++r) {
    if (cublasLtMatmul(h->lt, plan.op, &alpha, w, plan.a, x, plan.b, &beta, y, plan.c, y, plan.c,
                       &algo, h->workspace, h->workspace_bytes, stream) != CUBLAS_STATUS_SUCCESS) {
      return -1.f;
    }
  }
  float ms = 0.f;
  if (cudaEventRecord(end, stream) != cudaSuccess || cudaEventSynchronize(end) != cudaSuccess ||
      cudaEventElapsedTime(&ms, begin, end) != cudaSuccess) {
    return -1.f;
  }
  return ms / static_cast<float>(runs);
}

// Times the plan's first choice and candidates (see the top of the file) and keeps the fastest,
// where it beats the first choice by more than kTuneMargin. y is overwritten (the call writes
// it next). Without the scratch memory, or while the stream is being captured, the first choice
// stays.
cudaError_t tune_plan(GemmHandle* h, GemmHandle::Plan* plan, const void* w, void* y, int m, int k,
                      cudaStream_t stream) {
  std::vector<cublasLtMatmulAlgo_t> algos = {plan->algo};
  algos.insert(algos.end(), plan->candidates.begin(), plan->candidates.end());
  plan->candidates.clear();
  cudaStreamCaptureStatus capturing = cudaStreamCaptureStatusNone;
  PAGEDLM_CUDA_TRY(cudaStreamIsCapturing(stream, &capturing));
  if (capturing != cudaStreamCaptureStatusNone) return cudaSuccess;
  const size_t n = static_cast<size_t>(m) * k;
  void* x = nullptr;
  if (cudaMalloc(&x, n * sizeof(__nv_bfloat16)) != cudaSuccess) {
    cudaGetLastError();  // not an error of the GEMM: it runs untuned
    return cudaSuccess;
  }
  fill_tuning_input<<<1024, 256, 0, stream>>>(static_cast<__nv_bfloat16*>(x), n);
  cudaEvent_t begin = nullptr, end = nullptr;
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) err = cudaEventCreate(&begin);
  if (err == cudaSuccess) err = cudaEventCreate(&end);
  if (err == cudaSuccess) {
    // One call each first (it takes the first-use costs; a candidate that fails is dropped;
    // the first choice's time sets the calls per round: ~3 ms, so short GEMMs are not timed at
    // the event's resolution), then the rounds, whose best time counts.
    std::vector<float> best(algos.size(), -1.f);
    for (size_t i = 0; i < algos.size(); ++i) {
      best[i] = time_algo(h, *plan, algos[i], x, w, y, 1, begin, end, stream);
    }
    cudaGetLastError();
    if (best[0] > 0.f) {
      const int runs = std::clamp(static_cast<int>(3.f / best[0]), 2, 200);
      for (int round = 0; round < kTuneRounds; ++round) {
        for (size_t i = 0; i < algos.size(); ++i) {
          if (best[i] < 0.f) continue;
          const float ms = time_algo(h, *plan, algos[i], x, w, y, runs, begin, end, stream);
          best[i] = ms < 0.f ? -1.f : (round == 0 ? ms : std::min(best[i], ms));
        }
      }
      cudaGetLastError();
      size_t pick = 0;
      for (size_t i = 1; i < algos.size(); ++i) {
        if (best[i] > 0.f && best[i] < best[pick]) pick = i;
      }
      if (best[0] > 0.f && best[pick] < (1.f - kTuneMargin) * best[0]) plan->algo = algos[pick];
    }
  }
  if (begin) cudaEventDestroy(begin);
  if (end) cudaEventDestroy(end);
  const cudaError_t free_err = cudaFree(x);
  return err != cudaSuccess ? err : free_err;
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

void gemm_set_tuning(GemmHandle* handle, bool on) {
  if (handle != nullptr) handle->tuning = on;
}

cudaError_t launch_gemm_bf16(GemmHandle* h, const void* x, const void* w, const void* bias, void* y,
                             bool y_f32, int m, int n, int k, cudaStream_t stream) {
  if (h == nullptr || m < 0 || n <= 0 || k <= 0) return cudaErrorInvalidValue;
  if (y_f32 && bias != nullptr) return cudaErrorNotSupported;
  if (m == 0) return cudaSuccess;
  const auto key = std::make_tuple(m, n, k, bias != nullptr, y_f32, false);
  auto it = h->plans.find(key);
  if (it == h->plans.end()) {
    GemmHandle::Plan plan;
    const cudaError_t err = make_plan(h, m, n, k, bias != nullptr, y_f32, PlanFormat{}, &plan);
    if (err != cudaSuccess) return err;
    it = h->plans.emplace(key, plan).first;
  }
  GemmHandle::Plan& p = it->second;
  if (bias != nullptr) {
    PAGEDLM_LT_TRY(h, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias,
                                                     sizeof(bias)));
  }
  if (!p.candidates.empty()) PAGEDLM_CUDA_TRY(tune_plan(h, &p, w, y, m, k, stream));
  const float alpha = 1.f, beta = 0.f;
  PAGEDLM_LT_TRY(h, cublasLtMatmul(h->lt, p.op, &alpha, w, p.a, x, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, h->workspace, h->workspace_bytes, stream));
  return cudaSuccess;
}

void gemm_fp8_set_epilogue_scaling(GemmHandle* handle, bool on) {
  if (handle != nullptr) handle->fp8_epilogue = on;
}

bool gemm_fp8_scales_in_epilogue(const GemmHandle* handle, int m, int n, int k, bool has_bias) {
  if (handle == nullptr) return false;
  const auto it = handle->plans.find(std::make_tuple(m, n, k, has_bias, false, true));
  return it != handle->plans.end() && it->second.scale_in_epilogue;
}

cudaError_t launch_gemm_fp8(GemmHandle* h, const void* xq, const float* x_scales, const void* wq,
                            const float* w_scales, const void* bias, void* y, int m, int n, int k,
                            cudaStream_t stream, bool* unscaled) {
  if (unscaled != nullptr) *unscaled = false;
  if (h == nullptr || m < 0 || n <= 0 || k <= 0 || x_scales == nullptr || w_scales == nullptr) {
    return cudaErrorInvalidValue;
  }
  if (k % 16 != 0 || n % 16 != 0) return cudaErrorInvalidValue;
  if (m == 0) return cudaSuccess;
  const auto key = std::make_tuple(m, n, k, bias != nullptr, false, true);
  auto it = h->plans.find(key);
  // No kernel for the scale vectors: unscaled sums, scaled (and biased) by our kernel.
  auto epilogue_plan = [&](GemmHandle::Plan* plan) {
    const cudaError_t err = make_plan(h, m, n, k, false, false, PlanFormat{true, false}, plan);
    if (err == cudaSuccess) {
      h->last_status = 0;
      plan->scale_in_epilogue = true;
    }
    return err;
  };
  if (it == h->plans.end()) {
    GemmHandle::Plan plan;
    cudaError_t err = cudaErrorNotSupported;
    if (!h->fp8_epilogue) {
      err = make_plan(h, m, n, k, bias != nullptr, false, PlanFormat{true, true}, &plan);
    }
    if (err != cudaSuccess) PAGEDLM_CUDA_TRY(epilogue_plan(&plan));
    it = h->plans.emplace(key, plan).first;
  }
  GemmHandle::Plan& p = it->second;
  const float alpha = 1.f, beta = 0.f;
  if (!p.scale_in_epilogue) {
    PAGEDLM_LT_TRY(h, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER,
                                                     &w_scales, sizeof(w_scales)));
    PAGEDLM_LT_TRY(h, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER,
                                                     &x_scales, sizeof(x_scales)));
    if (bias != nullptr) {
      PAGEDLM_LT_TRY(h, cublasLtMatmulDescSetAttribute(p.op, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                       &bias, sizeof(bias)));
    }
    const cublasStatus_t st =
        cublasLtMatmul(h->lt, p.op, &alpha, wq, p.a, xq, p.b, &beta, y, p.c, y, p.c, &p.algo,
                       h->workspace, h->workspace_bytes, stream);
    if (st == CUBLAS_STATUS_SUCCESS) return cudaSuccess;
    // The heuristic offered an algorithm the call then refused for the scale vectors (it
    // checks some of them only here): this shape scales in the epilogue from now on.
    if (st != CUBLAS_STATUS_NOT_SUPPORTED) return fail(h, st);
    GemmHandle::Plan fallback;
    PAGEDLM_CUDA_TRY(epilogue_plan(&fallback));
    destroy_plan(p);
    p = fallback;
  }
  PAGEDLM_LT_TRY(h, cublasLtMatmul(h->lt, p.op, &alpha, wq, p.a, xq, p.b, &beta, y, p.c, y, p.c,
                                   &p.algo, h->workspace, h->workspace_bytes, stream));
  if (unscaled != nullptr && bias == nullptr) {
    *unscaled = true;
    return cudaSuccess;
  }
  return launch_fp8_scale_epilogue(y, x_scales, w_scales, bias, m, n, stream);
}

}  // namespace pagedlm::cuda
