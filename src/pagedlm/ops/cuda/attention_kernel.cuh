// The paged attention kernel (FlashAttention-2 style) as templates: attention.cu plans and
// launches, and attention_d<D>.cu instantiate each head size's configurations, so that the head
// sizes compile in parallel. Over the packed token stream: K/V tiles of BKV keys (64; 32 and 16
// where the device's shared memory is small) stream through shared memory (cp.async, STAGES
// stages), S = Q K^T and O += P V run on tensor cores (mma.sync m16n8k16 bf16 -> fp32, sm_80 on),
// softmax is online, S never leaves registers.
//
// Rows of a tile are (token, q head) pairs of one kv head's group, so all q heads that share a
// kv head read each K/V tile once (GQA packing, as FlashInfer does). Two warp layouts:
//   prefill: 4 warps x 16 rows each, every warp sees all keys of a tile;
//   decode:  1 x 16 rows, the 4 warps split the 64 keys of a tile (more bytes in flight per
//            row), merged through shared memory; across blocks the keys are split again
//            (flash-decoding) and a small kernel merges the per-split (lse, out) pairs.
// See docs/KERNELS.md for the variants and their timings.
//
// The layer's attention variant enters as two compile-time policies, as FlashInfer's variants
// do: kWindow (sliding window: each row's key range starts at its window, so tiles wholly
// before every row's window are never loaded, and the decode splits cut only the window) and
// kSoftcap (Gemma 2's tanh cap on the scores). Each launch picks its instantiation once, so the
// plain path (neither) compiles to exactly the code it had before the policies existed.
// Head sizes: 64, 80, 96, 128, 256 (a multiple of 16, for the mma's k steps and ldmatrix's
// 16-column pairs).
//
// The cache's element type KvT is the third policy: bf16, or e4m3 (__nv_fp8_e4m3) with one scale
// per tensor. A configuration of two stages or more lays an e4m3 cache's pipeline into the same
// shared memory as one bf16 stage, which the math reads, and 2 (STAGES - 1) stages of raw e4m3
// bytes (half a bf16 stage each) that cp.async fills: each tile is converted from its raw stage
// into the bf16 stage between two barriers (exactly, e4m3.cuh), so the mma loop is the bf16 one
// and as many bytes are in flight as with bf16 pages, twice the keys. Decode at head_dim 128
// keeps no bf16 stage: its mma reads f16 fragments made in registers from the raw codes
// (kDirect, in attend_units). One-stage configurations (head_dim 256 where shared memory is
// small) and decode at head_dim 64 read a tile into registers before the previous tile's math
// and store it converted after. The scales never touch the values: k_scale is folded into the
// score's scale on the host, v_scale multiplies the output.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>

#include <cmath>
#include <cstddef>
#include <type_traits>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/e4m3.cuh"
#include "pagedlm/ops/cuda/mma.cuh"

namespace pagedlm::cuda::attn {

using detail::ceil_div;
using detail::cp_async_16;
using detail::cp_async_commit;
using detail::cp_async_wait;
using detail::e4m3_even_to_f16x2_over_256;
using detail::e4m3_odd_to_f16x2_over_256;
using detail::e4m3x8_to_bf16x8;
using detail::e4m3x8_to_bf16x8_by_cvt;
using detail::ldmatrix_x4;
using detail::ldmatrix_x4_trans;
using detail::mma_16816;
using detail::mma_16816_f16;
using detail::pack_bf16;
using detail::pack_f16;
using detail::smem_addr;
using detail::wait_for_inputs;

constexpr int kThreads = 128;
constexpr int kMinSplitKeys = 256;  // no decode split shorter than this
// The shared pass's blocks hold 64 query rows (many sequences), so even one 64-key tile per split
// is worth its merge.
constexpr int kMinSharedSplitKeys = 64;
constexpr float kLog2e = 1.4426950408889634f;
struct AttnParams {
  const __nv_bfloat16* q;
  const void* k_cache;  // KvT elements
  const void* v_cache;
  const int32_t* q_indptr;
  const int32_t* kv_indptr;
  const int32_t* kv_page_indices;
  const int32_t* kv_last_page_len;
  __nv_bfloat16* out;
  // Partial results [slot, num_tokens, num_q_heads, (head_dim)] (lse in the log2 domain),
  // merged by merge_splits_kernel; null: the kernel normalizes and writes `out` itself.
  float* ws_o;
  float* ws_lse;
  // Decode without a shared pass, one row tile a sequence: [num_seqs * num_kv_heads] counters,
  // zero between launches. The last block of a (sequence, kv head) to finish merges its splits
  // (merge_row) and zeroes the counter again, a sequence of one split writes `out` directly, and
  // no merge kernel follows. Null: merge_splits_kernel merges every row after the launch.
  unsigned* merge_counters;
  int num_tokens;
  int num_q_heads;
  int num_kv_heads;
  int group;
  int page_size;
  int num_splits;   // key splits per (sequence or item, kv head)
  int extra_slots;  // slots after the splits, marked empty by split 0 (the shared pass fills them)
  int slot_offset;  // workspace slot of split 0
  float scale_log2;
  // Decode: the order in which sequences' blocks start (null: 0, 1, ...).
  const int32_t* seq_order;
  // Decode beside a shared-prefix pass: kv_skip[b] leading keys of sequence b are left to it.
  const int32_t* kv_skip;
  // The shared-prefix pass (kShared): items of sequences whose first keys are the same pages.
  const int32_t* num_items;  // [1]
  const int32_t* items;      // [max_items][4]: first member, members, page offset, shared keys
  const int32_t* members;    // sequence indices
  // kWindow: a row at position pos sees keys pos - (window - 1) .. pos.
  int window;
  // kSoftcap, in the log2 domain of the softmax: score * log2(e) = softcap_log2 *
  // tanh(q.k * softcap_pre), with softcap_pre = scale / softcap, softcap_log2 = softcap * log2(e).
  float softcap_pre;
  float softcap_log2;
  // e4m3 caches: a value is its stored e4m3 times v_scale (k_scale is in scale_log2 and
  // softcap_pre).
  float v_scale;
};

// The hardware tanh (max relative error 2^-11, as FlashAttention's and FlashInfer's soft-caps
// use): tanhf would cost far more instructions than the score's mma.
__device__ __forceinline__ float tanh_approx(float x) {
  float y;
  asm("tanh.approx.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// A raw score q.k in the softmax's log2 domain: scale * log2(e) * q.k, or with the soft-cap
// softcap * log2(e) * tanh(scale * q.k / softcap).
template <bool kSoftcap>
__device__ __forceinline__ float score_log2(const AttnParams& p, float qk) {
  if constexpr (kSoftcap) {
    return p.softcap_log2 * tanh_approx(qk * p.softcap_pre);
  } else {
    return qk * p.scale_log2;
  }
}

// One step of the online softmax for a row: its running max m takes in this tile's max
// `tile_max`. Returns alpha, the factor that scales what the row summed before (l and O), and
// leaves in tile_max the base this tile's scores are exponentiated against. `rescale` is set when
// the row already held keys and its max grew, i.e. O must be scaled down. A row with no visible
// key yet keeps m = -inf; its base is 0 then, so exp2 gives 0, not NaN.
__device__ __forceinline__ float advance_row_max(float& m, float& tile_max, bool& rescale) {
  const float m_new = fmaxf(m, tile_max);
  rescale |= m != -INFINITY && m_new > m;
  const float base = m_new == -INFINITY ? 0.f : m_new;
  const float alpha = exp2f(m - base);
  m = m_new;
  tile_max = base;
  return alpha;
}

// Keys of sequence b, whose pages start at kv_page_indices[page_begin] (= kv_indptr[b]).
__device__ __forceinline__ int seq_keys(const AttnParams& p, int b, int page_begin) {
  const int num_pages = p.kv_indptr[b + 1] - page_begin;
  return num_pages > 0 ? (num_pages - 1) * p.page_size + p.kv_last_page_len[b] : 0;
}

// The first key a row at position pos sees under the sliding window (may be negative).
__device__ __forceinline__ int window_start(const AttnParams& p, int pos) {
  return pos - (p.window - 1);
}

// Dynamic shared memory of a block: 16 * WM Q rows and STAGES stages of BKV K rows and BKV V
// rows, each row padded by 8 elements.
template <int D, int WM, int WN, int STAGES, int BKV>
constexpr size_t attn_smem_bytes() {
  return static_cast<size_t>(16 * WM + 2 * STAGES * BKV) * (D + 8) * sizeof(__nv_bfloat16);
}

// The three launches of the kernel: prefill and decode (one unit per block, the grid covers the
// units) and the shared-prefix pass (blocks that loop over their units).
enum class Pass { kPrefill, kDecode, kShared };

// Whether a configuration's e4m3 tiles feed the mma from the raw codes (kDirect in attend_units):
// decode at head_dim 128, one row of warps, two stages or more.
template <int D, int WM, int WN, int STAGES>
constexpr bool direct_decode() {
  return D == 128 && WM == 1 && WN > 1 && STAGES >= 2;
}

// One unit of a block's work: rows [row0, row0 + 16 * WM) of sequence b's (token, q head) pairs of
// kv head hk (shared pass: of an item's members) against keys [kv_begin, kv_end). Thread 0 fills
// it in shared memory; every thread reads it from there.
struct Unit {
  int id;  // position in the launch's unit order; -1: no unit left
  int hk, split, row0, n_rows, q_start, first_member, ctx;
  int n_splits;  // the splits this unit's sequence (or item) uses of the launch's
  int kv_begin, kv_end, page_begin, num_tiles;
};

// The row of q and out (and of the split results) that row r of unit u is: its token's, at q
// head hk * group + r % group (group = p.group, which callers hold in a register).
__device__ __forceinline__ size_t q_row(const AttnParams& p, const Unit& u, int group, int token,
                                        int r) {
  return static_cast<size_t>(token) * p.num_q_heads + u.hk * group + r % group;
}

// Where key pos of unit u's sequence (its kv head hk) starts in a paged cache of head_dim D.
template <int D>
__device__ __forceinline__ int64_t cache_offset(const AttnParams& p, const Unit& u, int pos) {
  const int page = p.kv_page_indices[u.page_begin + pos / p.page_size];
  return ((static_cast<int64_t>(page) * p.page_size + pos % p.page_size) * p.num_kv_heads + u.hk) *
         D;
}

// Static shared memory of a block (the kernel's two Units and the merge's flag, padded), counted
// against the device's limit.
constexpr size_t kAttnStaticSmemBytes = 2 * sizeof(Unit) + 16;

// The unit of row tile `tile` (shared pass: item `tile`), key split `split`, sequence b and kv
// head hk. False when it has no rows: a padding sequence, a tile past the sequence's rows, an
// item past the step's count. Splits are whole tiles of BKV keys.
// kWindow: the key range starts at the window of the unit's earliest row.
template <int kRows, int BKV, bool kShared, bool kWindow>
__device__ bool make_unit(const AttnParams& p, int tile, int split, int b, int hk, Unit& u) {
  // Decode/prefill: sequence b's new tokens, which see the keys before them (ctx) and up to
  // themselves. Shared pass: one token per member, all of which see keys [0, shared).
  int kv_lo = 0, kv_limit;
  u.hk = hk;
  u.split = split;
  u.q_start = 0;
  u.first_member = 0;
  if constexpr (kShared) {
    if (tile >= *p.num_items) return false;
    const int32_t* item = p.items + 4 * tile;
    u.first_member = item[0];
    u.n_rows = item[1] * p.group;
    u.page_begin = item[2];
    u.row0 = 0;
    u.ctx = kv_limit = item[3];
    if constexpr (kWindow) {
      // Each member's one new token is its last key; the earliest member window bounds the
      // item's keys (none at all when every member's window starts past the shared keys).
      int lo = kv_limit;
#pragma unroll 8
      for (int i = 0; i < item[1]; ++i) {
        const int m = p.members[u.first_member + i];
        lo = min(lo, window_start(p, seq_keys(p, m, p.kv_indptr[m]) - 1));
      }
      kv_lo = max(lo, 0);
    }
  } else {
    u.q_start = p.q_indptr[b];
    const int n_new = p.q_indptr[b + 1] - u.q_start;
    u.n_rows = n_new * p.group;
    u.row0 = tile * kRows;
    if (u.row0 >= u.n_rows) return false;
    u.page_begin = p.kv_indptr[b];
    const int n_kv = seq_keys(p, b, u.page_begin);
    u.ctx = n_kv - n_new;  // keys before the first new token
    const int last_row = min(u.row0 + kRows, u.n_rows) - 1;
    kv_limit = max(u.ctx + last_row / p.group + 1, 0);
    if (p.kv_skip != nullptr) kv_lo = min(p.kv_skip[b], kv_limit);
    // The first row's window starts first; it is never past the first row's own key.
    if constexpr (kWindow) kv_lo = max(kv_lo, window_start(p, u.ctx + u.row0 / p.group));
  }
  // Each sequence uses only as many of the launch's splits as its own length warrants; the
  // others see an empty key range and store an empty (lse = -inf) partial result. So the launch
  // shape, and a captured graph, do not depend on the lengths.
  const int n_keys = kv_limit - kv_lo;
  const int min_keys = kShared ? kMinSharedSplitKeys : kMinSplitKeys;
  const int splits = max(1, min(p.num_splits, n_keys / min_keys));
  u.n_splits = splits;
  // With the merge in the blocks, a split past the sequence's own has nothing to store.
  if (!kShared && p.merge_counters != nullptr && split >= splits) return false;
  const int chunk = static_cast<int>(ceil_div(ceil_div(n_keys, splits), BKV)) * BKV;
  u.kv_begin = kv_lo + min(split * chunk, n_keys);
  u.kv_end = min(u.kv_begin + chunk, kv_limit);
  u.num_tiles = static_cast<int>(ceil_div(u.kv_end - u.kv_begin, BKV));
  return true;
}

// Row `row` of the split results in slots [0, num_slots) merged into out[row] by one warp
// (ws_o: [slot][stride rows][D] f32, ws_lse: [slot][stride rows] in the log2 domain; out: bf16):
// the non-empty slots in increasing order. merge_splits_kernel and the last block of a decode
// launch's (sequence, kv head) both merge through it, so that the two give the same bits. The
// loads skip L1: other blocks of the same launch wrote the partial results.
template <int D>
__device__ __forceinline__ void merge_row(const float* ws_o, const float* ws_lse, size_t stride,
                                          int num_slots, size_t row, int lane, __nv_bfloat16* out) {
  // The splits' lse values 32 at a time, lane l holding split s0 + l: the launch's splits are set
  // for the longest sequence a captured graph may see, so a short one leaves all but its first
  // empty, and reading them one after another was most of the merge's time.
  auto lse_of = [&](int s) {
    return s < num_slots ? __ldcg(ws_lse + s * stride + row) : -INFINITY;
  };
  const float first = lse_of(lane);
  float mx = first;
  for (int s0 = 32; s0 < num_slots; s0 += 32) mx = fmaxf(mx, lse_of(s0 + lane));
  mx = detail::warp_max(mx);
  const float base = mx == -INFINITY ? 0.f : mx;
  // Lane l holds the pairs of columns 2 l, 2 l + 64, ... (D = 80, 96: the last round in part).
  constexpr int kPairs = (D / 2 + 31) / 32;
  float acc[2 * kPairs] = {};
  float wsum = 0.f;
  // The non-empty splits in increasing order, as a loop over every split would add them.
  for (int s0 = 0; s0 < num_slots; s0 += 32) {
    const float mine = s0 == 0 ? first : lse_of(s0 + lane);
    for (unsigned live = __ballot_sync(0xffffffffu, mine != -INFINITY); live != 0;
         live &= live - 1) {
      const int j = __ffs(live) - 1;
      const float w = exp2f(__shfl_sync(0xffffffffu, mine, j) - base);
      wsum += w;
      const float* src = ws_o + ((s0 + j) * stride + row) * D;
#pragma unroll
      for (int i = 0; i < kPairs; ++i) {
        const int col = 2 * lane + 64 * i;
        if (D % 64 != 0 && col >= D) break;
        const float2 v = __ldcg(reinterpret_cast<const float2*>(src + col));
        acc[2 * i] += w * v.x;
        acc[2 * i + 1] += w * v.y;
      }
    }
  }
  const float inv = wsum > 0.f ? 1.f / wsum : 0.f;
  __nv_bfloat16* dst = out + static_cast<size_t>(row) * D;
#pragma unroll
  for (int i = 0; i < kPairs; ++i) {
    const int col = 2 * lane + 64 * i;
    if (D % 64 != 0 && col >= D) break;
    *reinterpret_cast<__nv_bfloat162*>(dst + col) =
        __floats2bfloat162_rn(acc[2 * i] * inv, acc[2 * i + 1] * inv);
  }
}

// A block's units in order: positions first, first + stride, ... below total (kLoop; otherwise
// only the first); unit_at(position, unit) fills a unit and says whether it has rows (positions
// without are skipped). q: [num_tokens, num_q_heads, D]; k_cache/v_cache: [num_pages,
// page_size, num_kv_heads, D]. Shared memory: the Q rows, then STAGES K/V stages, each a tile's
// K rows followed by its V rows. Q arrives by cp.async with the first tile. A looping block
// loads the next unit's Q and first tiles while it writes the current unit's result, and its
// thread 0 looks the next unit up while the current one's first tile arrives. (Decode blocks
// looping this way over all units, assigned round-robin or fetched from an atomic counter, ran
// no faster than one block per unit: docs/KERNELS.md.)
template <int D, int WM, int WN, int STAGES, int BKV, bool kShared, bool kLoop, bool kWindow,
          bool kSoftcap, typename KvT, bool kKeyRows, typename UnitAt>
__device__ __forceinline__ void attend_units(const AttnParams& p, int first, int stride, int total,
                                             UnitAt unit_at) {
  static_assert(WM * WN == kThreads / 32, "4 warps");
  static_assert(STAGES >= 1 && (STAGES >= 2 || !kLoop), "a looping block prefetches its next unit");
  constexpr int kBlockKv = BKV;  // keys per pipeline stage
  constexpr int kRows = 16 * WM;
  constexpr int kStride = D + 8;  // padded smem row: conflict-free fragment loads
  constexpr int kStageRows = 2 * kBlockKv;
  constexpr int kWarpKv = kBlockKv / WN;
  constexpr int kNt = kWarpKv / 8;  // n8 tiles of S per warp
  constexpr int kDt = D / 8;        // n8 tiles of O per warp
  static_assert(kWarpKv % 16 == 0, "P.V steps over 16 keys (and K loads two n8 tiles)");
  constexpr bool kFp8 = std::is_same_v<KvT, __nv_fp8_e4m3>;
  static_assert(kFp8 || std::is_same_v<KvT, __nv_bfloat16>, "bf16 or e4m3 caches");
  // The warps' merge (WN > 1) works in one consumed stage.
  static_assert(WN == 1 || (WN * 16 * D + 4 * WN * 16 + 16) * sizeof(float) <=
                               kStageRows * kStride * sizeof(__nv_bfloat16),
                "merge buffers fit in one K/V stage");

  extern __shared__ __align__(16) unsigned char smem_raw[];
  __shared__ Unit units[2];  // the current unit and the next
  __nv_bfloat16* q_s = reinterpret_cast<__nv_bfloat16*>(smem_raw);
  auto stage_k = [&](int stage) { return q_s + (kRows + stage * kStageRows) * kStride; };

  const int group = p.group;
  const int tid = threadIdx.x;
  const int warp = tid >> 5, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int wm = warp / WN, wn = warp % WN;
  const bool split_out = p.ws_o != nullptr;

  auto find = [&](int pos, Unit& u) {
    for (; pos < total; pos += stride) {
      if (unit_at(pos, u)) {
        u.id = pos;
        return;
      }
    }
    u.id = -1;
  };
  // The token of row r of unit u (its q head is hk * group + r % group).
  auto token_of = [&](const Unit& u, int r) {
    return kShared ? p.q_indptr[p.members[u.first_member + r / group]] : u.q_start + r / group;
  };
  auto load_q = [&](const Unit& u) {
    for (int idx = tid; idx < kRows * (D / 8); idx += kThreads) {
      const int r = idx / (D / 8), c = idx % (D / 8);
      const int gr = u.row0 + r;
      const bool valid = gr < u.n_rows;
      size_t off = 0;
      if (valid) {
        off = q_row(p, u, group, token_of(u, gr), gr) * D + c * 8;
      }
      cp_async_16(q_s + r * kStride + c * 8, p.q + off, valid);
    }
  };
  // e4m3 caches in two stages or more (kRaw): the stages' memory holds one bf16 stage (stage 0,
  // which the math reads) and kRawStages stages of the tiles' raw codes after it. With one stage,
  // and for decode at head_dim 64 (kStash), a tile waits in registers instead: there the raw
  // stages measured slower (H200, 256 sequences of 768 keys, 3 kv heads: 31.5-32.4% of copy
  // bandwidth against 33.5-34.0% in registers).
  constexpr bool kRaw = kFp8 && STAGES >= 2 && !(D == 64 && WN > 1);
  constexpr bool kStash = kFp8 && !kRaw;
  // Decode at head_dim 128 (kDirect): no bf16 stage. The mma fragments come from the raw codes
  // in shared memory, as f16 (two or three integer instructions a pair, e4m3.cuh) with d
  // permuted so that each lane's codes are whole 16-byte chunks: K's chunk of a key serves four
  // k steps (Q's fragments take the same permutation), V's chunk g of four keys serves the 16 n8
  // tiles of O whose column g is d = 16 g + tile (O's columns come out permuted, undone where the
  // warps merge). So neither a conversion pass between two barriers nor a bf16 copy and its
  // ldmatrix reads remain, and the stages' whole memory holds raw tiles (four at d = 128).
  // Chunk c of a raw row r sits at position c ^ raw_swizzle(r): both reads are then free of
  // bank conflicts. The decode pass's merge reuses the stages once every tile is consumed.
  constexpr bool kDirect = kFp8 && direct_decode<D, WM, WN, STAGES>() && !kShared && !kLoop;
  // kKeyRows (kDirect, every unit one token's group of at most 8 q heads): the mma's rows are
  // keys and its columns the group's heads, S^T = K Q^T and O^T += V^T P^T. With the heads as
  // rows 12 or 13 of an mma's 16 rows sat idle (Llama's group of 4, SmolLM2's 3); with keys as
  // rows each mma covers 16 keys (or 16 of d), so a tile takes half the mma and, without the idle
  // rows' Q, S and O, about 56 fewer registers. The codes feed A exactly as they fed B (same
  // even/odd pairs), and P^T reaches B's layout by four shuffles.
  static_assert(!kKeyRows || (kDirect && kWarpKv == 16), "keys as rows: a direct decode tile");
  constexpr int kRawStageBytes = 2 * kBlockKv * D;  // K's codes, then V's, rows unpadded
  constexpr int kStagesBytes = STAGES * kStageRows * kStride * sizeof(__nv_bfloat16);
  constexpr int kRawStages =
      kDirect ? kStagesBytes / kRawStageBytes : (kRaw ? 2 * (STAGES - 1) : 0);
  static_assert(
      (kRaw && !kDirect ? kStageRows * kStride * sizeof(__nv_bfloat16) + kRawStages * kRawStageBytes
                        : 0) <= kStagesBytes,
      "raw stages fit beside one bf16 stage");
  static_assert(!kDirect || kRawStages >= 2, "a direct tile is read while the next one loads");
  // Tiles in flight ahead of the one the math reads, and the stages (bf16 or raw) they rotate
  // through. The raw stages of the bf16 route are free once converted; kDirect's stay in use
  // until the tile's math is done, so one fewer is ahead.
  constexpr int kAhead = kDirect ? kRawStages - 1 : (kRaw ? kRawStages : STAGES - 1);
  constexpr int kSlots = kRaw ? kRawStages : STAGES;
  auto raw_stage = [&](int slot) {
    return reinterpret_cast<uint8_t*>(stage_k(kDirect ? 0 : 1)) + slot * kRawStageBytes;
  };
  auto raw_swizzle = [](int r) { return (r & 6) ^ ((r & 1) << 2); };
  // kDirect's V codes for an mma over keys key0 .. key0 + 15 of a warp's raw V rows: lane (g, t)
  // reads chunk g (d = 16 g ..) of keys 2t, 2t + 1, 2t + 8, 2t + 9, and a byte permute pairs two
  // keys' codes of two d: visit(j, pair, lo, hi) gets keys 2t, 2t + 1 (lo) and 2t + 8, 2t + 9
  // (hi) at d = 16 g + 4 j + 2 pair (even bytes) and that d + 1 (odd bytes).
  auto v_code_pairs = [&](const uint8_t* vraw, int key0, auto&& visit) {
    uint4 rows[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int key = key0 + 2 * t + (i & 1) + 8 * (i >> 1);
      rows[i] = *reinterpret_cast<const uint4*>(vraw + key * D + (g ^ raw_swizzle(key)) * 16);
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const uint32_t w0 = (&rows[0].x)[j], w1 = (&rows[1].x)[j];
      const uint32_t w2 = (&rows[2].x)[j], w3 = (&rows[3].x)[j];
#pragma unroll
      for (int pair = 0; pair < 2; ++pair) {
        const uint32_t sel = pair == 0 ? 0x5410u : 0x7632u;
        visit(j, pair, __byte_perm(w0, w1, sel), __byte_perm(w2, w3, sel));
      }
    }
  };

  // A tile's rows: thread tid copies 16-byte chunk tid % kChunks of rows tid / kChunks + i *
  // kRowsPerPass. When a row's chunks divide a warp (D = 64, 128, 256), a warp's threads touch
  // 16 rows at most; lane l looks up the cache offset of the warp's row l % 16 (one page-table
  // read and one division per tile, not one per chunk: those were most of the loop's
  // instructions) and the others take it by shuffle. Otherwise (D = 80, 96: 10 or 12 chunks)
  // each thread looks up the rows of its own chunks. Either way pass i is chunk tid + i * kThreads
  // of the tile, row-major.
  // bf16 caches: the chunks (8 values) go to the stage by cp.async (waited for with the commit
  // groups); kRaw: the same for 16 codes a chunk, into raw stage `stage`; kStash: a chunk is 8
  // codes of K and 8 of V, loaded into registers (k_stash, v_stash). store_kv converts either
  // into a bf16 stage. Each walk spells the bf16 copy out itself: passed through a shared
  // lambda, the bf16 prefill and shared-pass loaders compiled to different SASS
  // (docs/KERNELS.md, "FP8 KV cache").
  constexpr int kChunkElems = kRaw ? 16 : 8;
  constexpr int kChunks = D / kChunkElems;
  constexpr int kTileChunks = kBlockKv * kChunks;
  constexpr int kChunkPasses = (kTileChunks + kThreads - 1) / kThreads;
  uint2 k_stash[kStash ? kChunkPasses : 1], v_stash[kStash ? kChunkPasses : 1];
  auto load_kv = [&](const Unit& u, int kv_tile, int stage) {
    const int kv0 = u.kv_begin + kv_tile * kBlockKv;
    const int kv_end = u.kv_end;
    __nv_bfloat16* ks = stage_k(stage);
    __nv_bfloat16* vs = ks + kBlockKv * kStride;
    const auto* k8 = static_cast<const uint8_t*>(p.k_cache);
    const auto* v8 = static_cast<const uint8_t*>(p.v_cache);
    // kRaw: chunk (r, c)'s 16 codes of K and V into the raw stage.
    auto copy_raw = [&](int r, int c, int64_t off, bool valid) {
      uint8_t* kr = raw_stage(stage);
      const int pos = kDirect ? c ^ raw_swizzle(r) : c;
      cp_async_16(kr + r * D + pos * 16, k8 + off, valid);
      cp_async_16(kr + kBlockKv * D + r * D + pos * 16, v8 + off, valid);
    };
    // kStash: chunk i's codes of K and V into the registers.
    auto stash = [&](int i, int64_t off, bool valid) {
      k_stash[i] = valid ? *reinterpret_cast<const uint2*>(k8 + off) : make_uint2(0, 0);
      v_stash[i] = valid ? *reinterpret_cast<const uint2*>(v8 + off) : make_uint2(0, 0);
    };
    if constexpr (32 % kChunks == 0) {
      constexpr int kRowsPerPass = kThreads / kChunks;
      constexpr int kPasses = kBlockKv / kRowsPerPass;
      constexpr int kWarpRows = 32 / kChunks;  // rows of one warp in one pass
      static_assert(kBlockKv % kRowsPerPass == 0 && kWarpRows * kPasses <= 16,
                    "a warp's rows of a tile: one per half-warp lane");
      const int c = tid % kChunks;
      const int mine = (lane % 16) / kWarpRows * kRowsPerPass + warp * kWarpRows + lane % kWarpRows;
      const int64_t my_off = kv0 + mine < kv_end ? cache_offset<D>(p, u, kv0 + mine) : 0;
#pragma unroll
      for (int i = 0; i < kPasses; ++i) {
        const int r = tid / kChunks + i * kRowsPerPass;
        const int64_t row_off = __shfl_sync(0xffffffffu, my_off, i * kWarpRows + lane / kChunks);
        const bool valid = kv0 + r < kv_end;
        const int64_t off = valid ? row_off + c * kChunkElems : 0;
        if constexpr (kRaw) {
          copy_raw(r, c, off, valid);
        } else if constexpr (kStash) {
          stash(i, off, valid);
        } else {
          cp_async_16(ks + r * kStride + c * 8, static_cast<const __nv_bfloat16*>(p.k_cache) + off,
                      valid);
          cp_async_16(vs + r * kStride + c * 8, static_cast<const __nv_bfloat16*>(p.v_cache) + off,
                      valid);
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < kChunkPasses; ++i) {
        const int idx = tid + i * kThreads;
        if (kTileChunks % kThreads != 0 && idx >= kTileChunks) break;
        const int r = idx / kChunks, c = idx % kChunks;
        const bool valid = kv0 + r < kv_end;
        const int64_t off = valid ? cache_offset<D>(p, u, kv0 + r) + c * kChunkElems : 0;
        if constexpr (kRaw) {
          copy_raw(r, c, off, valid);
        } else if constexpr (kStash) {
          stash(i, off, valid);
        } else {
          cp_async_16(ks + r * kStride + c * 8, static_cast<const __nv_bfloat16*>(p.k_cache) + off,
                      valid);
          cp_async_16(vs + r * kStride + c * 8, static_cast<const __nv_bfloat16*>(p.v_cache) + off,
                      valid);
        }
      }
    }
  };
  // e4m3: a tile's codes, 8 at a time (from the registers, or from raw stage `raw_slot`), as bf16
  // into stage `stage`: thread tid takes the 8-code units tid + i * kThreads of K and of V,
  // row-major, each one 8-byte read and one 16-byte store, consecutive threads side by side.
  // The raw stages' conversion runs alone between two barriers, where instructions count: on the
  // H200's d = 128 decode rows the integer route (e4m3.cuh) read 2090-2400 GB/s of codes with 16
  // instructions for four codes and 2300-2700 GB/s with 11. In registers at d = 64 the conversion
  // route measured faster (41.9-49.0% of copy bandwidth against 40.0-45.9%).
  constexpr int kUnits = kBlockKv * D / 8;
  auto store_kv = [&](int stage, int raw_slot) {
    __nv_bfloat16* ks = stage_k(stage);
    __nv_bfloat16* vs = ks + kBlockKv * kStride;
    const uint8_t* kr = kRaw ? raw_stage(raw_slot) : nullptr;
#pragma unroll
    for (int i = 0; i < (kUnits + kThreads - 1) / kThreads; ++i) {
      const int idx = tid + i * kThreads;
      if (kUnits % kThreads != 0 && idx >= kUnits) break;
      const int dst = idx / (D / 8) * kStride + idx % (D / 8) * 8;
      if constexpr (kRaw) {
        const uint2 k_codes = *reinterpret_cast<const uint2*>(kr + idx * 8);
        const uint2 v_codes = *reinterpret_cast<const uint2*>(kr + kBlockKv * D + idx * 8);
        *reinterpret_cast<uint4*>(ks + dst) = e4m3x8_to_bf16x8(k_codes);
        *reinterpret_cast<uint4*>(vs + dst) = e4m3x8_to_bf16x8(v_codes);
      } else {
        *reinterpret_cast<uint4*>(ks + dst) = e4m3x8_to_bf16x8_by_cvt(k_stash[i]);
        *reinterpret_cast<uint4*>(vs + dst) = e4m3x8_to_bf16x8_by_cvt(v_stash[i]);
      }
    }
  };
  // A unit's Q rows with its first tile, then its next kAhead - 1 tiles: kAhead groups (one
  // stage: Q alone, uncommitted; the loop's first group takes it with the first tile).
  auto prologue = [&](const Unit& u, int slot0) {
    load_q(u);
#pragma unroll
    for (int s = 0; s < kAhead; ++s) {
      if (s < u.num_tiles) {
        load_kv(u, s, (slot0 + s) % kSlots);
        if constexpr (kStash) store_kv((slot0 + s) % kSlots, 0);
      }
      cp_async_commit();
    }
  };

  if (tid == 0) find(first, units[0]);
  __syncthreads();
  if (units[0].id < 0) return;
  prologue(units[0], 0);
  int cur = 0;
  int base = 0;  // the slot (bf16 or raw stage) of the current unit's first tile
  for (;;) {
    const Unit& u = units[cur];
    const Unit& next = units[cur ^ 1];
    if (tid == 0) {  // published by the next barrier
      if (kLoop) {
        find(u.id + stride, units[cur ^ 1]);
      } else {
        units[cur ^ 1].id = -1;
      }
    }

    if (u.split == 0) {  // slots the shared pass fills for its members: empty until then
      const int rows = min(u.row0 + kRows, u.n_rows) - u.row0;
      for (int i = tid; i < rows * p.extra_slots; i += kThreads) {
        const int r = u.row0 + i / p.extra_slots;
        const int slot = p.slot_offset + p.num_splits + i % p.extra_slots;
        const size_t row = q_row(p, u, group, token_of(u, r), r);
        p.ws_lse[static_cast<size_t>(slot) * p.num_tokens * p.num_q_heads + row] = -INFINITY;
      }
    }

    // This thread's two rows (g and g + 8 of the warp's 16) and the keys each may see: below
    // lim, and (kWindow) from lo on.
    // (kKeyRows: the rows of this thread's two columns, 2t and 2t + 1.)
    int lim[2], lo[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int gr = kKeyRows ? u.row0 + wm * 16 + 2 * t + h : u.row0 + wm * 16 + g + 8 * h;
      const int visible = kShared ? u.ctx : u.ctx + gr / group + 1;
      lim[h] = gr < u.n_rows ? min(visible, u.kv_end) : u.kv_begin;
      if constexpr (kWindow) {
        int pos = 0;  // the row's position; a row past the unit sees nothing anyway
        if (gr < u.n_rows) {
          if constexpr (kShared) {
            const int m = p.members[u.first_member + gr / group];
            pos = seq_keys(p, m, p.kv_indptr[m]) - 1;
          } else {
            pos = u.ctx + gr / group;
          }
        }
        lo[h] = window_start(p, pos);
      }
    }

    float o[kDt][4];
#pragma unroll
    for (int i = 0; i < kDt; ++i) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.f;
    float m[2] = {-INFINITY, -INFINITY};  // kKeyRows: of columns 2t and 2t + 1, else rows g, g + 8
    float l[2] = {0.f, 0.f};
    uint32_t qf[D / 16][4];
    // kDirect: what a row's raw q.k' is multiplied by before the softmax's scale: 2^8 (the codes'
    // f16 are 2^-8 of theirs) over the power of two that brought the row's Q within f16's range.
    float row_factor[2] = {1.f, 1.f};  // kKeyRows: of columns 2t and 2t + 1

    const int n = u.num_tiles;
    for (int it = 0; it < n; ++it) {
      if constexpr (STAGES == 1) {
        // One stage (head_dim 256 within 99 KB): the tile loads once every warp is done with
        // the previous one, and nothing overlaps the copy but the other resident blocks.
        if (it > 0) __syncthreads();
        load_kv(u, it, 0);
        if constexpr (kStash) store_kv(0, 0);
        cp_async_commit();
        cp_async_wait<0>();
        __syncthreads();
      } else {
        cp_async_wait<kAhead - 1>();
        __syncthreads();  // tile `it` visible to all; the stage before it free for reuse
        if constexpr (kRaw && !kDirect) {  // into the bf16 stage, which every warp is done with
          store_kv(0, (base + it) % kSlots);
          __syncthreads();  // the bf16 tile visible to all; its raw stage free for reuse
        }
      }
      if (kDirect && it == 0) {
        // Q in f16, d in the order the K chunks are read: k step kk = 4 s + j takes word j of
        // chunk 4 s + t of a key's row, its even bytes as k = 2t, 2t + 1 and its odd bytes as
        // 2t + 8, 2t + 9. A row whose largest |q| passes 2^15 is scaled by a power of two first
        // (f16 ends at 65504; bf16 values in f16's normal range convert exactly). set(kk, even,
        // odd) takes row `row`'s pairs; the row's factor is returned.
        const __nv_bfloat16* qw = q_s + (wm * 16) * kStride;
        auto q_f16 = [&](int row, auto&& set) {
          auto q4 = [&](int kk) {
            const int d0 = 64 * (kk / 4) + 16 * t + 4 * (kk % 4);
            const uint2 raw = *reinterpret_cast<const uint2*>(qw + row * kStride + d0);
            const auto* v = reinterpret_cast<const __nv_bfloat16*>(&raw);
            return make_float4(__bfloat162float(v[0]), __bfloat162float(v[1]),
                               __bfloat162float(v[2]), __bfloat162float(v[3]));
          };
          float amax = 0.f;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            const float4 v = q4(kk);
            amax = fmaxf(fmaxf(amax, fmaxf(fabsf(v.x), fabsf(v.y))), fmaxf(fabsf(v.z), fabsf(v.w)));
          }
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
          amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 2));
          // (inf or NaN in Q: left as they are, as the bf16 route would.)
          const int shift = amax > 32768.f && amax <= 3.4e38f
                                ? static_cast<int>(ceilf(log2f(amax / 32768.f)))
                                : 0;
          const float q_scale = ldexpf(1.f, -shift);
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            const float4 v = q4(kk);
            set(kk, pack_f16(v.x * q_scale, v.z * q_scale), pack_f16(v.y * q_scale, v.w * q_scale));
          }
          return 256.f / q_scale;
        };
        if constexpr (kKeyRows) {
          // Q^T as B: lane (g, t) holds row g's pairs (qf[kk][0], [1]); each column's factor
          // comes from the lanes of its row.
          const float factor = q_f16(g, [&](int kk, uint32_t even, uint32_t odd) {
            qf[kk][0] = even;
            qf[kk][1] = odd;
          });
#pragma unroll
          for (int c = 0; c < 2; ++c) {
            row_factor[c] = __shfl_sync(0xffffffffu, factor, 4 * (2 * t + c));
          }
        } else {
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            row_factor[h] = q_f16(g + 8 * h, [&](int kk, uint32_t even, uint32_t odd) {
              qf[kk][h] = even;
              qf[kk][2 + h] = odd;
            });
          }
        }
      } else if (it == 0) {
        const __nv_bfloat16* qw = q_s + (wm * 16) * kStride;
#pragma unroll
        for (int ks = 0; ks < D / 16; ++ks) {
          qf[ks][0] = *reinterpret_cast<const uint32_t*>(qw + g * kStride + ks * 16 + 2 * t);
          qf[ks][1] = *reinterpret_cast<const uint32_t*>(qw + (g + 8) * kStride + ks * 16 + 2 * t);
          qf[ks][2] = *reinterpret_cast<const uint32_t*>(qw + g * kStride + ks * 16 + 8 + 2 * t);
          qf[ks][3] =
              *reinterpret_cast<const uint32_t*>(qw + (g + 8) * kStride + ks * 16 + 8 + 2 * t);
        }
      }
      // The tile kAhead ahead, into the stage (bf16 or raw) the barrier above freed. kStash: its
      // loads are in flight during this tile's math and it is stored after, before the next
      // barrier.
      if constexpr (STAGES > 1) {
        if (it + kAhead < n) load_kv(u, it + kAhead, (base + it + kAhead) % kSlots);
        cp_async_commit();
      }

      const __nv_bfloat16* ks = stage_k(kRaw ? 0 : (base + it) % STAGES) + (wn * kWarpKv) * kStride;
      const __nv_bfloat16* vs = ks + kBlockKv * kStride;

      if constexpr (kKeyRows) {
        // This warp's 16 keys of the raw stage: K's codes, then V's. Lane (g, t) holds S^T of keys
        // g and g + 8 against columns 2t, 2t + 1, and O^T of 16 d (16 g ..) against the same.
        const uint8_t* kraw = raw_stage((base + it) % kSlots) + wn * kWarpKv * D;
        float st[2][4];  // even and odd k steps apart: two chains of mma latency
#pragma unroll
        for (int e = 0; e < 4; ++e) st[0][e] = st[1][e] = 0.f;
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pos = ((4 * half + t) ^ raw_swizzle(g)) * 16;  // g + 8 swizzles as g
          const uint4 c0 = *reinterpret_cast<const uint4*>(kraw + g * D + pos);
          const uint4 c8 = *reinterpret_cast<const uint4*>(kraw + (g + 8) * D + pos);
          const uint32_t w0[4] = {c0.x, c0.y, c0.z, c0.w}, w8[4] = {c8.x, c8.y, c8.z, c8.w};
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const uint32_t a[4] = {
                e4m3_even_to_f16x2_over_256(w0[j]), e4m3_even_to_f16x2_over_256(w8[j]),
                e4m3_odd_to_f16x2_over_256(w0[j]), e4m3_odd_to_f16x2_over_256(w8[j])};
            mma_16816_f16(st[j % 2], a, qf[4 * half + j][0], qf[4 * half + j][1]);
          }
        }
        const int key0 = u.kv_begin + it * kBlockKv + wn * kWarpKv + g;
        float sc[4];
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = key0 + 8 * (e >> 1), c = e & 1;
          bool seen = key < lim[c];
          if constexpr (kWindow) seen = seen && key >= lo[c];
          const float qk = (st[0][e] + st[1][e]) * row_factor[c];
          sc[e] = seen ? score_log2<kSoftcap>(p, qk) : -INFINITY;
          mx[c] = fmaxf(mx[c], sc[e]);
        }
        float alpha[2];
        bool rescale = false;
#pragma unroll
        for (int c = 0; c < 2; ++c) {
#pragma unroll
          for (int x = 4; x < 32; x <<= 1)
            mx[c] = fmaxf(mx[c], __shfl_xor_sync(0xffffffffu, mx[c], x));
          alpha[c] = advance_row_max(m[c], mx[c], rescale);
        }
        float rs[2] = {0.f, 0.f};  // this lane's keys only: l is summed over g at the end
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          sc[e] = exp2f(sc[e] - mx[e & 1]);
          rs[e & 1] += sc[e];
        }
#pragma unroll
        for (int c = 0; c < 2; ++c) l[c] = l[c] * alpha[c] + rs[c];
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int mt = 0; mt < D / 16; ++mt) {
            o[mt][0] *= alpha[0];
            o[mt][1] *= alpha[1];
            o[mt][2] *= alpha[0];
            o[mt][3] *= alpha[1];
          }
        }
        // P^T as B: lane (g, t) takes column g of keys 2t, 2t + 1 (b0) and 2t + 8, 2t + 9 (b1)
        // from the lanes holding keys 2t and 2t + 1 against columns g & ~1, g | 1.
        const uint32_t p_lo = pack_f16(sc[0], sc[1]), p_hi = pack_f16(sc[2], sc[3]);
        const int src = 8 * t + (g >> 1);  // lane (2t, g / 2); + 4: lane (2t + 1, g / 2)
        const uint32_t half_sel = (g & 1) ? 0x7632u : 0x5410u;
        const uint32_t b0 = __byte_perm(__shfl_sync(0xffffffffu, p_lo, src),
                                        __shfl_sync(0xffffffffu, p_lo, src + 4), half_sel);
        const uint32_t b1 = __byte_perm(__shfl_sync(0xffffffffu, p_hi, src),
                                        __shfl_sync(0xffffffffu, p_hi, src + 4), half_sel);
        // V^T as A, from v_code_pairs: the even bytes are row g's (d), the odd bytes row g + 8's
        // (d + 1). O^T tile 2j + pair: rows g, g + 8 at d = 16 g + 4 j + 2 pair, + 1.
        v_code_pairs(kraw + kBlockKv * D, 0, [&](int j, int pair, uint32_t lo, uint32_t hi) {
          const uint32_t a[4] = {e4m3_even_to_f16x2_over_256(lo), e4m3_odd_to_f16x2_over_256(lo),
                                 e4m3_even_to_f16x2_over_256(hi), e4m3_odd_to_f16x2_over_256(hi)};
          mma_16816_f16(o[2 * j + pair], a, b0, b1);
        });
      } else {
        // A warp with few n8 tiles (decode: 2) accumulates even and odd k steps apart, two
        // chains of mma latency instead of one twice as long, and adds them after.
        constexpr int kChains = kNt >= 4 ? 1 : 2;
        float s[kNt][4];
        float s_odd[kNt][4];  // unused (and compiled away) with one chain
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
          s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.f;
          s_odd[nt][0] = s_odd[nt][1] = s_odd[nt][2] = s_odd[nt][3] = 0.f;
        }
        // The warp's keys in the raw stage (kDirect): K's codes, then V's.
        const uint8_t* kraw =
            kDirect ? raw_stage((base + it) % kSlots) + wn * kWarpKv * D : nullptr;
        if constexpr (kDirect) {
          // Key g of n8 tile nt: its chunks t and 4 + t, a word per k step (the Q order above).
#pragma unroll
          for (int nt = 0; nt < kNt; ++nt) {
            const uint8_t* krow = kraw + (nt * 8 + g) * D;
#pragma unroll
            for (int half = 0; half < 2; ++half) {
              const uint4 chunk =
                  *reinterpret_cast<const uint4*>(krow + ((4 * half + t) ^ raw_swizzle(g)) * 16);
              const uint32_t words[4] = {chunk.x, chunk.y, chunk.z, chunk.w};
#pragma unroll
              for (int j = 0; j < 4; ++j) {
                const int kk = 4 * half + j;
                float(&acc)[kNt][4] = kk % kChains == 1 ? s_odd : s;
                mma_16816_f16(acc[nt], qf[kk], e4m3_even_to_f16x2_over_256(words[j]),
                              e4m3_odd_to_f16x2_over_256(words[j]));
              }
            }
          }
        } else {
          // K fragments of two n8 tiles per ldmatrix: lane l addresses row l % 8 of matrix l / 8,
          // matrices (keys +0, d +0), (keys +0, d +8), (keys +8, d +0), (keys +8, d +8).
          const __nv_bfloat16* krow =
              ks + ((lane & 7) + (lane >> 4) * 8) * kStride + ((lane >> 3) & 1) * 8;
#pragma unroll
          for (int kk = 0; kk < D / 16; ++kk) {
            float(&acc)[kNt][4] = kk % kChains == 1 ? s_odd : s;
#pragma unroll
            for (int nt = 0; nt < kNt; nt += 2) {
              uint32_t bk[4];
              ldmatrix_x4(bk, krow + nt * 8 * kStride + kk * 16);
              mma_16816(acc[nt], qf[kk], bk[0], bk[1]);
              mma_16816(acc[nt + 1], qf[kk], bk[2], bk[3]);
            }
          }
        }
        if constexpr (kChains == 2) {
#pragma unroll
          for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
            for (int e = 0; e < 4; ++e) s[nt][e] += s_odd[nt][e];
          }
        }

        const int col0 = u.kv_begin + it * kBlockKv + wn * kWarpKv + 2 * t;
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int col = col0 + nt * 8 + (e & 1);
            const int h = e >> 1;
            bool seen = col < lim[h];
            if constexpr (kWindow) seen = seen && col >= lo[h];
            // The cap applies before the mask, as in HF; masked scores are -inf either way.
            const float qk = kDirect ? s[nt][e] * row_factor[h] : s[nt][e];
            s[nt][e] = seen ? score_log2<kSoftcap>(p, qk) : -INFINITY;
            mx[h] = fmaxf(mx[h], s[nt][e]);
          }
        }
        float alpha[2];
        bool rescale = false;  // O holds keys and the row's max grew: O must be scaled down
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
          mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
          alpha[h] = advance_row_max(m[h], mx[h], rescale);
        }
        float rs[2] = {0.f, 0.f};
#pragma unroll
        for (int nt = 0; nt < kNt; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            s[nt][e] = exp2f(s[nt][e] - mx[e >> 1]);
            rs[e >> 1] += s[nt][e];
          }
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] = l[h] * alpha[h] + rs[h];
        // Once a row's max settles most tiles leave it, so the warp skips the 4 * kDt multiplies
        // unless one of its rows needs them (a row whose O is still 0 needs none).
        if (__any_sync(0xffffffffu, rescale)) {
#pragma unroll
          for (int dt = 0; dt < kDt; ++dt) {
            o[dt][0] *= alpha[0];
            o[dt][1] *= alpha[0];
            o[dt][2] *= alpha[1];
            o[dt][3] *= alpha[1];
          }
        }

        // The S accumulator layout is the A-operand layout of P, so P stays in registers.
        if constexpr (kDirect) {
          // P in f16; V's B registers from v_code_pairs (keys 2t, 2t + 1 the first, 2t + 8, 2t + 9
          // the second): the even bytes are O's n8 tile 4 j + 2 pair, the odd bytes the next.
#pragma unroll
          for (int kk = 0; kk < kWarpKv / 16; ++kk) {
            uint32_t a[4];
            a[0] = pack_f16(s[2 * kk][0], s[2 * kk][1]);
            a[1] = pack_f16(s[2 * kk][2], s[2 * kk][3]);
            a[2] = pack_f16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            a[3] = pack_f16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
            v_code_pairs(kraw + kBlockKv * D, kk * 16,
                         [&](int j, int pair, uint32_t lo, uint32_t hi) {
                           mma_16816_f16(o[4 * j + 2 * pair], a, e4m3_even_to_f16x2_over_256(lo),
                                         e4m3_even_to_f16x2_over_256(hi));
                           mma_16816_f16(o[4 * j + 2 * pair + 1], a, e4m3_odd_to_f16x2_over_256(lo),
                                         e4m3_odd_to_f16x2_over_256(hi));
                         });
          }
        }
#pragma unroll
        for (int kk = 0; kk < (kDirect ? 0 : kWarpKv / 16); ++kk) {
          uint32_t a[4];
          a[0] = pack_bf16(s[2 * kk][0], s[2 * kk][1]);
          a[1] = pack_bf16(s[2 * kk][2], s[2 * kk][3]);
          a[2] = pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
          a[3] = pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
          const __nv_bfloat16* vrow =
              vs + (kk * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * kStride + (lane >> 4) * 8;
#pragma unroll
          for (int dn = 0; dn < D / 16; ++dn) {
            uint32_t bv[4];
            ldmatrix_x4_trans(bv, vrow + dn * 16);
            mma_16816(o[2 * dn], a, bv[0], bv[1]);
            mma_16816(o[2 * dn + 1], a, bv[2], bv[3]);
          }
        }
      }
      if constexpr (kStash && STAGES > 1) {
        if (it + kAhead < n) store_kv((base + it + kAhead) % kSlots, 0);
      }
    }
    // The next unit's Q and first tiles load while this one's result is written: into q_s
    // once every warp has its Q fragments (and this unit's own Q copy has landed when it had
    // no tiles), into the stages after the last one consumed.
    if constexpr (kLoop) {
      if (n == 0) cp_async_wait<0>();
      __syncthreads();
      if (next.id >= 0) prologue(next, (base + n) % kSlots);
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
      if constexpr (kKeyRows) {  // a column's keys are spread over g
#pragma unroll
        for (int x = 4; x < 32; x <<= 1) l[h] += __shfl_xor_sync(0xffffffffu, l[h], x);
      } else {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
      }
    }

    // A sequence of one split, with the merge in the blocks, needs no partial result.
    const bool partial_out = split_out && !(p.merge_counters != nullptr && u.n_splits == 1);
    auto store = [&](int r, int col, float v0, float v1, float lse) {
      const int gr = u.row0 + r;
      if (gr >= u.n_rows) return;
      if constexpr (kFp8) {  // linear, so the split results may carry it into the merge
        const float v_scale = kDirect ? 256.f * p.v_scale : p.v_scale;  // kDirect: V's 2^-8
        v0 *= v_scale;
        v1 *= v_scale;
      }
      const size_t row = q_row(p, u, group, token_of(u, gr), gr);
      if (!partial_out) {
        *reinterpret_cast<__nv_bfloat162*>(p.out + row * D + col) = __floats2bfloat162_rn(v0, v1);
      } else {
        const size_t srow =
            static_cast<size_t>(p.slot_offset + u.split) * p.num_tokens * p.num_q_heads + row;
        // An empty split's output is never read (the merge skips lse = -inf).
        if (lse != -INFINITY)
          *reinterpret_cast<float2*>(p.ws_o + srow * D + col) = make_float2(v0, v1);
        if (col == 0) p.ws_lse[srow] = lse;
      }
    };

    if constexpr (WN == 1) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        const float lse = l[h] > 0.f ? m[h] + log2f(l[h]) : -INFINITY;
        const int r = wm * 16 + g + 8 * h;
#pragma unroll
        for (int dt = 0; dt < kDt; ++dt) {
          store(r, dt * 8 + 2 * t, o[dt][2 * h] * inv, o[dt][2 * h + 1] * inv, lse);
        }
      }
    } else {
      // Merge the WN warps' partial softmax states of the same 16 rows through shared memory
      // (the stage of the last tile, which no load in flight targets), only for the rows in
      // use: a decode tile holds one token's group of q heads (3 or 4 of its 16 rows for
      // SmolLM2 and Llama).
      const int rows_used = min(u.row0 + 16, u.n_rows) - u.row0;
      __syncthreads();  // every warp is done with the last tile
      float* o_s = reinterpret_cast<float*>(stage_k(kRaw ? 0 : (base + n - 1 + STAGES) % STAGES));
      float* m_s = o_s + WN * 16 * D;  // [WN][16]
      float* l_s = m_s + WN * 16;      // [WN][16]
      float* f_s = l_s + WN * 16;      // [WN][16] per-warp factors
      float* lse_s = f_s + WN * 16;    // [16]
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int r = kKeyRows ? 2 * t + h : g + 8 * h;
        if (r >= rows_used) continue;
        if ((kKeyRows ? g : t) == 0) {
          m_s[wn * 16 + r] = m[h];
          l_s[wn * 16 + r] = l[h];
        }
        if constexpr (kKeyRows) {  // column h of O^T tile 2j + pair: d = 16 g + 4 j + 2 pair, + 1
#pragma unroll
          for (int mt = 0; mt < D / 16; ++mt) {
            *reinterpret_cast<float2*>(o_s + (wn * 16 + r) * D + 16 * g + 2 * mt) =
                make_float2(o[mt][h], o[mt][2 + h]);
          }
        } else {
#pragma unroll
          for (int dt = 0; dt < kDt; ++dt) {
            *reinterpret_cast<float2*>(o_s + (wn * 16 + r) * D + dt * 8 + 2 * t) =
                make_float2(o[dt][2 * h], o[dt][2 * h + 1]);
          }
        }
      }
      __syncthreads();
      if (tid < rows_used) {
        float mm = -INFINITY;
#pragma unroll
        for (int w = 0; w < WN; ++w) mm = fmaxf(mm, m_s[w * 16 + tid]);
        const float mbase = mm == -INFINITY ? 0.f : mm;
        float ll = 0.f;
#pragma unroll
        for (int w = 0; w < WN; ++w) ll += l_s[w * 16 + tid] * exp2f(m_s[w * 16 + tid] - mbase);
        const float inv = ll > 0.f ? 1.f / ll : 0.f;
#pragma unroll
        for (int w = 0; w < WN; ++w) f_s[w * 16 + tid] = exp2f(m_s[w * 16 + tid] - mbase) * inv;
        lse_s[tid] = ll > 0.f ? mbase + log2f(ll) : -INFINITY;
      }
      __syncthreads();
      for (int idx = tid; idx < rows_used * D / 2; idx += kThreads) {
        const int r = idx / (D / 2), col = (idx % (D / 2)) * 2;
        float v0 = 0.f, v1 = 0.f;
#pragma unroll
        for (int w = 0; w < WN; ++w) {
          const float f = f_s[w * 16 + r];
          if constexpr (kDirect &&
                        !kKeyRows) {  // o_s: column n of tile dt at dt * 8 + n: d = 16 n + dt
            const float* orow = o_s + (w * 16 + r) * D;
            v0 += f * orow[(col % 16) * 8 + col / 16];
            v1 += f * orow[(col % 16 + 1) * 8 + col / 16];
          } else {
            const float2 ov = *reinterpret_cast<const float2*>(o_s + (w * 16 + r) * D + col);
            v0 += f * ov.x;
            v1 += f * ov.y;
          }
        }
        store(r, col, v0, v1, lse_s[r]);
      }
    }
    if constexpr (!kLoop) {
      if (partial_out && p.merge_counters != nullptr) {
        // The last of the sequence's split blocks to store merges them (the threadFenceReduction
        // pattern: each thread's stores fenced before the count that publishes them).
        __shared__ bool last;
        __threadfence();
        __syncthreads();
        if (tid == 0) {
          unsigned* count = p.merge_counters + blockIdx.z * gridDim.y + blockIdx.y;
          last = atomicAdd(count, 1u) + 1 == static_cast<unsigned>(u.n_splits);
          if (last) *count = 0;  // zero again for the next launch
        }
        __syncthreads();
        if (last) {
          __threadfence();
          const size_t stride = static_cast<size_t>(p.num_tokens) * p.num_q_heads;
          const size_t slot0 = static_cast<size_t>(p.slot_offset) * stride;
          const int rows = min(u.row0 + kRows, u.n_rows) - u.row0;
          for (int r = warp; r < rows; r += kThreads / 32) {
            const int gr = u.row0 + r;
            const size_t row = q_row(p, u, group, token_of(u, gr), gr);
            merge_row<D>(p.ws_o + slot0 * D, p.ws_lse + slot0, stride, u.n_splits, row, lane,
                         p.out);
          }
        }
      }
      return;
    }
    base = (base + n) % kSlots;
    __syncthreads();  // every thread is done with `u` (refilled next) and the merge's stage
    if (next.id < 0) return;
    cur ^= 1;
  }
}

// Blocks per SM that the registers must allow: as many as the H200's shared memory holds
// (decode: 3 at d = 128, where a fourth would not fit anyway; 64-row tiles: 4 at d = 64, 3 at
// d = 80 and 96, 2 at d = 128). d = 256: one block per SM (64-row tiles: 165 KB; decode: 206 KB),
// so the full 255 registers.
template <int D, Pass kPass>
constexpr int kMinBlocksPerSm = D == 256
                                    ? 1
                                    : (kPass == Pass::kDecode ? 3
                                                              : (D == 64 ? 4 : (D <= 96 ? 3 : 2)));

// prefill and decode: grid (row tiles * num_splits, num_kv_heads, num_seqs), one unit per block.
//   Decode blocks start roughly in index order, sequence outermost: with seq_order longest
//   first, the longest sequences start first and the short ones fill the tail of the last wave.
// shared: grid (any, num_kv_heads); blocks loop over the (item, split) units in use, so the
//   grid need not cover the largest possible number of items.
template <int D, int WM, int WN, int STAGES, int BKV, Pass kPass, bool kWindow, bool kSoftcap,
          typename KvT, bool kKeyRows = false>
__global__ void __launch_bounds__(kThreads, kMinBlocksPerSm<D, kPass>)
    paged_attention_kernel(AttnParams p) {
  wait_for_inputs();
  constexpr int kRows = 16 * WM;
  if constexpr (kPass == Pass::kShared) {
    attend_units<D, WM, WN, STAGES, BKV, true, true, kWindow, kSoftcap, KvT, false>(
        p, blockIdx.x, gridDim.x, *p.num_items * p.num_splits, [&](int u, Unit& unit) {
          return make_unit<kRows, BKV, true, kWindow>(p, u / p.num_splits, u % p.num_splits, 0,
                                                      blockIdx.y, unit);
        });
  } else {
    attend_units<D, WM, WN, STAGES, BKV, false, false, kWindow, kSoftcap, KvT, kKeyRows>(
        p, 0, 1, 1, [&](int, Unit& unit) {
          const int b = p.seq_order != nullptr ? p.seq_order[blockIdx.z] : blockIdx.z;
          return make_unit<kRows, BKV, false, kWindow>(
              p, blockIdx.x / p.num_splits, blockIdx.x % p.num_splits, b, blockIdx.y, unit);
        });
  }
}

// ws_o: [num_splits, num_tokens, num_q_heads, D] f32, ws_lse: [num_splits, num_tokens,
// num_q_heads]; out: [num_tokens, num_q_heads, D] bf16. One warp per (token, head).
template <int D>
__global__ void __launch_bounds__(kThreads)
    merge_splits_kernel(const float* ws_o, const float* ws_lse, const int32_t* q_indptr,
                        int num_seqs, int num_tokens, int num_q_heads, int num_splits,
                        __nv_bfloat16* out) {
  wait_for_inputs();
  const int row = blockIdx.x * (kThreads / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= num_tokens * num_q_heads) return;
  const int token = row / num_q_heads;
  // Rows outside every sequence (padding of the stream) were never computed.
  if (token < q_indptr[0] || token >= q_indptr[num_seqs]) return;
  const size_t stride = static_cast<size_t>(num_tokens) * num_q_heads;
  merge_row<D>(ws_o, ws_lse, stride, num_splits, static_cast<size_t>(row), lane, out);
}

// One compiled configuration of the kernel: its pass and layout, its dynamic shared memory and
// its eight variants, indexed [e4m3 cache * 4 + window * 2 + softcap]; for direct e4m3 decode,
// also the keys-as-rows variants [window * 2 + softcap] (null in other configurations), for
// launches whose units are each at most 8 rows.
struct AttnKernel {
  Pass pass;
  int rows;  // query rows per block: 64 (prefill, shared pass) or 16 (decode)
  int stages, block_kv;
  size_t smem;
  const void* variants[8];
  const void* key_rows[4];
};

template <int D, int WM, int WN, int STAGES, int BKV, Pass kPass, typename KvT, bool kWindow,
          bool kSoftcap>
const void* attn_variant() {
  return reinterpret_cast<const void*>(
      &paged_attention_kernel<D, WM, WN, STAGES, BKV, kPass, kWindow, kSoftcap, KvT>);
}

template <int D, int WM, int WN, int STAGES, int BKV, Pass kPass, bool kWindow, bool kSoftcap>
const void* attn_key_rows_variant() {
  if constexpr (kPass == Pass::kDecode && direct_decode<D, WM, WN, STAGES>()) {
    return reinterpret_cast<const void*>(
        &paged_attention_kernel<D, WM, WN, STAGES, BKV, kPass, kWindow, kSoftcap, __nv_fp8_e4m3,
                                true>);
  } else {
    return nullptr;
  }
}

template <int D, int WM, int WN, int STAGES, int BKV, Pass kPass>
AttnKernel attn_kernel() {
  using bf16 = __nv_bfloat16;
  using e4m3 = __nv_fp8_e4m3;
  return {kPass,
          16 * WM,
          STAGES,
          BKV,
          attn_smem_bytes<D, WM, WN, STAGES, BKV>(),
          {attn_variant<D, WM, WN, STAGES, BKV, kPass, bf16, false, false>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, bf16, false, true>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, bf16, true, false>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, bf16, true, true>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, e4m3, false, false>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, e4m3, false, true>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, e4m3, true, false>(),
           attn_variant<D, WM, WN, STAGES, BKV, kPass, e4m3, true, true>()},
          {attn_key_rows_variant<D, WM, WN, STAGES, BKV, kPass, false, false>(),
           attn_key_rows_variant<D, WM, WN, STAGES, BKV, kPass, false, true>(),
           attn_key_rows_variant<D, WM, WN, STAGES, BKV, kPass, true, false>(),
           attn_key_rows_variant<D, WM, WN, STAGES, BKV, kPass, true, true>()}};
}

// A head size's configurations, each pass's in order of preference (the first whose shared
// memory the device has is taken), and its merge kernel.
struct AttnKernels {
  const AttnKernel* kernels;
  int count;
  const void* merge;
};

// A configuration: warp layout WM x WN, STAGES stages of BKV keys, for one pass.
template <int WM, int WN, int STAGES, int BKV, Pass kPass>
struct Config {};

// The kernels of head size D in the configurations listed.
template <int D, int... WM, int... WN, int... STAGES, int... BKV, Pass... kPass>
AttnKernels kernel_list(Config<WM, WN, STAGES, BKV, kPass>...) {
  static const AttnKernel kernels[] = {attn_kernel<D, WM, WN, STAGES, BKV, kPass>()...};
  return {kernels, static_cast<int>(sizeof...(WM)),
          reinterpret_cast<const void*>(&merge_splits_kernel<D>)};
}

// Up to head_dim 128 every configuration fits 99 KB per block (the least of any GPU from sm_80
// on), so each pass has one: 64-row tiles in two stages, decode in `decode_stages`.
template <int D, int decode_stages>
AttnKernels one_config_per_pass() {
  return kernel_list<D>(Config<4, 1, 2, 64, Pass::kPrefill>{},
                        Config<1, 4, decode_stages, 64, Pass::kDecode>{},
                        Config<4, 1, 2, 64, Pass::kShared>{});
}

// Defined in attention_d<D>.cu for D = 64, 80, 96, 128, 256.
template <int D>
AttnKernels attention_kernels();

}  // namespace pagedlm::cuda::attn
