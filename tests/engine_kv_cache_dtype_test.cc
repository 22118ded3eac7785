// --kv-cache-dtype: which element type a rank's KV cache takes (and where it is refused), the
// page bytes it is sized with, and an e4m3 cache's per-layer scales from the checkpoint.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "golden_fixture_util.h"
#include "ops_test_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

using testing::expect_error;

EngineOptions with(Device device, KvCacheDtype dtype) {
  EngineOptions o;
  o.device = device;
  o.kv_cache_dtype = dtype;
  return o;
}

TEST(KvCacheDtype, AutoIsTheComputeDtypeAndFp8IsE4m3OnTheGpu) {
  EXPECT_EQ(kv_cache_dtype(with(Device::kCpu, KvCacheDtype::kAuto), DType::kF32), DType::kF32);
  EXPECT_EQ(kv_cache_dtype(with(Device::kCuda, KvCacheDtype::kAuto), DType::kBF16), DType::kBF16);
  EXPECT_EQ(kv_cache_dtype(with(Device::kCuda, KvCacheDtype::kBf16), DType::kBF16), DType::kBF16);
  EXPECT_EQ(kv_cache_dtype(with(Device::kCuda, KvCacheDtype::kFp8), DType::kBF16), DType::kF8E4M3);
}

TEST(KvCacheDtype, TheCpuTakesBf16AndRefusesFp8) {
  EXPECT_EQ(kv_cache_dtype(with(Device::kCpu, KvCacheDtype::kBf16), DType::kF32), DType::kBF16);
  expect_error([] { kv_cache_dtype(with(Device::kCpu, KvCacheDtype::kFp8), DType::kF32); },
               {"--kv-cache-dtype fp8", "GPU only"});
  // bf16 pages hold f32 values only where the CPU computes them, and never f16 ones.
  expect_error([] { kv_cache_dtype(with(Device::kCuda, KvCacheDtype::kBf16), DType::kF32); },
               {"--kv-cache-dtype bf16", "CPU only"});
  expect_error([] { kv_cache_dtype(with(Device::kCuda, KvCacheDtype::kBf16), DType::kF16); },
               {"--kv-cache-dtype bf16", "f16"});
  // The whole engine says so before it loads anything onto a device.
  const Checkpoint checkpoint = load_checkpoint(testing::fixture_dir("llama-gqa"));
  EngineOptions o = with(Device::kCpu, KvCacheDtype::kFp8);
  o.num_pages = 16;
  expect_error([&] { Engine engine(checkpoint, o); }, {"--kv-cache-dtype fp8", "GPU only"});
}

// The pool is sized with the element size: an e4m3 page is half a bf16 one, a bf16 page half an
// f32 one, and the CPU's byte budget holds twice the bf16 pages.
TEST(KvCacheDtype, E4m3PagesAreHalfTheBytesOfBf16) {
  const int64_t bf16 = PagedKvCache::bytes_per_page(32, 16, 8, 128, DType::kBF16);
  EXPECT_EQ(bf16, int64_t{2} * 32 * 16 * 8 * 128 * 2);
  EXPECT_EQ(PagedKvCache::bytes_per_page(32, 16, 8, 128, DType::kF8E4M3) * 2, bf16);
  EXPECT_EQ(PagedKvCache::bytes_per_page(32, 16, 8, 128, DType::kF32), 2 * bf16);
  const Checkpoint checkpoint = load_checkpoint(testing::fixture_dir("llama-gqa"));
  const EngineOptions cpu = with(Device::kCpu, KvCacheDtype::kAuto);
  const int32_t f32_pages = kv_cache_pages(cpu, checkpoint.config, {}, DType::kF32);
  EXPECT_GT(f32_pages, 0);
  const int32_t bf16_pages = kv_cache_pages(cpu, checkpoint.config, {}, DType::kBF16);
  EXPECT_GE(bf16_pages, 2 * f32_pages);  // a budget's floor in pages of half the size
  EXPECT_LE(bf16_pages, 2 * f32_pages + 1);
}

TEST(KvCacheDtype, ScalesComeFromTheCheckpointElseOne) {
  // ct-mixed carries compressed-tensors' self_attn.k_scale / v_scale (0.02 and 0.01, in bf16).
  const Checkpoint ct = load_checkpoint(testing::fixture_dir("ct-mixed"));
  const std::vector<ops::KvCacheScales> scales =
      PagedKvCache::checkpoint_scales(ct, ct.config.num_layers);
  ASSERT_EQ(static_cast<int64_t>(scales.size()), ct.config.num_layers);
  for (const ops::KvCacheScales& s : scales) {
    EXPECT_NEAR(s.k, 0.02, 1e-4);
    EXPECT_NEAR(s.v, 0.01, 1e-4);
  }
  const Checkpoint plain = load_checkpoint(testing::fixture_dir("llama-gqa"));
  for (const ops::KvCacheScales& s :
       PagedKvCache::checkpoint_scales(plain, plain.config.num_layers)) {
    EXPECT_EQ(s.k, 1.f);
    EXPECT_EQ(s.v, 1.f);
  }
  // One layer's scale only: the others keep 1.0. A scale of no layer is refused by name.
  Checkpoint one;
  one.kv_scales.emplace("model.layers.1.self_attn.v_scale", Tensor::from_f32({0.5f}, {1}));
  const std::vector<ops::KvCacheScales> partial = PagedKvCache::checkpoint_scales(one, 3);
  EXPECT_EQ(partial[1].v, 0.5f);
  EXPECT_EQ(partial[1].k, 1.f);
  EXPECT_EQ(partial[0].v, 1.f);
  EXPECT_EQ(partial[2].v, 1.f);
  expect_error([&] { PagedKvCache::checkpoint_scales(one, 1); },
               {"model.layers.1.self_attn.v_scale", "no layer"});
  Checkpoint zero;
  zero.kv_scales.emplace("model.layers.0.self_attn.k_scale", Tensor::from_f32({0.f}, {1}));
  expect_error([&] { PagedKvCache::checkpoint_scales(zero, 2); },
               {"model.layers.0.self_attn.k_scale", "positive"});
  Checkpoint unnamed;
  unnamed.kv_scales.emplace("model.k_scale", Tensor::from_f32({0.5f}, {1}));
  expect_error([&] { PagedKvCache::checkpoint_scales(unnamed, 2); }, {"model.k_scale"});
}

}  // namespace
}  // namespace pagedlm
