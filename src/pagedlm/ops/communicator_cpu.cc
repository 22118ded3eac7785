#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <mutex>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/communicator.h"

namespace pagedlm::ops {
namespace {

// What the threads of one group share: a generation-counted barrier that an abort or a timeout
// breaks, and each rank's buffer for the collective in progress.
struct ThreadGroup {
  int32_t size;
  std::chrono::milliseconds timeout;
  std::mutex mutex;
  std::condition_variable changed;
  int32_t arrived = 0;
  uint64_t generation = 0;
  bool aborted = false;
  std::string why;
  std::vector<void*> data;  // each rank's tensor of the current collective
  std::vector<int64_t> numel;

  ThreadGroup(int32_t n, std::chrono::milliseconds t) : size(n), timeout(t), data(n), numel(n) {}

  [[noreturn]] void throw_aborted() const { fail("tensor-parallel group aborted: ", why); }

  void abort_locked(const std::string& reason) {
    if (!aborted) {  // the first reason is the cause; later ones are its consequences
      aborted = true;
      why = reason;
    }
    changed.notify_all();
  }

  // Publishes this rank's tensor, then waits until every rank has.
  void arrive(int32_t rank, void* ptr, int64_t n) {
    std::unique_lock<std::mutex> lock(mutex);
    if (aborted) throw_aborted();
    data[rank] = ptr;
    numel[rank] = n;
    wait_locked(lock, rank);
  }

  void barrier(int32_t rank) {
    std::unique_lock<std::mutex> lock(mutex);
    if (aborted) throw_aborted();
    wait_locked(lock, rank);
  }

  void wait_locked(std::unique_lock<std::mutex>& lock, int32_t rank) {
    const uint64_t gen = generation;
    if (++arrived == size) {
      arrived = 0;
      ++generation;
      changed.notify_all();
      return;
    }
    if (!changed.wait_for(lock, timeout, [&] { return generation != gen || aborted; })) {
      abort_locked(cat("rank ", rank, " waited ", timeout.count(),
                       " ms in a collective for the other ranks"));
    }
    if (aborted) throw_aborted();
  }
};

class ThreadCommunicator final : public Communicator {
 public:
  ThreadCommunicator(std::shared_ptr<ThreadGroup> group, int32_t rank)
      : group_(std::move(group)), rank_(rank) {}

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return group_->size; }

  void all_reduce_sum(const Tensor& x, void* /*stream*/) override {
    check_host_f32(x, "all_reduce_sum");
    const int64_t n = x.numel();
    ThreadGroup& g = *group_;
    g.arrive(rank_, x.raw(), n);
    check_same_numel(n, "all_reduce_sum");
    // Each rank sums its own slice of the elements over the ranks in rank order and writes the
    // sum into every rank's tensor: every rank ends with the same bits, whichever thread ran.
    const int64_t begin = n * rank_ / g.size, end = n * (rank_ + 1) / g.size;
    for (int64_t i = begin; i < end; ++i) {
      float sum = 0.f;
      for (int32_t r = 0; r < g.size; ++r) sum += static_cast<const float*>(g.data[r])[i];
      for (int32_t r = 0; r < g.size; ++r) static_cast<float*>(g.data[r])[i] = sum;
    }
    g.barrier(rank_);  // no rank reads its sums (or reuses its tensor) before all are written
  }

  void all_gather_cols(const Tensor& local, const Tensor& out, void* /*stream*/) override {
    check_host_f32(local, "all_gather_cols");
    check_host_f32(out, "all_gather_cols");
    PAGEDLM_CHECK(local.ndim() == 2 && out.ndim() == 2 && out.dim(0) == local.dim(0) &&
                      out.dim(1) == local.dim(1) * size(),
                  "all_gather_cols: local ", shape_str(local.shape()), " and out ",
                  shape_str(out.shape()), " do not fit ", size(), " ranks");
    ThreadGroup& g = *group_;
    g.arrive(rank_, local.raw(), local.numel());
    check_same_numel(local.numel(), "all_gather_cols");
    const int64_t rows = local.dim(0), cols = local.dim(1);
    float* dst = out.data<float>();
    for (int32_t r = 0; r < g.size; ++r) {
      const float* src = static_cast<const float*>(g.data[r]);
      for (int64_t i = 0; i < rows; ++i) {
        std::memcpy(dst + i * cols * g.size + r * cols, src + i * cols, cols * sizeof(float));
      }
    }
    g.barrier(rank_);  // the sources stay untouched until every rank has copied them
  }

  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(group_->mutex);
    group_->abort_locked(why);
  }

 private:
  static void check_host_f32(const Tensor& t, const char* op) {
    PAGEDLM_CHECK(t.device() == Device::kCpu && t.dtype() == DType::kF32, op,
                  ": the thread communicator takes f32 CPU tensors, got ", dtype_name(t.dtype()));
  }

  // After the arrival, all ranks see every count; a mismatch is a bug in the caller, which
  // aborts the group rather than read past a buffer.
  void check_same_numel(int64_t n, const char* op) {
    ThreadGroup& g = *group_;
    for (int32_t r = 0; r < g.size; ++r) {
      if (g.numel[r] != n) {
        const std::string why =
            cat(op, ": rank ", rank_, " has ", n, " elements but rank ", r, " has ", g.numel[r]);
        abort(why);
        fail("tensor-parallel group aborted: ", why);
      }
    }
  }

  std::shared_ptr<ThreadGroup> group_;
  int32_t rank_;
};

}  // namespace

std::vector<std::unique_ptr<Communicator>> make_thread_communicators(
    int32_t size, std::chrono::milliseconds timeout) {
  PAGEDLM_CHECK(size >= 1, "a tensor-parallel group needs at least one rank, got ", size);
  PAGEDLM_CHECK(timeout.count() > 0, "the collective timeout must be positive");
  auto group = std::make_shared<ThreadGroup>(size, timeout);
  std::vector<std::unique_ptr<Communicator>> out;
  out.reserve(size);
  for (int32_t r = 0; r < size; ++r) out.push_back(std::make_unique<ThreadCommunicator>(group, r));
  return out;
}

}  // namespace pagedlm::ops
