// KvCacheManager on pools small enough to work out by hand: page size 4, pages handed out
// 0, 1, 2, ... from a fresh pool, freed pages queued behind the never-used ones.
#include "pagedlm/kv/kv_cache_manager.h"

#include <gtest/gtest.h>

#include <numeric>
#include <vector>

#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

using Pages = std::vector<int32_t>;

KvCacheConfig small_config(int32_t window = 0) {
  return KvCacheConfig{
      .page_size = 4, .num_pages = 8, .window = window, .enable_prefix_cache = true};
}

// tokens first, first + 1, ..., first + n - 1
std::vector<int32_t> run_of(int32_t n, int32_t first) {
  std::vector<int32_t> tokens(n);
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

// A new sequence holding `tokens`, all committed, with num_lookahead slots more.
KvSeq committed_seq(KvCacheManager& kv, const std::vector<int32_t>& tokens,
                    int32_t num_lookahead = 0) {
  KvSeq seq = kv.new_seq("");
  const auto num_tokens = static_cast<int32_t>(tokens.size());
  kv.allocate_slots(seq, num_tokens, num_lookahead);
  kv.commit(seq, tokens, num_tokens);
  return seq;
}

TEST(KvCacheManager, RejectsABadConfig) {
  EXPECT_THROW(KvCacheManager(KvCacheConfig{.page_size = 3}), Error);
  EXPECT_THROW(KvCacheManager(KvCacheConfig{.page_size = -4}), Error);
  EXPECT_THROW(KvCacheManager(KvCacheConfig{.num_pages = 1, .window = 8}), Error);
  EXPECT_THROW(KvCacheManager(KvCacheConfig{.window = -1}), Error);
}

TEST(KvCacheManager, AllocatesPagesForTokensAndLookahead) {
  KvCacheManager kv(small_config());
  KvSeq seq = kv.new_seq("");
  // 5 tokens take two pages of 4.
  EXPECT_EQ(kv.num_pages_needed(seq, 5), 2);
  kv.allocate_slots(seq, 5);
  EXPECT_EQ(seq.pages(), (Pages{0, 1}));
  // 9 tokens take a third page; 4 lookahead slots after them (13 slots) a fourth.
  EXPECT_EQ(kv.num_pages_needed(seq, 9), 1);
  kv.allocate_slots(seq, 9, /*num_lookahead=*/4);
  EXPECT_EQ(seq.pages(), (Pages{0, 1, 2, 3}));
  // The lookahead already covers the 13th token: nothing new.
  EXPECT_EQ(kv.num_pages_needed(seq, 13), 0);
  EXPECT_EQ(kv.pool().num_free(), 4);
  EXPECT_TRUE(kv.can_allocate(4));
  EXPECT_FALSE(kv.can_allocate(5));
}

TEST(KvCacheManager, CommittedPagesServeWholeAndPartialHits) {
  KvCacheManager kv(small_config());
  const std::vector<int32_t> a_tokens = run_of(10, 10);  // 10 .. 19
  KvSeq a = committed_seq(kv, a_tokens);
  EXPECT_EQ(a.pages(), (Pages{0, 1, 2}));
  EXPECT_EQ(a.num_committed(), 10);

  // b shares a's first 10 tokens, then goes on with 99, 98. Lookups leave its last token to
  // compute, so 11 tokens may hit: pages 0 and 1 whole (10..17), then of page 2, which holds
  // 18, 19, b's 18, 19 (99 differs).
  std::vector<int32_t> b_tokens = a_tokens;
  b_tokens.insert(b_tokens.end(), {99, 98});
  KvSeq b = kv.new_seq("");
  const CachedPrefix hit = kv.find_cached(b, b_tokens);
  EXPECT_EQ(hit.num_full_pages, 2);
  EXPECT_EQ(kv.hit_pages(), (Pages{0, 1}));
  EXPECT_EQ(hit.num_free_full_pages, 0);  // a holds them
  EXPECT_EQ(hit.partial.page, 2);
  EXPECT_EQ(hit.partial.num_tokens, 2);
  EXPECT_EQ(hit.num_tokens(4), 10);
  EXPECT_EQ(hit.num_query_tokens, 12);
  // 12 tokens fill three pages: two are hits, the third is new; the copy source is a's.
  EXPECT_EQ(kv.num_pages_needed(b, 12, &hit), 1);

  kv.allocate_slots(b, 12, 0, &hit);
  EXPECT_EQ(b.pages(), (Pages{0, 1, 3}));
  EXPECT_EQ(b.num_committed(), 10);
  EXPECT_EQ(kv.pending_copies(), (Pages{2, 3, 2}));  // page 2's first 2 slots into page 3
  EXPECT_EQ(b.copy_page_index(), 2);
  EXPECT_EQ(b.copy_src_page(), 2);
  EXPECT_EQ(b.num_copied_tokens(), 2);
  EXPECT_EQ(kv.pool().ref_count(0), 2);
  EXPECT_EQ(kv.pool().ref_count(2), 2);  // a, and the hold until the step has copied
  EXPECT_EQ(kv.num_holders(2), 1);
  const KvCacheStats& stats = kv.stats();
  EXPECT_EQ(stats.prefix_query_tokens, 12);
  EXPECT_EQ(stats.prefix_hit_tokens, 10);
  EXPECT_EQ(stats.prefix_partial_hits, 1);
  EXPECT_EQ(stats.prefix_partial_hit_tokens, 2);

  kv.end_step();
  EXPECT_TRUE(kv.pending_copies().empty());
  EXPECT_EQ(kv.pool().ref_count(2), 1);

  // Another salt shares nothing.
  KvSeq salted = kv.new_seq("tenant");
  const CachedPrefix salted_hit = kv.find_cached(salted, b_tokens);
  EXPECT_EQ(salted_hit.num_full_pages, 0);
  EXPECT_EQ(salted_hit.partial.num_tokens, 0);
}

TEST(KvCacheManager, FreeGivesPagesBackTailFirstAndKeepsThemFindable) {
  KvCacheManager kv(small_config());
  const std::vector<int32_t> tokens = run_of(10, 10);
  KvSeq a = committed_seq(kv, tokens);
  kv.free(a);
  EXPECT_TRUE(a.pages().empty());
  EXPECT_EQ(a.num_committed(), 0);
  // Never-used pages first, then a's tail before its head.
  EXPECT_EQ(kv.pool().free_pages_in_eviction_order(), (Pages{3, 4, 5, 6, 7, 2, 1, 0}));
  EXPECT_EQ(kv.pool().num_cached(), 2);  // the two full pages
  const std::vector<CachedPageView> cached = kv.cached_pages(8);
  ASSERT_EQ(cached.size(), 3u);
  EXPECT_EQ(cached[0].page, 2);
  EXPECT_EQ(cached[0].num_tokens, 2);
  EXPECT_FALSE(cached[0].full);
  EXPECT_EQ(cached[1].page, 1);
  EXPECT_TRUE(cached[1].full);

  // The same 10 tokens again: 9 may hit, pages 0 and 1 whole (both free), then token 18 of
  // page 2 (free too). Three pages for 10 tokens, two of them hits, plus the free hits revived
  // and the free copy source held: 3 - 2 + 2 + 1 = 4 free pages.
  KvSeq again = kv.new_seq("");
  const CachedPrefix hit = kv.find_cached(again, tokens);
  EXPECT_EQ(hit.num_full_pages, 2);
  EXPECT_EQ(hit.num_free_full_pages, 2);
  EXPECT_EQ(hit.partial.page, 2);
  EXPECT_EQ(hit.partial.num_tokens, 1);
  EXPECT_EQ(kv.num_pages_needed(again, 10, &hit), 4);
  kv.allocate_slots(again, 10, 0, &hit);
  // Page 3 is the head of the free list; page 2 is held as the source, not handed out.
  EXPECT_EQ(again.pages(), (Pages{0, 1, 3}));
  EXPECT_EQ(kv.pool().num_free(), 4);
}

TEST(KvCacheManager, RollbackForgetsTheTokensAndReopensTheirPage) {
  KvCacheManager kv(small_config());
  const std::vector<int32_t> tokens = run_of(10, 10);
  KvSeq a = committed_seq(kv, tokens, /*num_lookahead=*/4);  // 14 slots: pages 0 .. 3
  EXPECT_EQ(a.pages(), (Pages{0, 1, 2, 3}));

  // Back to 5 tokens (10 .. 14): pages 0 and 1 stay, page 1 holding one token now; pages 2 and
  // 3 go back, page 3 first.
  ASSERT_TRUE(kv.can_rollback(a, 5));
  kv.rollback(a, std::span<const int32_t>(tokens).first(5), 5);
  EXPECT_EQ(a.pages(), (Pages{0, 1}));
  EXPECT_EQ(a.num_committed(), 5);
  EXPECT_EQ(kv.pool().free_pages_in_eviction_order(), (Pages{4, 5, 6, 7, 3, 2}));
  EXPECT_FALSE(kv.pool().has_hash(1));
  EXPECT_EQ(kv.cached_pages(8).size(), 0u);  // pages 2 and 3 serve nothing

  // Another sequence with the same 10 tokens and one more finds page 0 whole, then only the
  // one token (14) that page 1 still holds.
  std::vector<int32_t> other_tokens = tokens;
  other_tokens.push_back(50);
  KvSeq other = kv.new_seq("");
  const CachedPrefix hit = kv.find_cached(other, other_tokens);
  EXPECT_EQ(hit.num_full_pages, 1);
  EXPECT_EQ(hit.partial.page, 1);
  EXPECT_EQ(hit.partial.num_tokens, 1);

  // Committing again after the rollback makes page 1 whole once more.
  std::vector<int32_t> new_tokens = run_of(5, 10);
  new_tokens.insert(new_tokens.end(), {70, 71, 72});  // 8 tokens: pages 0 and 1 full
  kv.commit(a, new_tokens, 8);
  EXPECT_TRUE(kv.pool().has_hash(1));
  EXPECT_NO_THROW(kv.rollback(a, new_tokens, 0));
  EXPECT_EQ(a.num_committed(), 8);
  EXPECT_THROW(kv.rollback(a, new_tokens, 9), Error);  // more than committed
}

TEST(KvCacheManager, RollbackRefusesAPageAnotherSequenceReads) {
  KvCacheManager kv(small_config());
  const std::vector<int32_t> tokens = run_of(10, 10);
  KvSeq a = committed_seq(kv, tokens);
  KvSeq b = kv.new_seq("");
  const CachedPrefix hit = kv.find_cached(b, tokens);  // pages 0 and 1 whole
  kv.allocate_slots(b, 10, 0, &hit);
  kv.end_step();
  // Keeping 5 tokens would leave a filling page 1 again, which b holds too.
  EXPECT_FALSE(kv.can_rollback(a, 5));
  EXPECT_THROW(kv.rollback(a, std::span<const int32_t>(tokens).first(5), 5), Error);
  EXPECT_EQ(a.pages(), (Pages{0, 1, 2}));  // unchanged
  EXPECT_TRUE(kv.pool().has_hash(1));
  // Keeping 8 ends at a page boundary: a gives back only its own page 2.
  ASSERT_TRUE(kv.can_rollback(a, 2));
  kv.rollback(a, std::span<const int32_t>(tokens).first(8), 2);
  EXPECT_EQ(a.pages(), (Pages{0, 1}));
  EXPECT_EQ(kv.pool().ref_count(1), 2);
}

TEST(KvCacheManager, ReleasesPagesBehindTheWindow) {
  // Window 8: the pool's last page (7) is the null page.
  KvCacheManager kv(small_config(/*window=*/8));
  EXPECT_EQ(kv.num_usable_pages(), 7);
  const std::vector<int32_t> tokens = run_of(12, 10);
  KvSeq seq = committed_seq(kv, tokens);
  EXPECT_EQ(seq.pages(), (Pages{0, 1, 2}));
  // The query at 12 sees keys 5 .. 12: page 0 (keys 0 .. 3) is behind it, page 1 (4 .. 7) not.
  kv.release_behind_window(seq, 12);
  EXPECT_EQ(seq.pages(), (Pages{7, 1, 2}));
  EXPECT_EQ(seq.num_released_pages(), 1);
  EXPECT_EQ(kv.pool().num_free(), 5);
  EXPECT_TRUE(kv.pool().has_hash(0));  // still findable, as a freed page is
  // The query at 16 sees 9 .. 16: page 1 goes too.
  kv.release_behind_window(seq, 16);
  EXPECT_EQ(seq.pages(), (Pages{7, 7, 2}));
  // Rolling back to 7 tokens would reach page 1, released.
  EXPECT_FALSE(kv.can_rollback(seq, 5));
  // free() skips the released entries: the pool ends whole.
  kv.free(seq);
  EXPECT_EQ(kv.pool().num_free(), 7);
}

TEST(KvCacheManager, NothingIsFoundWithThePrefixCacheOff) {
  KvCacheConfig config = small_config();
  config.enable_prefix_cache = false;
  KvCacheManager kv(config);
  const std::vector<int32_t> tokens = run_of(10, 10);
  KvSeq a = committed_seq(kv, tokens);
  EXPECT_FALSE(kv.pool().has_hash(0));
  KvSeq b = kv.new_seq("");
  const CachedPrefix hit = kv.find_cached(b, tokens);
  EXPECT_EQ(hit.num_tokens(4), 0);
  EXPECT_EQ(hit.num_query_tokens, 0);
}

}  // namespace
}  // namespace pagedlm
