// ops::copy_kv_slots on the CPU: the partial-page prefix-hit copy moves exactly the leading
// slots it is asked to, in both caches, and refuses rows outside the cache.
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/copy_kv.h"

namespace pagedlm {
namespace {

constexpr int64_t kPages = 5, kPageSize = 4, kHeads = 2, kHeadDim = 3;
constexpr int64_t kRow = kHeads * kHeadDim;

// Every element distinct, and K's differ from V's, so any misplaced row shows.
Tensor numbered_cache(float offset) {
  Tensor t = Tensor::empty(DType::kF32, {kPages, kPageSize, kHeads, kHeadDim});
  for (int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = offset + static_cast<float>(i);
  return t;
}

float at(const Tensor& cache, int64_t page, int64_t slot, int64_t i) {
  return cache.data<float>()[(page * kPageSize + slot) * kRow + i];
}

TEST(CopyKvSlots, CopiesTheLeadingSlotsOfEachPairAndNothingElse) {
  const Tensor k = numbered_cache(0.f), v = numbered_cache(10000.f);
  const Tensor k0 = numbered_cache(0.f), v0 = numbered_cache(10000.f);
  // Page 1's first 3 slots to page 3, page 0's first slot to page 4.
  const std::vector<int32_t> rows = {1, 3, 3, 0, 4, 1};
  ops::copy_kv_slots(k, v, Tensor::from_i32(rows, {2, 3}));
  for (int64_t page = 0; page < kPages; ++page) {
    for (int64_t slot = 0; slot < kPageSize; ++slot) {
      int64_t from = page;
      if (page == 3 && slot < 3) from = 1;
      if (page == 4 && slot < 1) from = 0;
      for (int64_t i = 0; i < kRow; ++i) {
        EXPECT_EQ(at(k, page, slot, i), at(k0, from, slot, i)) << page << " " << slot;
        EXPECT_EQ(at(v, page, slot, i), at(v0, from, slot, i)) << page << " " << slot;
      }
    }
  }
}

TEST(CopyKvSlots, NoCopiesChangeNothing) {
  const Tensor k = numbered_cache(0.f), v = numbered_cache(10000.f);
  ops::copy_kv_slots(k, v, Tensor::from_i32({}, {0, 3}));
  const Tensor k0 = numbered_cache(0.f);
  for (int64_t i = 0; i < k.numel(); ++i) ASSERT_EQ(k.data<float>()[i], k0.data<float>()[i]);
}

TEST(CopyKvSlots, RejectsRowsOutsideTheCache) {
  const Tensor k = numbered_cache(0.f), v = numbered_cache(10000.f);
  const auto copy = [&](std::vector<int32_t> row) {
    ops::copy_kv_slots(k, v, Tensor::from_i32(row, {1, 3}));
  };
  EXPECT_THROW(copy({5, 0, 1}), Error);              // no page 5
  EXPECT_THROW(copy({0, -1, 1}), Error);             // no page -1
  EXPECT_THROW(copy({2, 2, 1}), Error);              // onto itself
  EXPECT_THROW(copy({0, 1, kPageSize + 1}), Error);  // more than a page
  EXPECT_THROW(copy({0, 1, -1}), Error);
  // Nothing was copied by the rejected calls.
  const Tensor k0 = numbered_cache(0.f);
  for (int64_t i = 0; i < k.numel(); ++i) ASSERT_EQ(k.data<float>()[i], k0.data<float>()[i]);
  // A wrongly shaped copies tensor is refused too.
  EXPECT_THROW(ops::copy_kv_slots(k, v, Tensor::from_i32({0, 1}, {1, 2})), Error);
}

}  // namespace
}  // namespace pagedlm
