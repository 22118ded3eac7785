#include "pagedlm/kv/block_pool.h"

#include "pagedlm/core/error.h"

namespace pagedlm {

BlockPool::BlockPool(int32_t num_pages, bool reserve_null_page)
    : ref_counts_(num_pages, 0),
      generations_(num_pages, 0),
      prev_(num_pages, kNone),
      next_(num_pages, kNone),
      hashes_(num_pages),
      has_hash_(num_pages, 0) {
  const int32_t num_usable = num_pages - (reserve_null_page ? 1 : 0);
  PAGEDLM_CHECK(num_usable > 0, "BlockPool needs at least one page besides the reserved ones, got ",
                num_pages, " pages", reserve_null_page ? " with a null page" : "");
  page_of_hash_.reserve(num_usable);
  // The null page stays off the free list for good: allocate() never returns it and, having no
  // hash, find() never does either.
  for (int32_t page = 0; page < num_usable; ++page) push_back(page);
  if (reserve_null_page) null_page_ = num_usable;
}

int32_t BlockPool::allocate() {
  const int32_t page = head_;
  if (page == kNone) return kNone;
  unlink(page);
  drop_hash(page);  // reuse overwrites the content, so the cache entry dies here
  ref_counts_[page] = 1;
  ++generations_[page];
  return page;
}

void BlockPool::acquire(int32_t page) {
  PAGEDLM_CHECK(page != null_page_, "the null page cannot be held");
  if (ref_counts_[page]++ == 0) {
    unlink(page);
    if (has_hash(page)) --num_cached_;
  }
}

void BlockPool::release(int32_t page) {
  PAGEDLM_CHECK(ref_counts_[page] > 0, "page ", page, " released more often than held");
  if (--ref_counts_[page] == 0) {
    push_back(page);
    if (has_hash(page)) ++num_cached_;
  }
}

bool BlockPool::set_hash(int32_t page, const BlockHash& hash) {
  if (has_hash(page) || page == null_page_) return false;
  if (!page_of_hash_.try_emplace(hash, page).second) return false;
  hashes_[page] = hash;
  has_hash_[page] = 1;
  if (ref_counts_[page] == 0) ++num_cached_;
  return true;
}

int32_t BlockPool::find(const BlockHash& hash) const {
  const auto it = page_of_hash_.find(hash);
  return it == page_of_hash_.end() ? kNone : it->second;
}

void BlockPool::forget(int32_t page) {
  PAGEDLM_CHECK(page != null_page_, "the null page holds nothing to forget");
  drop_hash(page);
  ++generations_[page];
}

void BlockPool::drop_hash(int32_t page) {
  if (!has_hash(page)) return;
  page_of_hash_.erase(hashes_[page]);
  has_hash_[page] = 0;
  if (ref_counts_[page] == 0) --num_cached_;
}

std::vector<int32_t> BlockPool::free_pages_in_eviction_order() const {
  std::vector<int32_t> pages;
  pages.reserve(num_free_);
  for (int32_t page = head_; page != kNone; page = next_[page]) pages.push_back(page);
  return pages;
}

void BlockPool::unlink(int32_t page) {
  const int32_t before = prev_[page];
  const int32_t after = next_[page];
  (before == kNone ? head_ : next_[before]) = after;
  (after == kNone ? tail_ : prev_[after]) = before;
  prev_[page] = kNone;
  next_[page] = kNone;
  --num_free_;
}

void BlockPool::push_back(int32_t page) {
  prev_[page] = tail_;
  next_[page] = kNone;
  (tail_ == kNone ? head_ : next_[tail_]) = page;
  tail_ = page;
  ++num_free_;
}

}  // namespace pagedlm
