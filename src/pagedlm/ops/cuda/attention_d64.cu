// The paged attention kernel's configurations at head size 64 (attention_kernel.cuh). Decode keeps
// three stages (at d = 64 59% of copy bandwidth against 51% with two at 768 keys on the H200).

#include "pagedlm/ops/cuda/attention_kernel.cuh"

namespace pagedlm::cuda::attn {

template <>
AttnKernels attention_kernels<64>() {
  return one_config_per_pass<64, 3>();
}

}  // namespace pagedlm::cuda::attn
