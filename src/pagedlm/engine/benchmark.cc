#include "pagedlm/engine/benchmark.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <numeric>
#include <random>
#include <unordered_map>

#include "pagedlm/core/dtype.h"
#include "pagedlm/engine/worker.h"
#include "pagedlm/model/model.h"

namespace pagedlm {

namespace {

using Clock = std::chrono::steady_clock;

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const double idx = p / 100.0 * static_cast<double>(v.size() - 1);
  const size_t lo = static_cast<size_t>(idx), hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (idx - static_cast<double>(lo));
}

// The ids a workload draws, away from the specials at the start and end of the vocabulary:
// [10, vocab - 10]. Variant k > 0 maps them through t -> 10 + (a (t - 10) + b) mod n, a bijection
// of that range (a coprime with n), the same for every id of the run.
class TokenDraw {
 public:
  TokenDraw(int64_t vocab, uint64_t variant) : hi_(std::max<int64_t>(10, vocab - 10)) {
    const int64_t n = hi_ - 10 + 1;
    if (variant == 0 || n < 3) return;
    a_ = static_cast<int64_t>((variant * 2654435761ULL) % static_cast<uint64_t>(n));
    while (a_ < 2 || std::gcd(a_, n) != 1) a_ = a_ + 1 < n ? a_ + 1 : 1;
    b_ = static_cast<int64_t>((variant * 40503ULL) % static_cast<uint64_t>(n));
  }

  std::vector<int32_t> operator()(std::mt19937_64& rng, int32_t count) const {
    std::uniform_int_distribution<int32_t> dist(10, static_cast<int32_t>(hi_));
    const int64_t n = hi_ - 10 + 1;
    std::vector<int32_t> ids(count);
    for (int32_t& t : ids) t = static_cast<int32_t>(10 + (a_ * (dist(rng) - 10) + b_) % n);
    return ids;
  }

 private:
  int64_t hi_;
  int64_t a_ = 1, b_ = 0;
};

int32_t uniform(std::mt19937_64& rng, int32_t lo, int32_t hi) {
  return std::uniform_int_distribution<int32_t>(lo, std::max(lo, hi))(rng);
}

Request make_request(std::vector<int32_t> prompt, int32_t max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  return r;
}

// Bytes and FLOPs of the model that do not depend on the step's contents. The experts of a
// mixture of experts are not among the weights read every step: a step reads those it activated
// (CausalLM::expert_bytes_read), and each token computes with its k.
struct ModelCosts {
  double layer_params = 0;  // weights every token goes through (attention, dense MLPs, routers)
  double expert_params_per_token = 0;  // the k experts' weights each token multiplies with
  double head_params = 0;              // lm_head: once per logits row
  double weight_bytes = 0;  // layer and head weights, read once per step (as the model stores them)
  double kv_bytes_per_token = 0;
  double attention_flops_per_pair = 0;  // per (query, key) pair over all layers and heads

  // kv_element_bytes: the KV cache's element size as stored (kv_cache_dtype: e4m3 pages and the
  // CPU's bf16 pages read fewer bytes than the compute dtype); weight_bytes: the step's weights
  // as stored (Engine::step_weight_bytes).
  ModelCosts(const ModelConfig& c, double kv_element_bytes, double step_weight_bytes)
      : weight_bytes(step_weight_bytes) {
    const double D = static_cast<double>(c.hidden_size), d = static_cast<double>(c.head_dim);
    const double q = static_cast<double>(c.num_heads) * d,
                 kv = static_cast<double>(c.num_kv_heads) * d;
    const double layers = static_cast<double>(c.num_layers);
    for (const LayerSpec& layer : c.layers) {
      layer_params += D * (q + 2 * kv) + q * D;
      if (layer.sparse_mlp) {
        layer_params += static_cast<double>(c.moe.num_experts) * D;  // the router
        expert_params_per_token += static_cast<double>(c.moe.experts_per_token) * 3 * D *
                                   static_cast<double>(c.moe.expert_intermediate_size);
      } else {
        layer_params += 3 * D * static_cast<double>(c.intermediate_size);
      }
    }
    head_params = static_cast<double>(c.vocab_size) * D;
    kv_bytes_per_token = 2 * layers * kv * kv_element_bytes;
    attention_flops_per_pair = 4 * layers * q;  // q.k and p.v, 2 FLOPs per multiply-add
  }
};

}  // namespace

std::vector<Request> workload_requests(const WorkloadSpec& spec, int64_t vocab) {
  PAGEDLM_CHECK(spec.kind == "random" || spec.kind == "shared-prefix", "workload_requests: the '",
                spec.kind, "' workload is not fixed in advance (random, shared-prefix)");
  PAGEDLM_CHECK(spec.num_requests > 0, "the workload needs at least one request");
  const TokenDraw random_tokens(vocab, spec.token_variant);
  std::mt19937_64 rng(spec.seed);
  // The draws stay in the order (and the expressions in the form) earlier runs drew them in, so
  // that a seed names the same workload as in the benchmarks logged before.
  std::vector<Request> requests;
  if (spec.kind == "random") {
    for (int32_t i = 0; i < spec.num_requests; ++i) {
      const int32_t len = uniform(rng, spec.prompt_min, spec.prompt_max);
      requests.push_back(
          make_request(random_tokens(rng, len), uniform(rng, spec.output_min, spec.output_max)));
    }
    return requests;
  }
  const std::vector<int32_t> prefix = random_tokens(rng, spec.prefix_len);
  for (int32_t i = 0; i < spec.num_requests; ++i) {
    std::vector<int32_t> prompt = prefix;
    const auto unique = random_tokens(rng, spec.unique_len);
    prompt.insert(prompt.end(), unique.begin(), unique.end());
    requests.push_back(
        make_request(std::move(prompt), uniform(rng, spec.output_min, spec.output_max)));
  }
  return requests;
}

std::vector<Request> warmup_requests(const WorkloadSpec& spec, int64_t vocab) {
  const TokenDraw random_tokens(vocab, spec.token_variant);
  std::mt19937_64 warm_rng(spec.seed ^ 0x9e3779b97f4a7c15ULL);
  std::vector<Request> warm;
  for (int32_t i = 0; i < spec.warmup_requests; ++i) {
    const int32_t len = spec.kind == "shared-prefix"
                            ? spec.prefix_len + spec.unique_len
                            : uniform(warm_rng, spec.prompt_min, spec.prompt_max);
    warm.push_back(make_request(random_tokens(warm_rng, len), 4));
  }
  return warm;
}

BenchmarkResult run_benchmark(Engine& engine, const WorkloadSpec& spec,
                              const std::function<void(int64_t, int64_t)>& progress,
                              const DevicePeaks& peaks, const std::function<bool()>& interrupted) {
  PAGEDLM_CHECK(spec.kind == "random" || spec.kind == "shared-prefix" || spec.kind == "chat",
                "unknown workload '", spec.kind, "' (random, shared-prefix, chat)");
  PAGEDLM_CHECK(spec.num_requests > 0, "the workload needs at least one request");
  const TokenDraw random_tokens(engine.config().vocab_size, spec.token_variant);
  std::mt19937_64 rng(spec.seed);

  // Chat conversations submit their next turn when the previous one finishes.
  struct Conversation {
    std::vector<int32_t> history;
    int32_t turns_left = 0;
  };
  std::map<int64_t, int64_t> conversation_of;  // request id -> conversation
  std::vector<Conversation> conversations;
  const auto stop = [&interrupted] { return interrupted && interrupted(); };
  BenchmarkResult stopped;
  stopped.interrupted = true;

  std::vector<Request> initial;
  if (spec.kind != "chat") {
    initial = workload_requests(spec, engine.config().vocab_size);
  } else {
    PAGEDLM_CHECK(spec.turns >= 1, "chat needs at least one turn");
    conversations.resize(spec.num_requests);
    for (Conversation& c : conversations) {
      c.history = random_tokens(rng, uniform(rng, spec.prompt_min, spec.prompt_max));
      c.turns_left = spec.turns;
    }
  }

  if (spec.warmup_requests > 0) {
    std::vector<Request> warm = warmup_requests(spec, engine.config().vocab_size);
    std::vector<int64_t> warm_ids;
    warm_ids.reserve(warm.size());
    for (Request& r : warm) warm_ids.push_back(engine.add_request(std::move(r)));
    while (engine.has_unfinished()) {
      if (stop()) return stopped;
      engine.step();
    }
    for (const int64_t id : warm_ids) engine.take_output(id);
  }

  const EngineOptions& options = engine.options();
  const DType compute = checked_compute_dtype(options.model_options(), options.device);
  const ModelCosts costs(engine.config(),
                         static_cast<double>(dtype_size(kv_cache_dtype(options, compute))),
                         static_cast<double>(engine.step_weight_bytes()));
  const int64_t total_requests =
      spec.kind == "chat" ? int64_t{spec.num_requests} * spec.turns : spec.num_requests;
  BenchmarkResult result;
  result.step_weight_bytes_by_format = engine.step_weight_bytes_by_format();
  const SchedulerStats stats_before = engine.stats();
  const int64_t steps_before = engine.num_steps();
  const int64_t logits_downloads_before = engine.logits_downloads();
  std::unordered_map<int64_t, Clock::time_point> submitted, last_token;
  std::vector<double> ttft_ms, itl_ms;
  const Clock::time_point start = Clock::now();

  auto submit = [&](Request r) {
    result.prompt_tokens += static_cast<int64_t>(r.prompt.size());
    const int32_t max_tokens = r.sampling.max_tokens;
    r.sampling = spec.sampling;
    r.sampling.max_tokens = max_tokens;
    r.sampling.ignore_eos = true;
    const int64_t id = engine.add_request(std::move(r));
    if (spec.logprobs >= 0) engine.enable_logprobs(id, spec.logprobs);
    submitted[id] = Clock::now();
    return id;
  };
  auto next_turn = [&](int64_t conv) {
    Conversation& c = conversations[conv];
    const auto user = random_tokens(rng, spec.unique_len);
    c.history.insert(c.history.end(), user.begin(), user.end());
    --c.turns_left;
    conversation_of[submit(
        make_request(c.history, uniform(rng, spec.output_min, spec.output_max)))] = conv;
  };

  for (Request& r : initial) submit(std::move(r));
  for (size_t c = 0; c < conversations.size(); ++c) next_turn(static_cast<int64_t>(c));

  int64_t done = 0;
  const bool moe = engine.config().moe.num_experts > 0;
  int64_t expert_bytes = moe ? engine.expert_bytes_read() : 0;
  Clock::time_point step_start = Clock::now();
  while (engine.has_unfinished()) {
    if (stop()) return stopped;
    const auto events = engine.step();
    const Clock::time_point now = Clock::now();
    const StepShape& shape = engine.last_step();
    double step_bytes =
        costs.weight_bytes + costs.kv_bytes_per_token * static_cast<double>(shape.kv_tokens);
    // The counters are cumulative, so the bytes add up over the run; with a step in flight
    // (asynchronous scheduling) a read may hold some of its experts, which the next step's
    // then lacks.
    if (moe) {
      const int64_t read = engine.expert_bytes_read();
      step_bytes += static_cast<double>(read - expert_bytes);
      expert_bytes = read;
    }
    result.bytes += step_bytes;
    result.flops += 2 * (costs.layer_params + costs.expert_params_per_token) * shape.num_tokens +
                    2 * costs.head_params * shape.num_seqs +
                    costs.attention_flops_per_pair * static_cast<double>(shape.attention_pairs);
    if (shape.decode) {
      ++result.decode_steps;
      result.decode_s += std::chrono::duration<double>(now - step_start).count();
      result.decode_bytes += step_bytes;
      result.decode_gpu_s += shape.gpu_ms / 1e3;
      if (shape.gap_gpu_ms >= 0) {
        result.decode_gap_gpu_s += shape.gap_gpu_ms / 1e3;
        ++result.decode_gaps;
      }
      result.decode_schedule_s += shape.schedule_ms / 1e3;
      result.decode_prepare_s += shape.prepare_ms / 1e3;
      result.decode_launch_s += shape.launch_ms / 1e3;
      result.decode_wait_s += shape.wait_ms / 1e3;
      result.decode_finish_s += shape.finish_ms / 1e3;
    } else {
      ++result.prefill_steps;
      result.prefill_launch_s += shape.launch_ms / 1e3;
      result.prefill_wait_s += shape.wait_ms / 1e3;
      result.prefill_gpu_s += shape.gpu_ms / 1e3;
    }
    result.gpu_s += shape.gpu_ms / 1e3;
    step_start = now;
    result.peak_pages_used = std::max(result.peak_pages_used, engine.stats().pages_used);
    result.kv_pages = engine.stats().pages_total;
    for (const RequestEvent& e : events) {
      if (e.token >= 0) {
        ++result.generated_tokens;
        auto it = last_token.find(e.request_id);
        const auto ms = [](auto d) { return std::chrono::duration<double, std::milli>(d).count(); };
        if (it == last_token.end()) {
          ttft_ms.push_back(ms(now - submitted[e.request_id]));
          last_token[e.request_id] = now;
        } else {
          itl_ms.push_back(ms(now - it->second));
          it->second = now;
        }
      }
      if (!e.finished) continue;
      ++done;
      RequestOutput out = engine.take_output(e.request_id);
      last_token.erase(e.request_id);
      submitted.erase(e.request_id);
      auto conv = conversation_of.find(e.request_id);
      if (conv != conversation_of.end()) {
        Conversation& c = conversations[conv->second];
        c.history.insert(c.history.end(), out.tokens.begin(), out.tokens.end());
        if (c.turns_left > 0) next_turn(conv->second);
        conversation_of.erase(conv);
      }
    }
    if (progress) progress(done, total_requests);
  }

  result.wall_s = std::chrono::duration<double>(Clock::now() - start).count();
  const SchedulerStats stats = engine.stats();
  result.num_requests = total_requests;
  result.steps = engine.num_steps() - steps_before;
  result.output_tok_s = static_cast<double>(result.generated_tokens) / result.wall_s;
  result.total_tok_s =
      static_cast<double>(result.generated_tokens + result.prompt_tokens) / result.wall_s;
  result.ttft_p50_ms = percentile(ttft_ms, 50);
  result.ttft_p99_ms = percentile(ttft_ms, 99);
  result.itl_p50_ms = percentile(itl_ms, 50);
  result.itl_p99_ms = percentile(itl_ms, 99);
  const int64_t queries = stats.prefix_query_tokens - stats_before.prefix_query_tokens;
  const int64_t hits = stats.prefix_hit_tokens - stats_before.prefix_hit_tokens;
  result.prefix_hit_rate =
      queries > 0 ? static_cast<double>(hits) / static_cast<double>(queries) : 0;
  result.preemptions = stats.preemptions - stats_before.preemptions;
  result.logits_downloads = engine.logits_downloads() - logits_downloads_before;
  if (result.decode_s > 0) result.decode_bytes_per_s = result.decode_bytes / result.decode_s;
  if (peaks.bytes_per_s > 0 && peaks.flops_per_s > 0) {
    result.bound_s = std::max(result.bytes / peaks.bytes_per_s, result.flops / peaks.flops_per_s);
    result.bound_output_tok_s = static_cast<double>(result.generated_tokens) / result.bound_s;
    result.bound_fraction = result.output_tok_s / result.bound_output_tok_s;
  }
  return result;
}

}  // namespace pagedlm
