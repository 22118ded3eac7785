#include "pagedlm/kv/kv_cache_manager.h"

#include <algorithm>
#include <limits>

#include "pagedlm/core/error.h"

namespace pagedlm {

namespace {

// Checked before the pool and the prefix cache are sized from it.
const KvCacheConfig& checked(const KvCacheConfig& config) {
  const int32_t page_size = config.page_size;
  PAGEDLM_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0,
                "the KV cache's page_size must be a power of two, got ", page_size);
  PAGEDLM_CHECK(config.window >= 0, "the KV cache's window must be >= 0, got ", config.window);
  // With a window the last page is the null page; at least one other must be left to use.
  const int32_t min_pages = config.window > 0 ? 2 : 1;
  PAGEDLM_CHECK(config.num_pages >= min_pages, "the KV cache's num_pages must be at least ",
                min_pages, config.window > 0 ? " (one is the null page)" : "", ", got ",
                config.num_pages);
  // Slots are int32 in the plan.
  PAGEDLM_CHECK(
      static_cast<int64_t>(config.num_pages) * page_size <= std::numeric_limits<int32_t>::max(),
      "KV cache: ", config.num_pages, " pages of ", page_size,
      " tokens overflow int32 slot indices");
  return config;
}

}  // namespace

KvCacheManager::KvCacheManager(const KvCacheConfig& config)
    : config_(checked(config)),
      page_shift_(std::countr_zero(static_cast<uint32_t>(config.page_size))),
      pool_(config.num_pages, /*reserve_null_page=*/config.window > 0),
      cache_(&pool_, config.page_size) {}

KvSeq KvCacheManager::new_seq(std::string_view cache_salt) const {
  KvSeq seq;
  if (config_.enable_prefix_cache) seq.extra_key_ = PrefixCache::extra_key(cache_salt);
  return seq;
}

const BlockHash& KvCacheManager::hash_pages(KvSeq& seq, std::span<const int32_t> tokens,
                                            int32_t page_index) {
  const int32_t page_size = config_.page_size;
  while (static_cast<int32_t>(seq.page_hashes_.size()) <= page_index) {
    const int32_t index = static_cast<int32_t>(seq.page_hashes_.size());
    const BlockHash& parent = index == 0 ? PrefixCache::kRootHash : seq.page_hashes_.back();
    seq.page_hashes_.push_back(PrefixCache::page_hash(
        parent, tokens.data() + static_cast<size_t>(index) * page_size, page_size, seq.extra_key_));
  }
  return seq.page_hashes_[page_index];
}

const BlockHash& KvCacheManager::parent_hash(const KvSeq& seq, int32_t page_index) {
  return page_index == 0 ? PrefixCache::kRootHash : seq.page_hashes_[page_index - 1];
}

CachedPrefix KvCacheManager::find_cached(KvSeq& seq, std::span<const int32_t> tokens) {
  PAGEDLM_CHECK(seq.pages_.empty(), "find_cached: the sequence holds pages already");
  const int32_t page_size = config_.page_size;
  hit_pages_.clear();
  CachedPrefix hit;
  if (!config_.enable_prefix_cache || tokens.empty()) return hit;
  const auto num_tokens = static_cast<int32_t>(tokens.size());
  hit.num_query_tokens = num_tokens;
  const int32_t max_hit_pages = (num_tokens - 1) / page_size;
  for (int32_t index = 0; index < max_hit_pages; ++index) {
    // page_hash() may grow page_hashes_, so it runs before parent_hash() takes a reference.
    const BlockHash& hash = page_hash(seq, tokens, index);
    const int32_t page =
        cache_.find(hash, parent_hash(seq, index),
                    tokens.data() + static_cast<size_t>(index) * page_size, seq.extra_key_);
    if (page < 0) break;
    hit_pages_.push_back(page);
  }
  hit.num_full_pages = static_cast<int32_t>(hit_pages_.size());
  hit.num_free_full_pages = static_cast<int32_t>(
      std::count_if(hit_pages_.begin(), hit_pages_.end(),
                    [this](int32_t page) { return pool_.ref_count(page) == 0; }));
  // Where the whole-page hits end, the next tokens may still equal the leading tokens of a page
  // someone else filled: those are copied into the sequence's own fresh page rather than computed.
  const int32_t begin = hit.num_full_pages * page_size;
  const int32_t max_tokens = std::min(page_size - 1, num_tokens - 1 - begin);
  if (hit.num_full_pages > 0) page_hash(seq, tokens, hit.num_full_pages - 1);  // the parent
  hit.partial = cache_.find_partial(parent_hash(seq, hit.num_full_pages), tokens.data() + begin,
                                    max_tokens, seq.extra_key_, copy_dsts_);
  return hit;
}

int32_t KvCacheManager::num_pages_needed_with_hit(int32_t needed, const CachedPrefix& hit) const {
  // Hit pages need no new page, but reviving a free one takes it off the free list; so does
  // holding a free copy source through the step.
  needed = std::max(0, needed - hit.num_full_pages) + hit.num_free_full_pages;
  if (hit.partial.num_tokens > 0 && pool_.ref_count(hit.partial.page) == 0) ++needed;
  return needed;
}

void KvCacheManager::take_hit_and_allocate(KvSeq& seq, int32_t num_pages, const CachedPrefix* hit) {
  if (hit != nullptr) {
    PAGEDLM_CHECK(seq.pages_.empty(), "allocate_slots: a cache hit for a sequence with pages");
    for (int32_t i = 0; i < hit->num_full_pages; ++i) {
      pool_.acquire(hit_pages_[i]);
      seq.pages_.push_back(hit_pages_[i]);
    }
    const PartialMatch& partial = hit->partial;
    if (partial.num_tokens > 0) {
      pool_.acquire(partial.page);  // before the allocations below, which must not hand it out
      copy_holds_.push_back(partial.page);
    }
    const int32_t num_hit_tokens = hit->num_tokens(config_.page_size);
    if (hit->num_query_tokens > 0) {
      stats_.prefix_query_tokens += hit->num_query_tokens;
      stats_.prefix_hit_tokens += num_hit_tokens;
    }
    seq.num_committed_ = num_hit_tokens;
    seq.copy_page_index_ = seq.copy_src_page_ = -1;
    seq.num_copied_tokens_ = 0;
    if (partial.num_tokens > 0) {
      // The sequence's own page for the partial hit: it follows the whole pages.
      const int32_t dst = pool_.allocate();
      PAGEDLM_CHECK(dst >= 0, "allocate_slots: no free page (can_allocate was not checked)");
      seq.pages_.push_back(dst);
      kv_copies_.insert(kv_copies_.end(), {partial.page, dst, partial.num_tokens});
      copy_dsts_.push_back(dst);
      seq.copy_page_index_ = hit->num_full_pages;
      seq.copy_src_page_ = partial.page;
      seq.num_copied_tokens_ = partial.num_tokens;
      ++stats_.prefix_partial_hits;
      stats_.prefix_partial_hit_tokens += partial.num_tokens;
    }
  }
  while (static_cast<int32_t>(seq.pages_.size()) < num_pages) {
    const int32_t page = pool_.allocate();
    PAGEDLM_CHECK(page >= 0, "allocate_slots: no free page (can_allocate was not checked)");
    seq.pages_.push_back(page);
  }
}

void KvCacheManager::commit(KvSeq& seq, std::span<const int32_t> tokens, int32_t num_tokens) {
  const int32_t begin = seq.num_committed_;
  if (num_tokens <= begin) return;
  PAGEDLM_CHECK(static_cast<int32_t>(tokens.size()) >= num_tokens &&
                    num_pages_for(num_tokens) <= static_cast<int32_t>(seq.pages_.size()),
                "commit: ", num_tokens, " tokens exceed the sequence's tokens or slots");
  seq.num_committed_ = num_tokens;
  if (!config_.enable_prefix_cache) return;
  const int32_t page_size = config_.page_size;
  for (int32_t index = begin >> page_shift_; index < num_tokens >> page_shift_; ++index) {
    const int32_t page = seq.pages_[index];
    if (pool_.has_hash(page)) continue;  // served by the cache: already indexed
    const BlockHash& hash = page_hash(seq, tokens, index);
    cache_.insert(page, hash, parent_hash(seq, index),
                  tokens.data() + static_cast<size_t>(index) * page_size, seq.extra_key_);
  }
  if ((num_tokens & (page_size - 1)) == 0) return;
  const int32_t index = num_tokens >> page_shift_;
  if (index > 0) page_hash(seq, tokens, index - 1);  // the parent of the partly filled page
  cache_.record(seq.pages_[index], parent_hash(seq, index),
                tokens.data() + static_cast<size_t>(index) * page_size,
                num_tokens - index * page_size, seq.extra_key_);
}

bool KvCacheManager::can_rollback(const KvSeq& seq, int32_t num_tokens) const {
  if (num_tokens < 0 || num_tokens > seq.num_committed_) return false;
  if (num_tokens == 0) return true;
  const int32_t kept = seq.num_committed_ - num_tokens;
  // The first page holding a rolled-back token must still be the sequence's (not released behind
  // the window), and if the kept tokens end inside it, the sequence fills it again: no one else
  // may read it.
  const int32_t first_touched = kept / config_.page_size;
  return first_touched >= seq.num_released_pages_ &&
         (kept % config_.page_size == 0 || pool_.ref_count(seq.pages_[first_touched]) == 1);
}

void KvCacheManager::rollback(KvSeq& seq, std::span<const int32_t> tokens, int32_t num_tokens) {
  PAGEDLM_CHECK(can_rollback(seq, num_tokens), "rollback: cannot roll back ", num_tokens,
                " of the sequence's ", seq.num_committed_,
                " committed tokens (more than committed, into a page released behind the window, "
                "or into a page another sequence shares)");
  if (num_tokens == 0) return;
  const int32_t page_size = config_.page_size;
  const int32_t kept = seq.num_committed_ - num_tokens;
  PAGEDLM_CHECK(static_cast<int32_t>(tokens.size()) >= kept, "rollback: ", tokens.size(),
                " tokens passed, ", kept, " stay committed");
  const int32_t first_touched = kept / page_size;
  const auto num_pages_kept = static_cast<size_t>(num_pages_for(kept));
  // Pages wholly beyond the kept tokens go, lookahead slots included, and no one finds them
  // again (the step that wrote them may not have run); the tail goes first so that the LRU
  // reuses it before the sequence's head.
  while (seq.pages_.size() > num_pages_kept) {
    const int32_t page = seq.pages_.back();
    pool_.forget(page);
    pool_.release(page);
    seq.pages_.pop_back();
  }
  seq.page_hashes_.resize(std::min(seq.page_hashes_.size(), static_cast<size_t>(kept / page_size)));
  seq.num_committed_ = kept;
  if (kept % page_size != 0) {
    // The last kept page is partly filled again: it is findable by its kept leading tokens only.
    const int32_t page = seq.pages_[first_touched];
    pool_.forget(page);
    if (config_.enable_prefix_cache) {
      if (first_touched > 0) page_hash(seq, tokens, first_touched - 1);  // the parent
      cache_.record(page, parent_hash(seq, first_touched),
                    tokens.data() + static_cast<size_t>(first_touched) * page_size,
                    kept - first_touched * page_size, seq.extra_key_);
    }
  }
}

void KvCacheManager::release_behind(KvSeq& seq, int32_t next_query) {
  // The query at next_query sees keys from next_query - window + 1 on; every later query sees
  // fewer. Oldest first, so the LRU free list reuses them in that order; a full page keeps its
  // hash (and stays findable, as a finished sequence's pages do) and a shared one just loses a
  // holder.
  const int32_t lowest_visible = next_query - config_.window + 1;
  const int32_t num_behind = std::max(0, lowest_visible) / config_.page_size;
  for (; seq.num_released_pages_ < num_behind; ++seq.num_released_pages_) {
    int32_t& page = seq.pages_[seq.num_released_pages_];
    pool_.release(page);
    page = pool_.null_page();
  }
}

void KvCacheManager::free(KvSeq& seq) {
  for (auto it = seq.pages_.rbegin(); it != seq.pages_.rend() - seq.num_released_pages_; ++it) {
    pool_.release(*it);
  }
  seq.pages_.clear();
  seq.num_released_pages_ = 0;
  seq.num_committed_ = 0;
  seq.copy_page_index_ = seq.copy_src_page_ = -1;
  seq.num_copied_tokens_ = 0;
}

void KvCacheManager::end_step() {
  for (const int32_t page : copy_holds_) pool_.release(page);
  copy_holds_.clear();
  copy_dsts_.clear();
  kv_copies_.clear();
}

std::vector<CachedPageView> KvCacheManager::cached_pages(int32_t max_pages) const {
  std::vector<CachedPageView> views;
  for (const int32_t page : pool_.free_pages_in_eviction_order()) {
    if (static_cast<int32_t>(views.size()) >= max_pages) break;
    const bool full = pool_.has_hash(page);
    const int32_t num_tokens = full ? config_.page_size : cache_.num_recorded(page);
    if (num_tokens > 0) views.push_back({page, num_tokens, full});
  }
  return views;
}

int32_t KvCacheManager::num_holders(int32_t page) const {
  return pool_.ref_count(page) -
         static_cast<int32_t>(std::count(copy_holds_.begin(), copy_holds_.end(), page));
}

}  // namespace pagedlm
