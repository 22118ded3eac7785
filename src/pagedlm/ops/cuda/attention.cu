// Paged attention, host side: picks each launch's kernel configuration by the device's shared
// memory (attention_kernel.cuh has the kernel; attention_d<D>.cu its instantiations), the decode
// split counts by its SM count, and launches. Prefill at head_dim 128 on Hopper goes to the wgmma
// kernel of attention_hopper.cu where it applies.

#include <cuda_bf16.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "pagedlm/ops/cuda/attention_hopper.h"
#include "pagedlm/ops/cuda/attention_kernel.cuh"
#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

using attn::AttnKernel;
using attn::AttnKernels;
using attn::AttnParams;
using attn::kLog2e;
using attn::kMinSharedSplitKeys;
using attn::kMinSplitKeys;
using attn::kThreads;
using attn::Pass;
using detail::ceil_div;

// A supported head size's kernels; none for the others.
AttnKernels kernels_of(int head_dim) {
  switch (head_dim) {
    case 64:
      return attn::attention_kernels<64>();
    case 80:
      return attn::attention_kernels<80>();
    case 96:
      return attn::attention_kernels<96>();
    case 128:
      return attn::attention_kernels<128>();
    case 256:
      return attn::attention_kernels<256>();
    default:
      return {nullptr, 0, nullptr};
  }
}

// The first configuration of `pass` at head_dim (in the order attention_d<D>.cu prefers them)
// whose shared memory one block of the device may have; null when none fits.
const AttnKernel* pick_kernel(int head_dim, Pass pass, const DeviceLimits& device) {
  const AttnKernels kernels = kernels_of(head_dim);
  for (int i = 0; i < kernels.count; ++i) {
    const AttnKernel& k = kernels.kernels[i];
    if (k.pass == pass && k.smem + attn::kAttnStaticSmemBytes <= device.smem_per_block) return &k;
  }
  return nullptr;
}

// Sets a kernel's dynamic shared-memory limit on the device (a host-side setting, not a stream
// operation), once per device and kernel, and tells how many of its blocks one SM holds
// (registers and shared memory, at least 1; under PAGEDLM_CUDA_SMEM_CAP_KB, what the capped SM
// holds). The variants of a configuration take the plain one's count (the policies add a few
// registers at most).
cudaError_t prepare(const AttnKernel& kernel, const void* fn, const DeviceLimits& device,
                    int* blocks_per_sm) {
  struct Prepared {
    int device;
    const void* fn;
    int blocks_per_sm;
  };
  static std::mutex mu;
  static std::vector<Prepared> prepared;
  std::lock_guard<std::mutex> lock(mu);
  for (const Prepared& p : prepared) {
    if (p.device == device.device && p.fn == fn) {
      *blocks_per_sm = p.blocks_per_sm;
      return cudaSuccess;
    }
  }
  PAGEDLM_CUDA_TRY(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                        static_cast<int>(kernel.smem)));
  int n = 0;
  PAGEDLM_CUDA_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, fn, kThreads, kernel.smem));
  const size_t per_block =
      kernel.smem + attn::kAttnStaticSmemBytes + device.smem_reserved_per_block;
  n = std::min(n, static_cast<int>(device.smem_per_sm / per_block));
  prepared.push_back({device.device, fn, std::max(n, 1)});
  *blocks_per_sm = prepared.back().blocks_per_sm;
  return cudaSuccess;
}

// Whether the keys-as-rows decode variants may run (PAGEDLM_ATTN_KEY_ROWS=0: not, for A/B).
bool key_rows_allowed() {
  static const bool allowed = detail::env_switch_on("PAGEDLM_ATTN_KEY_ROWS");
  return allowed;
}

// The launch of the variant that params and the cache's format need (make_params sets window
// and softcap_log2 only when they are on); few_rows: every unit holds at most 8 rows (one
// token's group a sequence), which the keys-as-rows variants need.
cudaError_t launch(const AttnKernel& kernel, const AttnParams& params, const KvCacheFormat& kv,
                   dim3 grid, const DeviceLimits& device, cudaStream_t stream,
                   bool few_rows = false) {
  const int policy = (params.window > 0 ? 2 : 0) + (params.softcap_log2 > 0.f ? 1 : 0);
  const void* fn = kernel.variants[(kv.e4m3 ? 4 : 0) + policy];
  if (kv.e4m3 && few_rows && kernel.key_rows[policy] != nullptr && key_rows_allowed()) {
    fn = kernel.key_rows[policy];
  }
  int blocks_per_sm = 0;
  PAGEDLM_CUDA_TRY(prepare(kernel, fn, device, &blocks_per_sm));
  AttnParams p = params;
  void* args[] = {&p};
  return detail::launch_overlapped(fn, grid, dim3(kThreads), args, kernel.smem, stream);
}

// The grid of a per-sequence launch: row tiles of the longest sequence times splits.
dim3 sequence_grid(const AttnParams& params, int rows_per_tile, int num_seqs, int max_q_len) {
  const int64_t rows = static_cast<int64_t>(max_q_len) * params.group;
  const unsigned tiles = std::max(1u, ceil_div(rows, rows_per_tile));
  return dim3(tiles * params.num_splits, params.num_kv_heads, num_seqs);
}

cudaError_t check_shapes(int num_q_heads, int num_kv_heads, int head_dim, int page_size,
                         const KvCacheFormat& kv) {
  if (kv.e4m3 && !(kv.k_scale > 0.f && kv.v_scale > 0.f)) return cudaErrorInvalidValue;
  if (num_kv_heads <= 0 || num_q_heads % num_kv_heads != 0) return cudaErrorInvalidValue;
  const int group = num_q_heads / num_kv_heads;
  if (group < 1 || group > 8) return cudaErrorInvalidValue;
  if (kernels_of(head_dim).count == 0) return cudaErrorInvalidValue;
  if (page_size < 1) return cudaErrorInvalidValue;
  return cudaSuccess;
}

AttnParams make_params(const void* q, const void* k_cache, const void* v_cache,
                       const int32_t* q_indptr, const int32_t* kv_indptr,
                       const int32_t* kv_page_indices, const int32_t* kv_last_page_len, void* out,
                       int num_tokens, int num_q_heads, int num_kv_heads, int page_size,
                       const AttentionVariant& variant, const KvCacheFormat& kv) {
  AttnParams p{};
  p.q = static_cast<const __nv_bfloat16*>(q);
  p.k_cache = k_cache;
  p.v_cache = v_cache;
  p.q_indptr = q_indptr;
  p.kv_indptr = kv_indptr;
  p.kv_page_indices = kv_page_indices;
  p.kv_last_page_len = kv_last_page_len;
  p.out = static_cast<__nv_bfloat16*>(out);
  p.num_tokens = num_tokens;
  p.num_q_heads = num_q_heads;
  p.num_kv_heads = num_kv_heads;
  p.group = num_q_heads / num_kv_heads;
  p.page_size = page_size;
  p.num_splits = 1;
  // An e4m3 cache's scores are q.k of the stored values times k_scale.
  const float score_scale = variant.scale * (kv.e4m3 ? kv.k_scale : 1.f);
  p.scale_log2 = score_scale * kLog2e;
  p.window = std::max(variant.window, 0);
  if (variant.softcap > 0.f) {
    p.softcap_pre = score_scale / variant.softcap;
    p.softcap_log2 = variant.softcap * kLog2e;
  }
  p.v_scale = kv.e4m3 ? kv.v_scale : 1.f;
  return p;
}

}  // namespace

size_t paged_attention_workspace_bytes(int max_num_tokens, int num_q_heads, int head_dim,
                                       int max_num_splits) {
  if (max_num_splits <= 1) return 0;
  const size_t rows = static_cast<size_t>(max_num_splits) * max_num_tokens * num_q_heads;
  // Output block first, 256-byte aligned, then the lse block.
  const size_t o_bytes = (rows * head_dim * sizeof(float) + 255) / 256 * 256;
  return o_bytes + rows * sizeof(float);
}

int paged_attention_decode_num_splits(int num_seqs, int num_kv_heads, int head_dim, int max_kv_len,
                                      const DeviceLimits& device) {
  // Decode blocks resident per SM (the kernel's registers and shared memory): on the H200 3 at
  // d = 128 (two stages) and at d = 64 (three), 1 at d = 256 (three stages, 206 KB).
  const AttnKernel* kernel = pick_kernel(head_dim, Pass::kDecode, device);
  int per_sm = 1;
  if (kernel == nullptr || prepare(*kernel, kernel->variants[0], device, &per_sm) != cudaSuccess) {
    cudaGetLastError();  // leave no sticky error behind; one block per SM is always safe
    per_sm = 1;
  }
  const int num_sms = device.num_sms;
  const int64_t slots = static_cast<int64_t>(std::max(num_sms, 1)) * per_sm;
  const int64_t blocks = std::max<int64_t>(1, static_cast<int64_t>(num_seqs) * num_kv_heads);
  // Two rounds of units or more: the last round's tail is a small share (and live batches mix
  // lengths).
  if (blocks >= 2 * slots) return 1;
  // Fewer units: a partial last round leaves SMs idle while it runs (on the H200, 8 seqs x 8 kv
  // heads at 32k keys: 78% of copy bandwidth with 256 blocks in 264 slots, 50% with 320). Take
  // the split count whose rounds are fullest, the smallest within 5% of the best, none shorter
  // than kMinSplitKeys keys.
  const int64_t max_splits = std::clamp<int64_t>(max_kv_len / kMinSplitKeys, 1, 64);
  auto fullness = [&](int64_t s) {
    const int64_t units = blocks * s;
    return static_cast<double>(units) / static_cast<double>(ceil_div(units, slots) * slots);
  };
  double best = 0;
  for (int64_t s = 1; s <= max_splits; ++s) best = std::max(best, fullness(s));
  for (int64_t s = 1; s <= max_splits; ++s) {
    if (fullness(s) >= best - 0.05) return static_cast<int>(s);
  }
  return 1;
}

cudaError_t launch_paged_attention_prefill(const void* q, const void* k_cache, const void* v_cache,
                                           const int32_t* q_indptr, const int32_t* kv_indptr,
                                           const int32_t* kv_page_indices,
                                           const int32_t* kv_last_page_len, void* out, int num_seqs,
                                           int num_tokens, int max_q_len, int num_q_heads,
                                           int num_kv_heads, int head_dim, int page_size,
                                           const AttentionVariant& variant, cudaStream_t stream,
                                           const KvCacheFormat& kv) {
  PAGEDLM_CUDA_TRY(check_shapes(num_q_heads, num_kv_heads, head_dim, page_size, kv));
  if (num_seqs <= 0 || num_tokens <= 0 || max_q_len <= 0) return cudaSuccess;
  const AttnParams params =
      make_params(q, k_cache, v_cache, q_indptr, kv_indptr, kv_page_indices, kv_last_page_len, out,
                  num_tokens, num_q_heads, num_kv_heads, page_size, variant, kv);
  const DeviceLimits* device = nullptr;
  PAGEDLM_CUDA_TRY(current_device_limits(&device));
  // On every prefill launch of its shapes, whatever the batch: a sequence's outputs must not
  // depend on which other sequences share its step.
  if (attn::hopper_prefill_applies(head_dim, params, kv.e4m3, *device)) {
    return attn::launch_hopper_prefill(params, num_seqs, max_q_len, stream);
  }
  const AttnKernel* kernel = pick_kernel(head_dim, Pass::kPrefill, *device);
  if (kernel == nullptr) return cudaErrorInvalidConfiguration;
  return launch(*kernel, params, kv, sequence_grid(params, kernel->rows, num_seqs, max_q_len),
                *device, stream);
}

cudaError_t launch_paged_attention_decode(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* q_indptr,
    const int32_t* kv_indptr, const int32_t* kv_page_indices, const int32_t* kv_last_page_len,
    void* out, int num_seqs, int num_tokens, int max_q_len, int num_q_heads, int num_kv_heads,
    int head_dim, int page_size, const AttentionVariant& variant, int num_splits, void* workspace,
    size_t workspace_bytes, const int32_t* seq_order, const SharedPrefixPass* shared,
    cudaStream_t stream, const KvCacheFormat& kv, unsigned* merge_counters) {
  PAGEDLM_CUDA_TRY(check_shapes(num_q_heads, num_kv_heads, head_dim, page_size, kv));
  if (num_splits < 1) return cudaErrorInvalidValue;
  if (shared != nullptr &&
      (shared->num_splits < 1 || shared->max_items < 1 || shared->kv_skip == nullptr ||
       shared->num_items == nullptr || shared->items == nullptr || shared->members == nullptr)) {
    return cudaErrorInvalidValue;
  }
  if (num_seqs <= 0 || num_tokens <= 0 || max_q_len <= 0) return cudaSuccess;
  AttnParams params =
      make_params(q, k_cache, v_cache, q_indptr, kv_indptr, kv_page_indices, kv_last_page_len, out,
                  num_tokens, num_q_heads, num_kv_heads, page_size, variant, kv);
  params.num_splits = num_splits;
  params.seq_order = seq_order;
  const int shared_splits = shared != nullptr ? shared->num_splits : 0;
  const int slots = num_splits + shared_splits;
  if (slots > 1) {
    const size_t need = paged_attention_workspace_bytes(num_tokens, num_q_heads, head_dim, slots);
    if (workspace == nullptr || workspace_bytes < need) return cudaErrorInvalidValue;
    const size_t rows = static_cast<size_t>(slots) * num_tokens * num_q_heads;
    params.ws_o = static_cast<float*>(workspace);
    params.ws_lse = reinterpret_cast<float*>(static_cast<char*>(workspace) +
                                             (rows * head_dim * sizeof(float) + 255) / 256 * 256);
  }
  if (shared != nullptr) {
    params.kv_skip = shared->kv_skip;
    params.extra_slots = shared_splits;
  }
  const DeviceLimits* device = nullptr;
  PAGEDLM_CUDA_TRY(current_device_limits(&device));
  const AttnKernel* decode = pick_kernel(head_dim, Pass::kDecode, *device);
  const AttnKernel* shared_kernel =
      shared != nullptr ? pick_kernel(head_dim, Pass::kShared, *device) : nullptr;
  if (decode == nullptr || (shared != nullptr && shared_kernel == nullptr)) {
    return cudaErrorInvalidConfiguration;
  }
  const dim3 grid = sequence_grid(params, decode->rows, num_seqs, max_q_len);
  // The merge in the blocks: no shared pass, and one row tile a sequence.
  const bool merge_in_blocks = merge_counters != nullptr && shared == nullptr && slots > 1 &&
                               grid.x == static_cast<unsigned>(num_splits);
  if (merge_in_blocks) params.merge_counters = merge_counters;
  const bool few_rows = static_cast<int64_t>(max_q_len) * params.group <= 8;
  PAGEDLM_CUDA_TRY(launch(*decode, params, kv, grid, *device, stream, few_rows));
  if (shared != nullptr) {
    // After the per-sequence pass, which marked these slots empty for every row: members' rows
    // get the shared keys' partial results.
    AttnParams sp = params;
    sp.kv_skip = nullptr;
    sp.extra_slots = 0;
    sp.slot_offset = num_splits;
    sp.num_splits = shared_splits;
    sp.num_items = shared->num_items;
    sp.items = shared->items;
    sp.members = shared->members;
    // Enough looping blocks for a few per SM, never more than the units that could exist.
    const int blocks = std::min(shared->max_items * shared_splits,
                                std::max(1, 4 * device->num_sms / num_kv_heads));
    const dim3 shared_grid(static_cast<unsigned>(blocks), static_cast<unsigned>(num_kv_heads), 1);
    PAGEDLM_CUDA_TRY(launch(*shared_kernel, sp, kv, shared_grid, *device, stream));
  }
  if (slots == 1 || merge_in_blocks) return cudaSuccess;
  const unsigned blocks = ceil_div(static_cast<int64_t>(num_tokens) * num_q_heads, kThreads / 32);
  const float* ws_o = params.ws_o;
  const float* ws_lse = params.ws_lse;
  __nv_bfloat16* merged = params.out;
  int merge_slots = slots;
  void* args[] = {&ws_o,       &ws_lse,      &q_indptr,    &num_seqs,
                  &num_tokens, &num_q_heads, &merge_slots, &merged};
  return detail::launch_overlapped(kernels_of(head_dim).merge, dim3(blocks), dim3(kThreads), args,
                                   0, stream);
}

int shared_prefix_members_per_item(int num_q_heads, int num_kv_heads) {
  return num_kv_heads > 0 ? std::max(1, 64 / std::max(1, num_q_heads / num_kv_heads)) : 1;
}

int shared_prefix_num_splits(int num_items, int num_kv_heads, const DeviceLimits& device) {
  // Four blocks per SM (what fits of this kernel) over all splits; the kernel trims splits below
  // kMinSharedSplitKeys keys, and the merge reads every split, so no more than 16.
  const int64_t blocks_per_split = std::max<int64_t>(1, int64_t{num_items} * num_kv_heads);
  const int64_t splits = int64_t{std::max(device.num_sms, 1)} * 4 / blocks_per_split;
  return static_cast<int>(std::clamp<int64_t>(splits, 1, 16));
}

}  // namespace pagedlm::cuda
