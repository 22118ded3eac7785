#include "pagedlm/engine/worker.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/cpu_ranks.h"
#include "pagedlm/engine/cuda_runner.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {
namespace {

// Whether a request's logits are changed before sampling.
bool adjusts_logits(const SamplingParams& p) {
  return p.presence_penalty != 0.f || p.frequency_penalty != 0.f || p.repetition_penalty != 1.f ||
         !p.logit_bias.empty();
}

// The block of a MaskRows is whole pages, so that pinning it (cudaHostRegister) pins nothing else.
constexpr size_t kMaskPageBytes = 4096;

}  // namespace

MaskRows::MaskRows(int32_t num_rows, int32_t words) : num_rows_(num_rows), words_(words) {
  PAGEDLM_CHECK(num_rows >= 1 && words >= 1, "a mask block needs rows and words, got ", num_rows,
                " x ", words);
  // Not zeroed: pages are touched only once masks are written.
  data_.reset(static_cast<int32_t*>(std::aligned_alloc(kMaskPageBytes, bytes())));
  PAGEDLM_CHECK(data_ != nullptr, "out of memory for ", bytes(), " bytes of token masks");
}

size_t MaskRows::bytes() const {
  const size_t used = sizeof(int32_t) * static_cast<size_t>(num_rows_) * words_;
  return (used + kMaskPageBytes - 1) / kMaskPageBytes * kMaskPageBytes;
}

void MaskRows::Free::operator()(int32_t* p) const { std::free(p); }

DType kv_cache_dtype(const EngineOptions& options, DType compute) {
  switch (options.kv_cache_dtype) {
    case KvCacheDtype::kAuto:
      return compute;
    case KvCacheDtype::kBf16:
      // The GPU's own dtype; on the CPU half the bytes of its f32 cache, which f32 compute
      // reads widened.
      ops::check_kv_cache_dtype(DType::kBF16, compute, options.device, "--kv-cache-dtype bf16");
      return DType::kBF16;
    case KvCacheDtype::kFp8:
      PAGEDLM_CHECK(options.device == Device::kCuda,
                    "--kv-cache-dtype fp8 is GPU only (the CPU's attention reads f32 and bf16 "
                    "caches)");
      ops::check_kv_cache_dtype(DType::kF8E4M3, compute, options.device, "--kv-cache-dtype fp8");
      return DType::kF8E4M3;
  }
  return compute;
}

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

void HeldStep::require_room() const {
  PAGEDLM_CHECK(results_.size() < 2, "two steps are in flight: collect one before launching");
}

StepHandle HeldStep::hold(StepResult result) {
  require_room();
  results_.emplace_back(++launched_, std::move(result));
  return {launched_};
}

StepResult HeldStep::take(StepHandle handle) {
  PAGEDLM_CHECK(!results_.empty() && handle.id == results_.front().first, "collect: step ",
                handle.id, " is not the oldest in flight");
  StepResult result = std::move(results_.front().second);
  results_.pop_front();
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
  const DType kv_dtype = kv_cache_dtype(options, rank.model->compute_dtype());
  const int32_t fits = kv_cache_pages(options, c, tp, kv_dtype);
  rank.num_pages = agree_num_pages ? agree_num_pages(fits) : fits;
  // Each rank's cache holds its share of the kv heads in the same pages (an e4m3 cache's
  // per-tensor scales are the same on every rank).
  rank.kv_cache = std::make_unique<PagedKvCache>(
      c.num_layers, rank.num_pages, options.page_size, rank_dims(c, tp).kv_heads, c.head_dim,
      options.device, kv_dtype,
      kv_dtype == DType::kF8E4M3 ? PagedKvCache::checkpoint_scales(checkpoint, c.num_layers)
                                 : std::vector<ops::KvCacheScales>{});
  if (rank.runner) {
    rank.runner->set_kv_cache(rank.kv_cache.get());
    rank.runner->warm_up();
  }
  return rank;
}

std::unique_ptr<Worker> make_worker(RankParts parts, CpuRanks* peers) {
  if (parts.runner) {
    PAGEDLM_CHECK(peers == nullptr, "a GPU rank's peers are processes, not threads");
    return std::make_unique<CudaWorker>(std::move(parts));
  }
  return std::make_unique<CpuWorker>(std::move(parts), peers);
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

CpuWorker::CpuWorker(RankParts parts, CpuRanks* peers)
    : model_(std::move(parts.model)),
      kv_cache_(std::move(parts.kv_cache)),
      num_pages_(parts.num_pages),
      peers_(peers) {}

CpuWorker::~CpuWorker() = default;

bool CpuWorker::forward(const StepPlan& plan, const ForwardInputs& inputs, const Tensor& logits) {
  kv_cache_->bind(plan);
  return model_->forward(inputs, *kv_cache_, logits);
}

StepHandle CpuWorker::launch(const StepPlan& plan, StepInputs step) {
  held_.require_room();
  StepResult result;
  const int32_t B = plan.num_seqs();
  const int64_t vocab = model_->config().vocab_size;
  const auto num_rows = static_cast<int64_t>(plan.logits_rows.size());
  // Pending rows take the last step's tokens here, as the GPU's take them on the device; a
  // sequence's RequestTokens that end with its pending token are read, for penalties, through a
  // copy that holds its value.
  std::vector<int32_t> token_ids = plan.token_ids;
  std::vector<RequestTokens> resolved_tokens;
  resolved_tokens.reserve(step.pending_rows.size());
  for (const PendingRow& p : step.pending_rows) {
    PAGEDLM_CHECK(p.row >= 0 && p.row < plan.num_tokens() && token_ids[p.row] == kPendingToken &&
                      p.source_row >= 0 &&
                      p.source_row < static_cast<int32_t>(last_row_tokens_.size()) &&
                      last_row_tokens_[p.source_row] >= 0,
                  "pending row ", p.row, " has no token of the last step's row ", p.source_row);
    token_ids[p.row] = last_row_tokens_[p.source_row];
    const auto b =
        static_cast<int32_t>(std::upper_bound(plan.q_indptr.begin(), plan.q_indptr.end(), p.row) -
                             plan.q_indptr.begin() - 1);
    SeqSampling& seq = step.sampling[b];
    if (seq.tokens != nullptr && seq.tokens->size() > 0 &&
        seq.tokens->all.back() == kPendingToken) {
      resolved_tokens.push_back(*seq.tokens);
      resolved_tokens.back().all.back() = token_ids[p.row];
      seq.tokens = &resolved_tokens.back();
    }
  }
  ForwardInputs inputs{Tensor::from_i32(token_ids, {plan.num_tokens()}),
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
    PAGEDLM_CHECK(step.masks.rows && step.masks.finish, "masked sequences need their masks");
    const auto t0 = std::chrono::steady_clock::now();
    step.masks.finish();
    result.timings.mask_ms =
        std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
  }
  result.sampled.assign(B, -1);
  for (int32_t b = 0; b < B && !step.sampling.empty(); ++b) {
    if (plan.samples[b] && plan.logits_indptr[b + 1] > plan.logits_indptr[b]) {
      const SeqSampling& seq = step.sampling[b];
      const float* row = result.logits.data<float>() + (plan.logits_indptr[b + 1] - 1) * vocab;
      const int32_t* mask = seq.mask_row >= 0 ? step.masks.rows->row(seq.mask_row) : nullptr;
      result.sampled[b] = sample_on_host(row, vocab, seq, mask);
    }
  }
  last_row_tokens_.assign(num_rows, -1);
  for (int32_t b = 0; b < B; ++b) {
    if (result.sampled[b] >= 0) last_row_tokens_[plan.logits_indptr[b + 1] - 1] = result.sampled[b];
  }
  fill_logprobs(plan, step.sampling, result);
  // The forward ran inline: no wait.
  result.timings.wait_begin = result.timings.wait_end = std::chrono::steady_clock::now();
  return held_.hold(std::move(result));
}

void CpuWorker::fill_logprobs(const StepPlan& plan, const std::vector<SeqSampling>& sampling,
                              StepResult& result) {
  const int32_t B = plan.num_seqs();
  // ops::sampled_logprobs over the logits rows, each sequence asking on its last row (the GPU
  // runs the same on the device); top_k -1 skips a row.
  const int64_t num_rows = result.logits.dim(0);
  std::vector<int32_t> tokens(num_rows, 0), top_k(num_rows, -1);
  bool any = false;
  for (int32_t b = 0; b < B && !sampling.empty(); ++b) {
    if (sampling[b].logprobs_top_k < 0 || result.sampled[b] < 0) continue;
    const int32_t row = plan.logits_indptr[b + 1] - 1;
    tokens[row] = result.sampled[b];
    top_k[row] = sampling[b].logprobs_top_k;
    any = true;
  }
  if (!any) return;
  std::vector<int32_t> top_ids(num_rows * ops::kMaxTopLogprobs);
  std::vector<float> logprob(num_rows), top_logprobs(num_rows * ops::kMaxTopLogprobs);
  ops::sampled_logprobs(result.logits, {tokens.data(), top_k.data(), logprob.data(), top_ids.data(),
                                        top_logprobs.data()});
  result.logprobs.assign(B, {});
  for (int32_t b = 0; b < B; ++b) {
    const int32_t row = plan.logits_indptr[b + 1] - 1;
    if (row < 0 || top_k[row] < 0) continue;
    SampledLogprobs& out = result.logprobs[b];
    out.logprob = logprob[row];
    const int64_t shown = std::min<int64_t>(std::max(top_k[row], 1), result.logits.dim(1));
    for (int64_t j = 0; j < shown; ++j) {
      out.top.emplace_back(top_ids[row * ops::kMaxTopLogprobs + j],
                           top_logprobs[row * ops::kMaxTopLogprobs + j]);
    }
  }
}

StepResult CpuWorker::collect(StepHandle handle) { return held_.take(handle); }

}  // namespace pagedlm
