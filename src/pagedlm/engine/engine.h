// The engine loop: schedule -> forward -> sample -> append, one packed step at a time,
// plus an offline API that runs a batch of requests to completion.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/sched/request.h"
#include "pagedlm/sched/scheduler.h"

namespace pagedlm {

class Executor;
class StructuredOutput;
namespace grammar {
class CompiledGrammar;
}  // namespace grammar

// The KV cache's element type (--kv-cache-dtype). kAuto: the compute dtype (f32 on the CPU,
// bf16 on the GPU). kFp8 (GPU only): OCP e4m3 with one scale per layer for K and one for V (the
// checkpoint's self_attn.k_scale / v_scale, 1.0 where it has none), half the bytes of bf16 per
// page, so twice the pages in the same memory.
enum class KvCacheDtype { kAuto, kBf16, kFp8 };

struct EngineOptions {
  int32_t page_size = 16;
  KvCacheDtype kv_cache_dtype = KvCacheDtype::kAuto;
  int32_t num_pages = 0;  // 0: sized from kv_cache_bytes (CPU) or gpu_memory_fraction (CUDA)
  int64_t kv_cache_bytes = int64_t{2} << 30;  // CPU: all tensor-parallel ranks' caches together
  // CUDA: the share of the device memory left free after weights and activations that the KV
  // cache takes when num_pages is 0.
  float gpu_memory_fraction = 0.9f;
  bool use_cuda_graphs = true;  // CUDA: replay decode steps as graphs (off: every step eager)
  // CUDA: decode steps read pages that several sequences share at the front of their page
  // tables once for all of them (cascade attention), not once per sequence.
  bool use_cascade_attention = true;
  // CUDA: at start-up, time a few of cuBLASLt's algorithms for each GEMM shape of the
  // full-budget prefill step and keep the fastest (off: its first choice).
  bool tune_gemms = true;
  // 0: 2048 on the CPU; 16384 on the GPU, where a larger prefill budget fills the decode batch
  // sooner (SmolLM2 random workload on the H200: 48k -> 58k output tok/s, docs/PERF.md).
  int32_t max_num_batched_tokens = 0;
  int32_t max_num_seqs = 256;
  // While any sequence decodes, each step's prefill is cut so that the step is expected to take
  // at most this long (the cost model: StepCostFit over the engine's own measured steps), which
  // bounds the inter-token latency of running streams while a long prompt is prefilled. With no
  // sequence decoding, prefill keeps the whole max_num_batched_tokens. -1: 200 ms on the CPU,
  // off on the GPU (whose steps take milliseconds); 0: off.
  double target_itl_ms = -1;
  bool enable_prefix_cache = true;
  // When every layer of the model slides (Mistral, Phi-3 and Qwen2 configs that set a window
  // from layer 0), pages wholly behind all later queries' windows go back to the pool (off: a
  // sequence keeps all its pages, as for models with a global layer).
  bool free_pages_outside_window = true;
  int32_t threads = 0;  // 0: all hardware threads; each CPU tensor-parallel rank runs as many
  // CPU: 8-bit activations for the block-quantized projections (ModelOptions).
  bool cpu_q8_activations = false;
  // CPU: 32-bit fixed-point activations for them, through the integer kernels (ModelOptions).
  bool cpu_fixed32_activations = false;
  // GPU: which projections run as FP8 W8A8 GEMMs (ModelOptions; --quantization).
  Fp8Weights fp8_weights = Fp8Weights::kCheckpoint;
  // GPU: a GGUF's projections computed from their blocks (ModelOptions; --gguf-blocks). Off by
  // default: on the H200 (2026-12-03) the block kernels beat bf16 on single-stream decode for
  // Q8_0 / Q4_1 but not for Q4_K, and steps of more than 8 rows expand the blocks every step.
  bool gguf_blocks_on_gpu = false;
  // The dtype of activations and dense weights (ModelOptions; --dtype). Unset: the device's.
  std::optional<DType> compute_dtype;
  // Throws where both integer activations are asked for.
  ModelOptions model_options() const;
  // Structured output: fill a sequence's next token mask on a worker thread as soon as its token
  // is accepted (MaskPrefetch), instead of inside the next step. -1: on the GPU, whose host
  // threads are otherwise idle while it runs, off on the CPU, whose threads run the forward
  // pass; 0: off; 1: on.
  int32_t prefetch_masks = -1;
  // Asynchronous scheduling: while the device runs step N, the host plans and launches step
  // N + 1, whose decodes take N's sampled tokens on the device (Scheduler::run_ahead); stops
  // are then checked one step late and the token computed past one is discarded. Steps that
  // cannot run ahead are run synchronously (docs/ARCHITECTURE.md lists them). Greedy and
  // seeded outputs are the same either way. -1: on on the GPU, off on the CPU (whose launch
  // runs the whole step, so nothing overlaps); 0: off; 1: on.
  int32_t async_scheduling = -1;
  Device device = Device::kCpu;
  // Ranks that split the model between them (model/tensor_parallel.h). Every rank runs the one
  // StepPlan rank 0's scheduler makes each step. On the CPU the ranks are threads of this
  // process; on GPUs each is a process with its own GPU (engine/process_group.h): rank 0 listens
  // at tensor_parallel_endpoint (HOST:PORT) and the others connect to it.
  int32_t tensor_parallel_size = 1;
  int32_t tensor_parallel_rank = 0;
  std::string tensor_parallel_endpoint;
  int32_t tensor_parallel_device = -1;  // this rank's GPU; -1: its rank modulo the GPUs seen
  // How long a rank waits in a collective for the others before the whole group fails.
  int32_t collective_timeout_ms = 300000;
  // GPU ranks in processes: what to do when another rank's process is gone (`why` names it; on
  // a watcher thread). A collective waiting for a dead peer never returns, so it should end the
  // process, as the command line's does; the engine never ends it itself. Such a group is
  // refused without one.
  std::function<void(const std::string& why)> on_lost_rank;
};

// The option values the command line (--kv-cache-dtype, --quantization) and the Python package
// (kv_cache_dtype=, quantization=) take by name, parsed in one place so that both accept the
// same names and refuse others with the same message (a pagedlm::Error listing the choices).
KvCacheDtype kv_cache_dtype_named(std::string_view name);  // auto, bf16 or fp8
// --dtype: auto (nullopt: the device's), float32 (float), bfloat16, float16 (half).
std::optional<DType> compute_dtype_named(std::string_view name);
// --quantization: auto, fp8 or none (EngineOptions::fp8_weights), or a GGUF block format
// (q8_0, q4_k, ...) in which dummy weights make their projections.
struct Quantization {
  Fp8Weights fp8_weights = Fp8Weights::kCheckpoint;
  std::optional<QuantType> dummy_blocks;
};
// dummy_weights: the model's weights are random (--dummy, load_format="dummy"), the only ones a
// block format applies to.
Quantization quantization_named(std::string_view name, bool dummy_weights);

// What one step produced for one request.
struct RequestEvent {
  int64_t request_id = 0;
  int32_t token = -1;  // -1 when the step produced no token for it
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  // Only for requests with enable_logprobs: the token's log-probability under the model's
  // distribution (before temperature and filters) and the most likely alternatives.
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
};

// A finished request (Engine::take_output).
struct RequestOutput {
  int64_t request_id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> tokens;
  FinishReason reason = FinishReason::kNone;
  int32_t num_cached_tokens = 0;
  Tensor prompt_logits;  // [prompt_len, vocab] f32 when asked for (rows served by the cache stay 0)
};

// The size of the last step, for benchmarks' byte and FLOP counts.
struct StepShape {
  int32_t num_tokens = 0;  // rows of the packed stream
  int32_t num_seqs = 0;
  int64_t kv_tokens = 0;        // keys held by the step's sequences (after its tokens)
  int64_t attention_pairs = 0;  // (query, visible key) pairs the step's attention computes
  bool decode = false;          // every sequence has exactly one new token
  double gpu_ms = 0;            // CUDA: the step's device time, upload to download
  double gap_gpu_ms = -1;       // CUDA: the device's idle time before it (StepTimings)
  // Host clock of step(): scheduling; the rest until the device is waited for (plan
  // bookkeeping, staging, launches; on the CPU also the forward); the wait; what follows it
  // (sampled tokens into the scheduler and the events). With asynchronous scheduling the step
  // was planned and launched in the step() before, so the rest until its wait also holds that
  // step()'s end and this one's planning of the next step.
  double schedule_ms = 0, prepare_ms = 0, wait_ms = 0, finish_ms = 0;
  // Host time the executor's launch of this step took (GPU: staging and enqueuing; the CPU:
  // the whole forward pass and sampling).
  double launch_ms = 0;
  // CUDA, steps with token masks: the device time of the forward pass and of what followed the
  // masks (CudaStepRunner::last_masked_forward_gpu_ms and last_masked_sampler_gpu_ms).
  double masked_forward_gpu_ms = 0, masked_sampler_gpu_ms = 0;
};

// The options with every default that depends on the device filled in (the token budget, the
// step-time target, the mask prefetch), checked; the one place such defaults are decided. Every
// rank of a group resolves its options with it.
EngineOptions resolve_options(EngineOptions options);

// The GPUs this process sees: 0 when this build has no CUDA support or the machine no GPU.
int cuda_device_count();
bool cuda_device_available();
// Fails unless every GPU this process sees runs pagedlm's CUDA kernels (compute capability 8.0
// or later), naming the GPU and its capability and pointing to --device cpu.
void require_supported_cuda_devices();

class Engine {
 public:
  Engine(const Checkpoint& checkpoint, EngineOptions options);
  ~Engine();

  const ModelConfig& config() const;
  // Call first on a thread other than the one that built the engine, before it steps the
  // engine there, and again when a thread that steps several engines turns to this one: makes
  // the engine's GPU current on it (a tensor-parallel rank 0 may be on any) and sets the
  // thread's OpenMP count to the engine's `threads` (OpenMP's count belongs to the thread that
  // sets it, so two engines stepped on two threads each keep their own).
  void use_on_this_thread() const;
  const EngineOptions& options() const { return options_; }

  // Validates the request (token ids in range, lengths) and queues it; returns its id.
  // request.id is ignored: the engine assigns ids.
  int64_t add_request(Request request);
  bool cancel(int64_t request_id);
  bool has_unfinished() const;

  // Runs one step; returns what happened to each request in it. With asynchronous scheduling
  // it launches the next step before it collects this one, which is then still in flight when
  // step() returns (has_unfinished() stays true until it is collected).
  std::vector<RequestEvent> step();
  // While draining, every step's prefill is held to target_itl_ms, whether or not a sequence
  // decodes: a caller that is stopping (a server's shutdown) then never waits long for the
  // step in progress.
  void set_draining(bool draining) { draining_ = draining; }
  // Lets a step be left midway, for a caller that is stopping (Ctrl-C, a server's drain
  // deadline): while `abandon()` holds, a CPU step's forward pass leaves at the next of its
  // points between large operations (ForwardStop; a CPU step that prefills a long prompt runs
  // for seconds) and step() returns at once. An abandoned step keeps nothing it did: every request
  // in it ends as cancelled (its event says so) and the pages it was writing go back to the pool
  // unknown to the prefix cache (Scheduler::abandon). GPU steps, which take milliseconds and may be
  // CUDA graphs, always run to the end. Empty (the default): steps are never abandoned.
  void set_abandon_check(std::function<bool()> abandon) { abandon_ = std::move(abandon); }
  // A server sets it: every step's prefill is held to target_itl_ms whether or not a sequence
  // decodes, as while draining, so that a request arriving while a long prompt is prefilled
  // alone waits about one step for its turn, not the whole prompt's prefill (2-core Intel Xeon,
  // 2026-12-02, b8c1423: a 4-token request 1 s after a 4,096-token prompt took 9.5-10.8 s).
  // Nothing changes where target_itl_ms is 0 (the GPU's default).
  void set_prefill_always_bounded(bool bounded) { prefill_always_bounded_ = bounded; }
  // The step-time model the engine has learned so far (all zero before its first prefill, and
  // while target_itl_ms is 0).
  const StepCost& step_cost() const { return step_cost_; }

  // Runs the given requests (and anything already queued) to completion; outputs in the
  // order of `requests`.
  std::vector<RequestOutput> generate(std::vector<Request> requests);

  // Output of a finished request (moves it out); throws if unknown or not finished.
  RequestOutput take_output(int64_t request_id);

  SchedulerStats stats() const;
  std::vector<SequenceView> sequence_map() const;
  std::vector<CachedPageView> cached_pages(int32_t max_pages) const;
  int64_t num_steps() const { return num_steps_; }
  const StepShape& last_step() const { return last_step_; }
  // Decode steps that read the pages several sequences share once for all of them (CUDA's
  // cascade attention).
  int64_t cascade_steps() const;
  // GPU steps that downloaded logits (only for prompt logits asked for; 0 on the CPU).
  int64_t logits_downloads() const;
  // Mixture-of-experts models: the bytes of expert weights the steps so far activated, all ranks
  // together (see CausalLM::expert_bytes_read).
  int64_t expert_bytes_read() const;
  // The bytes of the weights every step reads whole, all ranks together (see
  // CausalLM::step_weight_bytes; the ranks' shares are alike in size).
  int64_t step_weight_bytes() const;
  std::map<std::string, int64_t> step_weight_bytes_by_format() const;  // the same, by format

  // Makes step() fill RequestEvent::logprob and the `top_k` best alternatives (0: none) for
  // every token this request samples from now on (the server's logprobs option). The GPU
  // computes them on the device and takes top_k <= ops::kMaxTopLogprobs (20, the server's cap).
  void enable_logprobs(int64_t request_id, int32_t top_k);

  // Holds the request's output to a compiled grammar (structured output) from its first token:
  // each step samples it under the grammar's token mask, and its output is complete when the
  // grammar accepts a stop token (EOS). Call before the request's first step.
  void set_grammar(int64_t request_id, std::shared_ptr<const grammar::CompiledGrammar> grammar);
  // Host time the last step spent computing token masks; on the GPU, whether the forward pass was
  // still running when they were done (the mask time was hidden behind it).
  double last_mask_ms() const { return last_mask_ms_; }
  bool last_mask_hidden() const { return last_mask_hidden_; }
  // Host time the worker spent filling the masks started after the step before this one (0:
  // none started); they were ready for this step's masked sequences.
  double last_mask_prefetch_ms() const;
  // How many of the last step's masks came from that prefetch (the others were filled in it).
  int32_t last_prefetched_masks() const;

 private:
  // What the engine keeps of a request until take_output().
  struct LiveRequest {
    // Its prompt and outputs, which the scheduler appends to; copied into output.prompt and
    // output.tokens by take_output().
    std::shared_ptr<const RequestTokens> tokens;
    RequestOutput output;  // the rest of the output, filled as the request runs
    SamplingParams sampling;
    uint64_t seed = 0;
    int32_t logprobs_top_k = -1;  // -1: no logprobs
  };

  // A launched step, until it is collected.
  struct Launched;
  // Launches the plan's forward pass and sampling on the executor's ranks; `previous`: the
  // plan of the step launched just before (null: none), whose tokens the plan's pending rows
  // take.
  std::unique_ptr<Launched> launch_step(StepPlan plan, const StepPlan* previous);
  // Whether the engine may plan the next step before this one's tokens are known.
  bool can_run_ahead(const Launched& step) const;
  // Whether a plan made ahead may be launched before the step in flight is collected.
  bool can_launch_ahead(const StepPlan& plan) const;
  // Whether the step's logits must come back to the host (prompt logits asked for).
  bool wants_logits(const StepPlan& plan) const;
  // Applies a collected step's tokens: grammars, logprobs, prompt logits, the scheduler's update
  // (resolve when the step ran ahead), the events, the next masks' prefetch (StructuredOutput).
  std::vector<RequestEvent> finish_step(Launched& step, StepResult& result, bool ran_ahead);
  StepTimeLimit step_limit() const;
  // Ends the step of a forward pass left midway: its requests as cancelled, its pages forgotten.
  std::vector<RequestEvent> abandon_step(const StepPlan& plan);

  EngineOptions options_;
  std::unique_ptr<Executor> executor_;  // the ranks that run the steps
  std::unique_ptr<Scheduler> scheduler_;
  std::unordered_map<int64_t, LiveRequest> requests_;
  int64_t next_request_id_ = 1;
  int64_t num_steps_ = 0;
  StepShape last_step_;
  StepCostFit step_cost_fit_;
  StepCost step_cost_;
  bool draining_ = false;
  std::function<bool()> abandon_;
  bool prefill_always_bounded_ = false;
  uint64_t seed_counter_;
  double last_mask_ms_ = 0;
  bool last_mask_hidden_ = false;
  // The step launched and not yet collected (asynchronous scheduling keeps it between step()
  // calls).
  std::unique_ptr<Launched> in_flight_;
  // A plan made ahead whose launch waits for the next step() (see step()), and the plan of the
  // step before it, whose sampled ids its pending rows take.
  struct Deferred {
    StepPlan plan, previous;
  };
  std::optional<Deferred> deferred_;
  // Grammars, token masks and their prefetch. Last, so that its prefetch thread stops before
  // anything it could read goes.
  std::unique_ptr<StructuredOutput> structured_;
};

}  // namespace pagedlm
