// Mixture-of-experts MLP: the router (softmax, top k, renormalize) and the experts (each token's
// k gated MLPs and their weighted sum). The GPU groups the stream's (token, slot) pairs by
// expert with a permutation computed on the device, runs one grouped GEMM per projection over
// all experts, and sums back into token order; nothing syncs with the host, so a decode step
// stays capturable as a CUDA graph although the experts' loads change every step.
#pragma once

#include <cstdint>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/silu_mul.h"

namespace pagedlm::ops {

// logits: [T, E] f32 (the router's projection) -> expert_ids: [T, k] i32, expert_weights:
// [T, k] f32. Per row: p = softmax(logits), its k largest (descending; ties to the lower
// expert), divided by their sum when `normalize` (HF's norm_topk_prob; Mixtral always).
// E <= kMaxExperts, k <= kMaxExpertsPerToken.
inline constexpr int64_t kMaxExperts = 512;
inline constexpr int64_t kMaxExpertsPerToken = 16;
void moe_route(const Tensor& logits, bool normalize, const Tensor& expert_ids,
               const Tensor& expert_weights, void* stream = nullptr);

// One layer's experts. Dense: gate_up [E, 2F, D] (each expert's gate and up rows, placed as
// moe_gate_up_row says) and down [E, D, F] in the compute dtype. On the CPU, a GGUF's Q4_1 /
// Q8_0 experts stay in their blocks instead: gate_up_blocks[e] is [2F, D], gate rows then up
// rows, down_blocks[e] [D, F].
struct ExpertWeights {
  int64_t num_experts = 0, hidden = 0, ffn = 0;  // E, D, F
  Tensor gate_up, down;
  std::vector<QuantizedMatrix> gate_up_blocks, down_blocks;

  bool quantized() const { return !gate_up_blocks.empty(); }
};

// Where row r of an expert's gate (up when `up`) projection sits among its 2F gate_up rows: on
// the CPU all gate rows, then all up rows; on the GPU blocks of 8 alternate (gate 0-7, up 0-7,
// gate 8-15, ...), so the grouped GEMM's epilogue holds each feature's gate and up values side
// by side and applies the activation itself (the GPU needs ffn % 8 == 0).
int64_t moe_gate_up_row(int64_t r, bool up, int64_t ffn, Device device);

// Scratch for moe_experts over up to `rows` (token, slot) pairs (tokens * k) of E experts, on
// the op's device: plan (i32, moe_plan_size), gate_up [rows, 2F] (CPU only: the GPU fuses the
// activation into its gate/up GEMM), act [rows, F] and expert_out [rows, D] (compute dtype).
// Allocated once by the model, so a step allocates nothing. `activated` (i32 [1], optional) counts,
// over all calls, the experts that received at least one token: what a step had to read (see
// CausalLM::expert_bytes_read).
struct MoeWorkspace {
  Tensor plan, gate_up, act, expert_out, activated;
};
int64_t moe_plan_size(int64_t rows, int64_t num_experts);

// x: [T, D] compute dtype, expert_ids / expert_weights: moe_route's outputs -> out: [T, D]
// compute dtype. out[t] = sum over j in order of weights[t, j] * down_e(act(gate_e(x[t])) *
// up_e(x[t])), e = ids[t, j], accumulated in f32 and rounded once. Batch invariant: a token's
// output does not depend on the other tokens of the call or on the experts' loads.
void moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                 const ExpertWeights& weights, GatedActivation act, const MoeWorkspace& workspace,
                 const Tensor& out, void* stream = nullptr);

namespace cpu {
void moe_route(const float* logits, bool normalize, int32_t* expert_ids, float* expert_weights,
               int64_t tokens, int64_t num_experts, int64_t k);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
void moe_route(const float* logits, bool normalize, int32_t* expert_ids, float* expert_weights,
               int64_t tokens, int64_t num_experts, int64_t k, void* stream);
// Same contract as ops::moe_experts, on bf16 tensors (the GPU's compute dtype).
void moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                 const ExpertWeights& weights, GatedActivation act, const MoeWorkspace& workspace,
                 const Tensor& out, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
