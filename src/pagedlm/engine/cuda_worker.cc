#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/cuda_runner.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {

CudaWorker::CudaWorker(RankParts parts)
    : model_(std::move(parts.model)),
      runner_(std::move(parts.runner)),
      kv_cache_(std::move(parts.kv_cache)),
      num_pages_(parts.num_pages) {
  PAGEDLM_CHECK(runner_ != nullptr, "a GPU worker needs its step runner");
}

CudaWorker::~CudaWorker() = default;

void CudaWorker::make_current() const { runner_->make_current(); }

int64_t CudaWorker::cascade_steps() const { return runner_->cascade_steps(); }

int64_t CudaWorker::logits_downloads() const { return runner_->logits_downloads(); }

StepHandle CudaWorker::launch(const StepPlan& plan, StepInputs inputs) {
  // The runner enqueues the plan's upload, the pending rows' tokens, the forward pass, the
  // masks' upload and the sampler, and the downloads of the tokens (and logits, logprobs) into
  // the step's own pinned buffers, then returns; collect waits for the step's event.
  runner_->launch(plan, inputs.sampling, inputs.want_logits, inputs.masks, inputs.pending_rows);
  return {++launched_};
}

bool CudaWorker::launch_returns_early(const StepPlan& plan, bool want_logits) const {
  return runner_->replays_graph(plan, want_logits);
}

StepResult CudaWorker::collect(StepHandle handle) {
  PAGEDLM_CHECK(handle.id == collected_ + 1 && handle.id <= launched_, "collect: step ", handle.id,
                " is not the oldest in flight");
  ++collected_;
  return runner_->collect();
}

}  // namespace pagedlm
