// The GPU side of an engine step: stages the StepPlan in pinned memory and copies it with one
// asynchronous copy into fixed device buffers, runs the model and the sampler on the engine's
// stream, and returns only the sampled token ids, with logprobs where asked (logits rows only
// when a request asks for its prompt logits). Logit bias, penalties and logprobs are all
// computed on the device. Pure decode steps are padded to a batch bucket (1, 2, 4, ...) and
// replayed as CUDA graphs, captured at start-up (warm_up); a decode step with masks, bias,
// penalties or logprobs replays the bucket's forward-only graph and samples eagerly.
//
// Penalties read a device table of per-request token state: max_num_seqs slots, each the
// request's output-token counts (int32 [vocab]) and prompt bits ([vocab / 32] words), so
// 4.125 bytes x vocab per slot: 129 MiB for 256 slots at a 128k vocabulary, 153 MiB at 152k,
// allocated with the runner. A request that uses penalties takes a slot when it is first
// sampled (the least recently used one, so it keeps it across preemption until others need
// it), filled on the device from its prompt and outputs; after each draw a kernel counts the
// sampled token into its slot, so the table follows the device's own tokens.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <utility>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

class CausalLM;
class PagedKvCache;
struct EngineOptions;

class CudaStepRunner {
 public:
  // Allocates everything a step needs up front (activations for the larger of the token budget
  // and the largest decode bucket, logits, plan buffers, split-KV workspace).
  CudaStepRunner(CausalLM& model, const EngineOptions& options, int64_t max_model_len);
  ~CudaStepRunner();

  // The GPUs this process sees (0 when this build has no CUDA).
  static int device_count();
  // Fails unless every GPU this process sees runs pagedlm's kernels (compute capability 8.0 on),
  // naming the first that does not.
  static void require_supported_devices();
  // Free device memory now, in bytes.
  static int64_t free_memory_bytes();

  void set_kv_cache(PagedKvCache* kv_cache);
  // Makes the runner's GPU (current when it was built) current on the calling thread: a thread
  // starts on GPU 0, and the runner's streams and graphs belong to its own GPU.
  void make_current() const;

  // Does the first steps' one-time work at start-up (cuBLASLt plans for the full token budget,
  // kernel loading, one CUDA graph per decode bucket), so no request waits for it.
  // Call after set_kv_cache.
  void warm_up();

  // Enqueues the step and returns while the device runs it: the plan's upload, the pending
  // rows' tokens (copied on the device from the sampled ids of the step launched before), the
  // forward pass, the sampler, and the downloads of the sampled ids (and the logits [S, vocab]
  // f32 when want_logits, and logprobs where asked) into the step's own pinned buffers, then
  // the step's event. With masked sequences, masks.finish runs on the host while the device
  // runs the forward pass; then the rows they use are uploaded (on a stream of their own) from
  // masks.rows, pinned in place the first time the runner sees that block, into a fixed device
  // buffer that the sampler reads. At most two steps are in flight (step N + 1 is staged while N
  // runs: the pinned buffers are kept per step in flight).
  void launch(const StepPlan& plan, const std::vector<SeqSampling>& sampling, bool want_logits,
              const MaskBatch& masks, const std::vector<PendingRow>& pending_rows);
  // Waits for the oldest step in flight and returns its result: per sequence of its plan the
  // token sampled from its last logits row (-1 where the plan does not sample it), its logits
  // and logprobs where asked, its device time and the host's wait.
  StepResult collect();
  // Whether launch would replay a decode bucket's CUDA graph for this plan (else the forward
  // pass is enqueued kernel by kernel).
  bool replays_graph(const StepPlan& plan, bool want_logits) const;
  // Runs that downloaded logits (only those whose caller asked for them: prompt logits).
  int64_t logits_downloads() const;
  // Penalty slots filled from a request's tokens (first use, or again after eviction).
  int64_t penalty_slot_fills() const;

  // Steps that ran cascade attention's shared-prefix pass.
  int64_t cascade_steps() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedlm
