// A worker runs one tensor-parallel rank's share of the model on one device: it launches a step
// (a StepPlan and what the sampler needs of each sequence) and later collects its result (the
// sampled tokens, the logits when asked, timings). The engine above it knows no device; the
// executor (engine/executor.h) drives the workers of every rank this process runs.
//
// launch and collect are apart so that the engine can plan step N + 1 while the device runs
// step N (asynchronous scheduling, engine.h). On the GPU launch enqueues the plan's upload, the
// forward pass, the sampler and the sampled ids' download and returns; collect waits for the
// step's event. On the CPU the forward pass runs on the calling threads inside launch and
// collect returns what it held.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
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
  // Structured output: the row of the step's MaskBatch holding the token bitmask the sequence
  // is sampled under, or -1 (unmasked).
  int32_t mask_row = -1;
  // The request and its tokens (alive for the step), which the penalties read: on the host
  // directly; the GPU keeps a device table of the tokens of each request that uses them, filled
  // from these when the request takes a slot. Tokens may be null when no penalty is set.
  int64_t request_id = -1;
  const RequestTokens* tokens = nullptr;
  int32_t logprobs_top_k = -1;  // -1: no logprobs; else at most ops::kMaxTopLogprobs
};

// Returned logprobs of a sampled token, computed on the device from its raw logits row: its
// log-probability and the max(top_k, 1) most probable tokens (descending, ties toward the lower
// index), as ops::log_softmax_topk gives them.
struct SampledLogprobs {
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;
};

// Token bitmask rows (structured output): num_rows() rows of words() int32 words in host memory
// that the structured-output manager (engine/structured_output.h) owns and writes. A step lends
// them to the worker (MaskBatch), which reads them (CPU) or uploads the rows it uses (GPU). The
// block is page-aligned and never moves, so a GPU worker pins it in place the first time it
// sees it and its upload is a DMA from these very rows: nothing is copied on the host, and no
// worker hands the engine memory of its own.
class MaskRows {
 public:
  MaskRows(int32_t num_rows, int32_t words);
  MaskRows(const MaskRows&) = delete;
  MaskRows& operator=(const MaskRows&) = delete;

  int32_t* row(int32_t r) { return data_.get() + int64_t{r} * words_; }
  const int32_t* row(int32_t r) const { return data_.get() + int64_t{r} * words_; }
  int32_t num_rows() const { return num_rows_; }
  int32_t words() const { return words_; }
  void* data() { return data_.get(); }
  size_t bytes() const;  // the whole block, a multiple of the page size

 private:
  struct Free {
    void operator()(int32_t* p) const;
  };
  int32_t num_rows_, words_;
  std::unique_ptr<int32_t[], Free> data_;
};

// A step's token masks. The worker calls finish once the forward pass is enqueued (GPU: the
// host's work on the masks overlaps the device's) or done (CPU); it completes every row a
// sequence of the step names (SeqSampling::mask_row), which the worker reads only after it.
struct MaskBatch {
  std::shared_ptr<MaskRows> rows;  // null when no sequence of the step is masked
  std::function<void()> finish;
};

// A row of a plan whose token id is kPendingToken (Scheduler::run_ahead): its token is the one
// the step launched before this one sampled from its logits row source_row. The worker takes it
// on the device (GPU: a copy from the sampled ids, which stay on the device), never through the
// host.
struct PendingRow {
  int32_t row = 0;
  int32_t source_row = 0;
};

// What a step asks of a worker besides its plan. What it points to stays alive until collect.
struct StepInputs {
  // One per sequence of the plan. Rank 0's tokens are the step's; a GPU rank other than 0
  // samples greedy rows whose tokens are thrown away (run_worker_rank).
  std::vector<SeqSampling> sampling;
  // The step's logits [S, vocab] f32 come back to the host (StepResult::logits).
  bool want_logits = false;
  MaskBatch masks;  // used when a sequence has a mask row
  // Where the CPU's forward pass may be left midway (every rank of a group asks the same
  // object); null: it runs to the end. GPU steps are never left midway.
  ForwardStop* stop = nullptr;
  // The plan's rows whose tokens the step launched just before this one samples. A sequence's
  // RequestTokens end with kPendingToken when it has such a row: penalties count that token
  // as the one the row takes.
  std::vector<PendingRow> pending_rows;
};

// Where a step's time went.
struct StepTimings {
  // Host clock when the worker began and stopped waiting for the device (the CPU: both when
  // its forward and sampling were done).
  std::chrono::steady_clock::time_point wait_begin, wait_end;
  double gpu_ms = 0;  // GPU: device time from the plan upload to the tokens' download
  // GPU, a decode step after a decode step: the device's idle time between the two (from the
  // end event of the one before to this one's begin event); -1 otherwise.
  double gap_gpu_ms = -1;
  // GPU, steps with token masks: the device time of the forward pass and of what followed the
  // masks (CudaStepRunner::last_masked_forward_gpu_ms and last_masked_sampler_gpu_ms).
  double masked_forward_gpu_ms = 0, masked_sampler_gpu_ms = 0;
  // Host time MaskBatch::finish took; GPU: whether the forward pass was still running when it
  // ended.
  double mask_ms = 0;
  bool mask_hidden = false;
};

struct StepResult {
  // False when the forward pass was left midway (StepInputs::stop): nothing else is set, and
  // the step's K/V are only partly written.
  bool completed = true;
  std::vector<int32_t> sampled;  // per sequence of the plan: its token, -1 where not sampled
  Tensor logits;                 // [S, vocab] f32 on the host when want_logits (CPU: always)
  // Per sequence, the logprobs of its sampled token where its SeqSampling asked for them
  // (ops::sampled_logprobs, on the logits' device); empty when no sequence asked.
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
  // Starts the step. The plan and what inputs point to stay alive until launch returns (the
  // worker keeps what collect needs). At most two steps are in flight: step N + 1 may be
  // launched before step N is collected, and the steps are collected in order.
  virtual StepHandle launch(const StepPlan& plan, StepInputs inputs) = 0;
  // Waits for the step and returns its result.
  virtual StepResult collect(StepHandle handle) = 0;
  // Whether launch returns while the device is still early in the step (the GPU: a decode
  // bucket's graph replay, one call). Where it does not, launching the step ahead of collecting
  // the one before delays that one's tokens by about a step: the CPU runs the forward pass inside
  // launch, and a GPU step enqueued kernel by kernel fills the device's queue of pending work,
  // so its launch returns only near the step's end (H200, 2026-12-03: a 16k-token prefill of
  // the Llama-3.1-8B shape spent 340 of its 379 ms in launch).
  virtual bool launch_returns_early(const StepPlan& plan, bool want_logits) const { return false; }
  // Whether a step's forward pass may be left midway (StepInputs::stop; the CPU's). GPU steps
  // always run to the end.
  virtual bool leaves_steps_midway() const { return false; }

  virtual const CausalLM& model() const = 0;
  // The KV cache pages this rank holds (every rank of a group the same).
  virtual int32_t num_pages() const = 0;
  // Makes the worker's device current on the calling thread.
  virtual void make_current() const {}
  // Decode steps that read the pages several sequences share once for all of them (the GPU's
  // cascade attention).
  virtual int64_t cascade_steps() const { return 0; }
  // Steps that downloaded logits from the device (only for prompt logits asked for).
  virtual int64_t logits_downloads() const { return 0; }
};

// Launched steps' results, held until they are collected, for workers whose launch ends with the
// step done (the CPU's).
class HeldStep {
 public:
  // Fails while two steps are held: at most two are in flight.
  void require_room() const;
  StepHandle hold(StepResult result);
  // The oldest held step's result; fails unless `handle` is its.
  StepResult take(StepHandle handle);

 private:
  int64_t launched_ = 0;
  std::deque<std::pair<int64_t, StepResult>> results_;
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

// The element type of the KV cache for a model computing in `compute` on options.device
// (options.kv_cache_dtype); an Error says why for a combination the kernels do not run (e4m3 on
// the CPU, bf16 under f16 compute).
DType kv_cache_dtype(const EngineOptions& options, DType compute);

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
std::unique_ptr<Worker> make_worker(RankParts parts, CpuRanks* peers = nullptr);

// Samples a sequence's token on the host from its logits row [vocab], its bias and penalties
// applied; mask: its token bitmask or null.
int32_t sample_on_host(const float* row, int64_t vocab, const SeqSampling& seq,
                       const int32_t* mask);

// The CPU's worker: binds the step's pages (PagedKvCache), runs CausalLM::forward on the calling
// threads (beside the other ranks of its thread group, when it has peers), which may leave
// midway (StepInputs::stop), then fills the masks and samples every row on the host.
class CpuWorker final : public Worker {
 public:
  explicit CpuWorker(RankParts parts, CpuRanks* peers = nullptr);
  ~CpuWorker() override;

  StepHandle launch(const StepPlan& plan, StepInputs inputs) override;
  StepResult collect(StepHandle handle) override;
  bool leaves_steps_midway() const override { return true; }
  const CausalLM& model() const override { return *model_; }
  int32_t num_pages() const override { return num_pages_; }

  // This rank's forward pass alone (no peers, no sampling): the step's pages bound, then
  // CausalLM::forward; false when it was left midway. The thread group runs its ranks' with it.
  bool forward(const StepPlan& plan, const ForwardInputs& inputs, const Tensor& logits);

 private:
  // result.logprobs of the sequences whose SeqSampling asks for them, from result.logits.
  void fill_logprobs(const StepPlan& plan, const std::vector<SeqSampling>& sampling,
                     StepResult& result);

  std::unique_ptr<CausalLM> model_;
  std::unique_ptr<PagedKvCache> kv_cache_;
  int32_t num_pages_ = 0;
  CpuRanks* peers_ = nullptr;
  HeldStep held_;
  // The last launched step's sampled ids by logits row (-1: not sampled), which the next
  // step's pending rows take.
  std::vector<int32_t> last_row_tokens_;
};

// The GPU's worker: the model, its paged KV cache and the CudaStepRunner that stages each plan,
// launches the forward pass (a CUDA graph for decode buckets) and the sampler (bias, penalties
// and logprobs included) on its stream and the tokens' download (launch), then waits for them
// (collect).
class CudaWorker final : public Worker {
 public:
  explicit CudaWorker(RankParts parts);
  ~CudaWorker() override;

  StepHandle launch(const StepPlan& plan, StepInputs inputs) override;
  StepResult collect(StepHandle handle) override;
  bool launch_returns_early(const StepPlan& plan, bool want_logits) const override;
  const CausalLM& model() const override { return *model_; }
  int32_t num_pages() const override { return num_pages_; }
  void make_current() const override;
  int64_t cascade_steps() const override;
  int64_t logits_downloads() const override;

 private:
  std::unique_ptr<CausalLM> model_;
  std::unique_ptr<CudaStepRunner> runner_;
  std::unique_ptr<PagedKvCache> kv_cache_;
  int32_t num_pages_ = 0;
  int64_t launched_ = 0, collected_ = 0;
};

}  // namespace pagedlm
