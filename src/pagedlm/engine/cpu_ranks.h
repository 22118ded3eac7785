// Tensor parallelism on the CPU: the ranks of one group as threads of this process, joined by the
// shared-memory communicator (ops/communicator.h). Rank 0's worker (CpuWorker with these as its
// peers) runs on the engine's thread; this holds ranks 1..N-1, each a CpuWorker with its own
// share of the weights and its own KV cache (its share of the kv heads, with the same pages),
// and runs their forward passes on the step's plan beside rank 0's.
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/model.h"
#include "pagedlm/ops/communicator.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

class CpuWorker;
struct EngineOptions;

class CpuRanks {
 public:
  // comms: the whole group's communicators, rank r at [r]; rank 0's is used by rank 0's model
  // and stays owned here too.
  CpuRanks(const Checkpoint& checkpoint, std::vector<std::unique_ptr<ops::Communicator>> comms);
  ~CpuRanks();

  ops::Communicator* communicator(int32_t rank) const { return comms_.at(rank).get(); }
  int32_t size() const { return static_cast<int32_t>(comms_.size()); }

  // Builds ranks 1..N-1 (build_rank) with rank 0's KV cache pages (the executor builds rank 0).
  void create_ranks(const Checkpoint& checkpoint, const EngineOptions& options, int32_t num_pages);

  // Runs one step on every rank: `rank0` (rank 0's forward) on this thread, the others' forward
  // with the same inputs and plan on their own threads. A rank that throws aborts the group, so
  // the others stop at their next collective instead of waiting for it; then this throws the
  // first failure, naming its rank. Once aborted, the group fails every later step at once.
  void forward(const StepPlan& plan, const ForwardInputs& inputs,
               const std::function<void()>& rank0);

 private:
  std::vector<std::unique_ptr<ops::Communicator>> comms_;
  std::vector<std::unique_ptr<CpuWorker>> ranks_;  // ranks 1..N-1 at [r - 1]
};

}  // namespace pagedlm
