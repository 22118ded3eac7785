#include <cmath>
#include <numbers>
#include <vector>

#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/rope.h"

namespace pagedlm::ops {

namespace cpu {
namespace {

inline void rotate_heads(float* x, int64_t n_heads, int64_t head_dim, const float* cos_v,
                         const float* sin_v) {
  const int64_t half = head_dim / 2;
  for (int64_t h = 0; h < n_heads; ++h) {
    float* v = x + h * head_dim;
    for (int64_t i = 0; i < half; ++i) {
      const float x1 = v[i], x2 = v[i + half];
      v[i] = x1 * cos_v[i] - x2 * sin_v[i];
      v[i + half] = x2 * cos_v[i] + x1 * sin_v[i];
    }
  }
}

}  // namespace

void rope(float* q, float* k, const int32_t* positions, const float* inv_freq, int64_t n_tokens,
          int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
#pragma omp parallel
  {
    // The angles of one token are shared by all its q and k heads.
    std::vector<float> cos_v(half), sin_v(half);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < n_tokens; ++t) {
      const float pos = static_cast<float>(positions[t]);
      for (int64_t i = 0; i < half; ++i) {
        const float angle = pos * inv_freq[i];
        cos_v[i] = std::cos(angle);
        sin_v[i] = std::sin(angle);
      }
      rotate_heads(q + t * n_q_heads * head_dim, n_q_heads, head_dim, cos_v.data(), sin_v.data());
      rotate_heads(k + t * n_kv_heads * head_dim, n_kv_heads, head_dim, cos_v.data(), sin_v.data());
    }
  }
}

}  // namespace cpu

void rope(const Tensor& q, const Tensor& k, const Tensor& positions, const Tensor& inv_freq) {
  using detail::kAnyDim;
  constexpr const char* kOp = "rope";
  detail::expect_device(q, Device::kCpu, kOp, "q");
  detail::expect(q, kOp, "q", DType::kF32, {kAnyDim, kAnyDim, kAnyDim});
  const int64_t n_tokens = q.dim(0), n_q_heads = q.dim(1), head_dim = q.dim(2);
  PAGEDLM_CHECK(head_dim % 2 == 0, kOp, ": head_dim ", head_dim, " of q must be even");
  detail::expect(k, kOp, "k", DType::kF32, {n_tokens, kAnyDim, head_dim});
  detail::expect(positions, kOp, "positions", DType::kI32, {n_tokens});
  detail::expect(inv_freq, kOp, "inv_freq", DType::kF32, {head_dim / 2});
  detail::expect_devices(kOp, Device::kCpu,
                         {{&k, "k"}, {&positions, "positions"}, {&inv_freq, "inv_freq"}});
  cpu::rope(q.data<float>(), k.data<float>(), positions.data<int32_t>(), inv_freq.data<float>(),
            n_tokens, n_q_heads, k.dim(1), head_dim);
}

}  // namespace pagedlm::ops
