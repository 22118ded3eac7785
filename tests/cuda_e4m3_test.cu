// The e4m3 -> bf16 conversion of the attention kernels' FP8 KV caches (ops/cuda/e4m3.cuh),
// every one of the 256 codes against core/dtype.h's decoding (which follows the OCP e4m3
// definition: bias 7, subnormals below exponent 1, 0x7f / 0xff NaN): on the host, and through a
// kernel on the GPU, where the bf16x2 multiply runs as the device's instruction (skipped without
// a GPU). Also the f16 route (codes as f16 times 2^-8) on the host: integer operations only.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/ops/cuda/e4m3.cuh"

namespace pagedlm::cuda::e4m3_test {

// The 256 codes, four to a word, in order.
std::vector<uint32_t> all_codes() {
  std::vector<uint32_t> words(64);
  for (uint32_t i = 0; i < 64; ++i) {
    words[i] = (4 * i) | (4 * i + 1) << 8 | (4 * i + 2) << 16 | (4 * i + 3) << 24;
  }
  return words;
}

// out[2 i], out[2 i + 1]: the conversion of words[i] (four bf16).
void expect_every_code_exact(const std::vector<uint2>& out) {
  ASSERT_EQ(out.size(), 64u);
  for (int code = 0; code < 256; ++code) {
    const uint2 v = out[code / 4];
    const uint32_t pair = (code % 4) < 2 ? v.x : v.y;
    const auto bits = static_cast<uint16_t>(pair >> (16 * (code % 2)));
    const float got = bf16_to_f32(bits);
    const float want = f8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(want)) {  // never written to a cache: documented as +-480
      EXPECT_EQ(got, (code & 0x80) != 0 ? -480.f : 480.f) << "code " << code;
      continue;
    }
    EXPECT_EQ(got, want) << "code " << code;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << "code " << code;  // -0 stays -0
  }
}

TEST(E4m3ToBf16, EveryCodeExactOnTheHost) {
  std::vector<uint2> out;
  for (uint32_t w : all_codes()) out.push_back(detail::e4m3x4_to_bf16x4(w));
  expect_every_code_exact(out);
}

__global__ void convert_kernel(const uint32_t* words, uint2* out, int n) {
  const int i = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) out[i] = detail::e4m3x4_to_bf16x4(words[i]);
}

TEST(E4m3ToBf16, EveryCodeExactOnTheGpu) {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    cudaGetLastError();
    GTEST_SKIP() << "no CUDA device";
  }
  const std::vector<uint32_t> words = all_codes();
  uint32_t* d_words = nullptr;
  uint2* d_out = nullptr;
  ASSERT_EQ(cudaMalloc(&d_words, words.size() * sizeof(uint32_t)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&d_out, words.size() * sizeof(uint2)), cudaSuccess);
  ASSERT_EQ(
      cudaMemcpy(d_words, words.data(), words.size() * sizeof(uint32_t), cudaMemcpyHostToDevice),
      cudaSuccess);
  convert_kernel<<<1, 64>>>(d_words, d_out, static_cast<int>(words.size()));
  std::vector<uint2> out(words.size());
  ASSERT_EQ(cudaMemcpy(out.data(), d_out, out.size() * sizeof(uint2), cudaMemcpyDeviceToHost),
            cudaSuccess);
  cudaFree(d_words);
  cudaFree(d_out);
  expect_every_code_exact(out);
}

// The f16 route of the e4m3 decode kernel at head_dim 128: every code, from the even and the
// odd bytes of its word, times 2^8 is the code's value (NaN codes: +-480, as above).
TEST(E4m3ToF16, EveryCodeExactTimes256OnTheHost) {
  const std::vector<uint32_t> words = all_codes();
  for (int code = 0; code < 256; ++code) {
    const uint32_t w = words[code / 4];
    const uint32_t pair = code % 2 == 0 ? detail::e4m3_even_to_f16x2_over_256(w)
                                        : detail::e4m3_odd_to_f16x2_over_256(w);
    // Codes 0 and 1 of a word land in the low half, codes 2 and 3 in the high half.
    const auto bits = static_cast<uint16_t>(pair >> (16 * ((code % 4) / 2)));
    const float got = 256.f * f16_to_f32(bits);
    const float want = f8e4m3_to_f32(static_cast<uint8_t>(code));
    if (std::isnan(want)) {
      EXPECT_EQ(got, (code & 0x80) != 0 ? -480.f : 480.f) << "code " << code;
      continue;
    }
    EXPECT_EQ(got, want) << "code " << code;
    EXPECT_EQ(std::signbit(got), std::signbit(want)) << "code " << code;
  }
}

}  // namespace pagedlm::cuda::e4m3_test
