// Copies of leading K/V slots between pages of the paged KV cache: a partial-page prefix hit
// takes a cached page's first tokens into the request's own page instead of computing them.
#pragma once

#include <cstdint>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

// k_cache, v_cache: [num_pages, page_size, n_kv_heads, head_dim] (one layer's), copies:
// [num_copies, 3] i32 rows (src_page, dst_page, num_tokens) on the caches' device. Slots
// 0 .. num_tokens-1 of src_page are copied to the same slots of dst_page, in both caches. No
// page may be a destination and a source of one call (the copies run in parallel). On the CPU
// every row is checked (pages in range, 0 <= num_tokens <= page_size, src != dst) and an Error
// names the bad one; on the GPU the rows are device data and are not checked. Runs on `stream`
// (cudaStream_t) on the GPU.
void copy_kv_slots(const Tensor& k_cache, const Tensor& v_cache, const Tensor& copies,
                   void* stream = nullptr);

namespace cpu {
// row_bytes: bytes of one slot (n_kv_heads * head_dim elements).
void copy_kv_slots(char* k_cache, char* v_cache, const int32_t* copies, int64_t num_copies,
                   int64_t num_pages, int64_t page_size, int64_t row_bytes);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
void copy_kv_slots(void* k_cache, void* v_cache, const int32_t* copies, int64_t num_copies,
                   int64_t page_size, int64_t row_bytes, void* stream);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
