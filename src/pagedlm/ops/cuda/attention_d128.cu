// The paged attention kernel's configurations at head size 128 (attention_kernel.cuh). Decode
// takes two stages (74 KB, 3 blocks per H200 SM), which beat three (108 KB, 2 per SM) at 512-1024
// keys on the H200: 68-82% of copy bandwidth against 64-76% (docs/KERNELS.md, "Deeper
// pipelines").

#include "pagedlm/ops/cuda/attention_kernel.cuh"

namespace pagedlm::cuda::attn {

template <>
AttnKernels attention_kernels<128>() {
  return one_config_per_pass<128, 2>();
}

}  // namespace pagedlm::cuda::attn
