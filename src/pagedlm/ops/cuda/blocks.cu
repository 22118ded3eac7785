// The GPU's kernels for GGUF block weights (ops/linear_blocks.h): a matrix-vector product that
// expands blocks in registers (decode), and the expansion of a whole matrix to bf16 (prefill,
// before a GEMM). Both read the blocks as the file lays them out.
//
// Work unit: 8 consecutive weights of a block (a quarter of a 32-weight block, a 32nd of a
// K-quant's 256), which every format here yields from one or two 8-byte loads (Q8_0: 8 int8;
// the others: the low or high nibbles of 8 bytes, and Q5's fifth bits or Q6_K's high two from a
// few more) and which meet 8 bf16 activations in one 16-byte load. The lanes of a warp take
// consecutive units, so a warp reads 256 consecutive weights' bytes of a row per iteration.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"
#include "pagedlm/ops/cuda/kquant_lanes.cuh"
#include "pagedlm/ops/cuda/mma.cuh"
#include "pagedlm/ops/linear_blocks.h"

namespace pagedlm::ops::cuda {
namespace {

using ::pagedlm::cuda::detail::ceil_div;
using ::pagedlm::cuda::detail::launch_overlapped;
using ::pagedlm::cuda::detail::wait_for_inputs;
using ::pagedlm::cuda::detail::warp_sum;

constexpr int kWarpsPerBlock = 4;  // output features per thread block of the matrix-vector kernel

__device__ __forceinline__ uint32_t load_u32(const uint8_t* p) {
  const auto* h = reinterpret_cast<const uint16_t*>(p);
  return h[0] | (static_cast<uint32_t>(h[1]) << 16);
}

// Weights 8 * unit .. 8 * unit + 7 of a block, as ggml dequantizes them (ggml-quants.c; the
// layouts are core/quantized.h's).
template <QuantType kType>
__device__ __forceinline__ void dequantize_unit(const uint8_t* block, int unit, float* w) {
  if constexpr (kType == QuantType::kQ8_0) {
    const float d = load_f16(block);
    const uint2 q = load8(block + 2 + 8 * unit);
#pragma unroll
    for (int j = 0; j < 8; ++j) w[j] = static_cast<float>(static_cast<int8_t>(byte_of(q, j))) * d;
  } else if constexpr (kType == QuantType::kQ4_0 || kType == QuantType::kQ4_1 ||
                       kType == QuantType::kQ5_0 || kType == QuantType::kQ5_1) {
    // Weight j (< 16): the low nibble of byte j; weight j + 16: its high nibble; Q5's fifth bit
    // of weight j is bit j of qh.
    constexpr bool kMin = kType == QuantType::kQ4_1 || kType == QuantType::kQ5_1;
    constexpr bool kFifth = kType == QuantType::kQ5_0 || kType == QuantType::kQ5_1;
    constexpr int kQh = kMin ? 4 : 2;
    constexpr int kQs = (kMin ? 4 : 2) + (kFifth ? 4 : 0);
    const uint2 q = load8(block + kQs + 8 * (unit & 1));
    const int shift = unit < 2 ? 0 : 4;
    const uint32_t fifth = kFifth ? (load_u32(block + kQh) >> (8 * unit)) & 0xffu : 0u;
    const float d = load_f16(block);
    const float m = kMin ? load_f16(block + 2) : 0.f;
    constexpr int kOffset = kMin ? 0 : (kFifth ? 16 : 8);
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int v = ((byte_of(q, j) >> shift) & 0xf) | static_cast<int>(((fifth >> j) & 1u) << 4);
      if constexpr (kMin) {
        w[j] = static_cast<float>(v) * d + m;
      } else {
        w[j] = static_cast<float>(v - kOffset) * d;
      }
    }
  } else if constexpr (kType == QuantType::kQ4_K || kType == QuantType::kQ5_K) {
    // Sub-block sb = unit / 4 (32 weights): the low (even sb) or high (odd) nibbles of bytes
    // 32 (sb / 2) .. of the 128, scaled by d * sc[sb] less dmin * m[sb] (6-bit, packed in 12
    // bytes as ggml's get_scale_min_k4 reads them). Q5_K keeps 32 bytes of fifth bits between
    // the scales and the nibbles: weight l of sub-block sb has bit sb of byte l.
    constexpr bool kFifth = kType == QuantType::kQ5_K;
    const int sb = unit >> 2;
    const uint8_t* s = block + 4;
    int sc, mn;
    if (sb < 4) {
      sc = s[sb] & 63;
      mn = s[sb + 4] & 63;
    } else {
      sc = (s[sb + 4] & 0x0f) | ((s[sb - 4] >> 6) << 4);
      mn = (s[sb + 4] >> 4) | ((s[sb] >> 6) << 4);
    }
    const float d1 = load_f16(block) * static_cast<float>(sc);
    const float m1 = load_f16(block + 2) * static_cast<float>(mn);
    const int l0 = 8 * (unit & 3);  // the unit's first weight within its sub-block
    const uint2 q = load8(block + (kFifth ? 48 : 16) + 32 * (sb >> 1) + l0);
    const uint2 fifth = kFifth ? load8(block + 16 + l0) : uint2{0u, 0u};
    const int shift = (sb & 1) * 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int v = ((byte_of(q, j) >> shift) & 0xf) | (((byte_of(fifth, j) >> sb) & 1) << 4);
      w[j] = d1 * static_cast<float>(v) - m1;
    }
  } else if constexpr (kType == QuantType::kQ6_K) {
    // Half h of 128 weights, group g of 32 in it, l0 the unit's first of those 32: the low
    // (g < 2) or high nibbles of ql[64 h + 32 (g & 1) + l], bits 2g of qh[32 h + l], scale
    // sc[8 h + l / 16 + 2 g].
    const int h = unit >> 4, g = (unit >> 2) & 3, l0 = (unit & 3) * 8;
    const uint2 ql = load8(block + 64 * h + 32 * (g & 1) + l0);
    const uint2 qh = load8(block + 128 + 32 * h + l0);
    const auto sc = static_cast<float>(static_cast<int8_t>(block[192 + 8 * h + l0 / 16 + 2 * g]));
    const float d = load_f16(block + 208);
    const int shift = (g >> 1) * 4;
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int q = (((byte_of(ql, j) >> shift) & 0xf) | (((byte_of(qh, j) >> (2 * g)) & 3) << 4));
      w[j] = d * sc * static_cast<float>(q - 32);
    }
  }
}

// The warp sums its lanes' partial sums of output n for each of the kRows rows; lane 0 writes
// them (bf16 with the bias, or f32 without).
template <int kRows>
__device__ __forceinline__ void store_outputs(float (&acc)[kRows], const bf16* bias, void* out,
                                              bool out_f32, int n, int64_t out_stride) {
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = warp_sum(acc[r]);
  if (threadIdx.x != 0) return;
  const float b = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
#pragma unroll
  for (int r = 0; r < kRows; ++r) {
    const int64_t at = r * out_stride + n;
    if (out_f32) {
      static_cast<float*>(out)[at] = acc[r];
    } else {
      static_cast<bf16*>(out)[at] = __float2bfloat16(acc[r] + b);
    }
  }
}

// One warp per output feature n, all kRows rows of x at once (each weight read once): lane l takes
// units l, l + 32, ... of row n's blocks and accumulates w * x in f32 per row, then the warp
// sums its lanes. The order of every output's additions depends on in_features only, not on
// kRows or on the other rows.
template <QuantType kType, int kRows>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    block_matvec_kernel(const bf16* x, const uint8_t* blocks, const bf16* bias, void* out,
                        bool out_f32, int out_features, int in_features, int64_t out_stride) {
  wait_for_inputs();
  const int n = blockIdx.x * kWarpsPerBlock + static_cast<int>(threadIdx.y);
  if (n >= out_features) return;  // a whole warp: no block-wide synchronization follows
  constexpr int kBytes = static_cast<int>(quant_block_bytes(kType));
  constexpr int kElems = static_cast<int>(quant_block_elems(kType));
  constexpr int kUnits = kElems / 8;
  const int units = in_features / 8;
  const uint8_t* row = blocks + static_cast<int64_t>(n) * (in_features / kElems) * kBytes;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  for (int i = static_cast<int>(threadIdx.x); i < units; i += 32) {
    float w[8];
    dequantize_unit<kType>(row + (i / kUnits) * kBytes, i % kUnits, w);
    const int k0 = i * 8;  // unit i is weights 8i .. 8i + 7 of the row
#pragma unroll
    for (int r = 0; r < kRows; ++r) {
      const uint4 packed =
          *reinterpret_cast<const uint4*>(x + static_cast<int64_t>(r) * in_features + k0);
      const auto* xv = reinterpret_cast<const bf16*>(&packed);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[r] = fmaf(w[j], __bfloat162float(xv[j]), acc[r]);
    }
  }
  store_outputs<kRows>(acc, bias, out, out_f32, n, out_stride);
}

// The K-quants' matrix-vector kernel over a lane policy of kquant_lanes.cuh: eight lanes a
// 256-weight block, a warp four blocks an iteration, two iterations' loads in flight before
// either is used.
template <typename Lane, int kRows>
__global__ void __launch_bounds__(32 * kWarpsPerBlock)
    super_block_matvec_kernel(const bf16* x, const uint8_t* blocks, const bf16* bias, void* out,
                              bool out_f32, int out_features, int in_features, int64_t out_stride,
                              int block_bytes) {
  wait_for_inputs();
  const int n = blockIdx.x * kWarpsPerBlock + static_cast<int>(threadIdx.y);
  if (n >= out_features) return;  // a whole warp: no block-wide synchronization follows
  const int num_blocks = in_features / 256;
  const uint8_t* row = blocks + static_cast<int64_t>(n) * num_blocks * block_bytes;
  const int part = static_cast<int>(threadIdx.x) & 7;
  float acc[kRows];
#pragma unroll
  for (int r = 0; r < kRows; ++r) acc[r] = 0.f;
  auto load = [&](int b) { return Lane::load(row + static_cast<int64_t>(b) * block_bytes, part); };
  int b = static_cast<int>(threadIdx.x) >> 3;
  for (; b + 4 < num_blocks; b += 8) {
    const Lane first = load(b), second = load(b + 4);
    first.template dot<kRows>(part, x, in_features, int64_t{256} * b, acc);
    second.template dot<kRows>(part, x, in_features, int64_t{256} * (b + 4), acc);
  }
  if (b < num_blocks) load(b).template dot<kRows>(part, x, in_features, int64_t{256} * b, acc);
  store_outputs<kRows>(acc, bias, out, out_f32, n, out_stride);
}

// Q4_K times one row of x on tensor cores in integers (kquant_lanes.cuh's Q4kMmaTile): a thread
// block of kQ4kWarps warps takes 16 output features, its warps blocks w, w + kQ4kWarps, ... of
// their rows, each warp with the next block's weights in flight while it multiplies one; the
// warps' sums meet in shared memory. Each warp rounds the x of its own blocks to 8 bits
// (Q4kStagedX::stage_quarter: a lane 8 values, four lanes a sub-block), one block at a time into
// two small buffers of its own in shared memory, just before it multiplies them, with the next
// block's x loaded beside its weights: no thread block waits at a barrier for the whole row to
// be rounded first, and the shared memory does not grow with the row (H100, 8B shape, one
// stream: 1.048x the thread block rounding the whole row into its shared memory first, 378.0,
// 378.3 against 360.5, 361.1 output tok/s; that first pass was up to 1.075x by the measure of
// skipping it, docs/KERNELS.md). Per 16 x 256 weights a lane runs 8 int8 mmas and about 30
// integer instructions to form their fragments. On the H100 (8B shape, one stream;
// docs/PERF.md) the integer form was 1.05x the bf16 mma form it replaced (16 mmas and about 110
// instructions for the fragments, x staged in bf16 with its sums), which had been 1.03x the same
// with x and its sums in registers (122 registers, two thread blocks an SM). Of the shapes measured
// there, 8 warps a thread block and 3 thread blocks an SM (80 registers) is the fastest: 2 blocks
// 0.99x, 4 warps with 4 or 6 blocks 0.97x / 0.95x, 16 warps 0.87x. Slower still on the H200: two
// 16-feature tiles a warp (199 registers), and persistent thread blocks streaming their items
// through cp.async stages in shared memory. Launching it for programmatic dependent launch (its
// first weights loading while the kernel before it ends) ran 0.99x on the H100, and so did, within
// 1%, two blocks of weights in flight a warp; K split over thread block clusters ran 0.77x and
// 0.54x (docs/KERNELS.md).
constexpr int kQ4kWarps = 8;
constexpr int kQ4kBlocksPerSm = 3;

// A warp's walk over its blocks warp, warp + kQ4kWarps, ... of a row (fewer than num_blocks), with
// tiles[0] holding block `warp`: step(b, tile, next) multiplies block b from `tile` and loads the
// warp's next block into `next`; the two register sets alternate instead of one being copied into
// the other.
template <typename Tile, typename Step>
__device__ __forceinline__ void walk_blocks(int warp, int num_blocks, Tile (&tiles)[2],
                                            Step&& step) {
  if (warp >= num_blocks) return;
  for (int b = warp;;) {
    step(b, tiles[0], tiles[1]);
    if ((b += kQ4kWarps) >= num_blocks) break;
    step(b, tiles[1], tiles[0]);
    if ((b += kQ4kWarps) >= num_blocks) break;
  }
}

__global__ void __launch_bounds__(32 * kQ4kWarps, kQ4kBlocksPerSm)
    q4k_matvec_mma_kernel(const bf16* x, const uint8_t* blocks, const bf16* bias, void* out,
                          bool out_f32, int out_features, int in_features) {
  // Each warp's two buffers of one block's rounded x (8 sub-blocks), used in turn.
  __shared__ __align__(16) uint32_t staged[kQ4kWarps][2][8 * Q4kStagedX::kWords];
  __shared__ float partial[kQ4kWarps][16];
  const int lane = static_cast<int>(threadIdx.x), warp = static_cast<int>(threadIdx.y);
  const int g = lane >> 2, t = lane & 3;
  const int num_blocks = in_features / 256;
  const int n0 = static_cast<int>(blockIdx.x) * 16;
  // Rows past the matrix read row 0 (their sums are never stored).
  const int64_t row_bytes = static_cast<int64_t>(num_blocks) * 144;
  const uint8_t* row_g = blocks + (n0 + g < out_features ? n0 + g : 0) * row_bytes;
  const uint8_t* row_g8 = blocks + (n0 + g + 8 < out_features ? n0 + g + 8 : 0) * row_bytes;
  auto load = [&](int b) { return Q4kMmaTile::load(row_g + 144 * b, row_g8 + 144 * b, t); };
  // The lane's 8 values of x in block b.
  auto load_x = [&](int b) { return load16(x + 256 * b + 8 * lane); };
  Q4kMmaTile tiles[2];
  uint4 x_next = make_uint4(0, 0, 0, 0);
  // The weights are constant: a warp's first block loads while the kernel before this one ends.
  if (warp < num_blocks) tiles[0] = load(warp);
  wait_for_inputs();
  if (warp < num_blocks) x_next = load_x(warp);
  float acc[2] = {0.f, 0.f};
  int buffer = 0;
  // Rounds block b's x (loaded with its weights) into the warp's next buffer, then multiplies
  // block b from `tile` while block b + kQ4kWarps and its x load. With two buffers one barrier
  // of the warp a block suffices: a lane writes a buffer again only after every lane has passed
  // the barrier of the block between, so after it read the buffer.
  auto step = [&](int b, const Q4kMmaTile& tile, Q4kMmaTile& next) {
    uint32_t* xs = staged[warp][buffer];
    buffer ^= 1;
    Q4kStagedX::stage_quarter(x_next, xs + Q4kStagedX::kWords * (lane >> 2), lane & 3);
    __syncwarp();
    if (b + kQ4kWarps < num_blocks) {
      next = load(b + kQ4kWarps);
      x_next = load_x(b + kQ4kWarps);
    }
    int32_t c[4] = {0, 0, 0, 0};
#pragma unroll
    for (int p = 0; p < 4; ++p) {
      uint32_t a[4], low[2], high[2];
      Q4kStagedX::b_fragments(xs, 0, g, t, p, low, high);
      tile.a_fragment(0, p, a);
      ::pagedlm::cuda::detail::mma_16832_s8(c, a, low[0], low[1]);
      tile.a_fragment(1, p, a);
      ::pagedlm::cuda::detail::mma_16832_s8(c, a, high[0], high[1]);
    }
    float dx[2], x_sum[2];
    Q4kStagedX::scales(xs, 0, t, dx, x_sum);
    tile.accumulate(t, c, dx, x_sum, acc);
  };
  walk_blocks(warp, num_blocks, tiles, step);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float v = acc[h];
    v += __shfl_xor_sync(0xffffffffu, v, 1);
    v += __shfl_xor_sync(0xffffffffu, v, 2);
    if (t == 0) partial[warp][g + 8 * h] = v;
  }
  __syncthreads();
  if (warp != 0 || lane >= 16 || n0 + lane >= out_features) return;
  float sum = 0.f;
#pragma unroll
  for (int w = 0; w < kQ4kWarps; ++w) sum += partial[w][lane];
  const int n = n0 + lane;
  if (out_f32) {
    static_cast<float*>(out)[n] = sum;
  } else {
    const float bias_n = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
    static_cast<bf16*>(out)[n] = __float2bfloat16(sum + bias_n);
  }
}

void launch_q4k_matvec_mma(const bf16* x, const uint8_t* blocks, const bf16* bias, void* out,
                           bool out_f32, int out_features, int in_features, cudaStream_t stream) {
  launch_overlapped(q4k_matvec_mma_kernel, ceil_div(out_features, 16), dim3(32, kQ4kWarps), 0,
                    stream, x, blocks, bias, out, out_f32, out_features, in_features);
}

// Rows of x in two 8-bit planes per 32 values, StagedRowsX's layout, [rows][in_features / 32]
// sub-blocks of StagedRowsX::kWords words: one thread a sub-block.
__global__ void stage_rows_kernel(const bf16* x, uint32_t* staged, int64_t sub_blocks) {
  wait_for_inputs();
  const int64_t s = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
  if (s < sub_blocks) StagedRowsX::stage(x + 32 * s, staged + StagedRowsX::kWords * s);
}

// The staged rows of x a lane reads, in kTiles groups of eight (an mma's columns each): B's column
// g, C's columns 2t, 2t + 1. Rows past x's read its last row (their sums are never stored).
template <int kTiles>
struct LaneRows {
  const uint32_t* b[kTiles];
  const uint32_t* c[kTiles][2];

  __device__ LaneRows(const uint32_t* staged, int64_t row_words, int rows, int g, int t) {
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      b[nt] = staged + min(8 * nt + g, rows - 1) * row_words;
      c[nt][0] = staged + min(8 * nt + 2 * t, rows - 1) * row_words;
      c[nt][1] = staged + min(8 * nt + 2 * t + 1, rows - 1) * row_words;
    }
  }
};

// One 256-weight block of 16 features times the rows of x staged by stage_rows_kernel, added to
// the lane's sums (C's layout, each group of eight rows: feature g with rows 2t, 2t + 1, then
// feature g + 8). An output's arithmetic is the same in any group, so a row's sums do not depend
// on the rows beside it.
// Q4_K: eight sub-blocks of 32, one mma m16n8k32 a plane and a group each, less the mins' term.
template <int kTiles>
__device__ __forceinline__ void multiply_block(const Q4kRowsTile& tile, int b, int t,
                                               const LaneRows<kTiles>& x, float (&acc)[kTiles][4]) {
  using X = StagedRowsX;
#pragma unroll
  for (int sb = 0; sb < 8; ++sb) {
    const int64_t at = static_cast<int64_t>(8 * b + sb) * X::kWords;
    uint32_t a[4];
    tile.a_fragment(sb, a);
    float scale[2], min[2];
    tile.sub_block_scales(sb, scale, min);
#pragma unroll
    for (int nt = 0; nt < kTiles; ++nt) {
      int32_t hi[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
      ::pagedlm::cuda::detail::mma_16832_s8(hi, a, x.b[nt][at + t], x.b[nt][at + 4 + t]);
      ::pagedlm::cuda::detail::mma_16832_s8(lo, a, x.b[nt][at + X::kLowWord + t],
                                            x.b[nt][at + X::kLowWord + 4 + t]);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float unit = float_from_bits(x.c[nt][h][at + X::kScaleWord]);
        const float x_sum = float_from_bits(x.c[nt][h][at + X::kScaleWord + 1]);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int i = 2 * r + h;
          acc[nt][i] =
              fmaf(scale[r] * unit, static_cast<float>(X::combine(hi[i], lo[i])), acc[nt][i]);
          acc[nt][i] = fmaf(-min[r], x_sum, acc[nt][i]);
        }
      }
    }
  }
}

// Q6_K: sixteen sub-blocks of 16, one mma m16n8k16 a plane and a group each; sub-block
// (h, grp, s) is half s of staged 32 number 4 h + grp of the block.
template <int kTiles>
__device__ __forceinline__ void multiply_block(const Q6kRowsTile& tile, int b, int t,
                                               const LaneRows<kTiles>& x, float (&acc)[kTiles][4]) {
  using X = StagedRowsX;
#pragma unroll
  for (int h = 0; h < 2; ++h) {
#pragma unroll
    for (int grp = 0; grp < 4; ++grp) {
      const int64_t at = static_cast<int64_t>(8 * b + 4 * h + grp) * X::kWords;
#pragma unroll
      for (int s = 0; s < 2; ++s) {
        uint32_t a[2];
        tile.a_fragment(h, grp, s, a);
        float scale[2];
        tile.sub_block_scales(h, grp, s, scale);
#pragma unroll
        for (int nt = 0; nt < kTiles; ++nt) {
          int32_t hi[4] = {0, 0, 0, 0}, lo[4] = {0, 0, 0, 0};
          ::pagedlm::cuda::detail::mma_16816_s8(hi, a, x.b[nt][at + 4 * s + t]);
          ::pagedlm::cuda::detail::mma_16816_s8(lo, a, x.b[nt][at + X::kLowWord + 4 * s + t]);
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            const float unit = float_from_bits(x.c[nt][i & 1][at + X::kScaleWord]);
            acc[nt][i] = fmaf(scale[i >> 1] * unit, static_cast<float>(X::combine(hi[i], lo[i])),
                              acc[nt][i]);
          }
        }
      }
    }
  }
}

// K-quant blocks (Q4kRowsTile, Q6kRowsTile) times two to kStagedRowsMaxRows rows of x on tensor
// cores in integers, x staged by stage_rows_kernel: a thread block of kQ4kWarps warps takes 16
// output features, its warps blocks w, w + kQ4kWarps, ... of their rows with the next block's
// weights in flight, as the one-row Q4_K kernel. Each sub-block is one mma a plane of x
// (StagedRowsX) and a group of eight rows (kTiles groups) whose columns are the rows, and the lane
// scales each of its sums by its features' and rows' factors. The warps' sums meet in shared
// memory. Every output's additions run in one order (blocks in a warp's order, sub-blocks in order,
// then the warps in order), whatever the number of rows: a row's outputs do not depend on the rows
// beside it.
template <typename Tile, int kBlockBytes, int kTiles>
__global__ void __launch_bounds__(32 * kQ4kWarps)
    rows_mma_kernel(const uint32_t* staged, const uint8_t* blocks, const bf16* bias, void* out,
                    bool out_f32, int rows, int out_features, int in_features, int64_t out_stride) {
  wait_for_inputs();
  __shared__ float partial[kQ4kWarps][16][8 * kTiles];
  const int lane = static_cast<int>(threadIdx.x), warp = static_cast<int>(threadIdx.y);
  const int g = lane >> 2, t = lane & 3;
  const int num_blocks = in_features / 256;
  const int64_t row_words = static_cast<int64_t>(in_features / 32) * StagedRowsX::kWords;
  const int n0 = static_cast<int>(blockIdx.x) * 16;
  const int64_t row_bytes = static_cast<int64_t>(num_blocks) * kBlockBytes;
  const uint8_t* row_g = blocks + (n0 + g < out_features ? n0 + g : 0) * row_bytes;
  const uint8_t* row_g8 = blocks + (n0 + g + 8 < out_features ? n0 + g + 8 : 0) * row_bytes;
  const LaneRows<kTiles> x(staged, row_words, rows, g, t);
  auto load = [&](int b) {
    return Tile::load(row_g + kBlockBytes * b, row_g8 + kBlockBytes * b, t);
  };
  float acc[kTiles][4] = {};
  auto step = [&](int b, const Tile& tile, Tile& next) {
    if (b + kQ4kWarps < num_blocks) next = load(b + kQ4kWarps);
    multiply_block(tile, b, t, x, acc);
  };
  Tile tiles[2];
  if (warp < num_blocks) tiles[0] = load(warp);
  walk_blocks(warp, num_blocks, tiles, step);
#pragma unroll
  for (int nt = 0; nt < kTiles; ++nt) {
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      partial[warp][g + 8 * (i >> 1)][8 * nt + 2 * t + (i & 1)] = acc[nt][i];
    }
  }
  __syncthreads();
  for (int at = lane + 32 * warp; at < 16 * rows; at += 32 * kQ4kWarps) {
    const int feature = at & 15, row = at >> 4, n = n0 + feature;
    if (n >= out_features) continue;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kQ4kWarps; ++w) sum += partial[w][feature][row];
    const int64_t o = row * out_stride + n;
    if (out_f32) {
      static_cast<float*>(out)[o] = sum;
    } else {
      const float bias_n = bias != nullptr ? __bfloat162float(bias[n]) : 0.f;
      static_cast<bf16*>(out)[o] = __float2bfloat16(sum + bias_n);
    }
  }
}

template <typename Tile, int kBlockBytes>
void launch_rows_mma(const uint32_t* staged, const uint8_t* blocks, const bf16* bias, void* out,
                     bool out_f32, int rows, int out_features, int in_features, int64_t out_stride,
                     cudaStream_t stream) {
  static_assert(kStagedRowsMaxRows <= 16, "the larger kernel takes two groups of eight rows");
  const dim3 grid(ceil_div(out_features, 16)), threads(32, kQ4kWarps);
  auto launch = [&](auto tiles) {
    launch_overlapped(rows_mma_kernel<Tile, kBlockBytes, decltype(tiles)::value>, grid, threads, 0,
                      stream, staged, blocks, bias, out, out_f32, rows, out_features, in_features,
                      out_stride);
  };
  if (rows <= 8) {
    launch(std::integral_constant<int, 1>{});
  } else {
    launch(std::integral_constant<int, 2>{});
  }
}

// One thread per unit of 8 weights, one 16-byte store.
template <QuantType kType>
__global__ void dequantize_blocks_kernel(const uint8_t* blocks, bf16* dense, int64_t units) {
  wait_for_inputs();
  constexpr int kBytes = static_cast<int>(quant_block_bytes(kType));
  constexpr int kUnits = static_cast<int>(quant_block_elems(kType)) / 8;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < units;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float w[8];
    dequantize_unit<kType>(blocks + (i / kUnits) * kBytes, static_cast<int>(i % kUnits), w);
    uint4 packed;
    auto* o = reinterpret_cast<bf16*>(&packed);
#pragma unroll
    for (int j = 0; j < 8; ++j) o[j] = __float2bfloat16(w[j]);
    reinterpret_cast<uint4*>(dense)[i] = packed;  // unit i is weights 8i .. 8i + 7 of dense
  }
}

template <QuantType kType, int kRows>
cudaError_t launch_matvec_rows(const void* x, const void* blocks, const void* bias, void* out,
                               bool out_f32, int rows, int out_features, int in_features,
                               int64_t out_stride, cudaStream_t stream) {
  if constexpr (kRows > 1) {
    if (rows < kRows) {
      return launch_matvec_rows<kType, kRows - 1>(x, blocks, bias, out, out_f32, rows, out_features,
                                                  in_features, out_stride, stream);
    }
  }
  // Q4_K at one row: tensor cores (16-byte aligned blocks and x, as cudaMalloc's are). Its first
  // form, on the H200 (8B shape, one stream), ran 1.40x the Q4_K lanes that it replaced, which
  // had been 1.5x the generic kernel; at more rows Q4_K keeps the generic kernel (those lanes ran
  // 0.90x and 0.77x of it at four and eight rows).
  if constexpr (kType == QuantType::kQ4_K && kRows == 1) {
    if (reinterpret_cast<uintptr_t>(blocks) % 16 == 0 && reinterpret_cast<uintptr_t>(x) % 16 == 0) {
      launch_q4k_matvec_mma(static_cast<const bf16*>(x), static_cast<const uint8_t*>(blocks),
                            static_cast<const bf16*>(bias), out, out_f32, out_features, in_features,
                            stream);
      return cudaGetLastError();
    }
  }
  const dim3 threads(32, kWarpsPerBlock);
  const unsigned grid = ceil_div(out_features, kWarpsPerBlock);
  // Q6_K's lanes at every row count: on the H200 (8B shape, one to eight decoding sequences) 1.8x
  // the generic kernel at one row, 1.2x at four and eight.
  if constexpr (kType == QuantType::kQ6_K) {
    launch_overlapped(super_block_matvec_kernel<Q6kLane, kRows>, grid, threads, 0, stream,
                      static_cast<const bf16*>(x), static_cast<const uint8_t*>(blocks),
                      static_cast<const bf16*>(bias), out, out_f32, out_features, in_features,
                      out_stride, static_cast<int>(quant_block_bytes(kType)));
    return cudaGetLastError();
  }
  launch_overlapped(block_matvec_kernel<kType, kRows>, grid, threads, 0, stream,
                    static_cast<const bf16*>(x), static_cast<const uint8_t*>(blocks),
                    static_cast<const bf16*>(bias), out, out_f32, out_features, in_features,
                    out_stride);
  return cudaGetLastError();
}

template <QuantType kType>
cudaError_t launch_matvec(const void* x, const void* blocks, const void* bias, void* out,
                          bool out_f32, int rows, int out_features, int in_features,
                          int64_t out_stride, cudaStream_t stream) {
  static_assert(kBlockMatvecMaxRows == 8, "launch_matvec_rows starts at kBlockMatvecMaxRows");
  return launch_matvec_rows<kType, 8>(x, blocks, bias, out, out_f32, rows, out_features,
                                      in_features, out_stride, stream);
}

template <QuantType kType>
cudaError_t launch_dequantize(const void* blocks, void* dense, int64_t units, cudaStream_t stream) {
  constexpr int kThreads = 256;
  const unsigned grid = std::min<unsigned>(ceil_div(units, kThreads), 65535u * 16);
  launch_overlapped(dequantize_blocks_kernel<kType>, grid, kThreads, 0, stream,
                    static_cast<const uint8_t*>(blocks), static_cast<bf16*>(dense), units);
  return cudaGetLastError();
}

// Calls f(std::integral_constant<QuantType, type>{}) for the formats the GPU computes from;
// cudaErrorInvalidValue for the others.
template <typename F>
cudaError_t dispatch(QuantType type, F&& f) {
  switch (type) {
    case QuantType::kQ8_0:
      return f(std::integral_constant<QuantType, QuantType::kQ8_0>{});
    case QuantType::kQ4_0:
      return f(std::integral_constant<QuantType, QuantType::kQ4_0>{});
    case QuantType::kQ4_1:
      return f(std::integral_constant<QuantType, QuantType::kQ4_1>{});
    case QuantType::kQ5_0:
      return f(std::integral_constant<QuantType, QuantType::kQ5_0>{});
    case QuantType::kQ5_1:
      return f(std::integral_constant<QuantType, QuantType::kQ5_1>{});
    case QuantType::kQ4_K:
      return f(std::integral_constant<QuantType, QuantType::kQ4_K>{});
    case QuantType::kQ5_K:
      return f(std::integral_constant<QuantType, QuantType::kQ5_K>{});
    case QuantType::kQ6_K:
      return f(std::integral_constant<QuantType, QuantType::kQ6_K>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

void stage_rows(const void* x, void* staged, int64_t rows, int64_t in_features, void* stream) {
  static_assert(StagedRowsX::kWords == kStagedWordsPer32, "linear_blocks.h's size of a staged 32");
  const int64_t sub_blocks = rows * (in_features / 32);
  if (sub_blocks == 0) return;
  constexpr int kThreads = 128;
  launch_overlapped(stage_rows_kernel, ceil_div(sub_blocks, kThreads), kThreads, 0,
                    static_cast<cudaStream_t>(stream), static_cast<const bf16*>(x),
                    static_cast<uint32_t*>(staged), sub_blocks);
  ::pagedlm::cuda::check(cudaGetLastError(), "stage_rows");
}

void linear_blocks(const void* x, const void* blocks, QuantType type, const void* bias, void* out,
                   bool out_f32, int64_t rows, int64_t out_features, int64_t in_features,
                   int64_t out_stride, void* stream, const void* staged) {
  if (rows == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const auto r = static_cast<int>(rows), n = static_cast<int>(out_features),
             k = static_cast<int>(in_features);
  // With x staged, tensor cores (Q4_K's 144-byte blocks read 16 bytes at a time, 16-byte aligned
  // as linear_blocks checks; Q6_K's 210-byte ones 2 at a time).
  if (staged != nullptr && takes_staged_rows(type, rows)) {
    const auto* st = static_cast<const uint32_t*>(staged);
    const auto* bl = static_cast<const uint8_t*>(blocks);
    const auto* bi = static_cast<const bf16*>(bias);
    if (type == QuantType::kQ4_K) {
      launch_rows_mma<Q4kRowsTile, 144>(st, bl, bi, out, out_f32, r, n, k, out_stride, s);
    } else {
      launch_rows_mma<Q6kRowsTile, 210>(st, bl, bi, out, out_f32, r, n, k, out_stride, s);
    }
    ::pagedlm::cuda::check(cudaGetLastError(), "linear (GGUF blocks)");
    return;
  }
  const cudaError_t err = dispatch(type, [&](auto t) {
    return launch_matvec<decltype(t)::value>(x, blocks, bias, out, out_f32, r, n, k, out_stride, s);
  });
  ::pagedlm::cuda::check(err, "linear (GGUF blocks)");
}

void dequantize_blocks(const void* blocks, QuantType type, void* dense, int64_t out_features,
                       int64_t in_features, void* stream) {
  const int64_t units = out_features * in_features / 8;
  if (units == 0) return;
  const auto s = static_cast<cudaStream_t>(stream);
  const cudaError_t err = dispatch(
      type, [&](auto t) { return launch_dequantize<decltype(t)::value>(blocks, dense, units, s); });
  ::pagedlm::cuda::check(err, "dequantize_blocks");
}

}  // namespace pagedlm::ops::cuda
