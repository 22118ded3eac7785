// The executor drives the workers (engine/worker.h) of every tensor-parallel rank this process
// runs, behind the one launch / collect the engine calls:
//   - one rank: its worker alone, on the CPU or the GPU;
//   - CPU ranks: threads of this process (CpuRanks): rank 0's worker runs the step's forward pass
//     beside the others' and samples;
//   - GPU ranks: one process each (ProcessGroup): rank 0 sends every plan to the others, then its
//     worker runs it; the others run run_worker_rank, started by the command line, not an engine.
// Every rank is built by build_rank.
#pragma once

#include <memory>

#include "pagedlm/engine/worker.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {

class CpuRanks;
class ProcessGroup;
struct EngineOptions;

class Executor {
 public:
  // options: resolved (resolve_options), for rank 0. Builds the group's ranks this process runs;
  // with GPU ranks, meets the other processes first.
  Executor(const Checkpoint& checkpoint, const EngineOptions& options);
  // Ends the group's other ranks' loops (GPU ranks: rank 0 tells them to stop).
  ~Executor();

  StepHandle launch(const StepPlan& plan, StepInputs inputs);
  StepResult collect(StepHandle handle) { return worker_->collect(handle); }

  // Rank 0's worker: its model, KV cache pages and token mask rows.
  Worker& worker() { return *worker_; }
  const Worker& worker() const { return *worker_; }

 private:
  std::unique_ptr<ProcessGroup> group_;  // GPU ranks: rank 0's link to the others
  std::unique_ptr<CpuRanks> cpu_ranks_;  // CPU ranks: ranks 1..N-1
  // Last, so that it goes before the communicator its model joins the others through.
  std::unique_ptr<Worker> worker_;
};

// A GPU rank other than 0 of a group of processes: builds its rank as rank 0 does, then runs
// every step rank 0 sends until rank 0 is done (options: this rank's, unresolved). It takes no
// requests of its own: the command line runs it in place of an engine.
void run_worker_rank(const Checkpoint& checkpoint, const EngineOptions& options);

}  // namespace pagedlm
