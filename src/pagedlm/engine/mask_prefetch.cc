#include "pagedlm/engine/mask_prefetch.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/core/parallel.h"

namespace pagedlm {

MaskPrefetch::MaskPrefetch(int32_t* rows, int32_t max_rows, int32_t mask_words, int num_threads)
    : rows_(rows),
      max_rows_(max_rows),
      mask_words_(mask_words),
      worker_([this, num_threads] { run_worker(num_threads); }) {}

MaskPrefetch::~MaskPrefetch() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void MaskPrefetch::start(std::vector<Item> items) {
  wait();
  std::lock_guard<std::mutex> lock(mu_);
  if (items.empty() && items_.empty()) return;  // steps without a grammar: nothing to clear
  // At most one item per sequence of a step.
  PAGEDLM_CHECK(items.size() <= static_cast<size_t>(max_rows_), "more masks to prefetch (",
                items.size(), ") than rows (", max_rows_, ")");
  items_ = std::move(items);
  index_.clear();
  for (size_t i = 0; i < items_.size(); ++i) index_[items_[i].request_id] = i;
  refused_.assign(items_.size(), 0);
  pending_ = !items_.empty();
  if (!pending_) last_job_ms_ = 0;
  cv_.notify_all();
}

void MaskPrefetch::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !pending_; });
}

int32_t MaskPrefetch::row_of(int64_t request_id, int64_t num_tokens) const {
  // index_ and items_ change only in start(), on the caller's thread.
  const auto it = index_.find(request_id);
  if (it == index_.end() || items_[it->second].num_tokens != num_tokens) return -1;
  return static_cast<int32_t>(it->second);
}

std::vector<int64_t> MaskPrefetch::refused_requests() const {
  std::vector<int64_t> ids;
  for (size_t i = 0; i < items_.size(); ++i) {
    if (refused_[i] != 0) ids.push_back(items_[i].request_id);
  }
  return ids;
}

double MaskPrefetch::last_job_ms() const {
  std::lock_guard<std::mutex> lock(mu_);
  return last_job_ms_;
}

void MaskPrefetch::run_worker(int num_threads) {
  // This thread's own OpenMP team, beside the engine thread's.
  set_num_threads(num_threads);
  std::vector<int32_t> all;
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || pending_; });
      if (stop_) return;
    }
    const auto t0 = std::chrono::steady_clock::now();
    all.resize(items_.size());
    for (size_t i = 0; i < all.size(); ++i) all[i] = static_cast<int32_t>(i);
    // An item whose accept or fill throws counts as refused: the engine ends its output, and
    // until then its row allows every token.
    parallel_for_each(all, [&](int32_t i) {
      const Item& item = items_[i];
      int32_t* words = rows_ + int64_t{i} * mask_words_;
      try {
        if (item.token >= 0 && !item.matcher->accept(item.token)) {
          refused_[i] = 1;
        } else if (!item.matcher->fill_mask(words)) {
          std::fill(words, words + mask_words_, -1);
        }
      } catch (...) {
        refused_[i] = 1;
      }
      if (refused_[i] != 0) std::fill(words, words + mask_words_, -1);
    });
    const double ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_job_ms_ = ms;
      pending_ = false;
    }
    cv_.notify_all();
  }
}

}  // namespace pagedlm
