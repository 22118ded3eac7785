// Mixture-of-experts on the GPU (ops/moe.h), in four launches a layer, none of which waits for
// the host (a decode step stays one CUDA graph while the experts' loads change every step):
//   1. route: one warp per token, softmax over the experts in registers, top k by repeated warp
//      arg-max, renormalized;
//   2. plan: one block counts the (token, slot) pairs per expert, scans the counts into each
//      expert's first grouped row and tiles of rows, and scatters the pairs into grouped order;
//   3. the grouped GEMMs: one launch per projection over all experts, each block a tile of one
//      expert's rows (looked up in the plan; blocks past the plan's tile count exit) times a
//      column tile of that expert's weight, on tensor cores (mma.sync m16n8k16, cp.async
//      pipeline). The gate/up GEMM gathers its rows from the tokens and applies the activation
//      in its epilogue (gate and up rows are interleaved by 8, moe_gate_up_row), so only the
//      activated rows reach memory; the down GEMM writes each grouped row's output;
//   4. combine: each token's k outputs, weighted, summed in slot order in f32, rounded once.
// A token's result does not depend on where its rows land in the grouping (each output element
// is one row times one column, reduced over K in a fixed order), so the op is batch invariant
// although the scatter's order within an expert is not deterministic.

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cmath>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"
#include "pagedlm/ops/cuda/mma.cuh"
#include "pagedlm/ops/moe.h"

namespace pagedlm::ops::cuda {

namespace {

using bf16 = __nv_bfloat16;
using ::pagedlm::cuda::check;
using ::pagedlm::cuda::detail::ceil_div;
using ::pagedlm::cuda::detail::cp_async_16;
using ::pagedlm::cuda::detail::cp_async_commit;
using ::pagedlm::cuda::detail::cp_async_wait;
using ::pagedlm::cuda::detail::GeluTanh;
using ::pagedlm::cuda::detail::ldmatrix_x4;
using ::pagedlm::cuda::detail::mma_16816;
using ::pagedlm::cuda::detail::pack_bf16;
using ::pagedlm::cuda::detail::Silu;

cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// ---- 1. route -------------------------------------------------------------------------------

constexpr int kRouteWarps = 4;

// Each lane holds experts lane, lane + 32, ...; PER_LANE * 32 >= E.
template <int PER_LANE>
__global__ void route_kernel(const float* logits, int tokens, int E, int k, bool normalize,
                             int32_t* ids, float* weights) {
  const int lane = threadIdx.x & 31;
  const int t = blockIdx.x * kRouteWarps + (threadIdx.x >> 5);
  if (t >= tokens) return;
  const float* row = logits + static_cast<size_t>(t) * E;
  float p[PER_LANE];
  float max = -INFINITY;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? row[e] : -INFINITY;
    max = fmaxf(max, p[i]);
  }
  max = ::pagedlm::cuda::detail::warp_max(max);
  float sum = 0.f;
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? expf(p[i] - max) : 0.f;
    sum += p[i];
  }
  sum = ::pagedlm::cuda::detail::warp_sum(sum);
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) {
    const int e = lane + 32 * i;
    p[i] = e < E ? p[i] / sum : -1.f;  // -1: no expert, or taken
  }
  float picked_sum = 0.f;
  for (int j = 0; j < k; ++j) {
    // The lane's best (the lower expert on ties: i ascends with e), then the warp's.
    float best = -1.f;
    int best_e = E;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      if (p[i] > best) {
        best = p[i];
        best_e = lane + 32 * i;
      }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      const float other = __shfl_xor_sync(0xffffffffu, best, o);
      const int other_e = __shfl_xor_sync(0xffffffffu, best_e, o);
      if (other > best || (other == best && other_e < best_e)) {
        best = other;
        best_e = other_e;
      }
    }
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
      if (lane + 32 * i == best_e) p[i] = -1.f;  // taken
    }
    picked_sum += best;
    if (lane == 0) {
      ids[static_cast<size_t>(t) * k + j] = best_e;
      weights[static_cast<size_t>(t) * k + j] = best;
    }
  }
  if (lane == 0 && normalize) {
    for (int j = 0; j < k; ++j) weights[static_cast<size_t>(t) * k + j] /= picked_sum;
  }
}

// ---- 2. plan ------------------------------------------------------------------------------

// The plan (ops::moe_plan_size): counts [E] | offsets [E + 1] | tile count [1] | tiles (expert,
// first grouped row) [max_tiles] | token of each grouped row [rows] | grouped row of each
// (token, slot) [rows].
struct PlanView {
  int32_t *counts, *offsets, *num_tiles, *tiles, *token_of, *grouped_of;
};

PlanView plan_view(int32_t* plan, int rows, int E) {
  const int max_tiles = static_cast<int>(ceil_div(rows, 16)) + E;  // ops::moe_plan_size's bound
  PlanView v;
  v.counts = plan;
  v.offsets = v.counts + E;
  v.num_tiles = v.offsets + E + 1;
  v.tiles = v.num_tiles + 1;
  v.token_of = v.tiles + 2 * max_tiles;
  v.grouped_of = v.token_of + rows;
  return v;
}

constexpr int kPlanThreads = 1024;

__global__ void plan_kernel(const int32_t* ids, int rows, int k, int E, int tile_rows, PlanView v,
                            int32_t* activated) {
  __shared__ int count[ops::kMaxExperts], first[ops::kMaxExperts + 1],
      tile_first[ops::kMaxExperts + 1], cursor[ops::kMaxExperts];
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    count[e] = 0;
    cursor[e] = 0;
  }
  __syncthreads();
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    atomicAdd(&count[min(max(ids[i], 0), E - 1)], 1);  // router ids are in range; stay safe
  }
  __syncthreads();
  // Exclusive scans of the counts and of the tiles per expert, by warp 0: lane l takes a
  // contiguous run of experts.
  if (threadIdx.x < 32) {
    const int lane = threadIdx.x;
    const int per_lane = (E + 31) / 32;
    const int e0 = min(E, lane * per_lane), e1 = min(E, e0 + per_lane);
    int rows_sum = 0, tiles_sum = 0, used = 0;
    for (int e = e0; e < e1; ++e) {
      rows_sum += count[e];
      tiles_sum += (count[e] + tile_rows - 1) / tile_rows;
      used += count[e] > 0;
    }
    int rows_before = rows_sum, tiles_before = tiles_sum;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const int r = __shfl_up_sync(0xffffffffu, rows_before, o);
      const int t = __shfl_up_sync(0xffffffffu, tiles_before, o);
      if (lane >= o) {
        rows_before += r;
        tiles_before += t;
      }
    }
    rows_before -= rows_sum;
    tiles_before -= tiles_sum;
    for (int e = e0; e < e1; ++e) {
      first[e] = rows_before;
      tile_first[e] = tiles_before;
      rows_before += count[e];
      tiles_before += (count[e] + tile_rows - 1) / tile_rows;
    }
    if (lane == 31) {
      first[E] = rows_before;
      tile_first[E] = tiles_before;
      *v.num_tiles = tiles_before;
    }
    for (int o = 16; o > 0; o >>= 1) used += __shfl_xor_sync(0xffffffffu, used, o);
    if (lane == 0 && activated != nullptr) atomicAdd(activated, used);
  }
  __syncthreads();
  for (int e = threadIdx.x; e < E; e += blockDim.x) {
    v.counts[e] = count[e];
    v.offsets[e] = first[e];
    for (int t = tile_first[e]; t < tile_first[e + 1]; ++t) {
      v.tiles[2 * t] = e;
      v.tiles[2 * t + 1] = first[e] + (t - tile_first[e]) * tile_rows;
    }
  }
  if (threadIdx.x == 0) v.offsets[E] = first[E];
  for (int i = threadIdx.x; i < rows; i += blockDim.x) {
    const int e = min(max(ids[i], 0), E - 1);
    const int pos = first[e] + atomicAdd(&cursor[e], 1);
    v.token_of[pos] = i / k;
    v.grouped_of[i] = pos;
  }
}

// ---- 3. grouped GEMM ------------------------------------------------------------------------

// C[row, n] = sum_k A[a_row(row), k] * B_e[n, k] for the rows of each tile, e the tile's expert.
// Block tile BM x BN x kBK, warps of 32 x WN (BM / 32 along M, BN / WN along N), STAGES-deep
// cp.async pipeline. Shared rows are padded to kBK + 8 elements: the 8 rows an ldmatrix reads then
// start 16 bytes apart in the bank space, so no two conflict.
constexpr int kBK = 64, kPad = 8, kStride = kBK + kPad;

template <int BM_, int BN_, int WN_, int STAGES_>
struct GemmTile {
  static constexpr int BM = BM_, BN = BN_, WN = WN_, STAGES = STAGES_;
  static constexpr int kWarpsN = BN / WN;
  static constexpr int kThreads = BM / 32 * kWarpsN * 32;
  static constexpr int kNTiles = WN / 8;  // n8 tiles a warp holds, in pairs (gate, up)
  static constexpr int kSmemBytes = STAGES * (BM + BN) * kStride * static_cast<int>(sizeof(bf16));
  static_assert(BM % 32 == 0 && BN % WN == 0 && WN % 16 == 0, "whole warps, pairs of n8 tiles");
};

struct GemmArgs {
  const bf16* a;             // [a_rows, K]: the tokens (gather) or the grouped rows
  const int32_t* a_row_of;   // grouped row -> row of a (the gather), or null: a's row is it
  const bf16* b;             // [E, N, K]
  bf16* c;                   // [rows, N], or [rows, N / 2] with the activation
  const int32_t* offsets;    // plan: each expert's first grouped row, [E + 1]
  const int32_t* num_tiles;  // plan
  const int32_t* tiles;      // plan: (expert, first grouped row) per tile
  int n, k;
};

// ACT: 0 none (C is [rows, N]), 1 SiLU, 2 GELU-tanh; with an activation, B's rows alternate 8
// gate rows and 8 up rows and C is [rows, N / 2].
template <class Tile, int ACT>
__global__ void __launch_bounds__(Tile::kThreads) grouped_gemm_kernel(const GemmArgs args) {
  constexpr int BM = Tile::BM, kBN = Tile::BN, kStages = Tile::STAGES;
  constexpr int kThreads = Tile::kThreads, kNTiles = Tile::kNTiles;
  const int tile = blockIdx.x;
  if (tile >= *args.num_tiles) return;
  const int expert = args.tiles[2 * tile];
  const int row0 = args.tiles[2 * tile + 1];
  const int tile_rows = min(BM, args.offsets[expert + 1] - row0);
  const int n0 = blockIdx.y * kBN;
  const int N = args.n, K = args.k;

  extern __shared__ __align__(16) unsigned char smem_raw[];
  bf16* const a_s = reinterpret_cast<bf16*>(smem_raw);  // [kStages][BM][kStride]
  bf16* const b_s = a_s + kStages * BM * kStride;       // [kStages][kBN][kStride]

  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  // Warp (m, n) of the block, each 32 x WN. Two spellings of one division: each tile compiles to
  // the instructions that were measured (docs/KERNELS.md); one spelling for all moved the 128-row
  // tile's register allocation and its prefill time by 5% (H200).
  const int warp_m = Tile::kWarpsN == 2 ? warp >> 1 : static_cast<unsigned>(warp) / Tile::kWarpsN;
  const int warp_n = Tile::kWarpsN == 2 ? warp & 1 : static_cast<unsigned>(warp) % Tile::kWarpsN;

  // Each thread copies fixed 16-byte chunks of every stage: its rows' sources are found once.
  constexpr int kChunksPerRow = kBK / 8;
  constexpr int kAChunks = BM * kChunksPerRow / kThreads;
  constexpr int kBChunks = kBN * kChunksPerRow / kThreads;
  const bf16* a_src[kAChunks];
  bool a_valid[kAChunks];
#pragma unroll
  for (int i = 0; i < kAChunks; ++i) {
    const int r = (tid + i * kThreads) / kChunksPerRow;
    a_valid[i] = r < tile_rows;
    const int grouped = row0 + (a_valid[i] ? r : 0);
    const int a_row = args.a_row_of != nullptr ? args.a_row_of[grouped] : grouped;
    a_src[i] = args.a + static_cast<size_t>(a_row) * K;
  }
  const bf16* b_expert = args.b + static_cast<size_t>(expert) * N * K;
  const bf16* b_src[kBChunks];
  bool b_valid[kBChunks];
#pragma unroll
  for (int i = 0; i < kBChunks; ++i) {
    const int r = (tid + i * kThreads) / kChunksPerRow;
    b_valid[i] = n0 + r < N;
    b_src[i] = b_expert + static_cast<size_t>(b_valid[i] ? n0 + r : 0) * K;
  }

  auto load_stage = [&](int stage, int k0) {
    bf16* as = a_s + stage * BM * kStride;
    bf16* bs = b_s + stage * kBN * kStride;
#pragma unroll
    for (int i = 0; i < kAChunks; ++i) {
      const int chunk = tid + i * kThreads;
      const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
      const bool ok = a_valid[i] && k0 + c < K;
      cp_async_16(as + r * kStride + c, ok ? a_src[i] + k0 + c : args.a, ok);
    }
#pragma unroll
    for (int i = 0; i < kBChunks; ++i) {
      const int chunk = tid + i * kThreads;
      const int r = chunk / kChunksPerRow, c = (chunk % kChunksPerRow) * 8;
      const bool ok = b_valid[i] && k0 + c < K;
      cp_async_16(bs + r * kStride + c, ok ? b_src[i] + k0 + c : args.b, ok);
    }
  };

  float acc[2][kNTiles][4];
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int ni = 0; ni < kNTiles; ++ni) {
#pragma unroll
      for (int q = 0; q < 4; ++q) acc[mi][ni][q] = 0.f;
    }
  }

  const int k_tiles = (K + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < k_tiles) load_stage(s, s * kBK);
    cp_async_commit();
  }
  for (int kt = 0; kt < k_tiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    // Refill the stage consumed last iteration (every warp is past it after the barrier).
    const int next = kt + kStages - 1;
    if (next < k_tiles) load_stage(next % kStages, next * kBK);
    cp_async_commit();

    const bf16* as = a_s + (kt % kStages) * BM * kStride + warp_m * 32 * kStride;
    const bf16* bs = b_s + (kt % kStages) * kBN * kStride + warp_n * Tile::WN * kStride;
#pragma unroll
    for (int kk = 0; kk < kBK; kk += 16) {
      uint32_t af[2][4];
#pragma unroll
      for (int mi = 0; mi < 2; ++mi) {
        // A fragment (rows 0-7 / 8-15 x k 0-7 / 8-15): lane l addresses row l % 16, k (l / 16) * 8.
        ldmatrix_x4(af[mi], as + (mi * 16 + (lane & 15)) * kStride + kk + (lane >> 4) * 8);
      }
#pragma unroll
      for (int nj = 0; nj < kNTiles / 2; ++nj) {
        // Two n8 tiles per ldmatrix: lane l addresses row (l % 8) + (l / 16) * 8 (n), k
        // ((l / 8) % 2) * 8; registers 0-1 are the first tile's, 2-3 the second's.
        uint32_t bf[4];
        ldmatrix_x4(bf, bs + (nj * 16 + (lane & 7) + (lane >> 4) * 8) * kStride + kk +
                            ((lane >> 3) & 1) * 8);
#pragma unroll
        for (int mi = 0; mi < 2; ++mi) {
          mma_16816(acc[mi][2 * nj], af[mi], bf[0], bf[1]);
          mma_16816(acc[mi][2 * nj + 1], af[mi], bf[2], bf[3]);
        }
      }
    }
  }
  cp_async_wait<0>();

  // Epilogue. Accumulator (mi, ni): rows lane / 4 and lane / 4 + 8 of the m16 tile, columns
  // (lane % 4) * 2 + {0, 1} of the n8 tile.
  const int r_base = warp_m * 32 + (lane >> 2);
  const int c_base = n0 + warp_n * Tile::WN + (lane & 3) * 2;
#pragma unroll
  for (int mi = 0; mi < 2; ++mi) {
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int r = r_base + mi * 16 + half * 8;
      if (r >= tile_rows) continue;
      const size_t grouped = static_cast<size_t>(row0 + r);
      if constexpr (ACT == 0) {
#pragma unroll
        for (int ni = 0; ni < kNTiles; ++ni) {
          const int c = c_base + ni * 8;
          if (c >= N) continue;
          const float* v = acc[mi][ni] + half * 2;
          if (c + 1 < N) {
            *reinterpret_cast<uint32_t*>(args.c + grouped * N + c) = pack_bf16(v[0], v[1]);
          } else {
            args.c[grouped * N + c] = __float2bfloat16(v[0]);
          }
        }
      } else {
        // n8 tiles 2j (gate) and 2j + 1 (up) hold the same 8 features (moe_gate_up_row).
        const int F = N / 2;
#pragma unroll
        for (int nj = 0; nj < kNTiles / 2; ++nj) {
          const int c = c_base + nj * 16;  // the gate column; feature = c / 16 * 8 + c % 8
          if (c >= N) continue;
          const int f = c / 16 * 8 + c % 8;
          const float* g = acc[mi][2 * nj] + half * 2;
          const float* u = acc[mi][2 * nj + 1] + half * 2;
          float y0, y1;
          if constexpr (ACT == 1) {
            y0 = Silu{}(g[0]) * u[0];
            y1 = Silu{}(g[1]) * u[1];
          } else {
            y0 = GeluTanh{}(g[0]) * u[0];
            y1 = GeluTanh{}(g[1]) * u[1];
          }
          *reinterpret_cast<uint32_t*>(args.c + grouped * F + f) = pack_bf16(y0, y1);
        }
      }
    }
  }
}

template <class Tile, int ACT>
void launch_grouped_gemm(const GemmArgs& args, int rows, int E, cudaStream_t stream) {
  constexpr int kSmem = Tile::kSmemBytes;
  // The limit is the device's: set at the first launch on a device (before any capture, in the
  // warm-up), whichever engine's thread gets there first.
  check(::pagedlm::cuda::allow_dynamic_smem(
            reinterpret_cast<const void*>(grouped_gemm_kernel<Tile, ACT>), kSmem),
        "moe_experts: shared memory");
  const dim3 grid(ceil_div(rows, Tile::BM) + E, ceil_div(args.n, Tile::BN));
  grouped_gemm_kernel<Tile, ACT><<<grid, Tile::kThreads, kSmem, stream>>>(args);
}

// Tile heights: 128-row tiles (8 warps) reuse each weight tile most in prefill, from 128 rows an
// expert on average, where the device gives a block their 111 KB of shared memory (GPUs of 99 KB
// a block, RTX 30xx / 40xx / 50xx, take 64-row tiles there). 32-row tiles (four 32 x 32 warp tiles
// side by side; 69 KB of shared memory, three blocks an SM on sm_90 where the 64-row tile's 83 KB
// allow two) only where no expert can get more than 32 rows, at up to 32 tokens (a token takes an
// expert once): there they never add a tile that reads an expert's weights again. 64-row tiles
// otherwise. The 32-row tile streamed Qwen3-30B-A3B's experts 8% faster than the 64-row one at 256
// tokens routed uniformly (16 rows an expert), but a shared-prefix batch, whose tokens crowd onto a
// few experts, decoded 7% slower with it: each crowded expert's weights went to twice the blocks
// (H200, docs/KERNELS.md).
using PrefillTile = GemmTile<128, 128, 64, 3>;
using MidTile = GemmTile<64, 128, 64, 3>;
using DecodeTile = GemmTile<32, 128, 32, 3>;

int tile_rows_for(int tokens, int rows, int E) {
  const ::pagedlm::cuda::DeviceLimits* limits = nullptr;
  check(::pagedlm::cuda::current_device_limits(&limits), "moe_experts: the CUDA device");
  if (rows >= 128 * E && static_cast<size_t>(PrefillTile::kSmemBytes) <= limits->smem_per_block) {
    return PrefillTile::BM;
  }
  if (tokens <= DecodeTile::BM) return DecodeTile::BM;
  return MidTile::BM;
}

template <int ACT>
void grouped_gemm(const GemmArgs& args, int tile_rows, int rows, int E, cudaStream_t stream) {
  switch (tile_rows) {
    case PrefillTile::BM:
      launch_grouped_gemm<PrefillTile, ACT>(args, rows, E, stream);
      break;
    case DecodeTile::BM:
      launch_grouped_gemm<DecodeTile, ACT>(args, rows, E, stream);
      break;
    default:
      launch_grouped_gemm<MidTile, ACT>(args, rows, E, stream);
      break;
  }
}

// ---- 4. combine -----------------------------------------------------------------------------

// out[t] = sum_j w[t, j] * y[grouped_of[t * k + j]], D % 8 == 0; one block per token.
__global__ void combine_kernel(const bf16* y, const int32_t* grouped_of, const float* weights,
                               int k, int D, bf16* out) {
  const int t = blockIdx.x;
  for (int i = threadIdx.x * 8; i < D; i += blockDim.x * 8) {
    float sum[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
    for (int j = 0; j < k; ++j) {
      const float w = weights[static_cast<size_t>(t) * k + j];
      const uint4 packed = *reinterpret_cast<const uint4*>(
          y + static_cast<size_t>(grouped_of[static_cast<size_t>(t) * k + j]) * D + i);
      const auto* v = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const float2 f = __bfloat1622float2(v[q]);
        sum[2 * q] += w * f.x;
        sum[2 * q + 1] += w * f.y;
      }
    }
    uint4 result;
    auto* r = reinterpret_cast<uint32_t*>(&result);
#pragma unroll
    for (int q = 0; q < 4; ++q) r[q] = pack_bf16(sum[2 * q], sum[2 * q + 1]);
    *reinterpret_cast<uint4*>(out + static_cast<size_t>(t) * D + i) = result;
  }
}

}  // namespace

void moe_route(const float* logits, bool normalize, int32_t* expert_ids, float* expert_weights,
               int64_t tokens, int64_t num_experts, int64_t k, void* stream) {
  if (tokens == 0) return;
  const dim3 grid(ceil_div(tokens, kRouteWarps));
  const int E = static_cast<int>(num_experts), T = static_cast<int>(tokens);
  const int K = static_cast<int>(k);
  cudaStream_t s = as_stream(stream);
  if (E <= 64) {
    route_kernel<2>
        <<<grid, kRouteWarps * 32, 0, s>>>(logits, T, E, K, normalize, expert_ids, expert_weights);
  } else if (E <= 128) {
    route_kernel<4>
        <<<grid, kRouteWarps * 32, 0, s>>>(logits, T, E, K, normalize, expert_ids, expert_weights);
  } else {
    route_kernel<16>
        <<<grid, kRouteWarps * 32, 0, s>>>(logits, T, E, K, normalize, expert_ids, expert_weights);
  }
  check(cudaGetLastError(), "moe_route");
}

void moe_experts(const Tensor& x, const Tensor& expert_ids, const Tensor& expert_weights,
                 const ExpertWeights& w, GatedActivation act, const MoeWorkspace& ws,
                 const Tensor& out, void* stream) {
  PAGEDLM_CHECK(x.dtype() == DType::kBF16, "moe_experts: the CUDA kernels compute in bf16, got ",
                dtype_name(x.dtype()));
  const int T = static_cast<int>(x.dim(0)), k = static_cast<int>(expert_ids.dim(1));
  const int E = static_cast<int>(w.num_experts), D = static_cast<int>(w.hidden);
  const int F = static_cast<int>(w.ffn);
  PAGEDLM_CHECK(D % 8 == 0 && F % 8 == 0, "moe_experts: the GPU needs hidden and expert sizes ",
                "that are multiples of 8, got ", D, " and ", F);
  if (T == 0) return;
  const int rows = T * k;
  cudaStream_t s = as_stream(stream);
  const PlanView plan = plan_view(ws.plan.data<int32_t>(), rows, E);
  const int tile_rows = tile_rows_for(T, rows, E);
  int32_t* activated =
      ws.activated.defined() && ws.activated.numel() > 0 ? ws.activated.data<int32_t>() : nullptr;
  plan_kernel<<<1, kPlanThreads, 0, s>>>(expert_ids.data<int32_t>(), rows, k, E, tile_rows, plan,
                                         activated);
  check(cudaGetLastError(), "moe_experts: plan");

  GemmArgs up;
  up.a = static_cast<const bf16*>(x.raw());
  up.a_row_of = plan.token_of;
  up.b = static_cast<const bf16*>(w.gate_up.raw());
  up.c = static_cast<bf16*>(ws.act.raw());
  up.offsets = plan.offsets;
  up.num_tiles = plan.num_tiles;
  up.tiles = plan.tiles;
  up.n = 2 * F;
  up.k = D;
  if (act == GatedActivation::kSilu) {
    grouped_gemm<1>(up, tile_rows, rows, E, s);
  } else {
    grouped_gemm<2>(up, tile_rows, rows, E, s);
  }
  check(cudaGetLastError(), "moe_experts: gate/up GEMM");

  GemmArgs down = up;
  down.a = static_cast<const bf16*>(ws.act.raw());
  down.a_row_of = nullptr;
  down.b = static_cast<const bf16*>(w.down.raw());
  down.c = static_cast<bf16*>(ws.expert_out.raw());
  down.n = D;
  down.k = F;
  grouped_gemm<0>(down, tile_rows, rows, E, s);
  check(cudaGetLastError(), "moe_experts: down GEMM");

  combine_kernel<<<T, 128, 0, s>>>(static_cast<const bf16*>(ws.expert_out.raw()), plan.grouped_of,
                                   expert_weights.data<float>(), k, D,
                                   static_cast<bf16*>(out.raw()));
  check(cudaGetLastError(), "moe_experts: combine");
}

}  // namespace pagedlm::ops::cuda
