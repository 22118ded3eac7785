// The engine on the GPU (bf16 weights, activations and KV cache) against the golden fixtures'
// float64 reference logits, and against itself across chunking, prefix caching and CUDA graphs;
// its device sampling (bias, penalties, logprobs) against the host reference on the same logits.
// Skips on machines without a GPU (and in builds without CUDA).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "default_model_util.h"
#include "golden_fixture_util.h"
#include "ops_test_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/io/safetensors.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/weights.h"
#include "pagedlm/ops/device_state.h"
#include "pagedlm/ops/linear_fp8.h"
#include "pagedlm/ops/linear_weight.h"
#include "pagedlm/ops/sampling.h"

namespace pagedlm {
namespace {

using namespace pagedlm::testing;  // NOLINT: the fixture helpers

// bf16 weights and activations (f32 residual stream and logits): about 1e-2 relative error
// against float64 (fixtures README), up to 2e-2 for llama-gqa, whose float32 weights are rounded
// to bf16 on top.
constexpr double kLogitsTolerance = 2e-2;
// Greedy tokens must match while the reference's top-2 gap is above what bf16 noise can flip.
constexpr float kMarginThreshold = 0.1f;

// Mixtures of experts (kFlippedPosition, golden_fixture_util.h): HF's own bf16 forward picks the
// other expert at 82 of qwen3-moe's 518 positions, pagedlm at 28 (H200, 2026-12-01;
// scripts/gpu_host/fixture_accuracy.py measures both). So these fixtures are held, over all
// cases, to a median position within kLogitsTolerance and at most 1 in 10 positions beyond
// kFlippedPosition.

// The FP8 fixtures run here dequantized to bf16, as every other fixture's weights are: their
// W8A8 GEMMs have tests of their own below (CudaModelFp8), with the bound FP8 inputs allow.
EngineOptions cuda_options() {
  EngineOptions o;
  o.device = Device::kCuda;
  o.num_pages = 256;
  o.fp8_weights = Fp8Weights::kNone;
  return o;
}

class CudaModel : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    checkpoint_ = load_checkpoint(fixture_dir(GetParam()));
    expected_ = load_expected(GetParam());
  }
  std::vector<RequestOutput> logits_run(int32_t max_num_batched_tokens) {
    EngineOptions o = cuda_options();
    o.max_num_batched_tokens = max_num_batched_tokens;
    Engine engine(checkpoint_, o);
    std::vector<Request> requests;
    for (const auto& p : expected_.prompts) requests.push_back(logits_request(p));
    return engine.generate(std::move(requests));
  }
  Checkpoint checkpoint_;
  Expected expected_;
};

TEST_P(CudaModel, LogitsMatchReferenceUnchunkedAndChunked) {
  const std::vector<RequestOutput> whole = logits_run(4096);
  const std::vector<RequestOutput> chunked = logits_run(16);
  const bool moe = has_experts(checkpoint_);
  std::vector<double> positions;  // MoE: every case's per-position errors
  for (int i = 0; i < kNumCases; ++i) {
    const double err = relative_error(whole[i].prompt_logits, expected_.logits[i]);
    const double chunked_err = relative_error(chunked[i].prompt_logits, expected_.logits[i]);
    std::printf("%s case %d: rel err %.2e (chunked %.2e)\n", GetParam(), i, err, chunked_err);
    expect_case_logits(whole[i], err, chunked[i], chunked_err, expected_.logits[i], moe,
                       kLogitsTolerance, positions, cat(GetParam(), " case ", i));
    // Chunking changes GEMM shapes only, so both runs agree far better than with the reference.
    EXPECT_LT(relative_error(chunked[i].prompt_logits, whole[i].prompt_logits),
              kLogitsTolerance / 2)
        << GetParam() << " case " << i << " chunked vs unchunked";
  }
  if (moe) expect_moe_positions(positions, kLogitsTolerance, kFlippedPosition, GetParam());
}

// With a 16-token budget the prompts are prefilled in chunks over several steps while the
// requests prefilled before them decode: those steps' decodes take the decode kernel beside the
// prefill kernel's chunks.
TEST_P(CudaModel, GreedyGenerationMatchesReference) {
  for (const int32_t budget : {0, 16}) {
    SCOPED_TRACE(budget == 0 ? "default token budget" : "16-token budget");
    EngineOptions o = cuda_options();
    o.max_num_batched_tokens = budget;
    Engine engine(checkpoint_, o);
    expect_reference_greedy(engine.generate(greedy_requests(expected_)), expected_,
                            kMarginThreshold, GetParam());
    if (HasFatalFailure()) return;
  }
}

// Cases 1 and 2 share their first 33 tokens: case 2 is served all 33 from case 1's pages at
// every page size (whole pages shared, the rest of the last one copied on the device).
TEST_P(CudaModel, PrefixCacheServesTheCommon33TokensAndKeepsLogits) {
  constexpr int32_t kCommon = 33;
  for (const int32_t page_size : {1, 16, 64}) {
    SCOPED_TRACE(::testing::Message() << "page size " << page_size);
    EngineOptions o = cuda_options();
    o.page_size = page_size;
    o.num_pages = 1024 / page_size + 8;
    Engine engine(checkpoint_, o);
    Request first = logits_request(expected_.prompts[1]);
    first.use_prefix_cache = true;
    engine.generate({first});
    Request second = logits_request(expected_.prompts[2]);
    second.use_prefix_cache = true;
    const std::vector<RequestOutput> out = engine.generate({second});
    EXPECT_EQ(out[0].num_cached_tokens, kCommon);
    EXPECT_EQ(engine.stats().prefix_partial_hit_tokens, kCommon % page_size);
    EXPECT_LT(relative_error(out[0].prompt_logits, expected_.logits[2], kCommon), kLogitsTolerance);
  }
}

// The same prompts again: each is cached whole, so its first step computes only its last token
// (one row, shaped like a decode) after copying the rest of its last page. Such steps must run
// their copies, never a captured graph without them.
TEST_P(CudaModel, WholePromptHitsCopyTheirLastPageAndMatchTheReference) {
  Engine engine(checkpoint_, cuda_options());
  engine.generate(greedy_requests(expected_));
  const int64_t partial_before = engine.stats().prefix_partial_hits;
  expect_reference_greedy(engine.generate(greedy_requests(expected_)), expected_, kMarginThreshold,
                          GetParam());
  EXPECT_GT(engine.stats().prefix_partial_hits, partial_before);
}

// Two engines on one GPU in one process, each with its own device state (its cuBLASLt handle,
// workspace and GEMM plans: ops/device_state.h): stepped in turns on one thread, and at the
// same time from two threads, each gives exactly its greedy tokens alone. Their token budgets
// differ (the default, and 16: chunked prefill beside decodes), so their GEMM shapes and plans
// differ as well.
TEST_P(CudaModel, TwoEnginesOnOneGpuGiveTheirTokensAlone) {
  constexpr int32_t kBudgets[2] = {0, 16};
  expect_two_engines_give_their_tokens_alone(
      [&](int i) {
        EngineOptions o = cuda_options();
        o.max_num_batched_tokens = kBudgets[i];
        return std::make_unique<Engine>(checkpoint_, o);
      },
      expected_);
}

// Decode steps are padded to the same buckets with or without graphs, so a replayed graph must
// give exactly the eager step's tokens, greedy and seeded sampling alike.
TEST_P(CudaModel, GraphsGiveTheSameTokensAsEagerSteps) {
  std::vector<std::vector<int32_t>> runs[2];
  for (bool graphs : {false, true}) {
    EngineOptions o = cuda_options();
    o.use_cuda_graphs = graphs;
    Engine engine(checkpoint_, o);
    std::vector<Request> requests;
    for (int i = 0; i < kNumCases; ++i) {
      Request r;
      r.prompt = expected_.prompts[i];
      r.sampling.max_tokens = 24 + 4 * i;  // the batch shrinks through several buckets
      r.sampling.ignore_eos = true;
      if (i % 2 == 1) {
        r.sampling.temperature = 0.8f;
        r.sampling.top_p = 0.9f;
        r.sampling.seed = 1000 + i;
      }
      requests.push_back(std::move(r));
    }
    for (const RequestOutput& out : engine.generate(std::move(requests))) {
      runs[graphs].push_back(out.tokens);
    }
  }
  for (int i = 0; i < kNumCases; ++i) EXPECT_EQ(runs[0][i], runs[1][i]) << "case " << i;
}

// Asynchronous scheduling (the GPU's default) against steps planned only once the one before
// has returned its tokens: the same tokens, greedy, seeded, penalized (the device's penalty
// slots counting each draw as it runs ahead) and stopped by a stop id one step late, in a pool
// small enough to preempt; and no token past a stop.
TEST_P(CudaModel, AsynchronousSchedulingGivesTheSameTokens) {
  std::vector<RequestOutput> runs[2];
  int64_t preemptions[2] = {0, 0};
  // Pages of 4 tokens: a third of what all requests hold at their end, at least the longest one
  // and two more (each fixture's prompts have their own lengths). Requests i and i + kNumCases
  // share their prompt's pages through the prefix cache, so a prompt counts once: counted twice,
  // the pool had room for every request at once and nothing was preempted.
  int64_t all_pages = 0, longest_pages = 0;
  for (int i = 0; i < 2 * kNumCases; ++i) {
    const int64_t prompt = static_cast<int64_t>(expected_.prompts[i % kNumCases].size());
    const int64_t tokens = prompt + 12 + 3 * i;
    all_pages += (tokens + 3) / 4 - (i >= kNumCases ? prompt / 4 : 0);
    longest_pages = std::max(longest_pages, (tokens + 3) / 4);
  }
  for (const int32_t async : {0, 1}) {
    EngineOptions o = cuda_options();
    o.async_scheduling = async;
    o.num_pages = std::max(longest_pages + 2, all_pages / 3);
    o.page_size = 4;
    // A sliding-window model (phi3-d96: 48 tokens) would release the pages behind its window
    // and fit the pool without a preemption: here it keeps them as the others do.
    o.free_pages_outside_window = false;
    Engine engine(checkpoint_, o);
    std::vector<Request> requests;
    for (int i = 0; i < 2 * kNumCases; ++i) {
      Request r;
      r.prompt = expected_.prompts[i % kNumCases];
      r.sampling.max_tokens = 12 + 3 * i;
      r.sampling.ignore_eos = true;
      if (i % 3 == 1) {
        r.sampling.temperature = 0.8f;
        r.sampling.top_p = 0.9f;
        r.sampling.seed = 2000 + i;
      }
      if (i % 3 == 2) {
        r.sampling.repetition_penalty = 1.2f;
        r.sampling.frequency_penalty = 0.5f;
      }
      if (i == 0) r.sampling.stop_token_ids = {expected_.greedy[0][2]};  // greedy: stops early
      requests.push_back(std::move(r));
    }
    runs[async] = engine.generate(std::move(requests));
    preemptions[async] = engine.stats().preemptions;
  }
  EXPECT_GT(preemptions[1], 0) << "the pool was meant to force preemption";
  ASSERT_EQ(runs[0].size(), runs[1].size());
  for (size_t i = 0; i < runs[0].size(); ++i) {
    EXPECT_EQ(runs[1][i].tokens, runs[0][i].tokens) << "request " << i;
    EXPECT_EQ(runs[1][i].reason, runs[0][i].reason) << "request " << i;
    EXPECT_LE(runs[1][i].tokens.size(), static_cast<size_t>(12 + 3 * i)) << "request " << i;
  }
}

// Rows with logit adjustments are sampled on the device, penalties read from its per-request
// token counts: each token must be the argmax of the GPU's own logits for its prefix with the
// bias and the penalties applied (vLLM's order), wherever the adjusted top-2 gap is larger than
// bf16 noise between the decode and prefill kernels.
TEST_P(CudaModel, PenaltiesShapeGreedyTokens) {
  Engine engine(checkpoint_, cuda_options());
  Request r;
  r.prompt = expected_.prompts[0];
  r.sampling.max_tokens = 16;
  r.sampling.ignore_eos = true;
  r.sampling.presence_penalty = 1.5f;
  r.sampling.frequency_penalty = 0.5f;
  r.sampling.repetition_penalty = 1.2f;
  r.sampling.logit_bias = {{r.prompt[0], 1.5f}};
  const std::vector<int32_t> generated = engine.generate({r})[0].tokens;
  ASSERT_EQ(generated.size(), 16u);
  std::vector<int32_t> whole = r.prompt;
  whole.insert(whole.end(), generated.begin(), generated.end() - 1);
  const Tensor logits = engine.generate({logits_request(whole)})[0].prompt_logits;
  const int64_t vocab = logits.dim(1);
  std::map<int32_t, int32_t> counts;
  std::set<int32_t> seen(r.prompt.begin(), r.prompt.end());
  for (size_t t = 0; t < generated.size(); ++t) {
    const float* row = logits.data<float>() + (r.prompt.size() - 1 + t) * vocab;
    std::vector<float> penalized(row, row + vocab);
    penalized[r.prompt[0]] += 1.5f;
    for (int32_t token : seen) {
      penalized[token] = penalized[token] > 0 ? penalized[token] / 1.2f : penalized[token] * 1.2f;
    }
    for (const auto& [token, count] : counts) penalized[token] -= 1.5f + 0.5f * count;
    std::vector<float> sorted = penalized;
    std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
    if (sorted[0] - sorted[1] <= kMarginThreshold) break;
    EXPECT_EQ(generated[t],
              std::max_element(penalized.begin(), penalized.end()) - penalized.begin())
        << GetParam() << " step " << t;
    ++counts[generated[t]];
    seen.insert(generated[t]);
  }
}

// Sampling parameters the GPU applies on the device, one request each: every penalty alone,
// logit bias, logprobs, and all of them with a seeded draw.
std::vector<Request> device_sampling_requests(const Expected& expected) {
  std::vector<Request> requests;
  for (int kind = 0; kind < 6; ++kind) {
    Request r;
    r.prompt = expected.prompts[kind % kNumCases];
    r.sampling.max_tokens = 12;
    r.sampling.ignore_eos = true;
    switch (kind) {
      case 0:
        r.sampling.presence_penalty = 1.5f;
        break;
      case 1:
        r.sampling.frequency_penalty = 0.8f;
        break;
      case 2:
        r.sampling.repetition_penalty = 1.3f;
        break;
      case 3:
        r.sampling.logit_bias = {{r.prompt[0], 4.f}, {r.prompt[1], -2.f}};
        break;
      case 4:
        break;  // logprobs only
      default:
        r.sampling.temperature = 0.9f;
        r.sampling.top_p = 0.95f;
        r.sampling.seed = 77;
        r.sampling.presence_penalty = 0.5f;
        r.sampling.frequency_penalty = 0.5f;
        r.sampling.repetition_penalty = 1.1f;
        r.sampling.logit_bias = {{r.prompt[0], 1.f}};
    }
    requests.push_back(std::move(r));
  }
  return requests;
}

// Bias, penalties and logprobs never bring the logits to the host: the runner counts every
// logits download, and only the request that asks for its prompt logits makes one. Every token
// with logprobs carries them (top 5, descending).
TEST_P(CudaModel, DeviceSamplingDownloadsNoLogits) {
  Engine engine(checkpoint_, cuda_options());
  std::vector<int64_t> ids;
  for (Request& r : device_sampling_requests(expected_)) ids.push_back(engine.add_request(r));
  for (size_t i = 3; i < ids.size(); ++i) engine.enable_logprobs(ids[i], 5);
  int events_with_logprobs = 0;
  while (engine.has_unfinished()) {
    for (const RequestEvent& e : engine.step()) {
      if (e.request_id < ids[3] || e.token < 0) continue;
      ++events_with_logprobs;
      ASSERT_EQ(e.top_logprobs.size(), 5u);
      EXPECT_LE(e.logprob, 0.f);
      for (size_t j = 1; j < e.top_logprobs.size(); ++j) {
        EXPECT_GE(e.top_logprobs[j - 1].second, e.top_logprobs[j].second);
      }
    }
  }
  EXPECT_EQ(events_with_logprobs, 3 * 12);
  EXPECT_EQ(engine.logits_downloads(), 0) << GetParam() << ": logits left the device";
  for (const int64_t id : ids) EXPECT_EQ(engine.take_output(id).tokens.size(), 12u);
  // The counter counts: prompt logits are a download.
  engine.generate({logits_request(expected_.prompts[0])});
  EXPECT_GT(engine.logits_downloads(), 0);
}

// The device's bias, penalties, draw and logprobs against the host's on the same logits: a
// request's first token is drawn from its last prompt row, which comes back as its prompt
// logits in the same step. ops::sample_token over the row adjusted on the host (bias, then the
// repetition penalty over the prompt) must give the same token, greedy and seeded, and the
// logprobs must be ops::log_softmax_topk's within f32 rounding of a vocabulary-long sum.
TEST_P(CudaModel, DeviceSamplingMatchesHostReference) {
  Engine engine(checkpoint_, cuda_options());
  const int64_t vocab = checkpoint_.config.vocab_size;
  for (int i = 0; i < kNumCases; ++i) {
    for (const bool seeded : {false, true}) {
      Request r;
      r.prompt = expected_.prompts[i];
      r.sampling.max_tokens = 1;
      r.sampling.ignore_eos = true;
      r.want_prompt_logits = true;
      r.use_prefix_cache = false;
      r.sampling.repetition_penalty = seeded ? 1.25f : 0.8f;
      r.sampling.presence_penalty = 1.f;  // no output yet: presence and frequency stay off
      r.sampling.frequency_penalty = 0.5f;
      r.sampling.logit_bias = {
          {r.prompt.back(), 3.f}, {static_cast<int32_t>(i), -1.5f}, {r.prompt.back(), 0.25f}};
      if (seeded) {
        r.sampling.temperature = 1.1f;
        r.sampling.top_k = 50;
        r.sampling.top_p = 0.9f;
        r.sampling.seed = 1234 + i;
      }
      const int64_t id = engine.add_request(r);
      engine.enable_logprobs(id, 20);
      RequestEvent event;
      while (engine.has_unfinished()) {
        for (RequestEvent& e : engine.step()) {
          if (e.token >= 0) event = std::move(e);
        }
      }
      const RequestOutput out = engine.take_output(id);
      ASSERT_EQ(out.tokens.size(), 1u);
      const float* row = out.prompt_logits.data<float>() + (r.prompt.size() - 1) * vocab;
      // The host reference: bias in list order, the repetition penalty over the prompt.
      std::vector<float> adjusted(row, row + vocab);
      for (const auto& [token, bias] : r.sampling.logit_bias) adjusted[token] += bias;
      std::vector<bool> seen(vocab, false);
      for (const int32_t t : r.prompt) seen[t] = true;
      for (int64_t t = 0; t < vocab; ++t) {
        if (!seen[t]) continue;
        adjusted[t] = adjusted[t] > 0.f ? adjusted[t] / r.sampling.repetition_penalty
                                        : adjusted[t] * r.sampling.repetition_penalty;
      }
      const int32_t want =
          ops::sample_token(adjusted.data(), vocab, r.sampling, r.sampling.seed.value_or(0), 0);
      EXPECT_EQ(out.tokens[0], want) << GetParam() << " case " << i << (seeded ? " seeded" : "");
      const auto top = ops::log_softmax_topk(row, vocab, 20);
      ASSERT_EQ(event.top_logprobs.size(), top.size());
      constexpr float kTolerance = 1e-4f;
      for (size_t j = 0; j < top.size(); ++j) {
        EXPECT_EQ(event.top_logprobs[j].first, top[j].first) << GetParam() << " #" << j;
        EXPECT_NEAR(event.top_logprobs[j].second, top[j].second, kTolerance);
      }
      const double log_z = row[top[0].first] - static_cast<double>(top[0].second);
      EXPECT_NEAR(event.logprob, row[out.tokens[0]] - log_z, kTolerance);
    }
  }
}

// One penalty slot (max_num_seqs 1), two requests in turn with the same prompt and strong
// penalties: the second takes the first's slot, which must start clean (its counts zeroed, its
// prompt bits those of the new request), so both generate the same tokens; and so does a fresh
// engine with slots to spare.
TEST_P(CudaModel, PenaltySlotReuseStartsClean) {
  Request r;
  r.prompt = expected_.prompts[1];
  r.use_prefix_cache = false;  // both prefill the whole prompt, as the fresh engine does
  r.sampling.max_tokens = 16;
  r.sampling.ignore_eos = true;
  r.sampling.presence_penalty = 2.f;
  r.sampling.frequency_penalty = 1.f;
  r.sampling.repetition_penalty = 1.5f;
  EngineOptions one = cuda_options();
  one.max_num_seqs = 1;
  Engine engine(checkpoint_, one);
  const std::vector<RequestOutput> outs = engine.generate({r, r});
  Engine fresh(checkpoint_, cuda_options());
  const std::vector<int32_t> alone = fresh.generate({r})[0].tokens;
  ASSERT_EQ(alone.size(), 16u);
  EXPECT_EQ(outs[0].tokens, alone) << GetParam();
  EXPECT_EQ(outs[1].tokens, alone) << GetParam() << ": the reused slot kept the first's counts";
}

// Twelve requests behind one 448-token prefix: their decode steps take the cascade's shared pass
// (counted), and every greedy token must be the argmax of the prefill kernel's logits for its
// prefix (a fresh engine, no shared pass) wherever the top-2 gap is wider than bf16 noise.
TEST_P(CudaModel, CascadeDecodeAgreesWithPrefillLogits) {
  std::vector<int32_t> prefix;
  for (int i = 0; prefix.size() < 448; ++i) {
    const auto& p = expected_.prompts[i % kNumCases];
    prefix.insert(prefix.end(), p.begin(), p.end());
  }
  prefix.resize(448);
  const int32_t vocab = static_cast<int32_t>(checkpoint_.config.vocab_size);
  Engine engine(checkpoint_, cuda_options());
  std::vector<Request> requests;
  for (int32_t i = 0; i < 12; ++i) {
    Request r;
    r.prompt = prefix;
    r.prompt.insert(r.prompt.end(), {(7 * i + 3) % vocab, (11 * i + 5) % vocab});
    r.sampling.max_tokens = 10;
    r.sampling.ignore_eos = true;
    requests.push_back(std::move(r));
  }
  const std::vector<RequestOutput> outputs = engine.generate(requests);
  // With a sliding window on every layer (phi3-d96: 48 tokens) the pages behind it are released,
  // and the few shared pages left save too little for cascade to run; the other models take it.
  // Planned ahead (asynchronous scheduling), the first decode step is planned before the prefill
  // step's tokens resolve and release those pages, so that one step may still take the shared
  // pass (H200, 2026-12-03: one step); its tokens are checked below like every other.
  if (checkpoint_.config.window_of_all_layers() > 0) {
    EXPECT_LE(engine.cascade_steps(), 1);
  } else {
    EXPECT_GT(engine.cascade_steps(), 0);
  }

  EngineOptions o = cuda_options();
  o.use_cascade_attention = false;
  Engine check(checkpoint_, o);
  std::vector<Request> prefixes;
  for (size_t i = 0; i < requests.size(); ++i) {
    std::vector<int32_t> whole = requests[i].prompt;
    whole.insert(whole.end(), outputs[i].tokens.begin(), outputs[i].tokens.end() - 1);
    prefixes.push_back(logits_request(whole));
  }
  const std::vector<RequestOutput> logits = check.generate(std::move(prefixes));
  int checked = 0;
  for (size_t i = 0; i < requests.size(); ++i) {
    for (size_t t = 0; t < outputs[i].tokens.size(); ++t) {
      const float* row =
          logits[i].prompt_logits.data<float>() + (requests[i].prompt.size() - 1 + t) * vocab;
      std::vector<float> sorted(row, row + vocab);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      if (sorted[0] - sorted[1] <= kMarginThreshold) break;
      EXPECT_EQ(outputs[i].tokens[t], std::max_element(row, row + vocab) - row)
          << GetParam() << " request " << i << " step " << t;
      ++checked;
    }
  }
  EXPECT_GT(checked, 12) << "too few tokens with a clear margin to check";
}

// --kv-cache-dtype fp8: K and V stored as e4m3 (3 significand bits: rounding is off by up to
// 2^-4 of a value, about 3% RMS). scripts/fp8_w8a8_simulation.py --kv-cache-only, a float64
// forward that rounds only the cached keys and values to e4m3 as the GPU stores them (from bf16,
// with the checkpoint's k_scale / v_scale, else 1.0), is 3.7e-2 to 8.8e-2 from the reference on
// the fixtures of Llama's layout (worst: mistral and llama-gqa, 8.8e-2; ct-mixed with its own
// scales 5.4e-2): on these tiny random models the logits' error is about 1.4 times e4m3's
// largest rounding error. The bound is one e4m3 step at 1.0, 2^-3 (1.4 times the simulation's
// worst), for every fixture; the mixtures of experts take it for their median position, as the
// bf16 bound above, with at most 1 in 10 positions beyond twice it (a flipped expert).
constexpr double kE4m3KvTolerance = 0.125;
// Greedy tokens against the reference: the bf16 margin scaled by the ratio of the two bounds.
constexpr float kE4m3KvMargin = kMarginThreshold * (kE4m3KvTolerance / kLogitsTolerance);
// Decode against prefill logits, both over e4m3 caches: the same values except where a GEMM
// shape's bf16 rounding moves a key or value across an e4m3 rounding boundary.
constexpr float kE4m3KvSelfMargin = 3 * kMarginThreshold;

EngineOptions e4m3_kv_options() {
  EngineOptions o = cuda_options();
  o.kv_cache_dtype = KvCacheDtype::kFp8;
  return o;
}

// Every fixture with an e4m3 KV cache: the prompts' logits (prefill, whole and in 16-token
// chunks, which read pages earlier steps wrote) beside bf16's, both against the float64
// reference; then greedy generation (the decode kernel, graphs) against the reference's tokens
// and against the prefill kernel's argmax over the same e4m3 cache.
TEST_P(CudaModel, E4m3KvCacheLogitsAndGreedy) {
  auto logits = [&](const EngineOptions& options, int32_t budget) {
    EngineOptions o = options;
    o.max_num_batched_tokens = budget;
    Engine engine(checkpoint_, o);
    std::vector<Request> requests;
    for (const auto& p : expected_.prompts) requests.push_back(logits_request(p));
    return engine.generate(std::move(requests));
  };
  const std::vector<RequestOutput> bf16 = logits(cuda_options(), 4096);
  const std::vector<RequestOutput> whole = logits(e4m3_kv_options(), 4096);
  const std::vector<RequestOutput> chunked = logits(e4m3_kv_options(), 16);
  const bool moe = has_experts(checkpoint_);
  std::vector<double> positions;
  double worst = 0, worst_bf16 = 0;
  for (int i = 0; i < kNumCases; ++i) {
    const double err = relative_error(whole[i].prompt_logits, expected_.logits[i]);
    const double chunked_err = relative_error(chunked[i].prompt_logits, expected_.logits[i]);
    const double bf16_err = relative_error(bf16[i].prompt_logits, expected_.logits[i]);
    worst = std::max({worst, err, chunked_err});
    worst_bf16 = std::max(worst_bf16, bf16_err);
    std::printf("%s case %d: e4m3 KV rel err %.2e (chunked %.2e), bf16 KV %.2e\n", GetParam(), i,
                err, chunked_err, bf16_err);
    expect_case_logits(whole[i], err, chunked[i], chunked_err, expected_.logits[i], moe,
                       kE4m3KvTolerance, positions, cat(GetParam(), " case ", i));
  }
  std::printf("%s: worst rel err e4m3 KV %.3e, bf16 KV %.3e\n", GetParam(), worst, worst_bf16);
  if (moe) {
    expect_moe_positions(positions, kE4m3KvTolerance, 2 * kE4m3KvTolerance,
                         std::string(GetParam()) + " e4m3 KV");
  }

  Engine engine(checkpoint_, e4m3_kv_options());
  const std::vector<RequestOutput> greedy = engine.generate(greedy_requests(expected_));
  expect_reference_greedy(greedy, expected_, kE4m3KvMargin, GetParam());
  int matching = 0;
  for (int i = 0; i < kNumCases; ++i) {
    for (int t = 0; t < kGreedyTokens; ++t)
      matching += greedy[i].tokens[t] == expected_.greedy[i][t];
  }
  std::printf("%s: e4m3 KV greedy tokens equal to the reference's: %d of %d\n", GetParam(),
              matching, kNumCases * kGreedyTokens);

  // Each generated token against the prefill kernel's argmax for its prefix (a fresh engine).
  const int32_t vocab = static_cast<int32_t>(checkpoint_.config.vocab_size);
  std::vector<Request> prefixes;
  for (int i = 0; i < kNumCases; ++i) {
    std::vector<int32_t> tokens = expected_.prompts[i];
    tokens.insert(tokens.end(), greedy[i].tokens.begin(), greedy[i].tokens.end() - 1);
    prefixes.push_back(logits_request(tokens));
  }
  Engine check(checkpoint_, e4m3_kv_options());
  const std::vector<RequestOutput> prefill = check.generate(std::move(prefixes));
  int checked = 0;
  for (int i = 0; i < kNumCases; ++i) {
    for (int t = 0; t < kGreedyTokens; ++t) {
      const float* row = prefill[i].prompt_logits.data<float>() +
                         (expected_.prompts[i].size() - 1 + t) * static_cast<size_t>(vocab);
      std::vector<float> sorted(row, row + vocab);
      std::partial_sort(sorted.begin(), sorted.begin() + 2, sorted.end(), std::greater<float>());
      // Each position's prefix is the greedy run's own tokens, so a near tie at one position
      // says nothing about the next: skip it, check the rest.
      if (sorted[0] - sorted[1] <= kE4m3KvSelfMargin) continue;
      EXPECT_EQ(greedy[i].tokens[t], std::max_element(row, row + vocab) - row)
          << GetParam() << " case " << i << " step " << t;
      ++checked;
    }
  }
  std::printf("%s: %d e4m3 KV decode tokens checked against prefill logits\n", GetParam(), checked);
  EXPECT_GT(checked, 0) << GetParam();
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModel, ::testing::ValuesIn(kFixtures), [](const auto& info) {
  std::string n = info.param;
  for (char& c : n) c = std::isalnum(c) ? c : '_';
  return n;
});

// W8A8: the FP8 fixtures with their own weights and scales (per-tensor with static inputs,
// per-channel with clamped per-token inputs, compressed-tensors' mixed groups; fp8-block's
// 32x32 blocks run dequantized, so within the bf16 bound), and bf16 fixtures quantized at load
// (--quantization fp8), qwen2-bias for the bias, phi3 for fused projections. The reference stays
// the fixtures' float64 forward with unquantized activations (and, for the bf16 fixtures,
// unquantized weights), so the bounds are what FP8 itself costs on these tiny random models:
// scripts/fp8_w8a8_simulation.py, a float64 forward that rounds every FP8 input (and weight) to
// e4m3 as the GPU does, is 8.7e-2 to 9.1e-2 from the reference on fp8-tensor, ct-mixed and
// fbgemm (worst case), and 1.7e-1 to 1.9e-1 on llama-gqa, qwen2-bias, mistral and phi3 quantized
// at load. Which inputs cross an e4m3 rounding boundary depends on bf16's roundings before them
// (the simulation without its bf16 rounding of the inputs draws fp8-tensor's worst case at
// 9.5e-2: the same error drawn again), and the GPU's bf16 adds ~1e-2 in quadrature: bounds about
// 1.3 times the simulation's worst. scripts/gpu_host/fp8_torch_reference.py scores PyTorch's
// W8A8 forward of the same checkpoints beside pagedlm's.
constexpr double kW8A8CheckpointTolerance = 1.2e-1;
constexpr double kW8A8QuantizedTolerance = 2.4e-1;

struct Fp8Case {
  const char* fixture;
  Fp8Weights mode;
};

class CudaModelFp8 : public ::testing::TestWithParam<Fp8Case> {};

TEST_P(CudaModelFp8, LogitsNearReferenceUnchunkedAndChunked) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const Fp8Case& c = GetParam();
  const Checkpoint checkpoint = load_checkpoint(fixture_dir(c.fixture));
  const Expected expected = load_expected(c.fixture);
  EngineOptions o = cuda_options();
  o.fp8_weights = c.mode;
  if (!ops::fp8_gemm_supported()) {
    // FP8 asked for on a GPU without FP8 tensor cores: refused, naming what is missing; an FP8
    // checkpoint on its own runs dequantized.
    if (c.mode == Fp8Weights::kAll) {
      expect_error([&] { Engine engine(checkpoint, o); },
                   {"--quantization fp8", "FP8 tensor cores", "8.9"});
    }
    GTEST_SKIP() << "the GPU has no FP8 tensor cores";
  }
  auto run = [&](int32_t budget, std::map<std::string, int64_t>* formats) {
    o.max_num_batched_tokens = budget;
    Engine engine(checkpoint, o);
    if (formats != nullptr) *formats = engine.step_weight_bytes_by_format();
    std::vector<Request> requests;
    for (const auto& p : expected.prompts) requests.push_back(logits_request(p));
    return engine.generate(std::move(requests));
  };
  std::map<std::string, int64_t> formats;
  const std::vector<RequestOutput> whole = run(4096, &formats), chunked = run(16, nullptr);
  const std::string fp8_format = "f8_e4m3 (W8A8)";
  const bool fp8_block = std::string(c.fixture) == "fp8-block";
  EXPECT_EQ(formats.count(fp8_format), fp8_block ? 0u : 1u) << c.fixture;
  // bf16 besides the FP8 projections: the embedding / lm_head, and ct-mixed's block-scaled down.
  for (const auto& [format, bytes] : formats) {
    std::printf("%s: %s %lld bytes\n", c.fixture, format.c_str(), static_cast<long long>(bytes));
  }
  const double bound = fp8_block                    ? kLogitsTolerance
                       : c.mode == Fp8Weights::kAll ? kW8A8QuantizedTolerance
                                                    : kW8A8CheckpointTolerance;
  double worst = 0;
  for (int i = 0; i < kNumCases; ++i) {
    const double err = relative_error(whole[i].prompt_logits, expected.logits[i]);
    const double chunked_err = relative_error(chunked[i].prompt_logits, expected.logits[i]);
    worst = std::max({worst, err, chunked_err});
    EXPECT_LT(err, bound) << c.fixture << " case " << i;
    EXPECT_LT(chunked_err, bound) << c.fixture << " case " << i << " chunked";
    // Inputs are quantized per row (or with a fixed scale), so chunks change GEMM shapes only:
    // the f32 sums' order. Its bf16 roundings move some inputs across e4m3 rounding boundaries,
    // and on these models that draws the FP8 error anew rather than nudging it (the simulation's
    // two draws, with and without bf16 inputs, are 4.6e-2 to 9.2e-2 apart on the FP8
    // checkpoints, 1.0e-1 to 1.2e-1 on llama-gqa quantized at load): the same bound.
    EXPECT_LT(relative_error(chunked[i].prompt_logits, whole[i].prompt_logits), bound)
        << c.fixture << " case " << i << " chunked vs unchunked";
  }
  std::printf("%s (%s): W8A8 worst rel err %.3e vs the float64 reference\n", c.fixture,
              c.mode == Fp8Weights::kAll ? "--quantization fp8" : "checkpoint", worst);
}

// Decode steps replay CUDA graphs of the FP8 GEMMs (the row quantizer, cuBLASLt's FP8 call, the
// epilogue kernel where it scales): the same kernels on the same shapes as eager steps, so the
// same tokens, greedy and sampled, as the batch shrinks through the buckets.
TEST_P(CudaModelFp8, GraphsGiveTheSameTokensAsEagerSteps) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  if (!ops::fp8_gemm_supported()) GTEST_SKIP() << "the GPU has no FP8 tensor cores";
  const Fp8Case& c = GetParam();
  const Checkpoint checkpoint = load_checkpoint(fixture_dir(c.fixture));
  const Expected expected = load_expected(c.fixture);
  std::vector<std::vector<int32_t>> runs[2];
  for (bool graphs : {false, true}) {
    EngineOptions o = cuda_options();
    o.fp8_weights = c.mode;
    o.use_cuda_graphs = graphs;
    Engine engine(checkpoint, o);
    std::vector<Request> requests;
    for (int i = 0; i < kNumCases; ++i) {
      Request r;
      r.prompt = expected.prompts[i];
      r.sampling.max_tokens = 16 + 4 * i;
      r.sampling.ignore_eos = true;
      if (i % 2 == 1) {
        r.sampling.temperature = 0.8f;
        r.sampling.seed = 2000 + i;
      }
      requests.push_back(std::move(r));
    }
    for (const RequestOutput& out : engine.generate(std::move(requests))) {
      runs[graphs].push_back(out.tokens);
    }
  }
  for (int i = 0; i < kNumCases; ++i) {
    EXPECT_EQ(runs[0][i], runs[1][i]) << c.fixture << " case " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, CudaModelFp8,
                         ::testing::Values(Fp8Case{"fp8-tensor", Fp8Weights::kCheckpoint},
                                           Fp8Case{"fbgemm", Fp8Weights::kCheckpoint},
                                           Fp8Case{"ct-mixed", Fp8Weights::kCheckpoint},
                                           Fp8Case{"fp8-block", Fp8Weights::kCheckpoint},
                                           Fp8Case{"llama-gqa", Fp8Weights::kAll},
                                           Fp8Case{"qwen2-bias", Fp8Weights::kAll},
                                           Fp8Case{"phi3", Fp8Weights::kAll},
                                           Fp8Case{"mistral", Fp8Weights::kAll}),
                         [](const auto& info) {
                           std::string n = info.param.fixture;
                           for (char& ch : n) ch = std::isalnum(ch) ? ch : '_';
                           return n + (info.param.mode == Fp8Weights::kAll ? "_quantized"
                                                                           : "_checkpoint");
                         });

// A head size the GPU's kernels are not compiled for is refused when the engine is built, naming
// it (the CPU runs any even size). llama3-rope's heads are split in two: the same projection
// shapes at head_dim 32.
// Sized from the GPU's free memory, an e4m3 KV cache holds twice the pages of a bf16 one (the
// two engines one after the other, each taking the same share of what is free).
TEST(CudaModelLoad, E4m3KvCacheHoldsTwiceThePages) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const Checkpoint checkpoint = load_checkpoint(fixture_dir("llama-gqa"));
  auto pages = [&](KvCacheDtype dtype) {
    EngineOptions o = cuda_options();
    o.num_pages = 0;
    o.gpu_memory_fraction = 0.05f;
    o.kv_cache_dtype = dtype;
    return Engine(checkpoint, o).stats().pages_total;
  };
  const double bf16 = pages(KvCacheDtype::kAuto), e4m3 = pages(KvCacheDtype::kFp8);
  std::printf("KV pages in 5%% of free memory: bf16 %.0f, e4m3 %.0f\n", bf16, e4m3);
  EXPECT_GT(e4m3, 1.9 * bf16);
  EXPECT_LT(e4m3, 2.1 * bf16);
}

TEST(CudaModelLoad, HeadSizesWithoutKernelsAreRefused) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  Checkpoint checkpoint = load_checkpoint(fixture_dir("llama3-rope"));
  ModelConfig& c = checkpoint.config;
  c.head_dim /= 2;
  c.num_heads *= 2;
  c.num_kv_heads *= 2;
  try {
    Engine engine(checkpoint, cuda_options());
    ADD_FAILURE() << "head_dim 32 was accepted on the GPU";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("head_dim 32 is not supported on the GPU"),
              std::string::npos)
        << e.what();
  }
}

// The weight seam on the GPU (model/weights.h, ops/linear_weight.h): with --gguf-blocks a Q4_K
// projection stays in its blocks and a Q3_K one (no GPU kernel) is expanded to bf16; --quantization
// fp8 makes a projection W8A8 and leaves the lm_head's kind (may_fp8 false) in bf16. Each applies
// itself within float32 summation error of the float64 product of the weights it holds (the bf16
// input's values; the expanded projection's bf16 weights).
TEST(CudaWeights, EachProjectionLoadsIntoItsGpuFormatAndAppliesItself) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const ModelConfig config = load_checkpoint(fixture_dir("llama-gqa")).config;
  Checkpoint ckpt;
  ckpt.config = config;
  std::mt19937 rng(9);
  const int64_t rows = 2, out = 256, in = 512;
  ckpt.quantized["q4k"] = random_blocks(QuantType::kQ4_K, out, in, rng);
  ckpt.quantized["q3k"] = random_blocks(QuantType::kQ3_K, out, in, rng);
  ModelOptions blocks_on_gpu;
  blocks_on_gpu.gguf_blocks_on_gpu = true;
  WeightLoader load(ckpt, Device::kCuda, {}, blocks_on_gpu);
  EXPECT_EQ(load.compute_dtype(), DType::kBF16);
  const ops::LinearWeight q4k = load.linear({{"q4k", {out, in}, Shard::kRows}});
  const ops::LinearWeight q3k = load.linear({{"q3k", {out, in}, Shard::kRows}});
  ASSERT_EQ(q4k.format(), ops::WeightFormat::kGpuBlocks);
  EXPECT_EQ(load.widest_gpu_blocks(), out * in);
  ASSERT_EQ(q3k.format(), ops::WeightFormat::kDense);
  EXPECT_EQ(q3k.dense_weight().dtype(), DType::kBF16);

  // x rounded to bf16 on the host: the reference multiplies the values the GPU reads.
  const Tensor x32 = random_f32({rows, in}, rng);
  Tensor x_host = Tensor::empty(DType::kBF16, {rows, in});
  std::vector<double> x_values(rows * in);
  for (int64_t i = 0; i < rows * in; ++i) {
    const uint16_t b = f32_to_bf16(x32.data<float>()[i]);
    x_host.data<uint16_t>()[i] = b;
    x_values[i] = bf16_to_f32(b);
  }
  const Tensor x = x_host.to(Device::kCuda);
#ifdef PAGEDLM_HAS_CUDA
  ops::DeviceState device_state;
  ops::DeviceState* const state = &device_state;
#else
  ops::DeviceState* const state = nullptr;  // not reached: no CUDA device without CUDA
#endif
  auto check = [&](const ops::LinearWeight& w, const std::vector<float>& weights,
                   const char* what) {
    const Tensor y = Tensor::empty(DType::kF32, {rows, out}, Device::kCuda);
    w.apply(x, Tensor(), y, nullptr, state, {});
    const Tensor got = y.to(Device::kCpu);
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < out; ++c) {
        double sum = 0, magnitude = 0;
        for (int64_t k = 0; k < in; ++k) {
          const double term = x_values[r * in + k] * weights[c * in + k];
          sum += term;
          magnitude += std::abs(term);
        }
        EXPECT_NEAR(got.data<float>()[r * out + c], sum, 1e-5 * magnitude)
            << what << ": row " << r << ", output " << c;
      }
    }
  };
  check(q4k, dequantized(ckpt.quantized["q4k"]), "Q4_K blocks");
  std::vector<float> q3k_bf16 = dequantized(ckpt.quantized["q3k"]);
  for (float& v : q3k_bf16) v = bf16_to_f32(f32_to_bf16(v));
  check(q3k, q3k_bf16, "Q3_K expanded to bf16");

  if (ops::fp8_gemm_supported()) {
    const Checkpoint dense = load_checkpoint(fixture_dir("llama-gqa"));
    ModelOptions fp8;
    fp8.fp8_weights = Fp8Weights::kAll;
    WeightLoader fp8_load(dense, Device::kCuda, {}, fp8);
    const WeightPart o{"model.layers.0.self_attn.o_proj.weight", {256, 256}, Shard::kCols};
    EXPECT_EQ(fp8_load.linear({o}).format(), ops::WeightFormat::kFp8);
    EXPECT_TRUE(fp8_load.has_fp8());
    EXPECT_EQ(fp8_load.linear({o}, false).format(), ops::WeightFormat::kDense);
  }
}

// A fixture in each GGUF block format the GPU keeps (testdata/gguf_blocks: llama-gqa quantized by
// llama.cpp's own quantizer, every matrix in the one type; scripts/make_fixtures_gguf_blocks.py).
// With --gguf-blocks each projection stays in its blocks, and each case's logits are within the
// bf16 bound of the CPU's exact f32 kernels on the same file, the bound (and measure) the bf16
// fixtures are held to against float64 above: the prefill GEMMs round the expanded weights to
// bf16 as those fixtures' weights are rounded. Each prompt runs alone: those of 1 and 7 tokens
// take every projection through the matrix-vector kernels (Q4_K's one-row tensor-core kernel at 1,
// with x rounded to 8 bits), those of 40 to 300 through the bf16 expansion and the GEMM.
class CudaGgufBlocks : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
    type_ = GetParam();
    checkpoint_ = load_checkpoint(std::string(PAGEDLM_TESTDATA) + "/gguf_blocks/llama-gqa." +
                                  type_ + ".gguf");
    expected_ = load_expected("llama-gqa");
  }
  EngineOptions options(Device device) const {
    EngineOptions o = device == Device::kCuda ? cuda_options() : EngineOptions{};
    o.num_pages = 256;
    o.gguf_blocks_on_gpu = true;
    return o;
  }
  std::string type_;
  Checkpoint checkpoint_;
  Expected expected_;
};

TEST_P(CudaGgufBlocks, LogitsMatchTheCpuOnTheSameBlocks) {
  auto logits = [&](Device device) {
    Engine engine(checkpoint_, options(device));
    if (device == Device::kCuda) {
      const std::map<std::string, int64_t> bytes = engine.step_weight_bytes_by_format();
      EXPECT_GT(bytes.count(type_) ? bytes.at(type_) : 0, 0) << "no projection kept " << type_;
    }
    // One request at a time, so that each prompt's length alone picks the kernels.
    std::vector<RequestOutput> outputs;
    for (const auto& p : expected_.prompts) {
      std::vector<Request> one;
      one.push_back(logits_request(p));
      outputs.push_back(std::move(engine.generate(std::move(one)).at(0)));
    }
    return outputs;
  };
  const std::vector<RequestOutput> cpu = logits(Device::kCpu), gpu = logits(Device::kCuda);
  for (size_t i = 0; i < cpu.size(); ++i) {
    const double err = relative_error(gpu[i].prompt_logits, cpu[i].prompt_logits);
    const std::vector<double> errors = position_errors(gpu[i].prompt_logits, cpu[i].prompt_logits);
    EXPECT_LT(err, kLogitsTolerance) << type_ << " case " << i;
    std::printf("%s case %zu (%zu tokens): rel err %.2e against the CPU (worst position %.2e)\n",
                type_.c_str(), i, expected_.prompts[i].size(), err,
                *std::max_element(errors.begin(), errors.end()));
  }
}

// One sequence at a time, so that every decode step runs the one-row kernels (Q4_K's tensor-core
// kernel among them): a replayed graph gives exactly the eager steps' tokens, greedy and seeded.
TEST_P(CudaGgufBlocks, GraphsGiveTheSameTokensAsEagerStepsOneSequence) {
  std::vector<std::vector<int32_t>> runs[2];
  for (bool graphs : {false, true}) {
    EngineOptions o = options(Device::kCuda);
    o.use_cuda_graphs = graphs;
    Engine engine(checkpoint_, o);
    for (int i = 0; i < kNumCases; ++i) {
      Request r;
      r.prompt = expected_.prompts[i];
      r.sampling.max_tokens = 20;
      r.sampling.ignore_eos = true;
      if (i % 2 == 1) {
        r.sampling.temperature = 0.8f;
        r.sampling.seed = 3000 + i;
      }
      std::vector<Request> one;
      one.push_back(std::move(r));
      runs[graphs].push_back(engine.generate(std::move(one)).at(0).tokens);
    }
  }
  for (int i = 0; i < kNumCases; ++i) {
    EXPECT_EQ(runs[0][i].size(), 20u) << type_ << " case " << i;
    EXPECT_EQ(runs[0][i], runs[1][i]) << type_ << " case " << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Types, CudaGgufBlocks,
                         ::testing::Values("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"),
                         [](const auto& info) { return std::string(info.param); });

// The real model: greedy tokens of the GPU (bf16) and the CPU (f32) agree while the CPU's top-2
// logit gap is wide enough for bf16 rounding not to flip it.
TEST(CudaSmolLM2, GreedyTokensMatchCpu) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  REQUIRE_DEFAULT_MODEL();
  const std::string path = default_model_path();
  const Checkpoint checkpoint = load_checkpoint(path);
  const std::vector<int32_t> prompt = {1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365};
  constexpr int kTokens = 8;
  constexpr float kMargin = 0.5f;
  auto greedy = [&](Device device) {
    EngineOptions o;
    o.device = device;
    o.num_pages = 64;
    Engine engine(checkpoint, o);
    Request r;
    r.prompt = prompt;
    r.sampling.max_tokens = kTokens;
    r.sampling.ignore_eos = true;
    return engine.generate({r})[0].tokens;
  };
  const std::vector<int32_t> cpu = greedy(Device::kCpu), gpu = greedy(Device::kCuda);
  // The CPU's logits over prompt + continuation give the margin at every generated position.
  EngineOptions o;
  o.num_pages = 64;
  Engine engine(checkpoint, o);
  std::vector<int32_t> all = prompt;
  all.insert(all.end(), cpu.begin(), cpu.end());
  const Tensor logits = engine.generate({logits_request(all)})[0].prompt_logits;
  const int64_t vocab = logits.dim(1);
  for (int t = 0; t < kTokens; ++t) {
    const float* row = logits.data<float>() + (prompt.size() - 1 + t) * vocab;
    std::vector<float> top(row, row + vocab);
    std::partial_sort(top.begin(), top.begin() + 2, top.end(), std::greater<float>());
    if (top[0] - top[1] <= kMargin) break;
    ASSERT_EQ(gpu[t], cpu[t]) << "step " << t;
  }
}

// The default model's Q4_1 projections stay in their blocks on the GPU (the tied lm_head is the
// bf16 embedding): a 6-token prompt runs every projection through the matrix-vector kernel, a
// 40-token one through the bf16 expansion and the GEMM. Each position's logits are within the
// bf16 bound of the CPU's exact f32 kernels on the same blocks.
TEST(CudaSmolLM2, GgufBlocksOnGpuMatchCpuLogits) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  REQUIRE_DEFAULT_MODEL();
  const Checkpoint checkpoint = load_checkpoint(default_model_path());
  std::vector<int32_t> long_prompt;
  for (int i = 0; i < 40; ++i) long_prompt.push_back(1 + (i * 7919) % 49000);
  const std::vector<int32_t> short_prompt = {1, 9690, 198, 2683, 359, 253};
  auto logits = [&](Device device, const std::vector<int32_t>& prompt) {
    EngineOptions o;
    o.device = device;
    o.num_pages = 64;
    o.gguf_blocks_on_gpu = true;
    Engine engine(checkpoint, o);
    if (device == Device::kCuda) {
      const std::map<std::string, int64_t> bytes = engine.step_weight_bytes_by_format();
      EXPECT_GT(bytes.count("Q4_1") ? bytes.at("Q4_1") : 0, 0) << "no projection kept Q4_1";
    }
    return engine.generate({logits_request(prompt)})[0].prompt_logits;
  };
  for (const auto& prompt : {short_prompt, long_prompt}) {
    const Tensor cpu = logits(Device::kCpu, prompt), gpu = logits(Device::kCuda, prompt);
    const std::vector<double> errors = position_errors(gpu, cpu);
    for (size_t t = 0; t < errors.size(); ++t) {
      EXPECT_LE(errors[t], kLogitsTolerance) << prompt.size() << "-token prompt, position " << t;
    }
  }
  // Expanded to bf16 instead (the default), the same projections are reported as bf16.
  EngineOptions o;
  o.device = Device::kCuda;
  o.num_pages = 64;
  o.gguf_blocks_on_gpu = false;
  const std::map<std::string, int64_t> bytes = Engine(checkpoint, o).step_weight_bytes_by_format();
  EXPECT_EQ(bytes.count("Q4_1"), 0u);
  EXPECT_GT(bytes.count("bf16") ? bytes.at("bf16") : 0, 0);
}

}  // namespace
}  // namespace pagedlm
