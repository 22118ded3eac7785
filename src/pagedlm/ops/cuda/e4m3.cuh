// OCP e4m3 codes (FP8 KV caches) as bf16, exactly, two ways. The integer route: bit moves and one
// bf16x2 multiply a pair, about 11 instructions for four codes, where cuda_fp8.h's route (e4m3
// -> f16 -> f32 -> bf16, the conversion route) costs four conversions a pair, which run at a
// quarter of the FMA rate or less. Which one is faster depends on what the conversions overlap:
// the attention kernel converts a tile in shared memory between two barriers by the integer
// route and a tile staged in registers, after the tile's math, by the conversion route
// (attention_kernel.cuh says where each measured better). Decode at head_dim 128 takes a third
// route, to f16 times 2^-8 (below), for an mma with f16 operands. Host-callable (the integer
// routes), so that tests check every code on any machine.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cstdint>

namespace pagedlm::cuda::detail {

// Bytes of a and b as __byte_perm picks them: byte i of the result is byte s_i (nibble i of s)
// of b:a, one PRMT instruction on the device.
__host__ __device__ __forceinline__ uint32_t byte_perm(uint32_t a, uint32_t b, uint32_t s) {
#ifdef __CUDA_ARCH__
  return __byte_perm(a, b, s);
#else
  const uint64_t both = static_cast<uint64_t>(b) << 32 | a;
  uint32_t out = 0;
  for (int i = 0; i < 4; ++i) out |= ((both >> (8 * ((s >> (4 * i)) & 7))) & 0xffu) << (8 * i);
  return out;
#endif
}

// The word's two bf16 times 2^120: exact (a power of two, and every product a bf16).
__host__ __device__ __forceinline__ uint32_t unscale_bf16x2(uint32_t scaled) {
  __nv_bfloat162 v;
  static_assert(sizeof(v) == sizeof(scaled));
  __builtin_memcpy(&v, &scaled, sizeof(v));
  // 2^120 = 0x7b80 as bf16 (exponent field 247).
  const __nv_bfloat162 two_120 =
      __halves2bfloat162(__ushort_as_bfloat16(0x7b80), __ushort_as_bfloat16(0x7b80));
  v = __hmul2(v, two_120);
  uint32_t out;
  __builtin_memcpy(&out, &v, sizeof(out));
  return out;
}

// Four codes (a word, the first in the lowest byte) as four bf16 (the same order). Each code's
// sign goes to bit 15 of a 16-bit half and its seven other bits (exponent, mantissa) to bits
// 4-10, where bf16 reads them as the same mantissa under an exponent 120 lower (bias 127 against
// 7); a subnormal code (exponent 0) lands on the bf16 subnormal of the same ratio, and the
// multiply by 2^120 restores the value. Codes 1 and 3 sit in the high bytes of the word's halves
// already and codes 0 and 2 move up a byte, so each pair takes three or four integer
// instructions and the halves are put in order by two byte permutes. e4m3's NaN codes (0x7f,
// 0xff) come out as +-480: a cache is written saturated (to_e4m3), so it holds none.
__host__ __device__ __forceinline__ uint2 e4m3x4_to_bf16x4(uint32_t codes) {
  const uint32_t odd = (codes & 0x80008000u) | ((codes >> 4) & 0x07f007f0u);          // c1, c3
  const uint32_t even = ((codes << 8) & 0x80008000u) | ((codes << 4) & 0x07f007f0u);  // c0, c2
  return make_uint2(unscale_bf16x2(byte_perm(even, odd, 0x5410)),
                    unscale_bf16x2(byte_perm(even, odd, 0x7632)));
}

// Eight codes (8 bytes) as eight bf16 (16 bytes, the same order), the integer route.
__host__ __device__ __forceinline__ uint4 e4m3x8_to_bf16x8(uint2 codes) {
  const uint2 lo = e4m3x4_to_bf16x4(codes.x), hi = e4m3x4_to_bf16x4(codes.y);
  return make_uint4(lo.x, lo.y, hi.x, hi.y);
}

// The same by the conversion route (in hardware from sm_89 on, in software before); NaN codes
// stay NaN.
__device__ __forceinline__ uint4 e4m3x8_to_bf16x8_by_cvt(uint2 codes) {
  uint4 out;
  uint32_t* o = reinterpret_cast<uint32_t*>(&out);
  const uint32_t words[2] = {codes.x, codes.y};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const auto pair = static_cast<__nv_fp8x2_storage_t>(words[j / 2] >> (16 * (j % 2)));
    const __half2 h(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3));
    const __nv_bfloat162 b = __float22bfloat162_rn(__half22float2(h));
    o[j] = *reinterpret_cast<const uint32_t*>(&b);
  }
  return out;
}

// A word's codes as f16 pairs times 2^-8, exactly, for an mma with f16 operands: codes 0 and 2
// (the even bytes) and codes 1 and 3 (the odd bytes). A code's sign goes to bit 15 of its half
// and its seven other bits to bits 7-13, where f16 reads the same mantissa under an exponent 8
// lower (bias 15 against 7); a subnormal code lands on the f16 subnormal of the same ratio. So
// no multiply restores the value: the caller folds 2^8 into its own scale. Three and two
// integer instructions a pair. NaN codes come out as +-1.875 (480 after the 2^8), as with the
// bf16 route.
__host__ __device__ __forceinline__ uint32_t e4m3_even_to_f16x2_over_256(uint32_t codes) {
  return ((codes << 8) & 0x80008000u) | ((codes << 7) & 0x3f803f80u);
}
__host__ __device__ __forceinline__ uint32_t e4m3_odd_to_f16x2_over_256(uint32_t codes) {
  return (codes & 0x80008000u) | ((codes >> 1) & 0x3f803f80u);
}

}  // namespace pagedlm::cuda::detail
