// The K-quant blocks' lane policies for the GPU's matrix-vector kernel (blocks.cu): which bytes
// of a 256-weight block each of its eight lanes reads, and that lane's share of the dot product
// with rows of bf16 activations. Host-callable as well, so that tests/cuda_kquant_lanes_test.cu
// checks their arithmetic against the reference dequantization on any machine.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cstdint>
#include <cstring>

namespace pagedlm::ops::cuda {

using bf16 = __nv_bfloat16;

__host__ __device__ __forceinline__ float load_f16(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  return __half2float(*reinterpret_cast<const __half*>(p));
#else
  __half h;
  std::memcpy(&h, p, sizeof(h));
  return __half2float(h);
#endif
}

// 8 bytes from a 2-byte aligned address (a block's fields are no more aligned than that: Q8_0's
// blocks are 34 bytes, Q4_0's 18).
__host__ __device__ __forceinline__ uint2 load8(const uint8_t* p) {
#ifdef __CUDA_ARCH__
  const auto* h = reinterpret_cast<const uint16_t*>(p);
  return make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16),
                    h[2] | (static_cast<uint32_t>(h[3]) << 16));
#else
  uint2 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

__host__ __device__ __forceinline__ int byte_of(uint2 v, int j) {
  return static_cast<int>(((j < 4 ? v.x : v.y) >> (8 * (j & 3))) & 0xffu);
}

// Bit casts and 16-byte loads that are well defined in host code too (the host compiler may
// assume that a bf16 array is never read through a uint4).
__host__ __device__ __forceinline__ float float_from_bits(uint32_t bits) {
#ifdef __CUDA_ARCH__
  return __uint_as_float(bits);
#else
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
#endif
}

__host__ __device__ __forceinline__ uint4 load16(const void* p) {
#ifdef __CUDA_ARCH__
  return *static_cast<const uint4*>(p);
#else
  uint4 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

// The two bf16 of a 32-bit word as floats: exact, one instruction each.
__host__ __device__ __forceinline__ float bf16_low(uint32_t pair) {
  return float_from_bits(pair << 16);
}
__host__ __device__ __forceinline__ float bf16_high(uint32_t pair) {
  return float_from_bits(pair & 0xffff0000u);
}

__host__ __device__ __forceinline__ uint32_t word_of(uint4 v, int i) {
  return i == 0 ? v.x : i == 1 ? v.y : i == 2 ? v.z : v.w;
}

// A small unsigned integer q as the float 1 + q / 2^bits, by placing it at the top of the
// mantissa of 1.0: two integer instructions, where a conversion (I2F) runs at a quarter of the
// FMA rate or less. The lanes sum (1 + q / 2^bits) x and x, and recover sum(q x) as
// 2^bits (sum((1 + q / 2^bits) x) - sum(x)): the difference loses a bit or two of the f32 sums,
// well below the error of bf16 activations.
template <int kBits>
__host__ __device__ __forceinline__ float one_plus_fraction(uint32_t q) {
  return float_from_bits(0x3f800000u | (q << (23 - kBits)));
}

// Eight lanes take a 256-weight block, 32 weights each, chosen so that every byte of the block's
// quants is read once (blocks.cu's generic 8-weight units read a Q4_K byte once per nibble, and
// Q6_K's low bytes twice and high bytes four times). A lane's share of each 32-weight group is
// scale * sum(q x) (less min * sum(x) for Q4_K): ggml's weights, summed in another order. A
// lane policy has:
//   load(block, part) -> the lane's bytes, part = lane % 8;
//   dot<kRows>(bytes, part, x, in_features, k_block, acc).

// Q4_K: 144-byte blocks, 16-byte aligned whenever the matrix is (144 = 9 x 16), so two 16-byte
// loads: the block's head (d, dmin, 12 bytes of packed scales and mins) and 16 bytes of qs,
// whose low nibbles are weights 64c + 16h + j of sub-block 2c and high nibbles 64c + 32 + 16h
// + j of sub-block 2c + 1 (part = 2c + h).
struct Q4kLane {
  uint4 head;
  uint4 quants;

  static constexpr bool kNeeds16ByteAlignment = true;

  __host__ __device__ static Q4kLane load(const uint8_t* block, int part) {
    return {load16(block), load16(block + 16 + 16 * part)};
  }

  __host__ __device__ int head_byte(int i) const {
    const uint32_t word = i < 4 ? head.x : i < 8 ? head.y : i < 12 ? head.z : head.w;
    return static_cast<int>((word >> (8 * (i & 3))) & 0xffu);
  }

  // ggml's get_scale_min_k4 for sub-block sb, from the head's bytes 4-15.
  __host__ __device__ void scale_min(int sb, float* sc, float* mn) const {
    auto s = [&](int i) { return head_byte(4 + i); };
    int scale, min;
    if (sb < 4) {
      scale = s(sb) & 63;
      min = s(sb + 4) & 63;
    } else {
      scale = (s(sb + 4) & 0x0f) | ((s(sb - 4) >> 6) << 4);
      min = (s(sb + 4) >> 4) | ((s(sb) >> 6) << 4);
    }
    *sc = static_cast<float>(scale);
    *mn = static_cast<float>(min);
  }

  template <int kRows>
  __host__ __device__ void dot(int part, const bf16* x, int in_features, int64_t k_block,
                               float (&acc)[kRows]) const {
    const int c = part >> 1, h = part & 1;
    const float d = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x & 0xffffu)));
    const float dmin = __half2float(__ushort_as_half(static_cast<unsigned short>(head.x >> 16)));
    float sc_lo, mn_lo, sc_hi, mn_hi;
    scale_min(2 * c, &sc_lo, &mn_lo);
    scale_min(2 * c + 1, &sc_hi, &mn_hi);
    // The lane's 32 quants as magic floats, once for all rows.
    float q_lo[16], q_hi[16];
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      const uint32_t byte = (word_of(quants, j >> 2) >> (8 * (j & 3))) & 0xffu;
      q_lo[j] = one_plus_fraction<4>(byte & 0xfu);
      q_hi[j] = one_plus_fraction<4>(byte >> 4);
    }
    const float w_lo = 16.f * d * sc_lo, w_hi = 16.f * d * sc_hi;
    const float m_lo = dmin * mn_lo, m_hi = dmin * mn_hi;
    const int64_t lo0 = k_block + 64 * c + 16 * h, hi0 = lo0 + 32;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bf16* xr = x + static_cast<int64_t>(r) * in_features;
      const uint4 xv[4] = {load16(xr + lo0), load16(xr + lo0 + 8), load16(xr + hi0),
                           load16(xr + hi0 + 8)};
      float qx_lo = 0.f, x_lo = 0.f, qx_hi = 0.f, x_hi = 0.f;
#pragma unroll
      for (int j = 0; j < 16; j += 2) {
        const uint32_t lo_pair = word_of(xv[j >> 3], (j & 7) >> 1);
        const uint32_t hi_pair = word_of(xv[2 + (j >> 3)], (j & 7) >> 1);
        const float a0 = bf16_low(lo_pair), a1 = bf16_high(lo_pair);
        const float b0 = bf16_low(hi_pair), b1 = bf16_high(hi_pair);
        qx_lo = fmaf(q_lo[j + 1], a1, fmaf(q_lo[j], a0, qx_lo));
        x_lo += a0 + a1;
        qx_hi = fmaf(q_hi[j + 1], b1, fmaf(q_hi[j], b0, qx_hi));
        x_hi += b0 + b1;
      }
      acc[r] += w_lo * (qx_lo - x_lo) - m_lo * x_lo;
      acc[r] += w_hi * (qx_hi - x_hi) - m_hi * x_hi;
    }
  }
};

// Q6_K: 210-byte blocks (2-byte aligned only, so load8's 2-byte loads). Half h (128 weights) of
// a block, l0 = 8 (part % 4): ql[64h + l], ql[64h + 32 + l] and qh[32h + l] for l = l0 .. l0 + 7
// hold weights l, l + 32, l + 64 and l + 96 of the half (low nibbles of the first and second ql
// byte, then their high nibbles; the high two bits at 0, 2, 4, 6 of the qh byte), with scales
// sc[8h + l0 / 16 + 0, 2, 4, 6] (part = 4h + l0 / 8).
struct Q6kLane {
  uint2 ql_first, ql_second, qh;
  float d;
  uint32_t scales;  // sc[8h + is + 0, 2, 4, 6], is = l0 / 16, one byte each

  static constexpr bool kNeeds16ByteAlignment = false;

  __host__ __device__ static Q6kLane load(const uint8_t* block, int part) {
    const int h = part >> 2, l0 = (part & 3) * 8, is = (part & 3) >> 1;
    const uint8_t* sc = block + 192 + 8 * h + is;
    return {load8(block + 64 * h + l0), load8(block + 64 * h + 32 + l0),
            load8(block + 128 + 32 * h + l0), load_f16(block + 208),
            sc[0] | (static_cast<uint32_t>(sc[2]) << 8) | (static_cast<uint32_t>(sc[4]) << 16) |
                (static_cast<uint32_t>(sc[6]) << 24)};
  }

  template <int kRows>
  __host__ __device__ void dot(int part, const bf16* x, int in_features, int64_t k_block,
                               float (&acc)[kRows]) const {
    const int h = part >> 2, l0 = (part & 3) * 8;
    float scale[4];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      scale[g] = d * static_cast<float>(static_cast<int8_t>((scales >> (8 * g)) & 0xffu));
    }
    // The lane's 32 six-bit quants as magic floats 1 + q / 64, once for all rows: weight j of
    // group g is (q - 32) * scale[g], so a group's sum is scale[g] (64 (sum qx) - 96 (sum x)).
    float q[4][8];
#pragma unroll
    for (int g = 0; g < 4; ++g) {
      const uint2& ql = (g & 1) ? ql_second : ql_first;
      const int shift = (g >> 1) * 4;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const uint32_t v = ((static_cast<uint32_t>(byte_of(ql, j)) >> shift) & 0xfu) |
                           (((static_cast<uint32_t>(byte_of(qh, j)) >> (2 * g)) & 3u) << 4);
        q[g][j] = one_plus_fraction<6>(v);
      }
    }
    const int64_t k0 = k_block + 128 * h + l0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bf16* xr = x + static_cast<int64_t>(r) * in_features + k0;
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const uint4 packed = load16(xr + 32 * g);
        float qx = 0.f, sum = 0.f;
#pragma unroll
        for (int j = 0; j < 8; j += 2) {
          const uint32_t pair = word_of(packed, j >> 1);
          const float a0 = bf16_low(pair), a1 = bf16_high(pair);
          qx = fmaf(q[g][j + 1], a1, fmaf(q[g][j], a0, qx));
          sum += a0 + a1;
        }
        acc[r] += scale[g] * (64.f * qx - 96.f * sum);
      }
    }
  }
};

}  // namespace pagedlm::ops::cuda
