// PrefixCache: content addressing of full KV pages. A full page's hash chains the hash of the
// page before it, its tokens and an extra key (the tenant's cache salt):
//   h_i = XXH3_128(h_{i-1}, tokens of page i, extra key),
// so equal pages under different prefixes or salts never meet. The hash only finds a candidate;
// a hit is confirmed by comparing everything the hash was computed from, so a collision can
// never serve another sequence's KV. Pages live in a BlockPool, which owns the hash index and
// drops a page's entry when it reuses the page.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "pagedlm/kv/block_pool.h"

namespace pagedlm {

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

 private:
  BlockPool* pool_;
  int32_t page_size_;
  // What each indexed page was hashed from, kept to confirm hits.
  std::vector<int32_t> page_tokens_;   // [num_pages * page_size]
  std::vector<BlockHash> parents_;     // [num_pages]
  std::vector<BlockHash> extra_keys_;  // [num_pages]
};

}  // namespace pagedlm
