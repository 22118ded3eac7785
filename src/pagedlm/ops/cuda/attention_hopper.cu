// Causal prefill attention for Hopper (sm_90a): S = Q K^T and O += P V on wgmma, the
// warpgroup-wide asynchronous tensor-core instruction that only sm_90a has. The mma.sync kernel
// (attention_kernel.cuh) reaches about 230-270 TFLOP/s on an H100 at head_dim 128 (docs/PERF.md):
// mma.sync issues m16n8k16 per warp, each warp's fragments loaded from shared memory by ldmatrix,
// while wgmma reads both of S's operands and V straight from shared memory, 64 rows x 128 columns
// an instruction, so the warps spend their issue slots on the softmax.
//
// One block: 128 rows of one sequence's (token, q head) pairs of kv head hk (the same GQA row
// packing and Unit as the mma.sync kernel, make_unit), two warpgroups of 64 rows each, 128-key
// tiles in two stages by cp.async. Shared memory holds Q, K and V in the layout wgmma reads
// with its 128-byte swizzle: each row's 128 values as two 64-value panels, a panel's row 128
// bytes, the 16-byte chunk c of row r at chunk c ^ (r % 8) (the XOR keeps cp.async's writes
// and wgmma's reads free of bank conflicts; the hardware undoes it from the address bits, so
// every tile starts on a 1024-byte boundary). K and Q are read K-major (d contiguous), V
// MN-major (d contiguous, the transposed B operand). S stays in registers; the online softmax
// runs on wgmma's accumulator layout (for each 8-column group, lane (g, t) of warp w holds rows
// 16 w + g and 16 w + g + 8, columns 2 t and 2 t + 1: mma.sync's m16n8 layout per warp), and P
// feeds the second wgmma from registers in the A layout that accumulator layout converts to.
//
// Scope: head_dim 128, bf16 pages, no window or soft-cap (launch_paged_attention_prefill falls
// back to the mma.sync kernel for the rest). The kernel's code exists only in the sm_90a image
// of this file (the build gives it sm_90a where it builds sm_90); other images hold an empty
// body that is never launched.

#include <cuda_bf16.h>

#include "pagedlm/ops/cuda/attention_hopper.h"
#include "pagedlm/ops/cuda/attention_kernel.cuh"
#include "pagedlm/ops/cuda/common.cuh"

namespace pagedlm::cuda::attn {
namespace {

constexpr int kHopperD = 128;
constexpr int kHopperRows = 128;             // a block's rows: two warpgroups of 64
constexpr int kHopperKeys = 128;             // keys a tile
constexpr int kHopperThreads = 256;          // two warpgroups
constexpr int kPanelBytes = 128 * 128;       // 128 rows x 64 values (128 bytes) of one panel
constexpr int kTileBytes = 2 * kPanelBytes;  // 128 rows x 128 values
static_assert(kHopperKeys % 16 == 0 && kHopperRows == 2 * 64,
              "16-key P V steps, 64 rows a warpgroup");
// Q, then two stages of K and V; 1024 more to align the start.
constexpr size_t kHopperSmemBytes = 5 * kTileBytes + 1024;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)

// A shared-memory matrix descriptor of the 128-byte swizzle: start address, the leading and
// stride byte offsets (16-byte units) and the layout type (1: 128-byte swizzle) in bits 62-63.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t leading, uint32_t stride) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) |
         (static_cast<uint64_t>(leading >> 4) << 16) | (static_cast<uint64_t>(stride >> 4) << 32) |
         (uint64_t{1} << 62);
}

// Keeps the compiler from moving accesses of a wgmma's accumulators across its issue and wait.
__device__ __forceinline__ void fence_regs(float (&d)[64]) {
#pragma unroll
  for (int i = 0; i < 64; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_wait_all() {
  asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
}

// The 64 f32 accumulators of an m64n128 tile (a thread's share) as a wgmma's first operands:
// the asm's registers %0-%63 and their bindings to d[0..63].
#define PAGEDLM_WGMMA_ACCUMULATOR_REGS                                                       \
  "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"  \
  "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45," \
  "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
#define PAGEDLM_WGMMA_ACCUMULATORS(d)                                                             \
  "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), \
      "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]),    \
      "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]),  \
      "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]),  \
      "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]),  \
      "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]),  \
      "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),  \
      "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]),  \
      "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])

// d (64 x 128, f32) = (accumulate ? d : 0) + A B, A 64 x 16 and B 16 x 128 (bf16) in shared
// memory, both K-major.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t a, uint64_t b, int accumulate) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n" PAGEDLM_WGMMA_ACCUMULATOR_REGS
      "%64, %65, p, 1, 1, 0, 0;\n}\n"
      : PAGEDLM_WGMMA_ACCUMULATORS(d)
      : "l"(a), "l"(b), "r"(accumulate));
}

// d += A B with A (64 x 16, bf16) in registers (a[0..3], mma.sync's A fragment per warp) and B
// (16 x 128) in shared memory, MN-major (transposed).
__device__ __forceinline__ void wgmma_rs(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, 1, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16\n" PAGEDLM_WGMMA_ACCUMULATOR_REGS
      "{%64, %65, %66, %67}, %68, p, 1, 1, 1;\n}\n"
      : PAGEDLM_WGMMA_ACCUMULATORS(d)
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

#endif

__global__ void __launch_bounds__(kHopperThreads, 1) prefill_hopper_kernel(const AttnParams p) {
#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int D = kHopperD;
  extern __shared__ unsigned char smem_raw[];
  __shared__ Unit unit;
  const uint32_t base = (smem_addr(smem_raw) + 1023) & ~1023u;
  unsigned char* const smem = smem_raw + (base - smem_addr(smem_raw));
  // Byte offsets from `base`: Q, then stage s's K at (1 + 2 s) tiles and V one tile after it.
  auto k_tile = [](int stage) { return (1 + 2 * stage) * kTileBytes; };
  auto v_tile = [](int stage) { return (2 + 2 * stage) * kTileBytes; };
  // Where chunk c (0-15) of row r goes in a tile.
  auto swizzled = [](int r, int c) {
    return (c >> 3) * kPanelBytes + r * 128 + (((c & 7) ^ (r & 7)) << 4);
  };

  const int tid = threadIdx.x;
  const int lane = tid & 31, warp = tid >> 5;
  const int wg = warp >> 2;  // warpgroup: rows 64 wg ..
  const int g = lane >> 2, t = lane & 3;
  // The heaviest row tiles (the last rows see the most keys) start first.
  const int tile = gridDim.x - 1 - blockIdx.x;
  wait_for_inputs();
  if (tid == 0 && !make_unit<kHopperRows, kHopperKeys, false, false>(p, tile, 0, blockIdx.z,
                                                                     blockIdx.y, unit)) {
    unit.id = -1;
  } else if (tid == 0) {
    unit.id = 0;
  }
  __syncthreads();
  if (unit.id < 0) return;
  const Unit u = unit;
  const int group = p.group;

  // Loads: thread tid copies chunk tid % 16 of rows tid / 16 + 16 i, i < 8.
  const int chunk = tid & 15, row_lo = tid >> 4;
  for (int i = 0; i < 8; ++i) {
    const int r = row_lo + 16 * i;
    const int gr = u.row0 + r;
    const bool valid = gr < u.n_rows;
    size_t off = 0;
    if (valid) {
      off = q_row(p, u, group, u.q_start + gr / group, gr) * D + chunk * 8;
    }
    cp_async_16(smem + swizzled(r, chunk), p.q + off, valid);
  }
  const auto* kc = static_cast<const __nv_bfloat16*>(p.k_cache);
  const auto* vc = static_cast<const __nv_bfloat16*>(p.v_cache);
  // A tile's 16 rows of this warp (rows 2 warp + (lane & 1) + 16 ((lane >> 1) & 7)): each lane
  // looks one up and the pass that copies it takes it by shuffle.
  auto load_kv = [&](int it, int stage) {
    const int kv0 = u.kv_begin + it * kHopperKeys;
    const int mine = kv0 + 2 * warp + (lane & 1) + 16 * ((lane >> 1) & 7);
    int64_t my_off = 0;
    if (mine < u.kv_end) my_off = cache_offset<D>(p, u, mine);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const int r = row_lo + 16 * i;
      const int64_t row_off = __shfl_sync(0xffffffffu, my_off, 2 * i + (lane >> 4));
      const bool valid = kv0 + r < u.kv_end;
      const int64_t off = valid ? row_off + chunk * 8 : 0;
      cp_async_16(smem + k_tile(stage) + swizzled(r, chunk), kc + off, valid);
      cp_async_16(smem + v_tile(stage) + swizzled(r, chunk), vc + off, valid);
    }
  };

  // This thread's rows (16 (warp % 4) + g + 8 h of its warpgroup's 64) and the keys each sees.
  int lim[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int gr = u.row0 + 64 * wg + 16 * (warp & 3) + g + 8 * h;
    lim[h] = gr < u.n_rows ? min(u.ctx + gr / group + 1, u.kv_end) : u.kv_begin;
  }
  float o[64];
#pragma unroll
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  float s[64];
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

  load_kv(0, 0);
  cp_async_commit();
  const uint32_t q_base = base + 64 * wg * 128;  // the warpgroup's first Q row
  for (int it = 0; it < u.num_tiles; ++it) {
    const int stage = it & 1;
    cp_async_wait<0>();
    asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes to wgmma
    __syncthreads();  // tile `it` visible to all; the other stage's tile consumed by all
    if (it + 1 < u.num_tiles) load_kv(it + 1, stage ^ 1);
    cp_async_commit();

    // S = Q K^T over d in 16-value steps: step kk is 32 bytes into panel kk / 4.
    const uint32_t k_base = base + k_tile(stage);
    fence_regs(s);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      const uint32_t off = (kk >> 2) * kPanelBytes + (kk & 3) * 32;
      wgmma_ss(s, smem_desc(q_base + off, 16, 1024), smem_desc(k_base + off, 16, 1024), kk > 0);
    }
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(s);

    // Online softmax over this tile's keys kv0 + 8 j + 2 t + c (s[4 j + 2 h + c], row h).
    const int kv0 = u.kv_begin + it * kHopperKeys;
    float alpha[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float mx = -INFINITY;
      const bool masked = kv0 + kHopperKeys > lim[h];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * j + 2 * h + c];
          x = masked && kv0 + 8 * j + 2 * t + c >= lim[h] ? -INFINITY : x * p.scale_log2;
          mx = fmaxf(mx, x);
        }
      }
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
      mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
      bool rescale = false;
      alpha[h] = advance_row_max(m[h], mx, rescale);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < 16; ++j) {
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          float& x = s[4 * j + 2 * h + c];
          x = exp2f(x - mx);
          sum += x;
        }
      }
      l[h] = l[h] * alpha[h] + sum;
    }
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      o[4 * j + 0] *= alpha[0];
      o[4 * j + 1] *= alpha[0];
      o[4 * j + 2] *= alpha[1];
      o[4 * j + 3] *= alpha[1];
    }

    // O += P V over the keys in 16-key steps: step kk is 16 rows (2048 bytes) into each panel.
    const uint32_t v_base = base + v_tile(stage);
    uint32_t pa[8][4];
#pragma unroll
    for (int kk = 0; kk < 8; ++kk) {
      pa[kk][0] = pack_bf16(s[8 * kk + 0], s[8 * kk + 1]);
      pa[kk][1] = pack_bf16(s[8 * kk + 2], s[8 * kk + 3]);
      pa[kk][2] = pack_bf16(s[8 * kk + 4], s[8 * kk + 5]);
      pa[kk][3] = pack_bf16(s[8 * kk + 6], s[8 * kk + 7]);
    }
    fence_regs(o);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < kHopperKeys / 16; ++kk) {
      wgmma_rs(o, pa[kk], smem_desc(v_base + kk * 2048, kPanelBytes, 1024));
    }
    wgmma_commit();
    wgmma_wait_all();
    fence_regs(o);
  }

  // The rows' sums over the four lanes of a row, then O / l as bf16.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
    l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    const int gr = u.row0 + 64 * wg + 16 * (warp & 3) + g + 8 * h;
    if (gr >= u.n_rows) continue;
    const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
    __nv_bfloat16* out = p.out + q_row(p, u, group, u.q_start + gr / group, gr) * D;
#pragma unroll
    for (int j = 0; j < 16; ++j) {
      *reinterpret_cast<uint32_t*>(out + 8 * j + 2 * t) =
          pack_bf16(o[4 * j + 2 * h] * inv, o[4 * j + 2 * h + 1] * inv);
    }
  }
#endif
}

}  // namespace

bool hopper_prefill_built() {
#ifdef PAGEDLM_HOPPER_KERNELS
  return true;
#else
  return false;
#endif
}

bool hopper_prefill_applies(int head_dim, const AttnParams& params, bool e4m3_cache,
                            const DeviceLimits& device) {
  static const bool allowed = detail::env_switch_on("PAGEDLM_HOPPER_PREFILL");
  return allowed && hopper_prefill_built() && device.cc_major == 9 && device.cc_minor == 0 &&
         head_dim == kHopperD && !e4m3_cache && params.window == 0 && params.softcap_log2 == 0.f &&
         device.smem_per_block >= kHopperSmemBytes + sizeof(Unit);
}

cudaError_t launch_hopper_prefill(const AttnParams& params, int num_seqs, int max_q_len,
                                  cudaStream_t stream) {
  const void* fn = reinterpret_cast<const void*>(&prefill_hopper_kernel);
  PAGEDLM_CUDA_TRY(allow_dynamic_smem(fn, kHopperSmemBytes));
  const int64_t rows = static_cast<int64_t>(max_q_len) * params.group;
  const unsigned tiles = std::max(1u, detail::ceil_div(rows, kHopperRows));
  AttnParams p = params;
  void* args[] = {&p};
  return detail::launch_overlapped(fn, dim3(tiles, params.num_kv_heads, num_seqs),
                                   dim3(kHopperThreads), args, kHopperSmemBytes, stream);
}

}  // namespace pagedlm::cuda::attn
