#include "pagedlm/engine/worker.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/cpu_ranks.h"
#include "pagedlm/engine/cuda_runner.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {
namespace {

// Whether a request's logits are changed before sampling.
bool adjusts_logits(const SamplingParams& p) {
  return p.presence_penalty != 0.f || p.frequency_penalty != 0.f || p.repetition_penalty != 1.f ||
         !p.logit_bias.empty();
}

}  // namespace

int32_t kv_cache_pages(const EngineOptions& options, const ModelConfig& config, TensorParallel tp,
                       DType dtype) {
  if (options.num_pages > 0) return options.num_pages;
  const int64_t page_bytes = PagedKvCache::bytes_per_page(
      config.num_layers, options.page_size, rank_dims(config, tp).kv_heads, config.head_dim, dtype);
  const int64_t kv_bytes =
      options.device == Device::kCuda
          ? static_cast<int64_t>(static_cast<double>(CudaStepRunner::free_memory_bytes()) *
                                 options.gpu_memory_fraction)
          : options.kv_cache_bytes / tp.size;  // the CPU's ranks share the host's memory
  // With a window the scheduler reserves the cache's last page as the null page (never handed
  // out, zeroed on the GPU), so the count covers it and one page to use.
  const bool window = options.free_pages_outside_window && config.window_of_all_layers() > 0;
  const int64_t min_pages = window ? 2 : 1;
  return static_cast<int32_t>(
      std::clamp<int64_t>(kv_bytes / page_bytes, min_pages, int64_t{1} << 30));
}

void HeldStep::require_none() const {
  PAGEDLM_CHECK(!result_, "a step is in flight: collect it before launching the next");
}

StepHandle HeldStep::hold(StepResult result) {
  require_none();
  result_ = std::move(result);
  return {++launched_};
}

StepResult HeldStep::take(StepHandle handle) {
  PAGEDLM_CHECK(result_ && handle.id == launched_, "collect: step ", handle.id,
                " is not in flight");
  StepResult result = std::move(*result_);
  result_.reset();
  return result;
}

RankParts::RankParts() = default;
RankParts::RankParts(RankParts&&) noexcept = default;
RankParts& RankParts::operator=(RankParts&&) noexcept = default;
RankParts::~RankParts() = default;

RankParts build_rank(const Checkpoint& checkpoint, const EngineOptions& options, TensorParallel tp,
                     ops::Communicator* comm,
                     const std::function<int32_t(int32_t)>& agree_num_pages) {
  RankParts rank;
  rank.model = create_model(checkpoint, options.device, tp, comm, options.model_options());
  const ModelConfig& c = rank.model->config();
  if (options.device == Device::kCuda) {
    rank.runner = std::make_unique<CudaStepRunner>(*rank.model, options, c.max_position_embeddings);
  }
  const int32_t fits = kv_cache_pages(options, c, tp, rank.model->compute_dtype());
  rank.num_pages = agree_num_pages ? agree_num_pages(fits) : fits;
  // Each rank's cache holds its share of the kv heads in the same pages.
  rank.kv_cache = std::make_unique<PagedKvCache>(c.num_layers, rank.num_pages, options.page_size,
                                                 rank_dims(c, tp).kv_heads, c.head_dim,
                                                 options.device, rank.model->compute_dtype());
  if (rank.runner) {
    rank.runner->set_kv_cache(rank.kv_cache.get());
    rank.runner->warm_up();
  }
  return rank;
}

std::unique_ptr<Worker> make_worker(RankParts parts, const EngineOptions& options,
                                    CpuRanks* peers) {
  if (parts.runner) {
    PAGEDLM_CHECK(peers == nullptr, "a GPU rank's peers are processes, not threads");
    return std::make_unique<CudaWorker>(std::move(parts), options);
  }
  return std::make_unique<CpuWorker>(std::move(parts), options, peers);
}

int32_t sample_on_host(const float* row, int64_t vocab, const SeqSampling& seq,
                       const int32_t* mask) {
  const SamplingParams& params = *seq.params;
  if (!adjusts_logits(params)) {
    return ops::sample_token(row, vocab, params, seq.seed, seq.step, mask);
  }
  PAGEDLM_CHECK(seq.tokens != nullptr, "penalties need the sequence's tokens");
  const std::span<const int32_t> generated = seq.tokens->outputs();
  // vLLM's order (ops::adjust_logits, the same operations as the GPU sampler's): the bias, then
  // the repetition penalty (prompt and output), then presence and frequency (output only).
  std::vector<float> penalized(row, row + vocab);
  std::vector<int32_t> bias_tokens, counts(vocab, 0), prompt_seen((vocab + 31) / 32, 0);
  std::vector<float> bias_values;
  for (const auto& [token, bias] : params.logit_bias) {
    bias_tokens.push_back(token);
    bias_values.push_back(bias);
  }
  for (const int32_t t : seq.tokens->prompt()) {
    prompt_seen[t >> 5] |= static_cast<int32_t>(1u << (static_cast<uint32_t>(t) & 31));
  }
  for (const int32_t t : generated) ++counts[t];
  ops::adjust_logits(penalized.data(), vocab, bias_tokens.data(), bias_values.data(),
                     static_cast<int64_t>(bias_tokens.size()), params.repetition_penalty,
                     params.presence_penalty, params.frequency_penalty, counts.data(),
                     prompt_seen.data());
  return ops::sample_token(penalized.data(), vocab, params, seq.seed, seq.step, mask);
}

CpuWorker::CpuWorker(RankParts parts, const EngineOptions& options, CpuRanks* peers)
    : model_(std::move(parts.model)),
      kv_cache_(std::move(parts.kv_cache)),
      num_pages_(parts.num_pages),
      peers_(peers),
      mask_words_(grammar::bitmask_words(model_->config().vocab_size)) {
  // Not zeroed: pages are touched only once masks are written.
  mask_rows_.reset(new int32_t[static_cast<size_t>(2 * options.max_num_seqs) * mask_words_]);
}

CpuWorker::~CpuWorker() = default;

bool CpuWorker::forward(const StepPlan& plan, const ForwardInputs& inputs, const Tensor& logits) {
  kv_cache_->bind(plan);
  return model_->forward(inputs, *kv_cache_, logits);
}

StepHandle CpuWorker::launch(const StepPlan& plan, StepInputs step) {
  held_.require_none();
  StepResult result;
  const int32_t B = plan.num_seqs();
  const int64_t vocab = model_->config().vocab_size;
  const auto num_rows = static_cast<int64_t>(plan.logits_rows.size());
  ForwardInputs inputs{Tensor::from_i32(plan.token_ids, {plan.num_tokens()}),
                       Tensor::from_i32(plan.logits_rows, {num_rows})};
  inputs.stop = step.stop;
  result.logits = Tensor::empty(DType::kF32, {num_rows, vocab});
  bool finished = false;
  if (peers_) {
    peers_->forward(plan, inputs, [&] { finished = forward(plan, inputs, result.logits); });
  } else {
    finished = forward(plan, inputs, result.logits);
  }
  if (!finished) {
    StepResult left;
    left.completed = false;
    return held_.hold(std::move(left));
  }
  const bool masked = std::any_of(step.sampling.begin(), step.sampling.end(),
                                  [](const SeqSampling& s) { return s.mask_row >= 0; });
  if (masked) {
    const auto t0 = std::chrono::steady_clock::now();
    step.finish_masks();
    result.timings.mask_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  result.sampled.assign(B, -1);
  for (int32_t b = 0; b < B && !step.sampling.empty(); ++b) {
    if (plan.samples[b] && plan.logits_indptr[b + 1] > plan.logits_indptr[b]) {
      const SeqSampling& seq = step.sampling[b];
      const float* row = result.logits.data<float>() + (plan.logits_indptr[b + 1] - 1) * vocab;
      const int32_t* mask =
          seq.mask_row >= 0 ? mask_rows_.get() + int64_t{seq.mask_row} * mask_words_ : nullptr;
      result.sampled[b] = sample_on_host(row, vocab, seq, mask);
    }
  }
  // The forward ran inline: no wait.
  result.timings.wait_begin = result.timings.wait_end = std::chrono::steady_clock::now();
  return held_.hold(std::move(result));
}

StepResult CpuWorker::collect(StepHandle handle) { return held_.take(handle); }

}  // namespace pagedlm
