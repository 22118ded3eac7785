// A worker runs one tensor-parallel rank's share of the model on one device: it launches a step
// (a StepPlan and what the sampler needs of each sequence) and later collects its result (the
// sampled tokens, the logits when asked, timings). The engine above it knows no device; the
// executor (engine/executor.h) drives the workers of every rank this process runs.
//
// launch and collect are apart so that a scheduler can plan step N + 1 while the device runs
// step N. On the GPU launch enqueues the forward pass and the sampler; CudaStepRunner::run still
// waits for its stream before it returns (see CudaWorker), so today the wait happens inside
// launch. On the CPU the forward pass runs on the calling threads inside launch.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/sched/request.h"
#include "pagedlm/sched/sampling_params.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

class CpuRanks;
class CudaStepRunner;
class PagedKvCache;
struct EngineOptions;
namespace ops {
class Communicator;
}

// What the sampler needs of one sequence of the step.
struct SeqSampling {
  const SamplingParams* params = nullptr;  // the request's, alive for the step
  uint64_t seed = 0;
  int64_t step = 0;  // tokens generated so far: the counter of the request's random stream
  // Structured output: the row of the worker's mask_rows() holding the token bitmask the
  // sequence is sampled under, or -1 (unmasked).
  int32_t mask_row = -1;
  // The request and its tokens (alive for the step), which the penalties read: on the host
  // directly; the GPU keeps a device table of the tokens of each request that uses them, filled
  // from these when the request takes a slot. Tokens may be null when no penalty is set.
  int64_t request_id = -1;
  const RequestTokens* tokens = nullptr;
  int32_t logprobs_top_k = -1;  // -1: no logprobs; else at most max_top_logprobs()
};

// Returned logprobs of a sampled token, computed on the device from its raw logits row: its
// log-probability and the max(top_k, 1) most probable tokens (descending, ties toward the lower
// index), as ops::log_softmax_topk gives them.
struct SampledLogprobs {
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;
};

// Completes every masked sequence's row of mask_rows(); the worker calls it once the forward
// pass is enqueued (GPU: the host's work on the masks overlaps the device's) or done (CPU).
using MaskFill = std::function<void()>;

// What a step asks of a worker besides its plan. What it points to stays alive until collect.
struct StepInputs {
  // One per sequence of the plan. Rank 0's tokens are the step's; a GPU rank other than 0
  // samples greedy rows whose tokens are thrown away (run_worker_rank).
  std::vector<SeqSampling> sampling;
  // The step's logits [S, vocab] f32 come back to the host (StepResult::logits).
  bool want_logits = false;
  MaskFill finish_masks;  // called when a sequence has a mask row
  // Where the CPU's forward pass may be left midway (every rank of a group asks the same
  // object); null: it runs to the end. GPU steps are never left midway.
  ForwardStop* stop = nullptr;
};

// Where a step's time went.
struct StepTimings {
  // Host clock when the worker began and stopped waiting for the device (the CPU: both when
  // its forward and sampling were done).
  std::chrono::steady_clock::time_point wait_begin, wait_end;
  double gpu_ms = 0;  // GPU: device time from the plan upload to the tokens' download
  // GPU, steps with token masks: the device time of the forward pass and of what followed the
  // masks (CudaStepRunner::last_masked_forward_gpu_ms and last_masked_sampler_gpu_ms).
  double masked_forward_gpu_ms = 0, masked_sampler_gpu_ms = 0;
  // Host time finish_masks took; GPU: whether the forward pass was still running when it ended.
  double mask_ms = 0;
  bool mask_hidden = false;
};

struct StepResult {
  // False when the forward pass was left midway (StepInputs::stop): nothing else is set, and
  // the step's K/V are only partly written.
  bool completed = true;
  std::vector<int32_t> sampled;  // per sequence of the plan: its token, -1 where not sampled
  Tensor logits;                 // [S, vocab] f32 on the host when want_logits (CPU: always)
  // GPU: per sequence, the logprobs of its sampled token where its SeqSampling asked for them,
  // computed on the device. Empty on the CPU, where the engine computes them from the logits.
  std::vector<SampledLogprobs> logprobs;
  StepTimings timings;
};

// A launched step, to collect.
struct StepHandle {
  int64_t id = 0;
};

class Worker {
 public:
  virtual ~Worker() = default;
  // Starts the step. The plan and what inputs point to stay alive until collect. One step is in
  // flight at a time: collect it before the next launch.
  virtual StepHandle launch(const StepPlan& plan, StepInputs inputs) = 0;
  // Waits for the step and returns its result.
  virtual StepResult collect(StepHandle handle) = 0;

  virtual const CausalLM& model() const = 0;
  // The KV cache pages this rank holds (every rank of a group the same).
  virtual int32_t num_pages() const = 0;
  // Token bitmasks (structured output): 2 max_num_seqs rows of grammar::bitmask_words(vocab)
  // int32 words, written by the engine between steps and by finish_masks (GPU: pinned memory
  // the worker uploads from). SeqSampling::mask_row names a row.
  virtual int32_t* mask_rows() = 0;
  // Makes the worker's device current on the calling thread.
  virtual void make_current() const {}
  // Decode steps that read the pages several sequences share once for all of them (the GPU's
  // cascade attention).
  virtual int64_t cascade_steps() const { return 0; }
  // Steps that downloaded logits from the device (only for prompt logits asked for).
  virtual int64_t logits_downloads() const { return 0; }
  // The most alternatives SeqSampling::logprobs_top_k may ask for.
  virtual int32_t max_top_logprobs() const { return std::numeric_limits<int32_t>::max(); }
};

// A launched step's result, held until it is collected, for workers whose launch ends with the
// step done (the CPU's; the GPU's while CudaStepRunner::run waits for its stream).
class HeldStep {
 public:
  // Fails while a step is held: one step is in flight at a time.
  void require_none() const;
  StepHandle hold(StepResult result);
  // The held step's result; fails unless `handle` is the held step's.
  StepResult take(StepHandle handle);

 private:
  int64_t launched_ = 0;
  std::optional<StepResult> result_;
};

// One rank's share of the model and what runs it on its device.
struct RankParts {
  RankParts();
  RankParts(RankParts&&) noexcept;
  RankParts& operator=(RankParts&&) noexcept;
  ~RankParts();

  std::unique_ptr<CausalLM> model;
  std::unique_ptr<CudaStepRunner> runner;  // the GPU's
  std::unique_ptr<PagedKvCache> kv_cache;
  int32_t num_pages = 0;
};

// The KV cache pages a rank takes: options.num_pages when set, else what fits the share of free
// GPU memory (options.gpu_memory_fraction; the runner and weights already allocated) or, on the
// CPU, the rank's share of options.kv_cache_bytes.
int32_t kv_cache_pages(const EngineOptions& options, const ModelConfig& config, TensorParallel tp,
                       DType dtype);

// The one way a rank is built, on every rank of every kind of group: its share of the weights on
// options.device (resolved options, engine.h), then on the GPU its step runner (weights,
// activations and step buffers first, so that the KV cache takes what is left), then its KV
// cache of agree_num_pages(the pages that fit) pages (empty: those that fit; a group agrees on
// one count), then on the GPU the runner's warm-up, whose steps hold the group's collectives.
RankParts build_rank(const Checkpoint& checkpoint, const EngineOptions& options, TensorParallel tp,
                     ops::Communicator* comm,
                     const std::function<int32_t(int32_t)>& agree_num_pages = {});

// The worker of a rank: a CudaWorker when it has a runner, else a CpuWorker (peers: the other
// ranks of its thread group, or null).
std::unique_ptr<Worker> make_worker(RankParts parts, const EngineOptions& options,
                                    CpuRanks* peers = nullptr);

// Samples a sequence's token on the host from its logits row [vocab], its bias and penalties
// applied; mask: its token bitmask or null.
int32_t sample_on_host(const float* row, int64_t vocab, const SeqSampling& seq,
                       const int32_t* mask);

// The CPU's worker: binds the step's pages (PagedKvCache), runs CausalLM::forward on the calling
// threads (beside the other ranks of its thread group, when it has peers), which may leave
// midway (StepInputs::stop), then fills the masks and samples every row on the host.
class CpuWorker final : public Worker {
 public:
  CpuWorker(RankParts parts, const EngineOptions& options, CpuRanks* peers = nullptr);
  ~CpuWorker() override;

  StepHandle launch(const StepPlan& plan, StepInputs inputs) override;
  StepResult collect(StepHandle handle) override;
  const CausalLM& model() const override { return *model_; }
  int32_t num_pages() const override { return num_pages_; }
  int32_t* mask_rows() override { return mask_rows_.get(); }

  // This rank's forward pass alone (no peers, no sampling): the step's pages bound, then
  // CausalLM::forward; false when it was left midway. The thread group runs its ranks' with it.
  bool forward(const StepPlan& plan, const ForwardInputs& inputs, const Tensor& logits);

 private:
  std::unique_ptr<CausalLM> model_;
  std::unique_ptr<PagedKvCache> kv_cache_;
  int32_t num_pages_ = 0;
  CpuRanks* peers_ = nullptr;
  std::unique_ptr<int32_t[]> mask_rows_;
  int32_t mask_words_ = 0;
  HeldStep held_;
};

// The GPU's worker: the model, its paged KV cache and the CudaStepRunner that stages each plan,
// launches the forward pass (a CUDA graph for decode buckets) and the sampler (bias, penalties
// and logprobs included) on its stream, and downloads the tokens.
class CudaWorker final : public Worker {
 public:
  CudaWorker(RankParts parts, const EngineOptions& options);
  ~CudaWorker() override;

  StepHandle launch(const StepPlan& plan, StepInputs inputs) override;
  StepResult collect(StepHandle handle) override;
  const CausalLM& model() const override { return *model_; }
  int32_t num_pages() const override { return num_pages_; }
  int32_t* mask_rows() override;
  void make_current() const override;
  int64_t cascade_steps() const override;
  int64_t logits_downloads() const override;
  int32_t max_top_logprobs() const override;

 private:
  std::unique_ptr<CausalLM> model_;
  std::unique_ptr<CudaStepRunner> runner_;
  std::unique_ptr<PagedKvCache> kv_cache_;
  int32_t num_pages_ = 0;
  int32_t mask_words_ = 0;
  HeldStep held_;
};

}  // namespace pagedlm
