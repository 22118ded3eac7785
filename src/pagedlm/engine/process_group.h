// Tensor parallelism over GPUs: one process per rank, each on its own GPU. Rank 0 runs the
// engine (scheduler, sampling, the API); every step its executor sends the StepPlan to the other
// ranks, whose worker loops (run_worker_rank, engine/executor.h) run their share of the model on
// it, the NCCL collectives joining them on each rank's stream. They meet through
// engine/rendezvous.h (rank 0 listens at the endpoint and hands out the NCCL id), so the ranks may
// span machines. A rank whose process is gone is reported to every other rank's
// EngineOptions::on_lost_rank, naming it, which the command line answers by ending the process: a
// collective waiting for a dead peer never returns, so exiting is the only way not to hang.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "pagedlm/engine/plan_wire.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/ops/communicator.h"

namespace pagedlm {

struct EngineOptions;
class RendezvousClient;
class RendezvousServer;

class ProcessGroup {
 public:
  // Makes the rank's GPU current (options.tensor_parallel_device, or the rank's own ordinal
  // when negative), meets the other ranks and joins the NCCL group.
  ProcessGroup(const EngineOptions& options, const ModelConfig& config);
  // Rank 0 tells the others to stop and waits for them a while.
  ~ProcessGroup();

  int32_t rank() const { return rank_; }
  ops::Communicator* communicator() const { return comm_.get(); }

  // Every rank: the KV cache pages all ranks take, the fewest any rank's memory `fits` (each
  // rank's GPU may have other free memory: another model, another process, another machine).
  int32_t agree_num_pages(int32_t fits);
  // Rank 0.
  void send_step(const StepPlan& plan, bool want_logits);
  // The other ranks: the next step, or nothing when rank 0 is done.
  std::optional<WireStep> receive_step();

 private:
  int32_t rank_ = 0;
  std::unique_ptr<RendezvousServer> server_;  // rank 0
  std::unique_ptr<RendezvousClient> client_;  // the others
  std::unique_ptr<ops::Communicator> comm_;
};

}  // namespace pagedlm
