#include <cstring>

#include "pagedlm/ops/copy_kv.h"
#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace cpu {

void copy_kv_slots(char* k_cache, char* v_cache, const int32_t* copies, int64_t num_copies,
                   int64_t num_pages, int64_t page_size, int64_t row_bytes) {
  for (int64_t c = 0; c < num_copies; ++c) {
    const int32_t src = copies[3 * c], dst = copies[3 * c + 1], count = copies[3 * c + 2];
    PAGEDLM_CHECK(src >= 0 && src < num_pages && dst >= 0 && dst < num_pages && src != dst,
                  "copy_kv_slots: copy ", c, " from page ", src, " to page ", dst,
                  " is not between two different pages of ", num_pages);
    PAGEDLM_CHECK(count >= 0 && count <= page_size, "copy_kv_slots: copy ", c, " of ", count,
                  " tokens does not fit a page of ", page_size);
  }
  const int64_t page_bytes = page_size * row_bytes;
  for (int64_t c = 0; c < num_copies; ++c) {
    const int64_t src = copies[3 * c], dst = copies[3 * c + 1],
                  bytes = copies[3 * c + 2] * row_bytes;
    std::memcpy(k_cache + dst * page_bytes, k_cache + src * page_bytes, bytes);
    std::memcpy(v_cache + dst * page_bytes, v_cache + src * page_bytes, bytes);
  }
}

}  // namespace cpu

void copy_kv_slots(const Tensor& k_cache, const Tensor& v_cache, const Tensor& copies,
                   void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "copy_kv_slots";
  const DType dt = k_cache.dtype();
  detail::expect(k_cache, kOp, "k_cache", dt, {kAnyDim, kAnyDim, kAnyDim, kAnyDim});
  detail::expect(v_cache, kOp, "v_cache", dt,
                 {k_cache.dim(0), k_cache.dim(1), k_cache.dim(2), k_cache.dim(3)});
  detail::expect(copies, kOp, "copies", DType::kI32, {kAnyDim, 3});
  detail::expect_devices(kOp, k_cache.device(), {{&v_cache, "v_cache"}, {&copies, "copies"}});
  const int64_t num_copies = copies.dim(0);
  const int64_t row_bytes = k_cache.dim(2) * k_cache.dim(3) * static_cast<int64_t>(dtype_size(dt));
  if (num_copies == 0) return;
  if (k_cache.device() == Device::kCpu) {
    cpu::copy_kv_slots(static_cast<char*>(k_cache.raw()), static_cast<char*>(v_cache.raw()),
                       copies.data<int32_t>(), num_copies, k_cache.dim(0), k_cache.dim(1),
                       row_bytes);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::copy_kv_slots(k_cache.raw(), v_cache.raw(), copies.data<int32_t>(), num_copies,
                      k_cache.dim(1), row_bytes, stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
