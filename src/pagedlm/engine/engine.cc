#include "pagedlm/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <map>
#include <optional>
#include <random>
#include <string_view>
#include <unordered_map>
#include <utility>

#include "pagedlm/core/parallel.h"
#include "pagedlm/engine/cuda_runner.h"
#include "pagedlm/engine/executor.h"
#include "pagedlm/engine/structured_output.h"
#include "pagedlm/model/model.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {

namespace {

void validate_sampling(const SamplingParams& p) {
  PAGEDLM_CHECK(std::isfinite(p.temperature) && p.temperature >= 0.f,
                "temperature must be >= 0, got ", p.temperature);
  PAGEDLM_CHECK(p.top_k >= 0, "top_k must be >= 0, got ", p.top_k);
  PAGEDLM_CHECK(p.top_p > 0.f && p.top_p <= 1.f, "top_p must be in (0, 1], got ", p.top_p);
  PAGEDLM_CHECK(p.min_p >= 0.f && p.min_p <= 1.f, "min_p must be in [0, 1], got ", p.min_p);
  PAGEDLM_CHECK(p.max_tokens >= 0, "max_tokens must be >= 0, got ", p.max_tokens);
  PAGEDLM_CHECK(std::abs(p.presence_penalty) <= 2.f, "presence_penalty must be in [-2, 2], got ",
                p.presence_penalty);
  PAGEDLM_CHECK(std::abs(p.frequency_penalty) <= 2.f, "frequency_penalty must be in [-2, 2], got ",
                p.frequency_penalty);
  PAGEDLM_CHECK(std::isfinite(p.repetition_penalty) && p.repetition_penalty > 0.f,
                "repetition_penalty must be > 0, got ", p.repetition_penalty);
  for (const auto& [token, bias] : p.logit_bias) {
    PAGEDLM_CHECK(std::abs(bias) <= 100.f, "logit_bias of token ", token,
                  " must be in [-100, 100], got ", bias);
  }
}

StepShape shape_of(const StepPlan& plan) {
  StepShape shape;
  shape.num_tokens = plan.num_tokens();
  shape.num_seqs = plan.num_seqs();
  shape.decode = true;
  for (int32_t b = 0; b < plan.num_seqs(); ++b) {
    const int64_t n_new = plan.q_indptr[b + 1] - plan.q_indptr[b];
    const int32_t pages = plan.kv_indptr[b + 1] - plan.kv_indptr[b];
    const int64_t n_kv =
        pages > 0 ? int64_t{pages - 1} * plan.page_size + plan.kv_last_page_len[b] : 0;
    shape.kv_tokens += n_kv;
    // Query j of the n_new sees the n_kv - n_new earlier keys and j + 1 of the new ones.
    shape.attention_pairs += n_new * (n_kv - n_new) + n_new * (n_new + 1) / 2;
    shape.decode &= n_new == 1;
  }
  return shape;
}

}  // namespace

int cuda_device_count() { return CudaStepRunner::device_count(); }
bool cuda_device_available() { return cuda_device_count() > 0; }
void require_supported_cuda_devices() { CudaStepRunner::require_supported_devices(); }

KvCacheDtype kv_cache_dtype_named(std::string_view name) {
  if (name == "auto") return KvCacheDtype::kAuto;
  if (name == "bf16") return KvCacheDtype::kBf16;
  if (name == "fp8") return KvCacheDtype::kFp8;
  fail("--kv-cache-dtype ", name, ": not auto, bf16 or fp8");
}

std::optional<DType> compute_dtype_named(std::string_view name) {
  if (name == "auto") return std::nullopt;
  if (name == "float32" || name == "float") return DType::kF32;
  if (name == "bfloat16") return DType::kBF16;
  if (name == "float16" || name == "half") return DType::kF16;
  fail("--dtype ", name, ": not auto, float32, bfloat16 or float16");
}

Quantization quantization_named(std::string_view name, bool dummy_weights) {
  if (name == "auto") return {Fp8Weights::kCheckpoint, std::nullopt};
  if (name == "fp8") return {Fp8Weights::kAll, std::nullopt};
  if (name == "none") return {Fp8Weights::kNone, std::nullopt};
  const std::optional<QuantType> blocks = ggml_quant_type_named(name);
  PAGEDLM_CHECK(blocks, "--quantization ", name, ": not auto, fp8, none or a GGUF block format");
  PAGEDLM_CHECK(dummy_weights, "--quantization ", name,
                ": block formats make --dummy weights (Python: load_format='dummy'); a GGUF "
                "file keeps the blocks it holds");
  return {Fp8Weights::kCheckpoint, blocks};
}

EngineOptions resolve_options(EngineOptions options) {
  PAGEDLM_CHECK(options.page_size >= 1 && (options.page_size & (options.page_size - 1)) == 0,
                "page size must be a power of two, got ", options.page_size);
  const bool on_gpu = options.device == Device::kCuda;
  if (options.max_num_batched_tokens == 0) options.max_num_batched_tokens = on_gpu ? 16384 : 2048;
  PAGEDLM_CHECK(options.max_num_batched_tokens >= 1, "max_num_batched_tokens must be >= 1");
  PAGEDLM_CHECK(std::isfinite(options.target_itl_ms) &&
                    (options.target_itl_ms >= 0 || options.target_itl_ms == -1),
                "target_itl_ms must be >= 0 (0: off) or -1 (the device's default), got ",
                options.target_itl_ms);
  if (options.target_itl_ms == -1) options.target_itl_ms = on_gpu ? 0 : 200;
  PAGEDLM_CHECK(options.max_num_seqs >= 1, "max_num_seqs must be >= 1");
  // Before any weight is read: a model of many GB would otherwise load first.
  checked_compute_dtype(options.model_options(), options.device);
  if (options.prefetch_masks < 0) options.prefetch_masks = on_gpu ? 1 : 0;
  if (options.async_scheduling < 0) options.async_scheduling = on_gpu ? 1 : 0;
  if (on_gpu) {
    PAGEDLM_CHECK(cuda_device_available(), "the CUDA device was asked for but ",
                  "this build has no CUDA support or the machine has no GPU");
    PAGEDLM_CHECK(options.gpu_memory_fraction > 0.f && options.gpu_memory_fraction <= 1.f,
                  "gpu_memory_fraction must be in (0, 1], got ", options.gpu_memory_fraction);
  }
  PAGEDLM_CHECK(options.tensor_parallel_rank == 0 || on_gpu,
                "a tensor-parallel rank other than 0 runs on a GPU (on the CPU the ranks are ",
                "threads of one process)");
  return options;
}

ModelOptions EngineOptions::model_options() const {
  PAGEDLM_CHECK(!(cpu_q8_activations && cpu_fixed32_activations),
                "--cpu-q8-activations and --cpu-fixed32-activations are two ways to take the "
                "projections' inputs: choose one");
  ModelOptions model;
  if (cpu_q8_activations) model.cpu_int_activations = ops::IntActivations::kInt8;
  if (cpu_fixed32_activations) model.cpu_int_activations = ops::IntActivations::kFixed32;
  model.fp8_weights = fp8_weights;
  model.gguf_blocks_on_gpu = gguf_blocks_on_gpu;
  model.compute_dtype = compute_dtype;
  return model;
}

struct Engine::Launched {
  StepPlan plan;
  StepHandle handle;
  StepShape shape;
  bool want_logits = false;
  std::unique_ptr<ForwardStop> stop;
  std::vector<int32_t> mask_rows;  // per sequence: its row of the step's MaskBatch, -1 none
  double launch_ms = 0;            // host time of the executor's launch
  // Host clock: step() began, the plan was made.
  std::chrono::steady_clock::time_point begin, planned;
};

Engine::Engine(const Checkpoint& checkpoint, EngineOptions options)
    : seed_counter_(std::random_device{}()) {
  set_num_threads(options.threads);
  options_ = resolve_options(std::move(options));
  executor_ = std::make_unique<Executor>(checkpoint, options_);
  Worker& worker = executor_->worker();
  options_.num_pages = worker.num_pages();
  const ModelConfig& c = worker.model().config();
  const int32_t window = options_.free_pages_outside_window ? c.window_of_all_layers() : 0;
  SchedulerConfig sc;
  sc.page_size = options_.page_size;
  sc.num_pages = options_.num_pages;
  sc.window = window;
  sc.max_num_batched_tokens = options_.max_num_batched_tokens;
  sc.max_num_seqs = options_.max_num_seqs;
  sc.max_model_len = static_cast<int32_t>(c.max_position_embeddings);
  sc.enable_prefix_cache = options_.enable_prefix_cache;
  sc.eos_token_ids = c.eos_token_ids;
  scheduler_ = std::make_unique<Scheduler>(sc);
  // The prefetch takes half the engine's threads: the other half stay free for the engine
  // thread, which goes on with its step meanwhile, and the server's threads. On the H200's
  // 16-thread host a 256-sequence SmolLM2 step's masks (xgrammar 0.2.9) take ~0.35 ms on 8
  // threads, as on 15, and constrained decoding ran 2.7% faster than with 15 (three runs each,
  // docs/PERF.md).
  structured_ = std::make_unique<StructuredOutput>(
      c.vocab_size, options_.max_num_seqs, c.eos_token_ids,
      options_.prefetch_masks > 0 ? std::max(1, num_threads() / 2) : 0);
}

Engine::~Engine() {
  // A step still in flight (asynchronous scheduling) ends before the ranks that run it go.
  if (in_flight_) {
    try {
      static_cast<void>(executor_->collect(in_flight_->handle));
    } catch (const std::exception& e) {
      std::fprintf(stderr, "pagedlm: the step in flight at shutdown failed: %s\n", e.what());
    }
  }
}

const ModelConfig& Engine::config() const { return executor_->worker().model().config(); }

void Engine::use_on_this_thread() const {
  executor_->worker().make_current();
  set_num_threads(options_.threads);
}

int64_t Engine::add_request(Request request) {
  const int64_t vocab = config().vocab_size;
  PAGEDLM_CHECK(!request.prompt.empty(), "the prompt is empty");
  for (size_t i = 0; i < request.prompt.size(); ++i) {
    const int32_t t = request.prompt[i];
    PAGEDLM_CHECK(t >= 0 && t < vocab, "token id ", t, " at prompt position ", i,
                  " is out of range for a vocabulary of ", vocab);
  }
  validate_sampling(request.sampling);
  for (const auto& [token, bias] : request.sampling.logit_bias) {
    PAGEDLM_CHECK(token >= 0 && token < vocab, "logit_bias token id ", token,
                  " is out of range for a vocabulary of ", vocab);
  }
  request.id = next_request_id_++;
  const int64_t id = request.id;
  RequestOutput out;
  out.request_id = id;
  if (request.want_prompt_logits) {
    out.prompt_logits =
        Tensor::zeros(DType::kF32, {static_cast<int64_t>(request.prompt.size()), vocab});
  }
  LiveRequest live;
  live.seed = request.sampling.seed.value_or(seed_counter_++ * 0x9e3779b97f4a7c15ULL);
  live.sampling = request.sampling;
  // Validates lengths; nothing recorded if it throws.
  live.tokens = scheduler_->add(std::move(request));
  live.output = std::move(out);
  requests_.emplace(id, std::move(live));
  return id;
}

bool Engine::cancel(int64_t request_id) {
  if (!scheduler_->cancel(request_id)) return false;
  auto it = requests_.find(request_id);
  if (it != requests_.end()) it->second.output.reason = FinishReason::kCancelled;
  return true;
}

bool Engine::has_unfinished() const {
  return scheduler_->has_unfinished() || in_flight_ || deferred_;
}

StepTimeLimit Engine::step_limit() const {
  StepTimeLimit limit;
  // No limit before the first measured prefill: nothing to predict from yet.
  if (options_.target_itl_ms > 0 && step_cost_fit_.num_observations() > 0) {
    limit.max_ms = options_.target_itl_ms;
    limit.cost = step_cost_;
    limit.without_decodes = draining_ || prefill_always_bounded_;
  }
  return limit;
}

// Asynchronous scheduling. Step N is launched; if it can run ahead (can_run_ahead), the
// scheduler gives each of its sampling sequences a pending token (Scheduler::run_ahead) and plans
// step N + 1, which is launched at once where it can be (can_launch_ahead), its pending rows
// taking N's sampled ids on the device; then N is collected and its tokens resolve the pending
// ones (Scheduler::resolve), stops checked there: a sequence that stopped at N is finished, and
// the token N + 1 computes for it is discarded when N + 1 is collected. Where N + 1 cannot be
// launched ahead, it is launched right after N is collected (the same pending rows). Either
// way N + 1 stays in flight into the next step(), which plans N + 2 before collecting it.
// A launch that does not return early (Worker::launch_returns_early: a prefill, a CPU step)
// would hold N's tokens back until N + 1 is nearly done, so such an N + 1 is deferred: launched
// first thing in the next step(), once N's events are out (the device idles only while the
// caller takes them).
std::vector<RequestEvent> Engine::step() {
  using Clock = std::chrono::steady_clock;
  const Clock::time_point begin = Clock::now();
  if (!in_flight_) {
    if (deferred_) {
      const Deferred deferred = std::move(*deferred_);
      deferred_.reset();
      in_flight_ = launch_step(deferred.plan, &deferred.previous);
    } else {
      StepPlan plan = scheduler_->schedule(step_limit());
      if (plan.empty()) return {};
      in_flight_ = launch_step(std::move(plan), nullptr);
    }
    in_flight_->begin = begin;
  }
  std::unique_ptr<Launched> current = std::move(in_flight_);
  const bool ahead = can_run_ahead(*current);
  std::optional<StepPlan> next;
  if (ahead) {
    scheduler_->run_ahead(current->plan);
    const Clock::time_point next_begin = Clock::now();
    StepPlan plan = scheduler_->schedule(step_limit());
    if (!plan.empty()) {
      if (!executor_->worker().launch_returns_early(plan, wants_logits(plan))) {
        deferred_ = Deferred{std::move(plan), current->plan};
      } else if (can_launch_ahead(plan)) {
        in_flight_ = launch_step(std::move(plan), &current->plan);
        in_flight_->begin = next_begin;
      } else {
        next = std::move(plan);
      }
    }
  }
  StepResult result = executor_->collect(current->handle);
  std::vector<RequestEvent> events = finish_step(*current, result, ahead);
  if (next) {
    const Clock::time_point next_begin = Clock::now();
    in_flight_ = launch_step(std::move(*next), &current->plan);
    in_flight_->begin = next_begin;
  }
  return events;
}

bool Engine::can_run_ahead(const Launched& step) const {
  // Tensor-parallel ranks run every step in lockstep, collected before the next (the GPU ranks'
  // processes and the CPU's rank threads). A step that may be left midway (set_abandon_check,
  // on a worker that honours it) must end before the next is planned. Prompt logits leave the
  // device for the host to copy into the output.
  if (options_.async_scheduling <= 0 || options_.tensor_parallel_size > 1 || step.want_logits ||
      (abandon_ && executor_->worker().leaves_steps_midway())) {
    return false;
  }
  // A grammar's mask for the next token depends on this one (the step after is planned once
  // it is accepted); logprobs are computed beside the token and read with it.
  // (A request whose output was taken since it finished is gone.)
  for (const int64_t id : step.plan.request_ids) {
    const auto it = requests_.find(id);
    if (it != requests_.end() && (structured_->has(id) || it->second.logprobs_top_k >= 0)) {
      return false;
    }
  }
  return true;
}

bool Engine::wants_logits(const StepPlan& plan) const {
  // Logits leave the GPU only for steps that hold prompt positions someone asked for: bias,
  // penalties and logprobs are computed on the device (the CPU's logits are the host's anyway).
  for (int32_t b = 0; b < plan.num_seqs(); ++b) {
    const auto it = requests_.find(plan.request_ids[b]);
    if (it == requests_.end()) continue;
    const RequestOutput& out = it->second.output;
    if (!out.prompt_logits.defined() || out.prompt_logits.numel() == 0) continue;
    for (int32_t j = plan.logits_indptr[b]; j < plan.logits_indptr[b + 1]; ++j) {
      if (plan.positions[plan.logits_rows[j]] < out.prompt_logits.dim(0)) return true;
    }
  }
  return false;
}

bool Engine::can_launch_ahead(const StepPlan& plan) const {
  // Its grammar masks are filled once the step in flight is collected (the prefetch it starts).
  for (const int64_t id : plan.request_ids) {
    if (structured_->has(id)) return false;
  }
  return true;
}

std::unique_ptr<Engine::Launched> Engine::launch_step(StepPlan plan, const StepPlan* previous) {
  auto step = std::make_unique<Launched>();
  step->planned = std::chrono::steady_clock::now();
  step->plan = std::move(plan);
  const StepPlan& p = step->plan;
  ++num_steps_;
  step->shape = shape_of(p);
  const int32_t B = p.num_seqs();
  step->want_logits = wants_logits(p);
  // A request of a plan made ahead may be gone by its launch (finished by the step before and
  // its output taken, or cancelled): its row runs greedy and its token is discarded.
  static const SamplingParams kGone = [] {
    SamplingParams greedy;
    greedy.temperature = 0.f;
    return greedy;
  }();
  StepInputs inputs;
  inputs.sampling.resize(B);
  for (int32_t b = 0; b < B; ++b) {
    const auto it = requests_.find(p.request_ids[b]);
    if (it == requests_.end()) {
      inputs.sampling[b] = {&kGone, 0, 0, /*mask_row=*/-1, p.request_ids[b], nullptr, -1};
      continue;
    }
    const LiveRequest& r = it->second;
    inputs.sampling[b] = {&r.sampling,     r.seed,           int64_t{r.tokens->num_outputs()},
                          /*mask_row=*/-1, p.request_ids[b], r.tokens.get(),
                          r.logprobs_top_k};
  }
  inputs.want_logits = step->want_logits;
  // The rows of the sequences this step samples under a grammar; the worker calls the batch's
  // finish while the device runs the forward pass (the CPU: after it), then samples under them.
  last_mask_ms_ = 0;
  inputs.masks = structured_->launch(p, inputs.sampling, step->mask_rows);
  if (abandon_) inputs.stop = (step->stop = std::make_unique<ForwardStop>(abandon_)).get();
  // Pending rows (decodes planned ahead) take the previous step's sampled ids: each sequence's
  // last logits row there.
  if (std::find(p.token_ids.begin(), p.token_ids.end(), kPendingToken) != p.token_ids.end()) {
    PAGEDLM_CHECK(previous != nullptr, "a plan with pending tokens needs the step before it");
    std::unordered_map<int64_t, int32_t> source_row;
    for (int32_t b = 0; b < previous->num_seqs(); ++b) {
      if (previous->samples[b])
        source_row[previous->request_ids[b]] = previous->logits_indptr[b + 1] - 1;
    }
    for (int32_t b = 0; b < B; ++b) {
      for (int32_t row = p.q_indptr[b]; row < p.q_indptr[b + 1]; ++row) {
        if (p.token_ids[row] != kPendingToken) continue;
        const auto it = source_row.find(p.request_ids[b]);
        PAGEDLM_CHECK(it != source_row.end(), "request ", p.request_ids[b],
                      " has a pending token the step before did not sample");
        inputs.pending_rows.push_back({row, it->second});
      }
    }
  }
  const auto launch_begin = std::chrono::steady_clock::now();
  step->handle = executor_->launch(p, std::move(inputs));
  step->launch_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - launch_begin)
          .count();
  return step;
}

std::vector<RequestEvent> Engine::finish_step(Launched& step, StepResult& result, bool ran_ahead) {
  using Clock = std::chrono::steady_clock;
  const StepPlan& plan = step.plan;
  if (!result.completed) return abandon_step(plan);
  last_step_ = step.shape;
  last_mask_ms_ = result.timings.mask_ms;
  last_mask_hidden_ = result.timings.mask_hidden;
  std::vector<int32_t>& sampled = result.sampled;
  const Tensor& logits = result.logits;
  last_step_.gpu_ms = result.timings.gpu_ms;
  last_step_.gap_gpu_ms = result.timings.gap_gpu_ms;
  last_step_.masked_forward_gpu_ms = result.timings.masked_forward_gpu_ms;
  last_step_.masked_sampler_gpu_ms = result.timings.masked_sampler_gpu_ms;
  const Clock::time_point wait_begin = result.timings.wait_begin;
  const Clock::time_point wait_end = result.timings.wait_end;
  // A request may be gone (its output taken) when this step ran behind the one that finished it:
  // its rows are discarded.
  std::vector<LiveRequest*> live(plan.num_seqs(), nullptr);
  for (int32_t b = 0; b < plan.num_seqs(); ++b) {
    if (auto it = requests_.find(plan.request_ids[b]); it != requests_.end()) live[b] = &it->second;
  }

  // Sampled tokens advance their grammars; a token a grammar refuses becomes EOS.
  structured_->collect(plan, step.mask_rows, sampled);

  const int64_t vocab = config().vocab_size;
  std::map<int64_t, RequestEvent> logprob_events;
  for (int32_t b = 0; b < plan.num_seqs(); ++b) {
    const int64_t id = plan.request_ids[b];
    if (!live[b]) continue;
    RequestOutput& out = live[b]->output;
    out.num_cached_tokens = scheduler_->num_cached_tokens(id);
    if (live[b]->logprobs_top_k >= 0 && sampled[b] >= 0 && !result.logprobs.empty()) {
      // The worker's numbers are those of the token it drew (the engine replaces it only when a
      // grammar refuses it, which ends the output).
      RequestEvent& e = logprob_events[id];
      e.logprob = result.logprobs[b].logprob;
      if (live[b]->logprobs_top_k > 0) e.top_logprobs = std::move(result.logprobs[b].top);
    }
    if (!out.prompt_logits.defined() || out.prompt_logits.numel() == 0) continue;
    const int64_t prompt_len = out.prompt_logits.dim(0);
    for (int32_t j = plan.logits_indptr[b]; j < plan.logits_indptr[b + 1]; ++j) {
      const int32_t pos = plan.positions[plan.logits_rows[j]];
      if (pos < prompt_len) {
        std::memcpy(out.prompt_logits.data<float>() + pos * vocab, logits.data<float>() + j * vocab,
                    vocab * sizeof(float));
      }
    }
  }

  std::vector<RequestEvent> events;
  const std::vector<SeqUpdate> updates =
      ran_ahead ? scheduler_->resolve(plan, sampled) : scheduler_->update(plan, sampled);
  for (const SeqUpdate& u : updates) {
    if (u.reported) continue;  // finished by the step before: this step's token is discarded
    // Cancelled and its output taken while this step ran (after the step before returned).
    const auto live_it = requests_.find(u.request_id);
    if (live_it == requests_.end()) continue;
    if (u.finished) live_it->second.output.reason = u.reason;
    RequestEvent event;
    if (auto lp = logprob_events.find(u.request_id); lp != logprob_events.end() && u.token >= 0) {
      event = std::move(lp->second);
    }
    event.request_id = u.request_id;
    event.token = u.token;
    event.finished = u.finished;
    event.reason = u.reason;
    events.push_back(std::move(event));
  }
  structured_->prefetch(plan, sampled, [&](int32_t b) {
    return live[b] != nullptr && live[b]->output.reason == FinishReason::kNone;
  });
  const auto ms = [](Clock::duration d) {
    return std::chrono::duration<double, std::milli>(d).count();
  };
  last_step_.schedule_ms = ms(step.planned - step.begin);
  last_step_.prepare_ms = ms(wait_begin - step.planned);
  last_step_.wait_ms = ms(wait_end - wait_begin);
  const Clock::time_point end = Clock::now();
  last_step_.finish_ms = ms(end - wait_end);
  last_step_.launch_ms = step.launch_ms;
  // Steps that prefill teach the cost model, where a limit will use it (not on the GPU by
  // default); decode steps alone cannot tell the per-token cost from the fixed one (StepCostFit).
  // A step that ran ahead overlapped the next one's planning and launch: its wall time is not
  // its own.
  if (options_.target_itl_ms > 0 && !ran_ahead && last_step_.num_tokens > last_step_.num_seqs) {
    step_cost_fit_.observe(last_step_.num_tokens, last_step_.attention_pairs, ms(end - step.begin));
    step_cost_ = step_cost_fit_.estimate();
  }
  return events;
}

std::vector<RequestEvent> Engine::abandon_step(const StepPlan& plan) {
  // The prefetch may still be filling masks with these requests' matchers.
  structured_->wait();
  for (const int64_t id : plan.request_ids) {
    requests_.at(id).output.num_cached_tokens = scheduler_->num_cached_tokens(id);
  }
  std::vector<RequestEvent> events;
  for (const SeqUpdate& u : scheduler_->abandon(plan)) {
    requests_.at(u.request_id).output.reason = u.reason;
    RequestEvent& event = events.emplace_back();
    event.request_id = u.request_id;
    event.finished = true;
    event.reason = u.reason;
  }
  return events;
}

double Engine::last_mask_prefetch_ms() const { return structured_->last_prefetch_ms(); }

int32_t Engine::last_prefetched_masks() const { return structured_->last_prefetched_masks(); }

std::vector<RequestOutput> Engine::generate(std::vector<Request> requests) {
  std::vector<int64_t> ids;
  ids.reserve(requests.size());
  for (Request& r : requests) ids.push_back(add_request(std::move(r)));
  while (has_unfinished()) step();
  std::vector<RequestOutput> outputs;
  outputs.reserve(ids.size());
  for (int64_t id : ids) outputs.push_back(take_output(id));
  return outputs;
}

RequestOutput Engine::take_output(int64_t request_id) {
  auto it = requests_.find(request_id);
  PAGEDLM_CHECK(it != requests_.end(), "unknown request id ", request_id);
  PAGEDLM_CHECK(it->second.output.reason != FinishReason::kNone, "request ", request_id,
                " has not finished");
  RequestOutput out = std::move(it->second.output);
  const RequestTokens& tokens = *it->second.tokens;
  out.prompt.assign(tokens.prompt().begin(), tokens.prompt().end());
  out.tokens.assign(tokens.outputs().begin(), tokens.outputs().end());
  requests_.erase(it);
  structured_->remove(request_id);
  return out;
}

SchedulerStats Engine::stats() const { return scheduler_->stats(); }

int64_t Engine::cascade_steps() const { return executor_->worker().cascade_steps(); }

int64_t Engine::logits_downloads() const { return executor_->worker().logits_downloads(); }

std::vector<SequenceView> Engine::sequence_map() const { return scheduler_->sequence_map(); }

std::vector<CachedPageView> Engine::cached_pages(int32_t max_pages) const {
  return scheduler_->cached_pages(max_pages);
}

int64_t Engine::expert_bytes_read() const {
  return executor_->worker().model().expert_bytes_read() * options_.tensor_parallel_size;
}

int64_t Engine::step_weight_bytes() const {
  return executor_->worker().model().step_weight_bytes() * options_.tensor_parallel_size;
}

std::map<std::string, int64_t> Engine::step_weight_bytes_by_format() const {
  std::map<std::string, int64_t> by_format =
      executor_->worker().model().step_weight_bytes_by_format();
  for (auto& [format, bytes] : by_format) bytes *= options_.tensor_parallel_size;
  return by_format;
}

void Engine::enable_logprobs(int64_t request_id, int32_t top_k) {
  auto it = requests_.find(request_id);
  PAGEDLM_CHECK(it != requests_.end(), "unknown request id ", request_id);
  PAGEDLM_CHECK(top_k >= 0, "top logprobs must be >= 0, got ", top_k);
  PAGEDLM_CHECK(top_k <= ops::kMaxTopLogprobs, "top logprobs must be at most ",
                ops::kMaxTopLogprobs, ", got ", top_k);
  it->second.logprobs_top_k = top_k;
}

void Engine::set_grammar(int64_t request_id,
                         std::shared_ptr<const grammar::CompiledGrammar> compiled) {
  auto it = requests_.find(request_id);
  PAGEDLM_CHECK(it != requests_.end(), "unknown request id ", request_id);
  PAGEDLM_CHECK(it->second.tokens->num_outputs() == 0, "request ", request_id,
                " has already generated tokens; a grammar must be set before its first step");
  // After the grammar's stop token the output would run on unconstrained.
  PAGEDLM_CHECK(!it->second.sampling.ignore_eos, "a grammar cannot be combined with ignore_eos");
  structured_->add(request_id, std::move(compiled), it->second.tokens);
}

}  // namespace pagedlm
