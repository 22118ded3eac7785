#include "pagedlm/engine/cpu_ranks.h"

#include <exception>
#include <mutex>
#include <string>
#include <thread>

#include "pagedlm/core/error.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/worker.h"

namespace pagedlm {

CpuRanks::CpuRanks(const Checkpoint& checkpoint,
                   std::vector<std::unique_ptr<ops::Communicator>> comms)
    : comms_(std::move(comms)) {
  PAGEDLM_CHECK(!comms_.empty(), "a tensor-parallel group needs at least one rank");
  check_tensor_parallel(checkpoint.config, size());
}

CpuRanks::~CpuRanks() = default;

void CpuRanks::create_ranks(const Checkpoint& checkpoint, const EngineOptions& options,
                            int32_t num_pages) {
  PAGEDLM_CHECK(options.device == Device::kCpu, "the ranks of a thread group run on the CPU");
  for (int32_t r = 1; r < size(); ++r) {
    ranks_.push_back(
        std::make_unique<CpuWorker>(build_rank(checkpoint, options, {r, size()}, comms_[r].get(),
                                               [num_pages](int32_t) { return num_pages; })));
  }
}

void CpuRanks::forward(const StepPlan& plan, const ForwardInputs& inputs,
                       const std::function<void()>& rank0) {
  const int64_t rows = inputs.logits_rows.dim(0);
  std::mutex mutex;
  std::string first_failure;  // the first rank to fail: the cause, the others its consequence
  auto run = [&](int32_t r, const std::function<void()>& body) {
    try {
      body();
    } catch (const std::exception& e) {
      const std::string why = cat("rank ", r, ": ", e.what());
      {
        std::lock_guard<std::mutex> lock(mutex);
        if (first_failure.empty()) first_failure = why;
      }
      comms_[r]->abort(why);
    }
  };
  // OpenMP's thread count belongs to the thread that sets it, and a new thread starts from the
  // process default (all cores): each rank takes the calling thread's count, the engine's.
  const int omp_threads = num_threads();
  std::vector<std::thread> threads;
  threads.reserve(ranks_.size());
  for (size_t i = 0; i < ranks_.size(); ++i) {
    CpuWorker& rank = *ranks_[i];
    threads.emplace_back([&, i] {
      set_num_threads(omp_threads);
      run(static_cast<int32_t>(i + 1), [&] {
        // Every rank receives the whole logits; only rank 0's are sampled.
        const Tensor logits = Tensor::empty(DType::kF32, {rows, rank.model().config().vocab_size});
        // A pass left midway (inputs.stop) is left by every rank at the same point: rank 0's
        // result says so for all.
        static_cast<void>(rank.forward(plan, inputs, logits));
      });
    });
  }
  run(0, rank0);
  for (std::thread& t : threads) t.join();
  if (!first_failure.empty()) fail("tensor-parallel step failed on ", first_failure);
}

}  // namespace pagedlm
