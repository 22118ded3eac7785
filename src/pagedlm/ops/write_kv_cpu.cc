#include <cstring>
#include <type_traits>

#include "pagedlm/core/dtype.h"
#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/write_kv.h"

namespace pagedlm::ops {

namespace cpu {

template <typename Kv>
void write_kv(const float* k, const float* v, const int32_t* slot_mapping, Kv* k_cache, Kv* v_cache,
              int64_t n_tokens, int64_t n_kv_heads, int64_t head_dim, int64_t num_slots) {
  for (int64_t t = 0; t < n_tokens; ++t) {
    PAGEDLM_CHECK(slot_mapping[t] >= -1 && slot_mapping[t] < num_slots, "write_kv: slot ",
                  slot_mapping[t], " of token ", t, " is outside [-1, ", num_slots, ")");
  }
  const int64_t row = n_kv_heads * head_dim;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const int64_t slot = slot_mapping[t];
    if (slot < 0) continue;
    if constexpr (std::is_same_v<Kv, float>) {
      std::memcpy(k_cache + slot * row, k + t * row, row * sizeof(float));
      std::memcpy(v_cache + slot * row, v + t * row, row * sizeof(float));
    } else {
      for (int64_t i = 0; i < row; ++i) {
        k_cache[slot * row + i] = f32_to_bf16(k[t * row + i]);
        v_cache[slot * row + i] = f32_to_bf16(v[t * row + i]);
      }
    }
  }
}

template void write_kv(const float*, const float*, const int32_t*, float*, float*, int64_t, int64_t,
                       int64_t, int64_t);
template void write_kv(const float*, const float*, const int32_t*, uint16_t*, uint16_t*, int64_t,
                       int64_t, int64_t, int64_t);

}  // namespace cpu

void write_kv(const Tensor& k, const Tensor& v, const Tensor& slot_mapping, const Tensor& k_cache,
              const Tensor& v_cache) {
  using detail::kAnyDim;
  constexpr const char* kOp = "write_kv";
  detail::expect_device(k, Device::kCpu, kOp, "k");
  detail::expect(k, kOp, "k", DType::kF32, {kAnyDim, kAnyDim, kAnyDim});
  const int64_t n_tokens = k.dim(0), n_kv_heads = k.dim(1), head_dim = k.dim(2);
  detail::expect(v, kOp, "v", DType::kF32, {n_tokens, n_kv_heads, head_dim});
  detail::expect(slot_mapping, kOp, "slot_mapping", DType::kI32, {n_tokens});
  const DType cache_dt = k_cache.dtype() == DType::kBF16 ? DType::kBF16 : DType::kF32;
  detail::expect(k_cache, kOp, "k_cache", cache_dt, {kAnyDim, kAnyDim, n_kv_heads, head_dim});
  detail::expect(v_cache, kOp, "v_cache", cache_dt,
                 {k_cache.dim(0), k_cache.dim(1), n_kv_heads, head_dim});
  detail::expect_devices(
      kOp, Device::kCpu,
      {{&v, "v"}, {&slot_mapping, "slot_mapping"}, {&k_cache, "k_cache"}, {&v_cache, "v_cache"}});
  const int64_t num_slots = k_cache.dim(0) * k_cache.dim(1);
  if (cache_dt == DType::kBF16) {
    cpu::write_kv(k.data<float>(), v.data<float>(), slot_mapping.data<int32_t>(),
                  k_cache.data<uint16_t>(), v_cache.data<uint16_t>(), n_tokens, n_kv_heads,
                  head_dim, num_slots);
  } else {
    cpu::write_kv(k.data<float>(), v.data<float>(), slot_mapping.data<int32_t>(),
                  k_cache.data<float>(), v_cache.data<float>(), n_tokens, n_kv_heads, head_dim,
                  num_slots);
  }
}

}  // namespace pagedlm::ops
