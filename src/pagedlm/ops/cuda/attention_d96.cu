// The paged attention kernel's configurations at head size 96 (attention_kernel.cuh).
// Head size 96: every configuration fits 99 KB per block (the least of sm_80 on), so one of
// each pass. Decode keeps three stages (at d = 64 59% of copy bandwidth against 51% with two at
// 768 keys on the H200).

#include <iterator>

#include "pagedlm/ops/cuda/attention_kernel.cuh"

namespace pagedlm::cuda::attn {

template <>
AttnKernels attention_kernels<96>() {
  static const AttnKernel kernels[] = {
      attn_kernel<96, 4, 1, 2, 64, Pass::kPrefill>(),
      attn_kernel<96, 1, 4, 3, 64, Pass::kDecode>(),
      attn_kernel<96, 4, 1, 2, 64, Pass::kShared>(),
  };
  return {kernels, static_cast<int>(std::size(kernels)),
          reinterpret_cast<const void*>(&merge_splits_kernel<96>)};
}

}  // namespace pagedlm::cuda::attn
