#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/cuda_runner.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {

CudaWorker::CudaWorker(RankParts parts, const EngineOptions& options)
    : model_(std::move(parts.model)),
      runner_(std::move(parts.runner)),
      kv_cache_(std::move(parts.kv_cache)),
      num_pages_(parts.num_pages),
      mask_words_(grammar::bitmask_words(model_->config().vocab_size)) {
  PAGEDLM_CHECK(runner_ && runner_->mask_words() == mask_words_ &&
                    runner_->num_mask_rows() == 2 * options.max_num_seqs,
                "the GPU runner's token mask rows do not match the engine's");
}

CudaWorker::~CudaWorker() = default;

int32_t* CudaWorker::mask_rows() { return runner_->mask_rows(); }

void CudaWorker::make_current() const { runner_->make_current(); }

int64_t CudaWorker::cascade_steps() const { return runner_->cascade_steps(); }

int64_t CudaWorker::logits_downloads() const { return runner_->logits_downloads(); }

int32_t CudaWorker::max_top_logprobs() const { return ops::kMaxTopLogprobs; }

StepHandle CudaWorker::launch(const StepPlan& plan, StepInputs inputs) {
  held_.require_none();
  // CudaStepRunner::run enqueues the plan's upload, the forward pass, the masks' upload and the
  // sampler, and the downloads of the tokens and logits, then waits for its stream
  // (cudaStreamSynchronize) and reads the tokens. The wait and the read belong in collect: with
  // run() split there (the pinned token, logprob and logits buffers kept per step in flight),
  // launch returns while the device runs the step.
  StepResult result;
  result.sampled = runner_->run(plan, inputs.sampling,
                                inputs.want_logits ? &result.logits : nullptr, inputs.finish_masks);
  result.logprobs = runner_->last_logprobs();
  StepTimings& t = result.timings;
  t.gpu_ms = runner_->last_step_gpu_ms();
  t.masked_forward_gpu_ms = runner_->last_masked_forward_gpu_ms();
  t.masked_sampler_gpu_ms = runner_->last_masked_sampler_gpu_ms();
  t.wait_begin = runner_->last_wait_begin();
  t.wait_end = runner_->last_wait_end();
  t.mask_ms = runner_->last_mask_ms();
  t.mask_hidden = runner_->last_mask_hidden();
  return held_.hold(std::move(result));
}

StepResult CudaWorker::collect(StepHandle handle) { return held_.take(handle); }

}  // namespace pagedlm
