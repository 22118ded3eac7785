// The ops:: CUDA entry points (declared under PAGEDLM_HAS_CUDA in each ops/*.h) on top of the raw
// launchers of kernels.h. The launchers compute in bf16, so every entry point requires bf16;
// the f32 residual stream (embedding out, norm inputs, gathered rows) and the f32 logits are the
// exceptions.
// Ops run on the stream they are given; the model passes the engine's stream so that a decode
// step can be captured as a CUDA graph.

#include <cuda_runtime.h>

#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/linear_fp8.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/sampling.h"
#include "pagedlm/ops/silu_mul.h"
#include "pagedlm/ops/softcap.h"

namespace pagedlm::ops::cuda {

namespace {

namespace raw = ::pagedlm::cuda;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

void require_bf16(DType dtype, const char* op) {
  PAGEDLM_CHECK(dtype == DType::kBF16, op, ": the CUDA kernels compute in bf16, got ",
                dtype_name(dtype));
}

// The kernels' views of the FP8 forms (ops/linear_fp8.h); the Tensor entry points checked them.
raw::Fp8RowsOut rows_out(const Fp8RowsOut& out) {
  if (!out.on()) return {};
  return {out.values.raw(), out.scales.data<float>(), out.how.static_scale, out.how.max_abs_ub,
          kFp8MinScale};
}
raw::Fp8Unscaled unscaled_in(const Fp8Unscaled& in) {
  if (!in.on()) return {};
  return {in.x_scales.data<float>(), in.w_scales.data<float>()};
}

// The kernels' view of a cache of `cache_dtype` (bf16 or e4m3, ops::check_kv_cache_dtype).
raw::KvCacheFormat kv_cache_format(DType cache_dtype, const KvCacheScales& scales, const char* op) {
  if (cache_dtype != DType::kF8E4M3) {
    require_bf16(cache_dtype, op);
    return {};
  }
  return {true, scales.k, scales.v};
}

// cuBLASLt workspace: 32 MiB is what cuBLAS itself reserves per handle on Hopper.
constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

}  // namespace

}  // namespace pagedlm::ops::cuda

namespace pagedlm::ops {

// The GEMM plans are built on first use of a shape, so a warm-up run before graph capture
// leaves nothing to set up while capturing.
DeviceState::DeviceState() {
  ::pagedlm::cuda::check(cudaGetDevice(&device_), "cudaGetDevice");
  ::pagedlm::cuda::check(::pagedlm::cuda::gemm_create(&gemm_, cuda::kGemmWorkspaceBytes),
                         "cuBLASLt handle");
}

DeviceState::~DeviceState() { ::pagedlm::cuda::gemm_destroy(gemm_); }

void DeviceState::set_linear_tuning(bool on) { ::pagedlm::cuda::gemm_set_tuning(gemm_, on); }

void DeviceState::set_fp8_epilogue_scaling(bool on) {
  ::pagedlm::cuda::gemm_fp8_set_epilogue_scaling(gemm_, on);
}

bool DeviceState::fp8_scales_in_epilogue(int64_t rows, int64_t out_features, int64_t in_features,
                                         bool has_bias) const {
  return ::pagedlm::cuda::gemm_fp8_scales_in_epilogue(gemm_, static_cast<int>(rows),
                                                      static_cast<int>(out_features),
                                                      static_cast<int>(in_features), has_bias);
}

}  // namespace pagedlm::ops

namespace pagedlm::ops::cuda {

void embedding(const void* table, const int32_t* ids, float* out, int64_t n_tokens, int64_t vocab,
               int64_t dim, float scale, DType dtype, void* stream, int64_t vocab_begin) {
  require_bf16(dtype, "embedding");
  raw::check(raw::launch_embedding(table, ids, out, static_cast<int>(n_tokens),
                                   static_cast<int>(dim), scale, as_stream(stream),
                                   static_cast<int>(vocab_begin), static_cast<int>(vocab)),
             "embedding");
}

void gather_rows(const void* x, const int32_t* rows, void* out, int64_t n_rows, int64_t n_out,
                 int64_t dim, DType dtype, void* stream) {
  raw::check(
      raw::launch_gather_rows(x, rows, out, static_cast<int>(n_out),
                              dim * static_cast<int64_t>(dtype_size(dtype)), as_stream(stream)),
      "gather_rows");
}

void linear(const void* x, const void* weight, const void* bias, void* out, int64_t rows,
            int64_t out_features, int64_t in_features, DType dtype, DType out_dtype, void* stream,
            DeviceState& state) {
  require_bf16(dtype, "linear");
  if (out_dtype != DType::kF32) require_bf16(out_dtype, "linear out");
  raw::GemmHandle* h = state.gemm();
  const cudaError_t err = raw::launch_gemm_bf16(
      h, x, weight, bias, out, out_dtype == DType::kF32, static_cast<int>(rows),
      static_cast<int>(out_features), static_cast<int>(in_features), as_stream(stream));
  PAGEDLM_CHECK(err == cudaSuccess, "linear [", rows, ", ", in_features, "] x [", out_features,
                ", ", in_features, "]^T: ", cudaGetErrorString(err), " (cuBLAS status ",
                raw::gemm_last_status(h), ")");
}

void quantize_fp8_rows(const void* x, void* q, float* scales, int64_t rows, int64_t cols,
                       const Fp8InputScaling& how, void* stream) {
  raw::check(raw::launch_quantize_fp8_rows(x, q, scales, static_cast<int>(rows),
                                           static_cast<int>(cols), how.static_scale, how.max_abs_ub,
                                           kFp8MinScale, as_stream(stream)),
             "quantize_fp8_rows");
}

void linear_fp8(const void* xq, const float* x_scales, const void* wq, const float* w_scales,
                const void* bias, void* out, int64_t rows, int64_t out_features,
                int64_t in_features, void* stream, DeviceState& state, bool* unscaled) {
  raw::GemmHandle* h = state.gemm();
  const cudaError_t err = raw::launch_gemm_fp8(
      h, xq, x_scales, wq, w_scales, bias, out, static_cast<int>(rows),
      static_cast<int>(out_features), static_cast<int>(in_features), as_stream(stream), unscaled);
  PAGEDLM_CHECK(err == cudaSuccess, "linear (FP8 weight) [", rows, ", ", in_features, "] x [",
                out_features, ", ", in_features, "]^T: ", cudaGetErrorString(err),
                " (cuBLAS status ", raw::gemm_last_status(h), ")");
}

bool norm_fuses_fp8(int64_t dim) {
  return dim <= INT32_MAX && raw::norm_fuses_fp8(static_cast<int>(dim));
}

bool gated_mul_fuses_fp8(int64_t dim) {
  return dim <= INT32_MAX && raw::gated_mul_fuses_fp8(static_cast<int>(dim));
}

void device_capability(int* major, int* minor, const char** name) {
  const raw::DeviceLimits* limits = nullptr;
  raw::check(raw::current_device_limits(&limits), "the CUDA device");
  *major = limits->cc_major;
  *minor = limits->cc_minor;
  *name = limits->name;
}

void rms_norm(const void* x, DType x_dtype, const void* weight, void* out, int64_t rows,
              int64_t dim, float eps, float weight_offset, DType dtype, void* stream,
              const Fp8RowsOut& fp8_out) {
  require_bf16(dtype, "rms_norm");
  if (x_dtype == DType::kF32) {
    raw::check(raw::launch_rms_norm_f32(static_cast<const float*>(x), weight, out,
                                        static_cast<int>(rows), static_cast<int>(dim), eps,
                                        weight_offset, as_stream(stream), rows_out(fp8_out)),
               "rms_norm");
    return;
  }
  PAGEDLM_CHECK(!fp8_out.on(), "rms_norm: FP8 rows out need the f32 residual stream as x");
  require_bf16(x_dtype, "rms_norm x");
  raw::check(raw::launch_rms_norm(x, dim, weight, out, dim, static_cast<int>(rows), 1,
                                  static_cast<int>(dim), eps, weight_offset, as_stream(stream)),
             "rms_norm");
}

void add_rms_norm(float* residual, const void* x, const void* weight, void* out, int64_t rows,
                  int64_t dim, float eps, float weight_offset, DType dtype, void* stream,
                  const Fp8Unscaled& x_unscaled, const Fp8RowsOut& fp8_out) {
  require_bf16(dtype, "add_rms_norm");
  raw::check(raw::launch_add_rms_norm(residual, x, weight, out, static_cast<int>(rows),
                                      static_cast<int>(dim), eps, weight_offset, as_stream(stream),
                                      unscaled_in(x_unscaled), rows_out(fp8_out)),
             "add_rms_norm");
}

void head_rms_norm(void* x, int64_t rows, int64_t width, int64_t first_head, int64_t num_heads,
                   int64_t head_dim, const void* weight, float eps, float weight_offset,
                   DType dtype, void* stream) {
  require_bf16(dtype, "head_rms_norm");
  void* heads = static_cast<__nv_bfloat16*>(x) + first_head * head_dim;
  raw::check(raw::launch_rms_norm(heads, width, weight, heads, width, static_cast<int>(rows),
                                  static_cast<int>(num_heads), static_cast<int>(head_dim), eps,
                                  weight_offset, as_stream(stream)),
             "head_rms_norm");
}

void gated_mul(GatedActivation act, const void* gate_up, void* out, int64_t n_tokens, int64_t ffn,
               DType dtype, void* stream, const Fp8Unscaled& gate_up_unscaled,
               const Fp8RowsOut& fp8_out) {
  const char* op = gated_mul_name(act);
  require_bf16(dtype, op);
  const auto launch =
      act == GatedActivation::kSilu ? raw::launch_silu_mul : raw::launch_gelu_tanh_mul;
  raw::check(launch(gate_up, out, static_cast<int>(n_tokens), static_cast<int>(ffn),
                    as_stream(stream), unscaled_in(gate_up_unscaled), rows_out(fp8_out)),
             op);
}

void softcap(void* x, int64_t n, float cap, DType dtype, void* stream) {
  if (dtype != DType::kF32) require_bf16(dtype, "softcap");
  raw::check(raw::launch_softcap(x, dtype == DType::kF32, n, cap, as_stream(stream)), "softcap");
}

void sample_tokens(const float* logits, int64_t rows, int64_t vocab, const SamplerRows& params,
                   int32_t* out_tokens, void* stream) {
  raw::SampleAdjust adjust;
  adjust.bias_indptr = params.bias_indptr;
  adjust.bias_tokens = params.bias_tokens;
  adjust.bias_values = params.bias_values;
  adjust.bias_saved = params.bias_saved;
  adjust.penalty_slot = params.penalty_slot;
  adjust.repetition = params.repetition_penalty;
  adjust.presence = params.presence_penalty;
  adjust.frequency = params.frequency_penalty;
  adjust.counts = params.token_counts;
  adjust.prompt_seen = params.prompt_seen;
  raw::check(raw::launch_sample(logits, static_cast<int>(rows), static_cast<int>(vocab),
                                params.temperature, params.top_k, params.top_p, params.min_p,
                                params.seed, params.step, out_tokens, as_stream(stream),
                                params.mask, params.mask_slot, params.mask_words, adjust),
             "sampling");
}

void count_tokens(const TokenState& state, const int32_t* tokens, const int32_t* slots, int64_t n,
                  bool prompt, void* stream) {
  raw::check(raw::launch_count_tokens(state.counts, state.prompt_seen,
                                      static_cast<int>(state.vocab), state.num_slots, tokens, slots,
                                      static_cast<int>(n), prompt, as_stream(stream)),
             "count_tokens");
}

void sampled_logprobs(const float* logits, int64_t rows, int64_t vocab, const LogprobRows& params,
                      void* stream) {
  raw::check(
      raw::launch_sampled_logprobs(logits, static_cast<int>(rows), static_cast<int>(vocab),
                                   params.tokens, params.top_k, kMaxTopLogprobs, params.logprob,
                                   params.top_ids, params.top_logprobs, as_stream(stream)),
      "sampled_logprobs");
}

// The k part of qkv is rotated in place before it is written to the cache; q leaves the fused
// rows for q's own buffer, which attention reads.
void rope_write_kv(void* qkv, void* q, const float* inv_freq, const AttentionPlan& plan,
                   void* k_cache, void* v_cache, int64_t n_tokens, int64_t n_q_heads,
                   int64_t n_kv_heads, int64_t head_dim, DType dtype, DType cache_dtype,
                   const KvCacheScales& scales, void* stream) {
  require_bf16(dtype, "rope_write_kv");
  const raw::KvCacheFormat kv = kv_cache_format(cache_dtype, scales, "rope_write_kv");
  const int64_t q_width = n_q_heads * head_dim, kv_width = n_kv_heads * head_dim;
  const int64_t width = q_width + 2 * kv_width;
  auto* fused = static_cast<__nv_bfloat16*>(qkv);
  raw::check(raw::launch_rope_kv_write(
                 fused, width, q, q_width, fused + q_width, width, fused + q_width + kv_width,
                 width, plan.positions.data<int32_t>(), inv_freq, plan.slot_mapping.data<int32_t>(),
                 k_cache, v_cache, static_cast<int>(n_tokens), static_cast<int>(n_q_heads),
                 static_cast<int>(n_kv_heads), static_cast<int>(head_dim), as_stream(stream), kv),
             "rope + KV cache write");
}

// A decode step is one launch of the split-KV decode kernel (its launch shape is fixed per batch
// bucket, so the step can be a graph). Other steps: the prefill kernel, with the decode kernel
// for the step's leading decodes (in the prefill kernel each would fill a 64-row tile with its
// 1-8 rows: a prefill step of 29 prompts and 200 decodes took 1.09 ms against 0.75 ms for the
// prompts alone, docs/PERF.md).
void paged_attention(const void* q, const void* k_cache, const void* v_cache,
                     const AttentionPlan& plan, const AttentionVariant& variant, void* out,
                     const PagedAttentionDims& dims, DType dtype, DType cache_dtype,
                     const KvCacheScales& scales, void* stream) {
  require_bf16(dtype, "paged_attention");
  const raw::KvCacheFormat kv = kv_cache_format(cache_dtype, scales, "paged_attention");
  const int num_seqs = static_cast<int>(dims.num_seqs), n_tokens = static_cast<int>(dims.n_tokens);
  const int hq = static_cast<int>(dims.n_q_heads), hk = static_cast<int>(dims.n_kv_heads);
  const int d = static_cast<int>(dims.head_dim), page_size = static_cast<int>(dims.page_size);
  PAGEDLM_CHECK(plan.max_q_len >= 1 || n_tokens == 0, "paged_attention: the plan's max_q_len ",
                plan.max_q_len, " must be positive");
  const auto* q_indptr = plan.q_indptr.data<int32_t>();
  const auto* kv_indptr = plan.kv_indptr.data<int32_t>();
  const auto* pages = plan.kv_page_indices.data<int32_t>();
  const auto* last_len = plan.kv_last_page_len.data<int32_t>();
  const cudaStream_t s = as_stream(stream);
  if (plan.decode) {
    raw::SharedPrefixPass shared;
    const bool cascade = plan.kv_skip.raw() != nullptr;
    if (cascade) {
      shared.kv_skip = plan.kv_skip.data<int32_t>();
      shared.num_items = plan.shared_num_items.data<int32_t>();
      shared.items = plan.shared_items.data<int32_t>();
      shared.members = plan.shared_members.data<int32_t>();
      shared.max_items = plan.shared_max_items;
      shared.num_splits = plan.shared_splits;
    }
    raw::check(raw::launch_paged_attention_decode(
                   q, k_cache, v_cache, q_indptr, kv_indptr, pages, last_len, out, num_seqs,
                   n_tokens, plan.max_q_len, hq, hk, d, page_size, variant, plan.num_splits,
                   plan.workspace, plan.workspace_bytes, plan.seq_order.data<int32_t>(),
                   cascade ? &shared : nullptr, s, kv, static_cast<unsigned*>(plan.merge_counters)),
               "paged attention (decode)");
    return;
  }
  // The index arrays hold absolute rows and page offsets, so the prefill kernel's part of the
  // batch is the same arrays from sequence n on. One split: the workspace is sized for decode
  // steps, not for the rows of a prefill step.
  const int n = plan.num_leading_decodes;
  PAGEDLM_CHECK(n >= 0 && n <= num_seqs, "paged_attention: ", n, " leading decodes of ", num_seqs,
                " sequences");
  if (n > 0) {
    raw::check(raw::launch_paged_attention_decode(q, k_cache, v_cache, q_indptr, kv_indptr, pages,
                                                  last_len, out, n, n_tokens, 1, hq, hk, d,
                                                  page_size, variant, /*num_splits=*/1, nullptr, 0,
                                                  nullptr, nullptr, s, kv),
               "paged attention (a prefill step's decodes)");
  }
  if (n < num_seqs) {
    raw::check(raw::launch_paged_attention_prefill(
                   q, k_cache, v_cache, q_indptr + n, kv_indptr + n, pages, last_len + n, out,
                   num_seqs - n, n_tokens, plan.max_q_len, hq, hk, d, page_size, variant, s, kv),
               "paged attention (prefill)");
  }
}

namespace {

const raw::DeviceLimits& limits_of(int device) {
  const raw::DeviceLimits* limits = nullptr;
  const cudaError_t err = raw::device_limits(device, &limits);
  if (err == cudaErrorInvalidValue && *raw::smem_cap_error() != '\0') fail(raw::smem_cap_error());
  raw::check(err, "the CUDA device's properties");
  return *limits;
}

}  // namespace

void require_supported_device(int device) {
  const raw::DeviceLimits& d = limits_of(device);
  PAGEDLM_CHECK(d.cc_major * 10 + d.cc_minor >= raw::kMinComputeCapability, "GPU ", device, " (",
                d.name, ") has compute capability ", d.cc_major, ".", d.cc_minor,
                "; pagedlm's CUDA kernels need 8.0 or later (Ampere on). Run on the CPU with "
                "--device cpu");
}

int paged_attention_decode_num_splits(int num_seqs, int num_kv_heads, int head_dim, int max_kv_len,
                                      int device) {
  return raw::paged_attention_decode_num_splits(num_seqs, num_kv_heads, head_dim, max_kv_len,
                                                limits_of(device));
}

size_t paged_attention_workspace_bytes(int max_num_tokens, int num_q_heads, int head_dim,
                                       int max_num_splits) {
  return raw::paged_attention_workspace_bytes(max_num_tokens, num_q_heads, head_dim,
                                              max_num_splits);
}

int shared_prefix_members_per_item(int num_q_heads, int num_kv_heads) {
  return raw::shared_prefix_members_per_item(num_q_heads, num_kv_heads);
}

int shared_prefix_num_splits(int num_items, int num_kv_heads, int device) {
  return raw::shared_prefix_num_splits(num_items, num_kv_heads, limits_of(device));
}

}  // namespace pagedlm::ops::cuda
