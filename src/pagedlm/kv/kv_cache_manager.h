// KvCacheManager: the one owner of KV pages. It hands a sequence slots (pages from the BlockPool,
// ahead of tokens not known yet when asked), finds a new sequence's cached prefix (whole pages by
// hash, then a partial page whose leading tokens it shares), makes the pages a plan fills findable,
// rolls back the last tokens of a sequence, releases pages behind a sliding window, frees, and
// keeps the partial-page copies a step must run before its attention. The scheduler decides who
// runs and how much; it reaches pages only through this class, and never owns a page itself.
//
// A sequence's page table lives in a KvSeq that the caller keeps beside its own record of the
// sequence (no lookup by id on the hot path); only the manager changes it. The manager never
// owns tokens: where it needs them (hashing, recording a page's content) the caller passes the
// sequence's tokens, prompt then outputs, which must not change below what was committed.
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>
#include <span>
#include <string_view>
#include <vector>

#include "pagedlm/kv/block_pool.h"
#include "pagedlm/kv/prefix_cache.h"

namespace pagedlm {

struct KvCacheConfig {
  int32_t page_size = 16;
  int32_t num_pages = 4096;  // the null page included when window > 0
  // Every layer's sliding window (0: none). With one, the pool's last page is the null page,
  // which stands in for pages no later query can see once they are released.
  int32_t window = 0;
  bool enable_prefix_cache = true;
};

// One sequence's pages, as the manager keeps them.
class KvSeq {
 public:
  // The page table, in token order: entry i holds tokens [i * page_size, (i + 1) * page_size).
  // The first num_released_pages() entries are the pool's null page.
  const std::vector<int32_t>& pages() const { return pages_; }
  int32_t num_released_pages() const { return num_released_pages_; }
  // Tokens whose pages are findable by others: those the sequence's plans computed or hold.
  int32_t num_committed() const { return num_committed_; }
  // The partial-page hit of the last allocation that took one: entry copy_page_index() received
  // the first num_copied_tokens() slots of copy_src_page() (-1: none). For inspection.
  int32_t copy_page_index() const { return copy_page_index_; }
  int32_t copy_src_page() const { return copy_src_page_; }
  int32_t num_copied_tokens() const { return num_copied_tokens_; }

 private:
  friend class KvCacheManager;

  std::vector<int32_t> pages_;
  int32_t num_released_pages_ = 0;
  int32_t num_committed_ = 0;
  // Hashes of the first full pages of the sequence's tokens. Tokens of a full page never change
  // unless rolled back (which drops their hashes), so they survive free() (preemption) and serve
  // both lookups and commits.
  std::vector<BlockHash> page_hashes_;
  BlockHash extra_key_;
  int32_t copy_page_index_ = -1;
  int32_t copy_src_page_ = -1;
  int32_t num_copied_tokens_ = 0;
};

// What the cache holds of a sequence's first tokens (KvCacheManager::find_cached). Its pages stay
// valid until the pool changes (the next allocation or free).
struct CachedPrefix {
  int32_t num_full_pages = 0;       // whole pages, KvCacheManager::hit_pages()
  int32_t num_free_full_pages = 0;  // of those, pages no one holds: reviving them uses free pages
  PartialMatch partial;             // then the leading tokens of one more page (0: none)
  int32_t num_query_tokens = 0;     // the sequence's tokens when looked up (0: no lookup)

  int32_t num_tokens(int32_t page_size) const {
    return num_full_pages * page_size + partial.num_tokens;
  }
};

// A page no sequence holds whose content the prefix cache can still serve.
struct CachedPageView {
  int32_t page = 0;
  int32_t num_tokens = 0;  // leading tokens it can serve: page_size for a full page
  bool full = false;       // findable by hash (whole-page hits); else partial hits only
};

struct KvCacheStats {
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;  // whole pages and partial-page hits together
  int64_t prefix_partial_hits = 0;
  int64_t prefix_partial_hit_tokens = 0;
};

class KvCacheManager {
 public:
  // Throws pagedlm::Error for a page size that is not a power of two or too few pages.
  explicit KvCacheManager(const KvCacheConfig& config);

  int32_t page_size() const { return config_.page_size; }
  // Pages that hold num_tokens tokens.
  int32_t num_pages_for(int32_t num_tokens) const {
    return (num_tokens + config_.page_size - 1) >> page_shift_;
  }
  const BlockPool& pool() const { return pool_; }
  const PrefixCache& prefix_cache() const { return cache_; }
  // Pages a sequence may ever use: all but the null page.
  int32_t num_usable_pages() const { return pool_.num_pages() - pool_.num_reserved(); }

  // A new sequence's (empty) pages; its pages are findable only by sequences of the same salt.
  KvSeq new_seq(std::string_view cache_salt) const;

  // The longest prefix of `tokens` the cache holds: whole pages, then the leading tokens of one
  // more page (never a page this step's copies write). At least the last token is left to
  // compute, since its logits extend the sequence. The seq must hold no pages.
  CachedPrefix find_cached(KvSeq& seq, std::span<const int32_t> tokens);
  // The whole pages of the last find_cached().
  const std::vector<int32_t>& hit_pages() const { return hit_pages_; }

  // Free pages that allocate_slots(seq, num_tokens, hit) takes: new pages, revived free hits and
  // a free copy source held through the step.
  // Inline, as the two calls below: a step calls them for every sequence it decodes.
  int32_t num_pages_needed(const KvSeq& seq, int32_t num_tokens,
                           const CachedPrefix* hit = nullptr) const {
    const int32_t needed =
        std::max(0, num_pages_for(num_tokens) - static_cast<int32_t>(seq.pages_.size()));
    return hit == nullptr ? needed : num_pages_needed_with_hit(needed, *hit);
  }
  bool can_allocate(int32_t num_pages) const { return pool_.can_allocate(num_pages); }
  // Takes the hit, if any (its pages join the sequence, the partial page's tokens are queued to be
  // copied into the sequence's own next page), then gives the sequence pages for num_tokens tokens
  // plus num_lookahead slots for tokens not known yet. The caller checked can_allocate().
  void allocate_slots(KvSeq& seq, int32_t num_tokens, int32_t num_lookahead = 0,
                      const CachedPrefix* hit = nullptr) {
    const int32_t num_pages = num_pages_for(num_tokens + num_lookahead);
    if (hit != nullptr || static_cast<int32_t>(seq.pages_.size()) < num_pages) {
      take_hit_and_allocate(seq, num_pages, hit);
    }
  }

  // Makes the pages holding tokens [seq.num_committed(), num_tokens) findable: full ones by hash,
  // and the last, if the range ends inside it, for partial hits on its leading tokens. Called once
  // those tokens are in a plan, since every layer writes its new K/V before any attention (or
  // partial-page copy) reads them. tokens: the sequence's, at least num_tokens of them.
  void commit(KvSeq& seq, std::span<const int32_t> tokens, int32_t num_tokens);
  // Forgets the last num_tokens committed tokens (a step's rejected tokens, or one left midway):
  // no one finds their K/V any more, pages beyond the remaining tokens go back to the pool and the
  // page they ended in is the sequence's again to fill. `tokens`: the sequence's tokens that stay.
  // Throws if the rollback reaches a page another sequence holds or one released behind the window.
  void rollback(KvSeq& seq, std::span<const int32_t> tokens, int32_t num_tokens);
  // Whether rollback(seq, ..., num_tokens) can go ahead (it throws where not).
  bool can_rollback(const KvSeq& seq, int32_t num_tokens) const;
  // Releases the pages whose keys no query from position next_query on can see (sliding window).
  void release_behind_window(KvSeq& seq, int32_t next_query) {
    if (config_.window > 0) release_behind(seq, next_query);
  }
  // Gives back all the sequence's pages, tail first, so the LRU free list evicts a sequence's
  // tail before the prefix others share. Its page hashes stay for a later find_cached().
  void free(KvSeq& seq);

  // The step's partial-page copies, (src, dst, tokens) triples (StepPlan::kv_copies).
  const std::vector<int32_t>& pending_copies() const { return kv_copies_; }
  // The step that ran the pending copies is over: their source pages, held through it so that no
  // allocation reused them first, may go.
  void end_step();
  // A step that was to write these pages was left midway: the cache finds none of them again.
  void forget(int32_t page) { pool_.forget(page); }

  // Holders of `page` among sequences (a copy source held through the step does not count).
  int32_t num_holders(int32_t page) const;
  const KvCacheStats& stats() const { return stats_; }
  // Free pages still holding servable content, the next one to be reused first, at most
  // max_pages of them.
  std::vector<CachedPageView> cached_pages(int32_t max_pages) const;

 private:
  // The hash of the sequence's page page_index, hashing the pages up to it where not yet done.
  const BlockHash& page_hash(KvSeq& seq, std::span<const int32_t> tokens, int32_t page_index) {
    if (page_index < static_cast<int32_t>(seq.page_hashes_.size())) {
      return seq.page_hashes_[page_index];
    }
    return hash_pages(seq, tokens, page_index);
  }
  const BlockHash& hash_pages(KvSeq& seq, std::span<const int32_t> tokens, int32_t page_index);
  static const BlockHash& parent_hash(const KvSeq& seq, int32_t page_index);
  int32_t num_pages_needed_with_hit(int32_t needed, const CachedPrefix& hit) const;
  void take_hit_and_allocate(KvSeq& seq, int32_t num_pages, const CachedPrefix* hit);
  void release_behind(KvSeq& seq, int32_t next_query);

  KvCacheConfig config_;
  int32_t page_shift_;  // log2(page_size)
  BlockPool pool_;
  PrefixCache cache_;
  std::vector<int32_t> hit_pages_;  // of the last find_cached()
  std::vector<int32_t> kv_copies_;
  std::vector<int32_t> copy_holds_;  // copy sources, one reference each until end_step()
  std::vector<int32_t> copy_dsts_;   // written by this step's copies: no source for another one
  KvCacheStats stats_;
};

}  // namespace pagedlm
