// Presence and frequency penalties: each generated token must be the argmax of the model's
// logits for its prefix after the OpenAI formula is applied, computed here independently.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>

#include "golden_fixture_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/io/checkpoint.h"

namespace pagedlm {
namespace {

using namespace pagedlm::testing;  // NOLINT: the fixture helpers

TEST(EnginePenalties, GreedyTokensAreArgmaxOfPenalizedLogits) {
  const Checkpoint ckpt = load_checkpoint(fixture_dir("qwen2-bias"));
  const Expected expected = load_expected("qwen2-bias");
  EngineOptions opts;
  opts.num_pages = 128;
  Request plain;
  plain.prompt = expected.prompts[0];
  plain.sampling.max_tokens = 24;
  plain.sampling.ignore_eos = true;
  const std::vector<int32_t> unpenalized = Engine(ckpt, opts).generate({plain})[0].tokens;
  int num_changed = 0;
  for (auto [presence, frequency] :
       {std::pair{1.5f, 0.f}, std::pair{0.f, 0.7f}, std::pair{0.5f, 1.f}, std::pair{-0.5f, 0.f}}) {
    Engine engine(ckpt, opts);
    Request r;
    r.prompt = expected.prompts[0];
    r.sampling.max_tokens = 24;
    r.sampling.ignore_eos = true;
    r.sampling.presence_penalty = presence;
    r.sampling.frequency_penalty = frequency;
    const std::vector<int32_t> generated = engine.generate({r})[0].tokens;
    ASSERT_EQ(generated.size(), 24u);
    num_changed += generated != unpenalized;

    // The logits of every prefix, in one request: row p predicts token p + 1.
    std::vector<int32_t> whole = r.prompt;
    whole.insert(whole.end(), generated.begin(), generated.end() - 1);
    const Tensor logits = engine.generate({logits_request(whole)})[0].prompt_logits;
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
}

}  // namespace
}  // namespace pagedlm
