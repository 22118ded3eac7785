#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/moe.h"
#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace {

// The GPU's smallest tile of rows per expert (ops/cuda/moe.cu): the plan holds one entry per
// tile, at most ceil(rows / tile) + E of them.
constexpr int64_t kMinTileRows = 16;

}  // namespace

int64_t moe_plan_size(int64_t rows, int64_t num_experts) {
  const int64_t max_tiles = (rows + kMinTileRows - 1) / kMinTileRows + num_experts;
  // counts [E], offsets [E + 1], the tile count, tiles (expert, first row) [max_tiles], the
  // token of each grouped row [rows], the grouped row of each (token, slot) [rows].
  return 2 * num_experts + 2 + 2 * max_tiles + 2 * rows;
}

int64_t moe_gate_up_row(int64_t r, bool up, int64_t ffn, Device device) {
  if (device == Device::kCpu) return up ? ffn + r : r;
  return r / 8 * 16 + (up ? 8 : 0) + r % 8;
}

namespace cpu {

void moe_route(const float* logits, bool normalize, int32_t* expert_ids, float* expert_weights,
               int64_t tokens, int64_t num_experts, int64_t k) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < tokens; ++t) {
    const float* row = logits + t * num_experts;
    const float max = *std::max_element(row, row + num_experts);
    float p[kMaxExperts];
    float sum = 0.f;
    for (int64_t e = 0; e < num_experts; ++e) {
      p[e] = std::exp(row[e] - max);
      sum += p[e];
    }
    float picked_sum = 0.f;
    for (int64_t j = 0; j < k; ++j) {
      int64_t best = -1;
      for (int64_t e = 0; e < num_experts; ++e) {
        if (p[e] >= 0.f && (best < 0 || p[e] > p[best])) best = e;
      }
      expert_ids[t * k + j] = static_cast<int32_t>(best);
      expert_weights[t * k + j] = p[best] / sum;
      picked_sum += p[best] / sum;
      p[best] = -1.f;  // taken
    }
    if (normalize) {
      for (int64_t j = 0; j < k; ++j) expert_weights[t * k + j] /= picked_sum;
    }
  }
}

namespace {

// The grouping every backend computes: rows of each expert together, experts in order, and
// within an expert the (token, slot) pairs in stream order.
struct Grouping {
  std::vector<int64_t> offsets;     // [E + 1]
  std::vector<int64_t> token_of;    // grouped row -> token
  std::vector<int64_t> grouped_of;  // token * k + slot -> grouped row
};

Grouping group_by_expert(const int32_t* ids, int64_t rows, int64_t k, int64_t num_experts) {
  Grouping g;
  g.offsets.assign(num_experts + 1, 0);
  for (int64_t i = 0; i < rows; ++i) {
    PAGEDLM_CHECK(ids[i] >= 0 && ids[i] < num_experts, "moe_experts: expert id ", ids[i],
                  " of token ", i / k, " is outside [0, ", num_experts, ")");
    ++g.offsets[ids[i] + 1];
  }
  for (int64_t e = 0; e < num_experts; ++e) g.offsets[e + 1] += g.offsets[e];
  std::vector<int64_t> cursor(g.offsets.begin(), g.offsets.end() - 1);
  g.token_of.resize(rows);
  g.grouped_of.resize(rows);
  for (int64_t i = 0; i < rows; ++i) {
    const int64_t pos = cursor[ids[i]]++;
    g.token_of[pos] = i / k;
    g.grouped_of[i] = pos;
  }
  return g;
}

}  // namespace

}  // namespace cpu

void moe_route(const Tensor& logits, bool normalize, const Tensor& expert_ids,
               const Tensor& expert_weights, void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "moe_route";
  detail::expect(logits, kOp, "logits", DType::kF32, {kAnyDim, kAnyDim});
  const int64_t T = logits.dim(0), E = logits.dim(1);
  detail::expect(expert_ids, kOp, "expert_ids", DType::kI32, {T, kAnyDim});
  const int64_t k = expert_ids.dim(1);
  detail::expect(expert_weights, kOp, "expert_weights", DType::kF32, {T, k});
  PAGEDLM_CHECK(E >= 1 && E <= kMaxExperts && k >= 1 && k <= std::min(E, kMaxExpertsPerToken), kOp,
                ": ", k, " of ", E, " experts is outside what the router supports (", kMaxExperts,
                " experts, ", kMaxExpertsPerToken, " per token)");
  detail::expect_devices(kOp, logits.device(),
                         {{&expert_ids, "expert_ids"}, {&expert_weights, "expert_weights"}});
  if (logits.device() == Device::kCpu) {
    cpu::moe_route(logits.data<float>(), normalize, expert_ids.data<int32_t>(),
                   expert_weights.data<float>(), T, E, k);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::moe_route(logits.data<float>(), normalize, expert_ids.data<int32_t>(),
                  expert_weights.data<float>(), T, E, k, stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

void moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                 const ExpertWeights& w, GatedActivation act, const MoeWorkspace& ws,
                 const Tensor& out, void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "moe_experts";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  const int64_t E = w.num_experts, D = w.hidden, F = w.ffn;
  detail::expect(x, kOp, "x", dt, {kAnyDim, D});
  const int64_t T = x.dim(0);
  detail::expect(expert_ids, kOp, "expert_ids", DType::kI32, {T, kAnyDim});
  const int64_t k = expert_ids.dim(1), rows = T * k;
  detail::expect(expert_weights, kOp, "expert_weights", DType::kF32, {T, k});
  detail::expect(out, kOp, "out", dt, {T, D});
  PAGEDLM_CHECK(E >= 1 && E <= kMaxExperts && k >= 1 && k <= E, kOp, ": ", k, " of ", E,
                " experts per token");
  if (w.quantized()) {
    PAGEDLM_CHECK(x.device() == Device::kCpu, kOp, ": block-quantized experts are a CPU path");
    PAGEDLM_CHECK(static_cast<int64_t>(w.gate_up_blocks.size()) == E &&
                      static_cast<int64_t>(w.down_blocks.size()) == E,
                  kOp, ": ", w.gate_up_blocks.size(), " / ", w.down_blocks.size(),
                  " quantized experts for ", E);
    for (int64_t e = 0; e < E; ++e) {
      PAGEDLM_CHECK(w.gate_up_blocks[e].rows == 2 * F && w.gate_up_blocks[e].cols == D &&
                        w.down_blocks[e].rows == D && w.down_blocks[e].cols == F,
                    kOp, ": quantized expert ", e, " has the wrong shape");
    }
  } else {
    detail::expect(w.gate_up, kOp, "gate_up", dt, {E, 2 * F, D});
    detail::expect(w.down, kOp, "down", dt, {E, D, F});
    detail::expect_devices(kOp, x.device(), {{&w.gate_up, "gate_up"}, {&w.down, "down"}});
  }
  // The GPU applies the activation in the gate/up GEMM's epilogue: no gate_up scratch there.
  const bool gate_up_ok =
      x.device() != Device::kCpu ||
      (ws.gate_up.dtype() == dt && ws.gate_up.ndim() == 2 && ws.gate_up.dim(0) >= rows &&
       ws.gate_up.dim(1) == 2 * F && ws.gate_up.device() == Device::kCpu);
  PAGEDLM_CHECK(ws.plan.dtype() == DType::kI32 && ws.plan.numel() >= moe_plan_size(rows, E) &&
                    gate_up_ok && ws.act.dtype() == dt && ws.act.ndim() == 2 &&
                    ws.act.dim(0) >= rows && ws.act.dim(1) == F && ws.expert_out.dtype() == dt &&
                    ws.expert_out.ndim() == 2 && ws.expert_out.dim(0) >= rows &&
                    ws.expert_out.dim(1) == D,
                kOp, ": the workspace is too small for ", rows, " rows");
  detail::expect_devices(kOp, x.device(),
                         {{&expert_ids, "expert_ids"},
                          {&expert_weights, "expert_weights"},
                          {&out, "out"},
                          {&ws.plan, "workspace plan"},
                          {&ws.act, "workspace act"},
                          {&ws.expert_out, "workspace expert_out"}});
  if (x.device() != Device::kCpu) {
#ifdef PAGEDLM_HAS_CUDA
    cuda::moe_experts(x, expert_ids, expert_weights, w, act, ws, out, stream);
    return;
#else
    (void)stream;
    detail::fail_no_cuda(kOp);
#endif
  }
  if (T == 0) return;
  const cpu::Grouping g = cpu::group_by_expert(expert_ids.data<int32_t>(), rows, k, E);
  if (ws.activated.defined() && ws.activated.numel() > 0) {
    int32_t& activated = *ws.activated.data<int32_t>();
    for (int64_t e = 0; e < E; ++e) activated += g.offsets[e + 1] > g.offsets[e] ? 1 : 0;
  }
  // Grouped rows: x gathered into expert_out, then each expert's gate/up, activation and down
  // projection over its rows; the down projection overwrites the gathered x it no longer needs.
  float* grouped = ws.expert_out.data<float>();
  float* gate_up = ws.gate_up.data<float>();
  float* act_out = ws.act.data<float>();
  const float* xs = x.data<float>();
  for (int64_t pos = 0; pos < rows; ++pos) {
    std::memcpy(grouped + pos * D, xs + g.token_of[pos] * D, D * sizeof(float));
  }
  for (int64_t e = 0; e < E; ++e) {
    const int64_t first = g.offsets[e], n = g.offsets[e + 1] - first;
    if (n == 0) continue;
    float* rows_x = grouped + first * D;
    float* rows_gate_up = gate_up + first * 2 * F;
    float* rows_act = act_out + first * F;
    if (w.quantized()) {
      cpu::linear(rows_x, w.gate_up_blocks[e], nullptr, rows_gate_up, n);
    } else {
      cpu::linear(rows_x, w.gate_up.data<float>() + e * 2 * F * D, nullptr, rows_gate_up, n, 2 * F,
                  D);
    }
    cpu::gated_mul(act, rows_gate_up, rows_act, n, F);
    if (w.quantized()) {
      cpu::linear(rows_act, w.down_blocks[e], nullptr, rows_x, n);
    } else {
      cpu::linear(rows_act, w.down.data<float>() + e * D * F, nullptr, rows_x, n, D, F);
    }
  }
  const float* weights = expert_weights.data<float>();
  float* y = out.data<float>();
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    float* dst = y + t * D;
    std::fill(dst, dst + D, 0.f);
    for (int64_t j = 0; j < k; ++j) {
      const float wj = weights[t * k + j];
      const float* src = grouped + g.grouped_of[t * k + j] * D;
      for (int64_t i = 0; i < D; ++i) dst[i] += wj * src[i];
    }
  }
}

}  // namespace pagedlm::ops
