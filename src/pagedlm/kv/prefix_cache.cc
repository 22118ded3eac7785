#include "pagedlm/kv/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

BlockHash from_xxh(const XXH128_hash_t& hash) { return {hash.low64, hash.high64}; }

}  // namespace

PrefixCache::PrefixCache(BlockPool* pool, int32_t page_size)
    : pool_(pool),
      page_size_(page_size),
      page_tokens_(static_cast<size_t>(pool->num_pages()) * page_size),
      parents_(pool->num_pages()),
      extra_keys_(pool->num_pages()) {
  PAGEDLM_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0,
                "page_size must be a power of two, got ", page_size);
}

BlockHash PrefixCache::extra_key(std::string_view cache_salt) {
  return from_xxh(XXH3_128bits(cache_salt.data(), cache_salt.size()));
}

BlockHash PrefixCache::page_hash(const BlockHash& parent, const int32_t* tokens, int32_t page_size,
                                 const BlockHash& extra_key) {
  // One contiguous input keeps this on XXH3's one-shot path, much cheaper than its streaming
  // state for a page of a few dozen bytes; the buffer is reused across calls.
  thread_local std::vector<unsigned char> bytes;
  const size_t token_bytes = sizeof(int32_t) * page_size;
  bytes.resize(2 * sizeof(BlockHash) + token_bytes);
  std::memcpy(bytes.data(), &parent, sizeof(BlockHash));
  std::memcpy(bytes.data() + sizeof(BlockHash), tokens, token_bytes);
  std::memcpy(bytes.data() + sizeof(BlockHash) + token_bytes, &extra_key, sizeof(BlockHash));
  return from_xxh(XXH3_128bits(bytes.data(), bytes.size()));
}

bool PrefixCache::insert(int32_t page, const BlockHash& hash, const BlockHash& parent,
                         const int32_t* tokens, const BlockHash& extra_key) {
  if (!pool_->set_hash(page, hash)) return false;
  std::copy_n(tokens, page_size_, page_tokens_.begin() + static_cast<size_t>(page) * page_size_);
  parents_[page] = parent;
  extra_keys_[page] = extra_key;
  return true;
}

int32_t PrefixCache::find(const BlockHash& hash, const BlockHash& parent, const int32_t* tokens,
                          const BlockHash& extra_key) const {
  const int32_t page = pool_->find(hash);
  if (page < 0) return -1;
  const bool same_content =
      parents_[page] == parent && extra_keys_[page] == extra_key &&
      std::equal(tokens, tokens + page_size_,
                 page_tokens_.begin() + static_cast<size_t>(page) * page_size_);
  return same_content ? page : -1;
}

}  // namespace pagedlm
