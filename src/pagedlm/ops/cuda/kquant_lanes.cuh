// The K-quant blocks' arithmetic for the GPU's matrix-vector kernels (blocks.cu): Q6_K's lane
// policy (which bytes of a 256-weight block each of eight lanes reads, and that lane's share of
// the dot product with rows of bf16 activations) and Q4_K's tensor-core tile (each lane's mma
// fragments and its share of the scales). Host-callable as well, so that
// tests/cuda_kquant_lanes_test.cu checks their arithmetic against the reference dequantization
// on any machine.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <vector_functions.h>
#include <vector_types.h>

#include <cmath>
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

__host__ __device__ __forceinline__ uint32_t float_bits(float f) {
#ifdef __CUDA_ARCH__
  return __float_as_uint(f);
#else
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  return bits;
#endif
}

// A T from an address aligned to sizeof(T): one load on the device; memcpy on the host, whose
// tests emulate the kernels.
template <typename T>
__host__ __device__ __forceinline__ T load_aligned(const void* p) {
#ifdef __CUDA_ARCH__
  return *static_cast<const T*>(p);
#else
  T v;
  std::memcpy(&v, p, sizeof(v));
  return v;
#endif
}

// 16 bytes from a 16-byte aligned address.
__host__ __device__ __forceinline__ uint4 load16(const void* p) { return load_aligned<uint4>(p); }

// 4 bytes from a 4-byte aligned address.
__host__ __device__ __forceinline__ uint32_t load_word(const void* p) {
  return load_aligned<uint32_t>(p);
}

// An f16 from its bits, as a float.
__host__ __device__ __forceinline__ float f16_bits_to_float(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits & 0xffffu)));
}

// ggml's get_scale_min_k4 for four of a Q4_K block's eight sub-blocks at once, a byte each:
// sub-blocks 0-3 (upper = false) or 4-7, from the header's words y, z, w (its scale bytes 0-3,
// 4-7, 8-11).
struct Q4kScaleBytes {
  uint32_t scales, mins;
};
__host__ __device__ __forceinline__ Q4kScaleBytes q4k_scale_bytes(bool upper, uint32_t y,
                                                                  uint32_t z, uint32_t w) {
  return {upper ? (w & 0x0f0f0f0fu) | ((y >> 2) & 0x30303030u) : y & 0x3f3f3f3fu,
          upper ? ((w >> 4) & 0x0f0f0f0fu) | ((z >> 2) & 0x30303030u) : z & 0x3f3f3f3fu};
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
// quants is read once (blocks.cu's generic 8-weight units read Q6_K's low bytes twice and high
// bytes four times). A lane's share of each 32-weight group is scale * sum(q x): ggml's
// weights, summed in another order. A lane policy has:
//   load(block, part) -> the lane's bytes, part = lane % 8;
//   dot<kRows>(bytes, part, x, in_features, k_block, acc).

// Q6_K: 210-byte blocks (2-byte aligned only, so load8's 2-byte loads). Half h (128 weights) of
// a block, l0 = 8 (part % 4): ql[64h + l], ql[64h + 32 + l] and qh[32h + l] for l = l0 .. l0 + 7
// hold weights l, l + 32, l + 64 and l + 96 of the half (low nibbles of the first and second ql
// byte, then their high nibbles; the high two bits at 0, 2, 4, 6 of the qh byte), with scales
// sc[8h + l0 / 16 + 0, 2, 4, 6] (part = 4h + l0 / 8).
struct Q6kLane {
  uint2 ql_first, ql_second, qh;
  float d;
  uint32_t scales;  // sc[8h + is + 0, 2, 4, 6], is = l0 / 16, one byte each

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

// Q4_K times one row of activations on tensor cores, in integers as llama.cpp's mmvq does it: x
// rounded to 8 bits per 32 values (Q4kStagedX), and mma.sync m16n8k32 (s8 in, s32 sums) over 16
// weight rows and one 256-weight block at a time, blocks.cu's q4k_matvec_mma_kernel. The products
// of each mma need not be the weights' own order, only the same order on both sides, and its
// eight columns need not be rows of x: column n holds x only where the k index falls in
// sub-block n, so that C[row][n] is sub-block n's sum alone, and its scales can be applied once
// per sub-block after eight mmas. Lane (g, t) = (lane / 4, lane % 4):
//   A (weights): bytes 32t .. 32t + 31 of rows g and g + 8's quants, sub-blocks 2t (low
//     nibbles) and 2t + 1 (high). mma (h, p), h the half and p = 0 .. 3, takes words 2p and
//     2p + 1 of them: their low (h = 0) or high (h = 1) nibbles, four int8 per word in one or two
//     integer instructions, at k = 4t .. 4t + 3 and 4t + 16 .. 4t + 19. These are weights
//     8p .. 8p + 7 of sub-block 2t + h, in order.
//   B (x): column g, the same k: x's 8-bit values at those weights where g = 2t + h (the lane's
//     own sub-block), else 0, so only lane (g, g / 2) feeds x: words 2p, 2p + 1 of sub-block g,
//     read from shared memory where the warp staged the block's x (stage_quarter).
//   C: lane (g, t) holds sub-blocks 2t, 2t + 1 of rows g and g + 8, the sub-blocks whose scales
//     it decodes from the rows' heads; each is d sc dx sum(q xq) - dmin m dx sum(xq), with dx the
//     sub-block of x's scale and dx sum(xq) staged beside it.
// Integer products and sums are exact, where bf16 products of 128 + q rounded in the f32 sums:
// the error is x's rounding to 8 bits alone, which the lanes' test and backend_ops_test state.

// The lane's weights of one block for rows g and g + 8.
struct Q4kMmaTile {
  uint4 head[2];       // rows g, g + 8: d, dmin, 12 bytes of packed 6-bit scales and mins
  uint4 quants[2][2];  // rows g, g + 8: quant bytes 32t .. 32t + 15, 32t + 16 .. 32t + 31

  __host__ __device__ static Q4kMmaTile load(const uint8_t* block_g, const uint8_t* block_g8,
                                             int t) {
    const uint8_t* q_g = block_g + 16 + 32 * t;
    const uint8_t* q_g8 = block_g8 + 16 + 32 * t;
    return {{load16(block_g), load16(block_g8)},
            {{load16(q_g), load16(q_g + 16)}, {load16(q_g8), load16(q_g8 + 16)}}};
  }

  // mma (h, p)'s A fragment: {row g, k 4t..}, {row g + 8, k 4t..}, {row g, k 4t + 16..},
  // {row g + 8, k 4t + 16..}.
  __host__ __device__ void a_fragment(int h, int p, uint32_t (&a)[4]) const {
    const int w = 2 * (p & 1), shift = 4 * h;
    constexpr uint32_t kNibbles = 0x0f0f0f0fu;
    a[0] = (word_of(quants[0][p >> 1], w) >> shift) & kNibbles;
    a[1] = (word_of(quants[1][p >> 1], w) >> shift) & kNibbles;
    a[2] = (word_of(quants[0][p >> 1], w + 1) >> shift) & kNibbles;
    a[3] = (word_of(quants[1][p >> 1], w + 1) >> shift) & kNibbles;
  }

  // Adds the lane's two sub-blocks of rows g (acc[0]) and g + 8 (acc[1]) from C (c), given x's
  // scale dx and dx sum(xq) of sub-blocks 2t, 2t + 1.
  __host__ __device__ void accumulate(int t, const int32_t (&c)[4], const float (&dx)[2],
                                      const float (&x_sum)[2], float (&acc)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4& h = head[r];
      const float d = f16_bits_to_float(h.x);
      const float dmin = f16_bits_to_float(h.x >> 16);
      // Lanes 0, 1 take sub-blocks 0-3, lanes 2, 3 4-7.
      const auto [scales, mins] = q4k_scale_bytes(t >= 2, h.y, h.z, h.w);
      const int at = 16 * (t & 1);  // the first of the lane's two sub-blocks, as a bit offset
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        const float a = d * static_cast<float>((scales >> (at + 8 * s)) & 0xffu);
        const float m = dmin * static_cast<float>((mins >> (at + 8 * s)) & 0xffu);
        acc[r] = fmaf(a * dx[s], static_cast<float>(c[2 * r + s]), acc[r]);
        acc[r] = fmaf(-m, x_sum[s], acc[r]);
      }
    }
  }
};

// Q4_K blocks against several rows of x on tensor cores in integers (at two to eight rows; the
// one-row tile above gives the eight columns of an mma to the eight sub-blocks instead): a warp
// takes 16 output features (rows g and g + 8 on lane (g, t)) and one 256-weight block of them at
// a time. Each sub-block is one mma m16n8k32 a plane of x (StagedRowsX) whose k runs over its 32
// weights in order and whose eight columns are eight rows of x; so C holds that sub-block's
// integer dot products of two features with two rows, and the lane scales the planes' joined sums
// by its features' d sc and dmin m and the rows' unit and unit sum. Lane t reads bytes 4t .. 4t + 3
// and 16 + 4t .. 19 + 4t of each of the four 32-byte groups of quants (group j: sub-block 2j in the
// low nibbles, 2j + 1 in the high): in the file's layout, A's fragments of all eight sub-blocks.
struct Q4kRowsTile {
  uint32_t head[2][4];    // rows g, g + 8: d and dmin, then 12 bytes of packed scales and mins
  uint32_t quants[2][8];  // rows g, g + 8: words 8 j + t and 8 j + 4 + t of the 128 quant bytes

  __host__ __device__ static Q4kRowsTile load(const uint8_t* block_g, const uint8_t* block_g8,
                                              int t) {
    Q4kRowsTile tile;
    const uint8_t* blocks[2] = {block_g, block_g8};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint4 h = load16(blocks[r]);
      tile.head[r][0] = h.x;
      tile.head[r][1] = h.y;
      tile.head[r][2] = h.z;
      tile.head[r][3] = h.w;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        tile.quants[r][2 * j] = load_word(blocks[r] + 16 + 32 * j + 4 * t);
        tile.quants[r][2 * j + 1] = load_word(blocks[r] + 16 + 32 * j + 16 + 4 * t);
      }
    }
    return tile;
  }

  // Sub-block sb's A fragment: {row g, k 4t..}, {row g + 8, k 4t..}, {row g, k 4t + 16..},
  // {row g + 8, k 4t + 16..}.
  __host__ __device__ void a_fragment(int sb, uint32_t (&a)[4]) const {
    const int j = sb >> 1, shift = 4 * (sb & 1);
    constexpr uint32_t kNibbles = 0x0f0f0f0fu;
    a[0] = (quants[0][2 * j] >> shift) & kNibbles;
    a[1] = (quants[1][2 * j] >> shift) & kNibbles;
    a[2] = (quants[0][2 * j + 1] >> shift) & kNibbles;
    a[3] = (quants[1][2 * j + 1] >> shift) & kNibbles;
  }

  // d sc[sb] (scale) and dmin m[sb] (min) of rows g (r = 0) and g + 8 (r = 1).
  __host__ __device__ void sub_block_scales(int sb, float (&scale)[2], float (&min)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const auto [scales, mins] = q4k_scale_bytes(sb >= 4, head[r][1], head[r][2], head[r][3]);
      const int at = 8 * (sb & 3);
      const float d = f16_bits_to_float(head[r][0]);
      const float dmin = f16_bits_to_float(head[r][0] >> 16);
      scale[r] = d * static_cast<float>((scales >> at) & 0xffu);
      min[r] = dmin * static_cast<float>((mins >> at) & 0xffu);
    }
  }
};

// Q6_K blocks against several rows of x on tensor cores in integers, as Q4kRowsTile: each
// 16-weight sub-block (one int8 scale) is one mma m16n8k16 a plane of x whose k runs over its
// weights in order and whose columns are rows of x (StagedRowsX: the sub-block is half of one
// staged 32).
// Sub-block (h, grp, s) is weights 128 h + 32 grp + 16 s .. + 15 of the block: the low (grp < 2)
// or high nibbles of ql[64 h + 32 (grp & 1) + l], bits 2 grp of qh[32 h + l] (l = 16 s + ..), and
// scale sc[8 h + 2 grp + s]; lane t holds bytes 4t .. 4t + 3 of each. Blocks are 210 bytes, so a
// block's words are read as pairs of 2-byte halves.
struct Q6kRowsTile {
  uint32_t low[2][8];     // rows g, g + 8: ql words at 64 h + 32 c + 16 s + 4t, index 4h + 2c + s
  uint32_t high[2][4];    // rows g, g + 8: qh words at 128 + 32 h + 16 s + 4t, index 2h + s
  uint32_t scales[2][4];  // rows g, g + 8: the 16 int8 scales
  float d[2];

  __host__ __device__ static uint32_t load_halves(const uint8_t* p) {
#ifdef __CUDA_ARCH__
    const auto* h = reinterpret_cast<const uint16_t*>(p);
    return h[0] | (static_cast<uint32_t>(h[1]) << 16);
#else
    return load_word(p);
#endif
  }

  __host__ __device__ static Q6kRowsTile load(const uint8_t* block_g, const uint8_t* block_g8,
                                              int t) {
    Q6kRowsTile tile;
    const uint8_t* blocks[2] = {block_g, block_g8};
#pragma unroll
    for (int r = 0; r < 2; ++r) {
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int h = i >> 2, c = (i >> 1) & 1, s = i & 1;
        tile.low[r][i] = load_halves(blocks[r] + 64 * h + 32 * c + 16 * s + 4 * t);
      }
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        tile.high[r][i] = load_halves(blocks[r] + 128 + 32 * (i >> 1) + 16 * (i & 1) + 4 * t);
        tile.scales[r][i] = load_halves(blocks[r] + 192 + 4 * i);
      }
      tile.d[r] = load_f16(blocks[r] + 208);
    }
    return tile;
  }

  // Sub-block (h, grp, s)'s A fragment, q - 32 as int8: {row g, k 4t..}, {row g + 8, k 4t..}.
  __host__ __device__ void a_fragment(int h, int grp, int s, uint32_t (&a)[2]) const {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t q = ((low[r][4 * h + 2 * (grp & 1) + s] >> (4 * (grp >> 1))) & 0x0f0f0f0fu) |
                         (((high[r][2 * h + s] >> (2 * grp)) & 0x03030303u) << 4);
      // q - 32 in each byte: q ^ 32 is its 6-bit two's complement; bit 5 copied to bits 6, 7
      // (times 6: 0x20 -> 0xc0, no carry between bytes) sign-extends it.
      const uint32_t v = q ^ 0x20202020u;
      a[r] = v | ((v & 0x20202020u) * 6u);
    }
  }

  // d sc of rows g (r = 0) and g + 8 (r = 1) for sub-block (h, grp, s).
  __host__ __device__ void sub_block_scales(int h, int grp, int s, float (&scale)[2]) const {
    const int i = 8 * h + 2 * grp + s;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const auto sc = static_cast<int8_t>((scales[r][i >> 2] >> (8 * (i & 3))) & 0xffu);
      scale[r] = d[r] * static_cast<float>(sc);
    }
  }
};

// 32 values of x (at xs, 16-byte aligned) as floats; returns ggml's 8-bit step for them, dx =
// max |x| / 127.
__host__ __device__ __forceinline__ float load_sub_block(const bf16* xs, float (&v)[32]) {
  float amax = 0.f;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const uint4 words = load16(xs + 8 * q);
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      v[8 * q + 2 * w] = bf16_low(word_of(words, w));
      v[8 * q + 2 * w + 1] = bf16_high(word_of(words, w));
    }
  }
#pragma unroll
  for (int i = 0; i < 32; ++i) amax = fmaxf(amax, fabsf(v[i]));
  return amax / 127.f;
}

// x in shared memory for Q4kMmaTile's B fragments (a block's or a row's), rounded to 8 bits per
// 32-value sub-block as ggml rounds activations (and the CPU's 8-bit mode): dx = max |x| / 127, xq
// = x * (1 / dx) rounded to nearest with ties to even, all zero where dx is. kWords words a
// sub-block: its 32 int8 in order, dx, then dx sum(xq) (the mins' term, in x's rounded values like
// the rest). At a stride of 10 words the eight sub-blocks that a warp's lanes read at once fall in
// distinct banks.
struct Q4kStagedX {
  static constexpr int kWords = 10;
  static constexpr int kScaleWord = 8;

  // A warp stages a sub-block four lanes at a time (stage_quarter), each lane a quarter (values
  // 8 quarter .. 8 quarter + 7 as eight bf16 in `words`); the lanes meet by shuffles for the
  // sub-block's largest |x| and sum(xq), which do not depend on their order. The pieces between
  // the shuffles are apart so that a host test can run the four lanes in turn.

  // The quarter's values as floats into v; returns their largest |x|.
  __host__ __device__ static float quarter_values(uint4 words, float (&v)[8]) {
    float amax = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      v[2 * w] = bf16_low(word_of(words, w));
      v[2 * w + 1] = bf16_high(word_of(words, w));
    }
#pragma unroll
    for (int i = 0; i < 8; ++i) amax = fmaxf(amax, fabsf(v[i]));
    return amax;
  }

  // The sub-block's step from its largest |x|: dx = amax / 127.
  __host__ __device__ static float step(float amax) { return amax / 127.f; }

  // Four values (at v) as int8 at `inverse` (rounded to nearest, ties to even) in one word, low
  // byte first; their sum is added to `sum`.
  __host__ __device__ static uint32_t round_four(const float* v, float inverse, int& sum) {
    uint32_t word = 0;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int q = static_cast<int>(rintf(v[j] * inverse));
      sum += q;
      word |= (static_cast<uint32_t>(q) & 0xffu) << (8 * j);
    }
    return word;
  }

  // The quarter's values as int8 at step dx (x / dx rounded to nearest, ties to even; zeros where
  // dx is) in two words; their sum is added to `sum`.
  __host__ __device__ static uint2 round_quarter(const float (&v)[8], float dx, int& sum) {
    const float inverse = dx != 0.f ? 1.f / dx : 0.f;
    const uint32_t low = round_four(v, inverse, sum);
    return make_uint2(low, round_four(v + 4, inverse, sum));
  }

  // The quarter's words, and (quarter 0) the sub-block's dx and dx sum(xq), into sub_block.
  __host__ __device__ static void put_quarter(uint2 words, float dx, int sum, uint32_t* sub_block,
                                              int quarter) {
#ifdef __CUDA_ARCH__
    *reinterpret_cast<uint2*>(sub_block + 2 * quarter) = words;
#else
    sub_block[2 * quarter] = words.x;
    sub_block[2 * quarter + 1] = words.y;
#endif
    if (quarter == 0) {
      sub_block[kScaleWord] = float_bits(dx);
      sub_block[kScaleWord + 1] = float_bits(dx * static_cast<float>(sum));
    }
  }

  // A warp's lane's quarter; every lane of the warp calls it.
  __device__ static void stage_quarter(uint4 words, uint32_t* sub_block, int quarter) {
    float v[8];
    float amax = quarter_values(words, v);
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
    const float dx = step(amax);
    int sum = 0;
    const uint2 quantized = round_quarter(v, dx, sum);
    sum += __shfl_xor_sync(0xffffffffu, sum, 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    put_quarter(quantized, dx, sum, sub_block, quarter);
  }

  // Lane (g, t)'s {b0, b1} for mmas (0, p) and (1, p) of block b: words 2p, 2p + 1 of sub-block g
  // in the mma of half g % 2 on lane (g, g / 2), zeros elsewhere.
  __host__ __device__ static void b_fragments(const uint32_t* staged, int b, int g, int t, int p,
                                              uint32_t (&low)[2], uint32_t (&high)[2]) {
    const uint32_t* pair = staged + kWords * (8 * b + g) + 2 * p;  // 8-byte aligned
#ifdef __CUDA_ARCH__
    const uint2 words = *reinterpret_cast<const uint2*>(pair);
    const uint32_t b0 = words.x, b1 = words.y;
#else
    const uint32_t b0 = pair[0], b1 = pair[1];
#endif
    const bool mine = t == g >> 1, odd = (g & 1) != 0;
    low[0] = mine && !odd ? b0 : 0u;
    low[1] = mine && !odd ? b1 : 0u;
    high[0] = mine && odd ? b0 : 0u;
    high[1] = mine && odd ? b1 : 0u;
  }

  // dx and dx sum(xq) of sub-blocks 2t, 2t + 1 of block b.
  __host__ __device__ static void scales(const uint32_t* staged, int b, int t, float (&dx)[2],
                                         float (&x_sum)[2]) {
    const uint32_t* first = staged + kWords * (8 * b + 2 * t) + kScaleWord;
    dx[0] = float_from_bits(first[0]);
    x_sum[0] = float_from_bits(first[1]);
    dx[1] = float_from_bits(first[kWords]);
    x_sum[1] = float_from_bits(first[kWords + 1]);
  }
};

// Rows of x for the several-row tiles (Q4kRowsTile, Q6kRowsTile), staged in global memory by
// stage_rows_kernel, each 32 values in two 8-bit planes. One plane (ggml's rounding, Q4kStagedX)
// keeps about 8 bits against the 32's largest value, and on the Q4_K and Q6_K fixtures a model's
// logits drifted 2.6e-2 and 2.8e-2 from the CPU's exact ones, past the bf16 bound (2e-2); two keep
// about 15. With dx = max |x| / 127 and p = x (1 / dx) (products rounded to float as Q4kStagedX's):
// hi = p rounded to nearest even, lo = (p - hi) 128 rounded to nearest even (|lo| <= 64), and x is
// taken as unit (128 hi + lo), unit = dx / 128. A tile multiplies each plane by one mma and joins
// the integer sums (combine): exact, and below 2^24, so exact as floats too. kWords a 32: hi's 32
// int8, lo's, unit, then unit sum(128 hi + lo) (Q4_K's mins' term).
struct StagedRowsX {
  static constexpr int kWords = 18;
  static constexpr int kLowWord = 8;
  static constexpr int kScaleWord = 16;

  __host__ __device__ static float product(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);  // never contracted into p - hi
#else
    return static_cast<float>(static_cast<double>(a) *
                              static_cast<double>(b));  // exact, rounded once
#endif
  }

  // Sub-block s (32 values at xs, 16-byte aligned) into staged + kWords s.
  __host__ __device__ static void stage(const bf16* xs, uint32_t* sub_block) {
    float v[32];
    const float dx = load_sub_block(xs, v), inverse = dx != 0.f ? 1.f / dx : 0.f;
    int sum = 0;
#pragma unroll
    for (int w = 0; w < 8; ++w) {
      uint32_t high = 0, low = 0;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float p = product(v[4 * w + j], inverse);
        const float hi = rintf(p);
        const int lo = static_cast<int>(rintf((p - hi) * 128.f));  // p - hi: exact
        sum += combine(static_cast<int>(hi), lo);
        high |= (static_cast<uint32_t>(static_cast<int>(hi)) & 0xffu) << (8 * j);
        low |= (static_cast<uint32_t>(lo) & 0xffu) << (8 * j);
      }
      sub_block[w] = high;
      sub_block[kLowWord + w] = low;
    }
    const float unit = dx * (1.f / 128.f);
    sub_block[kScaleWord] = float_bits(unit);
    sub_block[kScaleWord + 1] = float_bits(unit * static_cast<float>(sum));
  }

  // One value, or one dot product's sums, of the two planes in units.
  __host__ __device__ static int32_t combine(int32_t hi, int32_t lo) { return hi * 128 + lo; }
};

}  // namespace pagedlm::ops::cuda
