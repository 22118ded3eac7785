// BlockPool: the pages of the paged KV cache as host-side bookkeeping. Each page has a ref count
// (how many sequences hold it) and, once full and registered, the 128-bit hash of its content.
// Pages with ref count 0 sit in an intrusive doubly linked LRU free list; a freed page keeps its
// hash, so the prefix cache can still find and revive it until allocate() reuses it.
// A pool may reserve its last page as the null page: never handed out, never written, it stands
// in for the page-table entries of pages a sequence no longer needs (keys behind every layer's
// sliding window), so the table keeps its length and a kernel reading it finds finite zeros.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <vector>

namespace pagedlm {

struct BlockHash {
  uint64_t low = 0;
  uint64_t high = 0;
  bool operator==(const BlockHash&) const = default;
};

struct BlockHashHasher {
  // The value is already a strong hash; its low half spreads buckets as well as any mix would.
  size_t operator()(const BlockHash& hash) const { return static_cast<size_t>(hash.low); }
};

class BlockPool {
 public:
  explicit BlockPool(int32_t num_pages, bool reserve_null_page = false);

  // All pages, the null page included.
  int32_t num_pages() const { return static_cast<int32_t>(ref_counts_.size()); }
  // 1 with a null page, else 0: pages that are neither free nor used.
  int32_t num_reserved() const { return null_page_ == kNone ? 0 : 1; }
  // The reserved page (the last one), or -1 when the pool has none.
  int32_t null_page() const { return null_page_; }
  int32_t num_free() const { return num_free_; }
  int32_t num_used() const { return num_pages() - num_reserved() - num_free_; }
  // Free pages still findable by hash.
  int32_t num_cached() const { return num_cached_; }
  bool can_allocate(int32_t num_new_pages) const { return num_free_ >= num_new_pages; }

  int32_t ref_count(int32_t page) const { return ref_counts_[page]; }
  // How often allocate() has handed `page` out: content recorded against one generation is
  // stale once it changes (the prefix cache's partial-page index checks this, since pages
  // without a hash leave no entry here for allocate() to drop).
  uint32_t generation(int32_t page) const { return generations_[page]; }

  // Takes the least recently freed page (head of the free list), drops its hash from the
  // index and returns it with ref count 1; -1 when no page is free.
  int32_t allocate();
  // One more holder of `page`; a free page leaves the free list (a prefix-cache hit revives it).
  void acquire(int32_t page);
  // One holder less; at ref count 0 the page goes to the tail of the free list, keeping its hash.
  void release(int32_t page);

  // Indexes `page` under `hash`. False (and nothing changes) when the page already has a hash
  // or another page is indexed under it: the first copy of a content stays the shared one.
  bool set_hash(int32_t page, const BlockHash& hash);
  bool has_hash(int32_t page) const { return has_hash_[page] != 0; }
  const BlockHash& hash(int32_t page) const { return hashes_[page]; }
  // The page indexed under `hash`, or -1.
  int32_t find(const BlockHash& hash) const;
  // The page no longer holds what it was indexed or recorded with (a step that was to write it
  // was abandoned midway): its hash leaves the index and its generation moves on, so the prefix
  // cache finds it neither whole nor by its leading tokens. Holders and free list stay as they are.
  void forget(int32_t page);

  // Free pages from the next one allocate() takes to the last; for tests and diagnostics.
  std::vector<int32_t> free_pages_in_eviction_order() const;

 private:
  void unlink(int32_t page);
  void push_back(int32_t page);
  void drop_hash(int32_t page);

  static constexpr int32_t kNone = -1;

  std::vector<int32_t> ref_counts_;
  std::vector<uint32_t> generations_;
  std::vector<int32_t> prev_;  // free-list links, kNone at the ends or off the list
  std::vector<int32_t> next_;
  int32_t head_ = kNone;  // least recently freed: evicted first
  int32_t tail_ = kNone;  // most recently freed
  int32_t num_free_ = 0;
  int32_t num_cached_ = 0;
  int32_t null_page_ = kNone;

  std::vector<BlockHash> hashes_;
  std::vector<uint8_t> has_hash_;
  std::unordered_map<BlockHash, int32_t, BlockHashHasher> page_of_hash_;
};

}  // namespace pagedlm
