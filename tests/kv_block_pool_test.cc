#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/kv/block_pool.h"

namespace pagedlm {
namespace {

using Pages = std::vector<int32_t>;

TEST(BlockPool, StartsWithEveryPageFreeInIndexOrder) {
  BlockPool pool(4);
  EXPECT_EQ(pool.num_pages(), 4);
  EXPECT_EQ(pool.num_free(), 4);
  EXPECT_EQ(pool.num_used(), 0);
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_EQ(pool.free_pages_in_eviction_order(), (Pages{0, 1, 2, 3}));
}

TEST(BlockPool, RejectsEmptyPool) { EXPECT_THROW(BlockPool(0), Error); }

TEST(BlockPool, RefCountsFollowAcquireAndRelease) {
  BlockPool pool(3);
  const int32_t page = pool.allocate();
  EXPECT_EQ(page, 0);
  EXPECT_EQ(pool.ref_count(page), 1);
  pool.acquire(page);
  EXPECT_EQ(pool.ref_count(page), 2);
  pool.release(page);
  EXPECT_EQ(pool.ref_count(page), 1);
  EXPECT_EQ(pool.num_free(), 2);
  pool.release(page);
  EXPECT_EQ(pool.ref_count(page), 0);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_THROW(pool.release(page), Error);
}

TEST(BlockPool, AllocateReturnsMinusOneWhenExhausted) {
  BlockPool pool(2);
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_FALSE(pool.can_allocate(1));
  EXPECT_EQ(pool.allocate(), -1);
}

TEST(BlockPool, EvictsLeastRecentlyFreedFirst) {
  BlockPool pool(4);
  for (int32_t i = 0; i < 4; ++i) pool.allocate();
  pool.release(2);
  pool.release(0);
  pool.release(3);
  EXPECT_EQ(pool.free_pages_in_eviction_order(), (Pages{2, 0, 3}));
  EXPECT_EQ(pool.allocate(), 2);
  EXPECT_EQ(pool.allocate(), 0);
  pool.release(1);
  EXPECT_EQ(pool.free_pages_in_eviction_order(), (Pages{3, 1}));
}

TEST(BlockPool, AcquiringAFreePageTakesItOffTheFreeList) {
  BlockPool pool(3);
  for (int32_t i = 0; i < 3; ++i) pool.allocate();
  pool.release(0);
  pool.release(1);
  pool.release(2);
  pool.acquire(1);  // a prefix-cache hit revives the page from the middle of the list
  EXPECT_EQ(pool.ref_count(1), 1);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.free_pages_in_eviction_order(), (Pages{0, 2}));
}

TEST(BlockPool, FreedPageKeepsItsHashUntilReused) {
  BlockPool pool(2);
  const BlockHash hash{11, 22};
  const int32_t page = pool.allocate();
  ASSERT_TRUE(pool.set_hash(page, hash));
  EXPECT_EQ(pool.find(hash), page);
  EXPECT_EQ(pool.num_cached(), 0);  // held pages are not "cached"

  pool.release(page);
  EXPECT_EQ(pool.find(hash), page);
  EXPECT_EQ(pool.num_cached(), 1);

  pool.acquire(page);
  EXPECT_EQ(pool.num_cached(), 0);
  pool.release(page);
  EXPECT_EQ(pool.num_cached(), 1);

  // Page 1 is older on the free list, so it goes first; the cached page survives.
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_EQ(pool.find(hash), page);
  EXPECT_EQ(pool.allocate(), page);
  EXPECT_EQ(pool.find(hash), -1);
  EXPECT_FALSE(pool.has_hash(page));
  EXPECT_EQ(pool.num_cached(), 0);
}

// A page a step was to write but left midway: neither its hash nor its generation's record
// serves it any more, whether it is still held or already free, and it stays where it is.
TEST(BlockPool, ForgottenPageIsFoundNoMore) {
  BlockPool pool(3);
  const BlockHash held_hash{5, 6}, free_hash{7, 8};
  const int32_t held = pool.allocate();
  const int32_t freed = pool.allocate();
  ASSERT_TRUE(pool.set_hash(held, held_hash));
  ASSERT_TRUE(pool.set_hash(freed, free_hash));
  pool.release(freed);
  EXPECT_EQ(pool.num_cached(), 1);
  const uint32_t held_generation = pool.generation(held);
  const uint32_t freed_generation = pool.generation(freed);

  pool.forget(held);
  pool.forget(freed);
  EXPECT_EQ(pool.find(held_hash), -1);
  EXPECT_EQ(pool.find(free_hash), -1);
  EXPECT_FALSE(pool.has_hash(held));
  EXPECT_FALSE(pool.has_hash(freed));
  EXPECT_EQ(pool.num_cached(), 0);
  EXPECT_NE(pool.generation(held), held_generation);
  EXPECT_NE(pool.generation(freed), freed_generation);
  EXPECT_EQ(pool.ref_count(held), 1);
  EXPECT_EQ(pool.num_free(), 2);
  EXPECT_EQ(pool.free_pages_in_eviction_order(), (Pages{2, freed}));
  // The hash is free for another page.
  EXPECT_TRUE(pool.set_hash(held, free_hash));
}

TEST(BlockPool, FirstPageWithAHashStaysIndexed) {
  BlockPool pool(2);
  const BlockHash hash{1, 2};
  const int32_t first = pool.allocate();
  const int32_t second = pool.allocate();
  EXPECT_TRUE(pool.set_hash(first, hash));
  EXPECT_FALSE(pool.set_hash(second, hash));
  EXPECT_FALSE(pool.set_hash(first, BlockHash{3, 4}));
  EXPECT_EQ(pool.find(hash), first);
  EXPECT_FALSE(pool.has_hash(second));
}

TEST(BlockPool, NullPageIsTheLastAndNeverHandedOut) {
  BlockPool pool(4, /*reserve_null_page=*/true);
  EXPECT_EQ(pool.null_page(), 3);
  EXPECT_EQ(pool.num_pages(), 4);
  EXPECT_EQ(pool.num_reserved(), 1);
  EXPECT_EQ(pool.num_free(), 3);
  EXPECT_EQ(pool.num_used(), 0);
  EXPECT_EQ(pool.free_pages_in_eviction_order(), (Pages{0, 1, 2}));
  EXPECT_EQ(pool.allocate(), 0);
  EXPECT_EQ(pool.allocate(), 1);
  EXPECT_EQ(pool.allocate(), 2);
  EXPECT_EQ(pool.num_used(), 3);
  EXPECT_EQ(pool.num_free(), 0);
  EXPECT_EQ(pool.allocate(), -1);
  // Nobody holds it and nothing can be cached in it.
  EXPECT_EQ(pool.ref_count(3), 0);
  EXPECT_THROW(pool.acquire(3), Error);
  EXPECT_THROW(pool.release(3), Error);
  EXPECT_FALSE(pool.set_hash(3, BlockHash{5, 6}));
  EXPECT_EQ(pool.find(BlockHash{5, 6}), -1);
  for (int32_t page = 0; page < 3; ++page) pool.release(page);
  EXPECT_EQ(pool.num_free(), pool.num_pages() - pool.num_reserved());
}

TEST(BlockPool, NoNullPageUnlessAskedFor) {
  BlockPool pool(2);
  EXPECT_EQ(pool.null_page(), -1);
  EXPECT_EQ(pool.num_reserved(), 0);
  // One page and the null page leave nothing to use.
  EXPECT_THROW(BlockPool(1, /*reserve_null_page=*/true), Error);
  EXPECT_EQ(BlockPool(2, /*reserve_null_page=*/true).num_free(), 1);
}

// Random operations against a plain model of ref counts and the LRU order.
TEST(BlockPool, RandomOperationsMatchAModel) {
  constexpr int32_t kNumPages = 16;
  BlockPool pool(kNumPages);
  std::vector<int32_t> model_refs(kNumPages, 0);
  std::vector<int32_t> model_free = pool.free_pages_in_eviction_order();
  std::mt19937 rng(7);
  for (int32_t op = 0; op < 5000; ++op) {
    const int32_t page = static_cast<int32_t>(rng() % kNumPages);
    switch (rng() % 3) {
      case 0: {
        const int32_t got = pool.allocate();
        if (model_free.empty()) {
          EXPECT_EQ(got, -1);
        } else {
          EXPECT_EQ(got, model_free.front());
          model_free.erase(model_free.begin());
          model_refs[got] = 1;
        }
        break;
      }
      case 1:
        if (model_refs[page]++ == 0) std::erase(model_free, page);
        pool.acquire(page);
        break;
      default:
        if (model_refs[page] == 0) break;
        if (--model_refs[page] == 0) model_free.push_back(page);
        pool.release(page);
    }
    ASSERT_EQ(pool.free_pages_in_eviction_order(), model_free);
    ASSERT_EQ(pool.num_free(), static_cast<int32_t>(model_free.size()));
    for (int32_t p = 0; p < kNumPages; ++p) ASSERT_EQ(pool.ref_count(p), model_refs[p]);
  }
}

}  // namespace
}  // namespace pagedlm
