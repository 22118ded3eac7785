// The paged attention kernel's configurations at head size 256 (attention_kernel.cuh).
// Head size 256: one block per SM whatever the configuration, so each pass takes the deepest
// pipeline of the largest key tiles that fits. The H200 (227 KB per block): 64-key tiles, two
// stages for 64-row tiles (165 KB), three for decode (206 KB, two 64 KB tiles in flight per SM
// instead of one). 163 KB (A100): 32-key tiles in three stages, two decode stages. 99 KB
// (consumer GPUs): 16-key tiles in three stages, one decode stage (the decode warps split 64
// keys, so its tiles cannot shrink).

#include "pagedlm/ops/cuda/attention_kernel.cuh"

namespace pagedlm::cuda::attn {

template <>
AttnKernels attention_kernels<256>() {
  return kernel_list<256>(Config<4, 1, 2, 64, Pass::kPrefill>{},  // 165 KB
                          Config<4, 1, 3, 32, Pass::kPrefill>{},  // 132 KB
                          Config<4, 1, 3, 16, Pass::kPrefill>{},  // 82 KB
                          Config<1, 4, 3, 64, Pass::kDecode>{},   // 206 KB
                          Config<1, 4, 2, 64, Pass::kDecode>{},   // 140 KB
                          Config<1, 4, 1, 64, Pass::kDecode>{},   // 74 KB
                          Config<4, 1, 2, 64, Pass::kShared>{},
                          Config<4, 1, 3, 32, Pass::kShared>{},
                          Config<4, 1, 3, 16, Pass::kShared>{});
}

}  // namespace pagedlm::cuda::attn
