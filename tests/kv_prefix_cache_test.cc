#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/kv/prefix_cache.h"

namespace pagedlm {
namespace {

// Hashes every full page of `tokens` in a chain, as the scheduler does.
std::vector<BlockHash> chain(const std::vector<int32_t>& tokens, int32_t page_size,
                             const BlockHash& extra_key) {
  std::vector<BlockHash> hashes;
  BlockHash parent = PrefixCache::kRootHash;
  for (size_t begin = 0; begin + page_size <= tokens.size(); begin += page_size) {
    parent = PrefixCache::page_hash(parent, tokens.data() + begin, page_size, extra_key);
    hashes.push_back(parent);
  }
  return hashes;
}

std::vector<int32_t> page_of(int32_t page_size, int32_t first_token) {
  std::vector<int32_t> tokens(page_size);
  std::iota(tokens.begin(), tokens.end(), first_token);
  return tokens;
}

std::vector<int32_t> concat(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  std::vector<int32_t> out = a;
  out.insert(out.end(), b.begin(), b.end());
  return out;
}

class PrefixCacheTest : public ::testing::TestWithParam<int32_t> {
 protected:
  int32_t page_size() const { return GetParam(); }

  // Stores `tokens` page by page in fresh pages, as one sequence would.
  std::vector<int32_t> store(const std::vector<int32_t>& tokens, const BlockHash& extra_key) {
    const std::vector<BlockHash> hashes = chain(tokens, page_size(), extra_key);
    std::vector<int32_t> pages;
    for (size_t i = 0; i < hashes.size(); ++i) {
      const int32_t page = pool_.allocate();
      const BlockHash& parent = i == 0 ? PrefixCache::kRootHash : hashes[i - 1];
      EXPECT_TRUE(
          cache_.insert(page, hashes[i], parent, tokens.data() + i * page_size(), extra_key));
      pages.push_back(page);
    }
    return pages;
  }

  // Number of leading pages of `tokens` the cache serves.
  int32_t count_hits(const std::vector<int32_t>& tokens, const BlockHash& extra_key) const {
    const std::vector<BlockHash> hashes = chain(tokens, page_size(), extra_key);
    int32_t num_hits = 0;
    for (size_t i = 0; i < hashes.size(); ++i) {
      const BlockHash& parent = i == 0 ? PrefixCache::kRootHash : hashes[i - 1];
      if (cache_.find(hashes[i], parent, tokens.data() + i * page_size(), extra_key) < 0) break;
      ++num_hits;
    }
    return num_hits;
  }

  BlockPool pool_{64};
  PrefixCache cache_{&pool_, GetParam()};
};

TEST_P(PrefixCacheTest, ServesTheSameChain) {
  const BlockHash no_salt = PrefixCache::extra_key("");
  const std::vector<int32_t> tokens = concat(page_of(page_size(), 100), page_of(page_size(), 200));
  const std::vector<int32_t> pages = store(tokens, no_salt);
  EXPECT_EQ(count_hits(tokens, no_salt), 2);
  const std::vector<BlockHash> hashes = chain(tokens, page_size(), no_salt);
  EXPECT_EQ(cache_.find(hashes[1], hashes[0], tokens.data() + page_size(), no_salt), pages[1]);
}

TEST_P(PrefixCacheTest, SamePageUnderADifferentPrefixDoesNotHit) {
  const BlockHash no_salt = PrefixCache::extra_key("");
  const std::vector<int32_t> second = page_of(page_size(), 200);
  store(concat(page_of(page_size(), 100), second), no_salt);

  const std::vector<int32_t> other = concat(page_of(page_size(), 300), second);
  EXPECT_EQ(count_hits(other, no_salt), 0);
  const std::vector<BlockHash> hashes = chain(other, page_size(), no_salt);
  const std::vector<BlockHash> stored =
      chain(concat(page_of(page_size(), 100), second), page_size(), no_salt);
  EXPECT_NE(hashes[1], stored[1]);
  // Even asked directly for the stored hash, a different parent is not served.
  EXPECT_EQ(cache_.find(stored[1], hashes[0], second.data(), no_salt), -1);
}

TEST_P(PrefixCacheTest, SaltsIsolateTenants) {
  const BlockHash salt_a = PrefixCache::extra_key("tenant-a");
  const BlockHash salt_b = PrefixCache::extra_key("tenant-b");
  const BlockHash no_salt = PrefixCache::extra_key("");
  EXPECT_NE(salt_a, salt_b);
  EXPECT_NE(salt_a, no_salt);
  const std::vector<int32_t> tokens = concat(page_of(page_size(), 1), page_of(page_size(), 9));
  store(tokens, salt_a);
  EXPECT_EQ(count_hits(tokens, salt_a), 2);
  EXPECT_EQ(count_hits(tokens, salt_b), 0);
  EXPECT_EQ(count_hits(tokens, no_salt), 0);
  // A tenant that somehow knew the other's hash still is not served.
  const std::vector<BlockHash> hashes = chain(tokens, page_size(), salt_a);
  EXPECT_EQ(cache_.find(hashes[0], PrefixCache::kRootHash, tokens.data(), salt_b), -1);
}

TEST_P(PrefixCacheTest, CollidingHashWithOtherTokensIsRejected) {
  const BlockHash no_salt = PrefixCache::extra_key("");
  const std::vector<int32_t> stored = page_of(page_size(), 40);
  const BlockHash forged{0x1234, 0x5678};  // pretend another content hashes to this too
  const int32_t page = pool_.allocate();
  ASSERT_TRUE(cache_.insert(page, forged, PrefixCache::kRootHash, stored.data(), no_salt));
  EXPECT_EQ(cache_.find(forged, PrefixCache::kRootHash, stored.data(), no_salt), page);

  std::vector<int32_t> colliding = stored;
  colliding.back() += 1;
  EXPECT_EQ(cache_.find(forged, PrefixCache::kRootHash, colliding.data(), no_salt), -1);
}

TEST_P(PrefixCacheTest, ReusedPageIsNoLongerFound) {
  BlockPool small_pool(1);
  PrefixCache cache(&small_pool, page_size());
  const BlockHash no_salt = PrefixCache::extra_key("");
  const std::vector<int32_t> tokens = page_of(page_size(), 5);
  const BlockHash hash =
      PrefixCache::page_hash(PrefixCache::kRootHash, tokens.data(), page_size(), no_salt);
  const int32_t page = small_pool.allocate();
  ASSERT_TRUE(cache.insert(page, hash, PrefixCache::kRootHash, tokens.data(), no_salt));
  small_pool.release(page);
  EXPECT_EQ(cache.find(hash, PrefixCache::kRootHash, tokens.data(), no_salt), page);
  EXPECT_EQ(small_pool.allocate(), page);
  EXPECT_EQ(cache.find(hash, PrefixCache::kRootHash, tokens.data(), no_salt), -1);
}

TEST_P(PrefixCacheTest, PageHashDependsOnEveryToken) {
  const BlockHash no_salt = PrefixCache::extra_key("");
  std::vector<int32_t> tokens = page_of(page_size(), 0);
  const BlockHash base =
      PrefixCache::page_hash(PrefixCache::kRootHash, tokens.data(), page_size(), no_salt);
  for (int32_t i = 0; i < page_size(); ++i) {
    tokens[i] += 1;
    EXPECT_NE(PrefixCache::page_hash(PrefixCache::kRootHash, tokens.data(), page_size(), no_salt),
              base);
    tokens[i] -= 1;
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizes, PrefixCacheTest, ::testing::Values(1, 16, 64));

TEST(PrefixCache, RejectsPageSizeThatIsNotAPowerOfTwo) {
  BlockPool pool(4);
  EXPECT_THROW(PrefixCache(&pool, 12), Error);
  EXPECT_THROW(PrefixCache(&pool, 0), Error);
}

}  // namespace
}  // namespace pagedlm

namespace pagedlm {
namespace {

// The partial-page index: pages recorded as they fill, found by their longest leading run.
TEST(PrefixCachePartial, FindsTheLongestLeadingRunUnderTheSameParentAndSalt) {
  BlockPool pool(8);
  PrefixCache cache(&pool, 8);
  const BlockHash salt = PrefixCache::extra_key(""), other = PrefixCache::extra_key("b");
  const BlockHash parent =
      PrefixCache::page_hash(PrefixCache::kRootHash, std::vector<int32_t>(8, 1).data(), 8, salt);
  const int32_t a = pool.allocate(), b = pool.allocate();
  const std::vector<int32_t> a_tokens = {5, 6, 7, 8, 9};
  cache.record(a, parent, a_tokens.data(), 3, salt);  // a holds 5 6 7 so far
  const std::vector<int32_t> b_tokens = {5, 6, 0, 0};
  cache.record(b, parent, b_tokens.data(), 4, salt);

  const std::vector<int32_t> query = {5, 6, 7, 8, 1};
  PartialMatch match = cache.find_partial(parent, query.data(), 5, salt);
  EXPECT_EQ(match.page, a);
  EXPECT_EQ(match.num_tokens, 3);                     // only what a has recorded
  cache.record(a, parent, a_tokens.data(), 5, salt);  // a fills on
  EXPECT_EQ(cache.find_partial(parent, query.data(), 5, salt).num_tokens, 4);
  EXPECT_EQ(cache.find_partial(parent, query.data(), 2, salt).num_tokens, 2);  // capped
  // Excluding a leaves b's two tokens.
  match = cache.find_partial(parent, query.data(), 5, salt, {a});
  EXPECT_EQ(match.page, b);
  EXPECT_EQ(match.num_tokens, 2);
  // Another salt or parent finds nothing, though the tokens are equal.
  EXPECT_EQ(cache.find_partial(parent, query.data(), 5, other).num_tokens, 0);
  EXPECT_EQ(cache.find_partial(PrefixCache::kRootHash, query.data(), 5, salt).num_tokens, 0);
  EXPECT_EQ(cache.num_recorded(a), 5);
}

TEST(PrefixCachePartial, ARecordDiesWhenThePageIsHandedOutAgain) {
  BlockPool pool(1);
  PrefixCache cache(&pool, 4);
  const BlockHash salt = PrefixCache::extra_key("");
  const int32_t page = pool.allocate();
  const std::vector<int32_t> tokens = {3, 4};
  cache.record(page, PrefixCache::kRootHash, tokens.data(), 2, salt);
  pool.release(page);  // free, still recorded: a partial hit may still take it
  EXPECT_EQ(cache.find_partial(PrefixCache::kRootHash, tokens.data(), 2, salt).page, page);
  EXPECT_EQ(pool.allocate(), page);  // reused: its slots are about to be overwritten
  EXPECT_EQ(cache.num_recorded(page), 0);
  EXPECT_EQ(cache.find_partial(PrefixCache::kRootHash, tokens.data(), 2, salt).num_tokens, 0);
  // Recorded anew with other content under another first token, only that is found.
  const std::vector<int32_t> fresh = {9, 4, 4};
  cache.record(page, PrefixCache::kRootHash, fresh.data(), 3, salt);
  EXPECT_EQ(cache.find_partial(PrefixCache::kRootHash, tokens.data(), 2, salt).num_tokens, 0);
  EXPECT_EQ(cache.find_partial(PrefixCache::kRootHash, fresh.data(), 3, salt).num_tokens, 3);
}

}  // namespace
}  // namespace pagedlm
