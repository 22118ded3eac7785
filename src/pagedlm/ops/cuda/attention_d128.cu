// The paged attention kernel's configurations at head size 128 (attention_kernel.cuh).
// Head size 128: every configuration fits 99 KB per block (the least of sm_80 on). Decode takes
// two stages (74 KB, 3 blocks per H200 SM), which beat three (108 KB, 2 per SM) at 512-1024 keys
// on the H200: 68-82% of copy bandwidth against 64-76% (docs/KERNELS.md, "Deeper pipelines").

#include <iterator>

#include "pagedlm/ops/cuda/attention_kernel.cuh"

namespace pagedlm::cuda::attn {

template <>
AttnKernels attention_kernels<128>() {
  static const AttnKernel kernels[] = {
      attn_kernel<128, 4, 1, 2, 64, Pass::kPrefill>(),
      attn_kernel<128, 1, 4, 2, 64, Pass::kDecode>(),
      attn_kernel<128, 4, 1, 2, 64, Pass::kShared>(),
  };
  return {kernels, static_cast<int>(std::size(kernels)),
          reinterpret_cast<const void*>(&merge_splits_kernel<128>)};
}

}  // namespace pagedlm::cuda::attn
