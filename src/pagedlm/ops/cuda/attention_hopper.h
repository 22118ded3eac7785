// Causal prefill attention on Hopper's wgmma (attention_hopper.cu), beside the mma.sync kernel
// that every other case takes.
#pragma once

#include <cuda_runtime.h>

#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda::attn {

struct AttnParams;

// Whether this build holds the kernel's sm_90a code (the CUDA architectures named sm_90).
bool hopper_prefill_built();
// Whether a prefill launch of these params runs on it: built, a compute capability 9.0 device,
// head_dim 128, bf16 pages, no window or soft-cap, and PAGEDLM_HOPPER_PREFILL not "0" (which keeps
// the mma.sync kernel, for comparisons in one binary).
bool hopper_prefill_applies(int head_dim, const AttnParams& params, bool e4m3_cache,
                            const DeviceLimits& device);
// Grid: row tiles of 128 of the longest sequence, kv heads, sequences.
cudaError_t launch_hopper_prefill(const AttnParams& params, int num_seqs, int max_q_len,
                                  cudaStream_t stream);

}  // namespace pagedlm::cuda::attn
