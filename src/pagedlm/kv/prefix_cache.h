// PrefixCache: content addressing of full KV pages. A full page's hash chains the hash of the
// page before it, its tokens and an extra key (the tenant's cache salt):
//   h_i = XXH3_128(h_{i-1}, tokens of page i, extra key),
// so equal pages under different prefixes or salts never meet. The hash only finds a candidate;
// a hit is confirmed by comparing everything the hash was computed from, so a collision can
// never serve another sequence's KV. Pages live in a BlockPool, which owns the hash index and
// drops a page's entry when it reuses the page.
//
// Beyond whole pages, the cache finds the longest run of a page's first tokens that a request
// shares (a partial-page hit: the request's prefix ends inside a page someone else filled). Every
// page whose leading tokens are in a plan is recorded with those tokens, its parent hash and
// extra key, under a key of (parent, extra key, first token): full pages, and pages still being
// filled or released while partly full (their first slots never change: pages are append-only
// until allocate() hands them out again, which bumps the pool's generation of the page and so
// invalidates the record). A partial hit is confirmed token by token, like a full one.
#pragma once

#include <cstdint>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "pagedlm/kv/block_pool.h"

namespace pagedlm {

// The longest leading run of a recorded page that a request's next tokens equal.
struct PartialMatch {
  int32_t page = -1;
  int32_t num_tokens = 0;
};

class PrefixCache {
 public:
  // The parent hash of a sequence's first page.
  static constexpr BlockHash kRootHash{};

  PrefixCache(BlockPool* pool, int32_t page_size);

  int32_t page_size() const { return page_size_; }

  // The extra key of every page of a request with this salt ("" for no salt).
  static BlockHash extra_key(std::string_view cache_salt);
  // h_i for a full page of page_size tokens.
  static BlockHash page_hash(const BlockHash& parent, const int32_t* tokens, int32_t page_size,
                             const BlockHash& extra_key);

  // Makes `page`, which holds the page_size `tokens` after the prefix hashed as `parent`,
  // findable under `hash`. False when the page or the hash is already indexed.
  bool insert(int32_t page, const BlockHash& hash, const BlockHash& parent, const int32_t* tokens,
              const BlockHash& extra_key);
  // The page cached under `hash` whose stored parent, tokens and extra key equal these, or -1.
  // Does not acquire the page.
  int32_t find(const BlockHash& hash, const BlockHash& parent, const int32_t* tokens,
               const BlockHash& extra_key) const;

  // Records that `page` holds its first num_filled tokens, page_tokens[0 .. num_filled), after
  // the prefix hashed as `parent`. Call again as the page fills; insert() records full pages.
  void record(int32_t page, const BlockHash& parent, const int32_t* page_tokens, int32_t num_filled,
              const BlockHash& extra_key);
  // Among recorded pages after `parent` with this extra key (the same salt chain), the one whose
  // leading tokens share the longest run with tokens[0 .. max_tokens), skipping `excluded`.
  // Does not acquire the page. num_tokens is 0 when nothing matches.
  PartialMatch find_partial(const BlockHash& parent, const int32_t* tokens, int32_t max_tokens,
                            const BlockHash& extra_key,
                            const std::vector<int32_t>& excluded = {}) const;
  // Leading tokens of `page` whose K/V the cache can still serve (0: none).
  int32_t num_recorded(int32_t page) const;

 private:
  BlockPool* pool_;
  int32_t page_size_;
  // What each indexed page was hashed from, kept to confirm hits.
  std::vector<int32_t> page_tokens_;   // [num_pages * page_size]
  std::vector<BlockHash> parents_;     // [num_pages]
  std::vector<BlockHash> extra_keys_;  // [num_pages]
  // Partial-hit index: tokens recorded per page (0: none), the pool generation they belong to,
  // the key the page is listed under in children_.
  std::vector<int32_t> num_recorded_;          // [num_pages]
  std::vector<uint32_t> recorded_generation_;  // [num_pages]
  std::vector<BlockHash> child_key_;           // [num_pages]
  std::unordered_multimap<BlockHash, int32_t, BlockHashHasher> children_;
};

}  // namespace pagedlm
