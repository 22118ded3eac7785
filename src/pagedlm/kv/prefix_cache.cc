#include "pagedlm/kv/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cstring>

#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

BlockHash from_xxh(const XXH128_hash_t& hash) { return {hash.low64, hash.high64}; }

// The partial index's key. A cheap mix is enough: every candidate is checked against the parent,
// the extra key and the tokens it was recorded with.
BlockHash child_key(const BlockHash& parent, int32_t first_token, const BlockHash& extra_key) {
  constexpr uint64_t kMulA = 0x9E3779B97F4A7C15ULL, kMulB = 0xC2B2AE3D27D4EB4FULL;
  return {parent.low ^ (extra_key.low * kMulA) ^ (static_cast<uint64_t>(first_token) * kMulB),
          parent.high ^ extra_key.high};
}

// Candidates compared per partial lookup, so admission stays cheap when many cached pages follow
// one prefix with the same first token (a shared system prompt ending inside a page puts every
// request's page there; any of them serves the shared run).
constexpr int32_t kMaxPartialCandidates = 64;

}  // namespace

PrefixCache::PrefixCache(BlockPool* pool, int32_t page_size)
    : pool_(pool),
      page_size_(page_size),
      page_tokens_(static_cast<size_t>(pool->num_pages()) * page_size),
      parents_(pool->num_pages()),
      extra_keys_(pool->num_pages()),
      num_recorded_(pool->num_pages(), 0),
      recorded_generation_(pool->num_pages(), 0),
      child_key_(pool->num_pages()) {
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
  // Recorded even when the hash is taken by an equal page: its tokens can still serve partial hits.
  record(page, parent, tokens, page_size_, extra_key);
  return pool_->set_hash(page, hash);
}

void PrefixCache::record(int32_t page, const BlockHash& parent, const int32_t* page_tokens,
                         int32_t num_filled, const BlockHash& extra_key) {
  PAGEDLM_CHECK(num_filled > 0 && num_filled <= page_size_, "PrefixCache::record: ", num_filled,
                " tokens do not fit a page of ", page_size_);
  const uint32_t generation = pool_->generation(page);
  const bool current = num_recorded_[page] > 0 && recorded_generation_[page] == generation;
  if (!current) {
    if (num_recorded_[page] > 0) {  // a stale record of the page's previous content
      auto [it, end] = children_.equal_range(child_key_[page]);
      while (it != end && it->second != page) ++it;
      if (it != end) children_.erase(it);
    }
    parents_[page] = parent;
    extra_keys_[page] = extra_key;
    recorded_generation_[page] = generation;
    child_key_[page] = child_key(parent, page_tokens[0], extra_key);
    children_.emplace(child_key_[page], page);
    num_recorded_[page] = 0;
  }
  if (num_filled <= num_recorded_[page]) return;
  std::copy(page_tokens + num_recorded_[page], page_tokens + num_filled,
            page_tokens_.begin() + static_cast<size_t>(page) * page_size_ + num_recorded_[page]);
  num_recorded_[page] = num_filled;
}

int32_t PrefixCache::num_recorded(int32_t page) const {
  return recorded_generation_[page] == pool_->generation(page) ? num_recorded_[page] : 0;
}

PartialMatch PrefixCache::find_partial(const BlockHash& parent, const int32_t* tokens,
                                       int32_t max_tokens, const BlockHash& extra_key,
                                       const std::vector<int32_t>& excluded) const {
  PartialMatch best;
  if (max_tokens <= 0) return best;
  auto [it, end] = children_.equal_range(child_key(parent, tokens[0], extra_key));
  for (int32_t tried = 0; it != end && tried < kMaxPartialCandidates; ++it, ++tried) {
    const int32_t page = it->second;
    const int32_t filled = num_recorded(page);
    if (filled <= best.num_tokens || parents_[page] != parent || extra_keys_[page] != extra_key ||
        std::find(excluded.begin(), excluded.end(), page) != excluded.end()) {
      continue;
    }
    const int32_t* recorded = page_tokens_.data() + static_cast<size_t>(page) * page_size_;
    const int32_t limit = std::min(filled, max_tokens);
    const int32_t run =
        static_cast<int32_t>(std::mismatch(tokens, tokens + limit, recorded).first - tokens);
    if (run > best.num_tokens) best = {page, run};
  }
  return best;
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
