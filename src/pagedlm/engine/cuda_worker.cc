#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/cuda_runner.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/grammar/grammar.h"

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

StepHandle CudaWorker::launch(const StepPlan& plan, StepInputs inputs) {
  PAGEDLM_CHECK(!in_flight_, "a step is in flight: collect it before launching the next");
  InFlight step{&plan, std::move(inputs), {}};
  // CudaStepRunner::run enqueues the plan's upload, the forward pass, the masks' upload and the
  // sampler, and the downloads of the tokens and logits, then waits for its stream
  // (cudaStreamSynchronize) and reads the tokens. The wait and the read belong in collect: with
  // run() split there (the pinned token and logits buffers kept per step in flight), launch
  // returns while the device runs the step.
  StepResult& result = step.result;
  result.sampled =
      runner_->run(plan, step.inputs.sampling, step.inputs.want_logits ? &result.logits : nullptr,
                   step.inputs.finish_masks);
  StepTimings& t = result.timings;
  t.gpu_ms = runner_->last_step_gpu_ms();
  t.masked_forward_gpu_ms = runner_->last_masked_forward_gpu_ms();
  t.masked_sampler_gpu_ms = runner_->last_masked_sampler_gpu_ms();
  t.wait_begin = runner_->last_wait_begin();
  t.wait_end = runner_->last_wait_end();
  t.mask_ms = runner_->last_mask_ms();
  t.mask_hidden = runner_->last_mask_hidden();
  in_flight_ = std::move(step);
  return {++launched_};
}

StepResult CudaWorker::collect(StepHandle handle) {
  PAGEDLM_CHECK(in_flight_ && handle.id == launched_, "collect: step ", handle.id,
                " is not in flight");
  InFlight step = std::move(*in_flight_);
  in_flight_.reset();
  const StepPlan& plan = *step.plan;
  StepResult& result = step.result;
  const int64_t vocab = model_->config().vocab_size;
  // The device sampler knows no logit adjustments: those rows are sampled again here, from the
  // logits the step downloaded (StepInputs::want_logits covers them) and the same mask rows.
  for (int32_t b = 0; b < plan.num_seqs(); ++b) {
    const SeqSampling& seq = step.inputs.sampling[b];
    if (result.sampled[b] < 0 || !adjusts_logits(*seq.params)) continue;
    PAGEDLM_CHECK(result.logits.defined(), "a row that adjusts its logits needs them on the host");
    const float* row = result.logits.data<float>() + (plan.logits_indptr[b + 1] - 1) * vocab;
    const int32_t* mask =
        seq.mask_row >= 0 ? mask_rows() + int64_t{seq.mask_row} * mask_words_ : nullptr;
    result.sampled[b] = sample_on_host(row, vocab, seq, mask);
  }
  return std::move(result);
}

}  // namespace pagedlm
