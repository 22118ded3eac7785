#include "pagedlm/engine/executor.h"

#include <chrono>
#include <optional>
#include <utility>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/cpu_ranks.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/process_group.h"

namespace pagedlm {

Executor::Executor(const Checkpoint& checkpoint, const EngineOptions& options) {
  const int32_t tp = options.tensor_parallel_size;
  check_tensor_parallel(checkpoint.config, tp);
  PAGEDLM_CHECK(options.tensor_parallel_rank == 0, "tensor-parallel rank ",
                options.tensor_parallel_rank,
                " runs rank 0's steps (run_worker_rank); only rank 0 runs an engine");
  ops::Communicator* comm = nullptr;
  std::function<int32_t(int32_t)> agree_num_pages;
  if (tp > 1 && options.device == Device::kCuda) {
    group_ = std::make_unique<ProcessGroup>(options, checkpoint.config);
    comm = group_->communicator();
    // Every rank's cache has the same pages: the count that fits the fullest GPU.
    agree_num_pages = [this](int32_t fits) { return group_->agree_num_pages(fits); };
  } else if (tp > 1) {
    cpu_ranks_ = std::make_unique<CpuRanks>(
        checkpoint, ops::make_thread_communicators(
                        tp, std::chrono::milliseconds(options.collective_timeout_ms)));
    comm = cpu_ranks_->communicator(0);
  }
  RankParts rank0 = build_rank(checkpoint, options, {0, tp}, comm, agree_num_pages);
  if (cpu_ranks_) cpu_ranks_->create_ranks(checkpoint, options, rank0.num_pages);
  worker_ = make_worker(std::move(rank0), cpu_ranks_.get());
}

Executor::~Executor() = default;

StepHandle Executor::launch(const StepPlan& plan, StepInputs inputs) {
  if (group_) group_->send_step(plan, inputs.want_logits);
  return worker_->launch(plan, std::move(inputs));
}

void run_worker_rank(const Checkpoint& checkpoint, const EngineOptions& unresolved) {
  // Resolved as rank 0 resolves its own, so that every rank sizes its step buffers alike.
  const EngineOptions options = resolve_options(unresolved);
  PAGEDLM_CHECK(options.device == Device::kCuda,
                "a tensor-parallel rank in its own process runs on a GPU");
  check_tensor_parallel(checkpoint.config, options.tensor_parallel_size);
  ProcessGroup group(options, checkpoint.config);
  std::unique_ptr<Worker> worker = make_worker(
      build_rank(checkpoint, options, {group.rank(), options.tensor_parallel_size},
                 group.communicator(), [&](int32_t fits) { return group.agree_num_pages(fits); }));
  // This rank's sampled tokens are thrown away: rank 0 samples. Greedy rows keep the sampler
  // cheap.
  SamplingParams greedy;
  greedy.temperature = 0.f;
  while (std::optional<WireStep> step = group.receive_step()) {
    StepInputs inputs;
    inputs.sampling.assign(step->plan.num_seqs(), SeqSampling{&greedy, 0, 0});
    inputs.want_logits = step->want_logits;
    worker->collect(worker->launch(step->plan, std::move(inputs)));
  }
}

}  // namespace pagedlm
