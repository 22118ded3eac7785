// Logit adjustments (OpenAI's logit_bias and presence/frequency penalties, vLLM's repetition
// penalty): each generated token must be the argmax of the model's logits for its prefix after
// the formulas are applied, computed here independently.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <set>

#include "golden_fixture_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

using namespace pagedlm::testing;  // NOLINT: the fixture helpers

constexpr int32_t kTokens = 24;

Request greedy_request(const std::vector<int32_t>& prompt) {
  Request r;
  r.prompt = prompt;
  r.sampling.max_tokens = kTokens;
  r.sampling.ignore_eos = true;
  return r;
}

// The logits that chose each generated token, from one prefill of prompt + generated: row
// prompt.size() - 1 + t predicts generated[t].
Tensor logits_of_prefixes(Engine& engine, const std::vector<int32_t>& prompt,
                          const std::vector<int32_t>& generated) {
  std::vector<int32_t> whole = prompt;
  whole.insert(whole.end(), generated.begin(), generated.end() - 1);
  return engine.generate({logits_request(whole)})[0].prompt_logits;
}

TEST(EnginePenalties, GreedyTokensAreArgmaxOfPenalizedLogits) {
  const Checkpoint ckpt = load_checkpoint(fixture_dir("qwen2-bias"));
  const Expected expected = load_expected("qwen2-bias");
  EngineOptions opts;
  opts.num_pages = 128;
  const std::vector<int32_t> unpenalized =
      Engine(ckpt, opts).generate({greedy_request(expected.prompts[0])})[0].tokens;
  int num_changed = 0;
  for (auto [presence, frequency] :
       {std::pair{1.5f, 0.f}, std::pair{0.f, 0.7f}, std::pair{0.5f, 1.f}, std::pair{-0.5f, 0.f}}) {
    Engine engine(ckpt, opts);
    Request r = greedy_request(expected.prompts[0]);
    r.sampling.presence_penalty = presence;
    r.sampling.frequency_penalty = frequency;
    const std::vector<int32_t> generated = engine.generate({r})[0].tokens;
    ASSERT_EQ(generated.size(), static_cast<size_t>(kTokens));
    num_changed += generated != unpenalized;
    const Tensor logits = logits_of_prefixes(engine, r.prompt, generated);
    const int64_t vocab = logits.dim(1);
    std::map<int32_t, int32_t> counts;
    for (size_t t = 0; t < generated.size(); ++t) {
      const float* row = logits.data<float>() + (r.prompt.size() - 1 + t) * vocab;
      std::vector<float> penalized(row, row + vocab);
      for (const auto& [token, count] : counts) penalized[token] -= presence + frequency * count;
      const auto best = std::max_element(penalized.begin(), penalized.end());
      EXPECT_EQ(generated[t], best - penalized.begin())
          << "step " << t << " presence " << presence << " frequency " << frequency;
      ++counts[generated[t]];
    }
  }
  EXPECT_GT(num_changed, 0) << "the penalties never changed the greedy output";
}

// vLLM's order: bias, then repetition (prompt and output: logit / r if positive, * r if not),
// then presence/frequency. A +100 bias forces its token.
TEST(EnginePenalties, LogitBiasAndRepetitionPenalty) {
  const Checkpoint ckpt = load_checkpoint(fixture_dir("qwen2-bias"));
  const Expected expected = load_expected("qwen2-bias");
  EngineOptions opts;
  opts.num_pages = 128;
  Request r = greedy_request(expected.prompts[0]);
  const std::vector<int32_t> plain = Engine(ckpt, opts).generate({r})[0].tokens;
  r.sampling.repetition_penalty = 1.4f;
  r.sampling.frequency_penalty = 0.3f;
  r.sampling.logit_bias = {{plain[0], -4.f}, {7, 2.5f}};
  Engine engine(ckpt, opts);
  const std::vector<int32_t> generated = engine.generate({r})[0].tokens;
  ASSERT_EQ(generated.size(), static_cast<size_t>(kTokens));
  EXPECT_NE(generated, plain);
  const Tensor logits = logits_of_prefixes(engine, r.prompt, generated);
  const int64_t vocab = logits.dim(1);
  std::set<int32_t> seen(r.prompt.begin(), r.prompt.end());
  std::map<int32_t, int32_t> counts;
  for (size_t t = 0; t < generated.size(); ++t) {
    const float* row = logits.data<float>() + (r.prompt.size() - 1 + t) * vocab;
    std::vector<float> adjusted(row, row + vocab);
    adjusted[plain[0]] += -4.f;
    adjusted[7] += 2.5f;
    for (int32_t token : seen) {
      adjusted[token] = adjusted[token] > 0 ? adjusted[token] / 1.4f : adjusted[token] * 1.4f;
    }
    for (const auto& [token, count] : counts) adjusted[token] -= 0.3f * count;
    EXPECT_EQ(generated[t], std::max_element(adjusted.begin(), adjusted.end()) - adjusted.begin())
        << "step " << t;
    seen.insert(generated[t]);
    ++counts[generated[t]];
  }

  Request forced;
  forced.prompt = expected.prompts[1];
  forced.sampling.max_tokens = 6;
  forced.sampling.ignore_eos = true;
  forced.sampling.logit_bias = {{11, 100.f}};
  EXPECT_EQ(engine.generate({forced})[0].tokens, std::vector<int32_t>(6, 11));
}

TEST(EnginePenalties, ZeroPenaltiesChangeNothingAndOutOfRangeIsRejected) {
  const Checkpoint ckpt = load_checkpoint(fixture_dir("llama-gqa"));
  Engine engine(ckpt, EngineOptions{});
  Request r;
  r.prompt = {5, 6, 7, 8};
  r.sampling.max_tokens = 8;
  r.sampling.ignore_eos = true;
  const auto plain = engine.generate({r})[0].tokens;
  r.sampling.presence_penalty = 0.f;
  r.sampling.frequency_penalty = 0.f;
  EXPECT_EQ(engine.generate({r})[0].tokens, plain);
  r.sampling.presence_penalty = 2.5f;
  EXPECT_THROW(engine.add_request(r), Error);
  r.sampling.presence_penalty = 0.f;
  r.sampling.frequency_penalty = -2.01f;
  EXPECT_THROW(engine.add_request(r), Error);
  r.sampling.frequency_penalty = 0.f;
  r.sampling.repetition_penalty = 1.f;
  r.sampling.logit_bias = {};
  EXPECT_EQ(engine.generate({r})[0].tokens, plain) << "neutral values change nothing";
  r.sampling.repetition_penalty = 0.f;
  EXPECT_THROW(engine.add_request(r), Error);
  r.sampling.repetition_penalty = 1.f;
  r.sampling.logit_bias = {{3, 100.5f}};
  EXPECT_THROW(engine.add_request(r), Error);
  r.sampling.logit_bias = {{static_cast<int32_t>(ckpt.config.vocab_size), 1.f}};
  EXPECT_THROW(engine.add_request(r), Error);
  EXPECT_FALSE(engine.has_unfinished()) << "rejected requests leave nothing behind";
}

}  // namespace
}  // namespace pagedlm
