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

namespace pagedlm::ops::cuda {

using bf16 = __nv_bfloat16;

__host__ __device__ __forceinline__ float load_f16(const uint8_t* p) {
  return __half2float(*reinterpret_cast<const __half*>(p));
}

// 8 bytes from a 2-byte aligned address (a block's fields are no more aligned than that: Q8_0's
// blocks are 34 bytes, Q4_0's 18).
__host__ __device__ __forceinline__ uint2 load8(const uint8_t* p) {
  const auto* h = reinterpret_cast<const uint16_t*>(p);
  return make_uint2(h[0] | (static_cast<uint32_t>(h[1]) << 16),
                    h[2] | (static_cast<uint32_t>(h[3]) << 16));
}

__host__ __device__ __forceinline__ int byte_of(uint2 v, int j) {
  return static_cast<int>(((j < 4 ? v.x : v.y) >> (8 * (j & 3))) & 0xffu);
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
    return {*reinterpret_cast<const uint4*>(block),
            *reinterpret_cast<const uint4*>(block + 16 + 16 * part)};
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
    const uint32_t q[4] = {quants.x, quants.y, quants.z, quants.w};
    const int64_t lo0 = k_block + 64 * c + 16 * h, hi0 = lo0 + 32;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bf16* xr = x + static_cast<int64_t>(r) * in_features;
      uint4 xv[4];
      xv[0] = *reinterpret_cast<const uint4*>(xr + lo0);
      xv[1] = *reinterpret_cast<const uint4*>(xr + lo0 + 8);
      xv[2] = *reinterpret_cast<const uint4*>(xr + hi0);
      xv[3] = *reinterpret_cast<const uint4*>(xr + hi0 + 8);
      const auto* xlo = reinterpret_cast<const bf16*>(&xv[0]);
      const auto* xhi = reinterpret_cast<const bf16*>(&xv[2]);
      float qx_lo = 0.f, x_lo = 0.f, qx_hi = 0.f, x_hi = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const uint32_t byte = (q[j >> 2] >> (8 * (j & 3))) & 0xffu;
        const float a = __bfloat162float(xlo[j]), b = __bfloat162float(xhi[j]);
        qx_lo = fmaf(static_cast<float>(byte & 0xfu), a, qx_lo);
        x_lo += a;
        qx_hi = fmaf(static_cast<float>(byte >> 4), b, qx_hi);
        x_hi += b;
      }
      acc[r] += d * sc_lo * qx_lo - dmin * mn_lo * x_lo;
      acc[r] += d * sc_hi * qx_hi - dmin * mn_hi * x_hi;
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
    const int64_t k0 = k_block + 128 * h + l0;
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const bf16* xr = x + static_cast<int64_t>(r) * in_features + k0;
      float qx[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int g = 0; g < 4; ++g) {
        const uint4 packed = *reinterpret_cast<const uint4*>(xr + 32 * g);
        const auto* xv = reinterpret_cast<const bf16*>(&packed);
        const uint2& ql = (g & 1) ? ql_second : ql_first;
        const int shift = (g >> 1) * 4;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          const int q =
              ((byte_of(ql, j) >> shift) & 0xf) | (((byte_of(qh, j) >> (2 * g)) & 3) << 4);
          qx[g] = fmaf(static_cast<float>(q - 32), __bfloat162float(xv[j]), qx[g]);
        }
      }
      acc[r] += scale[0] * qx[0] + scale[1] * qx[1] + scale[2] * qx[2] + scale[3] * qx[3];
    }
  }
};

}  // namespace pagedlm::ops::cuda
