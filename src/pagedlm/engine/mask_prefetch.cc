#include "pagedlm/engine/mask_prefetch.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "pagedlm/core/parallel.h"

namespace pagedlm {

MaskPrefetch::MaskPrefetch(int32_t mask_words, int num_threads)
    : mask_words_(mask_words), worker_([this, num_threads] { run_worker(num_threads); }) {}

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
  items_ = std::move(items);
  index_.clear();
  for (size_t i = 0; i < items_.size(); ++i) index_[items_[i].request_id] = i;
  masks_.resize(items_.size() * mask_words_);
  refused_.assign(items_.size(), 0);
  pending_ = !items_.empty();
  if (!pending_) last_job_ms_ = 0;
  cv_.notify_all();
}

void MaskPrefetch::wait() {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait(lock, [&] { return !pending_; });
}

const int32_t* MaskPrefetch::find(int64_t request_id, int64_t num_tokens) {
  // index_ and items_ change only in start(), on the caller's thread.
  const auto it = index_.find(request_id);
  if (it == index_.end() || items_[it->second].num_tokens != num_tokens) return nullptr;
  wait();
  std::lock_guard<std::mutex> lock(mu_);
  return refused_[it->second] != 0 ? nullptr : masks_.data() + it->second * mask_words_;
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
    // An item whose accept or fill throws counts as refused: the engine ends its output.
    parallel_for_each(all, [&](int32_t i) {
      const Item& item = items_[i];
      try {
        if (item.token >= 0 && !item.matcher->accept(item.token)) {
          refused_[i] = 1;
          return;
        }
        int32_t* words = masks_.data() + int64_t{i} * mask_words_;
        if (!item.matcher->fill_mask(words)) std::fill(words, words + mask_words_, -1);
      } catch (...) {
        refused_[i] = 1;
      }
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
