// The structured-output manager on its own, with the default model's tokenizer and a grammar of
// two choices: which rows a step's sequences are sampled under (filled in the step, then
// prefetched), what the rows allow, and a token outside the grammar ending the output.
#include <gtest/gtest.h>

#include <memory>
#include <string>
#include <vector>

#include "default_model_util.h"
#include "pagedlm/engine/structured_output.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/io/model_cache.h"

namespace pagedlm {
namespace {

constexpr int32_t kMaxNumSeqs = 4;

// One sequence that samples its next token.
StepPlan one_sequence(int64_t request_id) {
  StepPlan plan;
  plan.request_ids = {request_id};
  plan.samples = {1};
  plan.logits_indptr = {0, 1};
  return plan;
}

class StructuredOutputTest : public ::testing::Test {
 protected:
  void SetUp() override {
    REQUIRE_DEFAULT_MODEL();
    model_ = std::make_unique<TextModel>(load_text_model(default_model_path()));
    vocab_ = model_->checkpoint.config.vocab_size;
    eos_ = model_->checkpoint.config.eos_token_ids;
    grammar::GrammarCompiler compiler(*model_->tokenizer, static_cast<int32_t>(vocab_), eos_);
    grammar::GrammarSpec spec;
    spec.kind = grammar::GrammarSpec::Kind::kChoice;
    spec.choices = {"yes", "no"};
    choice_ = compiler.compile(spec);
    yes_ = model_->tokenizer->encode("yes");
    banana_ = model_->tokenizer->encode("banana");
    ASSERT_FALSE(yes_.empty());
    ASSERT_FALSE(banana_.empty());
  }

  std::unique_ptr<TextModel> model_;
  int64_t vocab_ = 0;
  std::vector<int32_t> eos_;
  grammar::CompiledGrammarPtr choice_;
  std::vector<int32_t> yes_, banana_;
};

TEST_F(StructuredOutputTest, AStepWithoutGrammarsHasNoMasks) {
  StructuredOutput structured(vocab_, kMaxNumSeqs, eos_, 1);
  std::vector<SeqSampling> sampling(1);
  std::vector<int32_t> rows;
  const MaskBatch batch = structured.launch(one_sequence(3), sampling, rows);
  EXPECT_EQ(batch.rows, nullptr);
  EXPECT_EQ(sampling[0].mask_row, -1);
  EXPECT_EQ(rows, std::vector<int32_t>{-1});
}

TEST_F(StructuredOutputTest, MasksAreFilledInTheStepThenPrefetched) {
  StructuredOutput structured(vocab_, kMaxNumSeqs, eos_, 1);
  auto tokens = std::make_shared<RequestTokens>();
  tokens->all = {1, 2, 3};
  tokens->num_prompt = 3;
  structured.add(7, choice_, tokens);
  ASSERT_TRUE(structured.has(7));
  const StepPlan plan = one_sequence(7);

  // The first token: no prefetch has run, so the row is one of those filled in the step.
  std::vector<SeqSampling> sampling(1);
  std::vector<int32_t> rows;
  MaskBatch batch = structured.launch(plan, sampling, rows);
  ASSERT_NE(batch.rows, nullptr);
  EXPECT_EQ(sampling[0].mask_row, kMaxNumSeqs);
  EXPECT_EQ(structured.last_prefetched_masks(), 0);
  batch.finish();
  const int32_t* mask = batch.rows->row(sampling[0].mask_row);
  EXPECT_TRUE(grammar::bitmask_allows(mask, yes_[0]));
  EXPECT_FALSE(grammar::bitmask_allows(mask, banana_[0]));
  EXPECT_FALSE(grammar::bitmask_allows(mask, eos_[0]));

  // "yes", token by token: each accepted, each next mask prefetched into row 0 (the prefetch's
  // item 0) as the token before it was taken.
  for (const int32_t t : yes_) {
    std::vector<int32_t> sampled = {t};
    structured.collect(plan, rows, sampled);
    EXPECT_EQ(sampled[0], t);
    tokens->all.push_back(t);  // the scheduler's part
    structured.prefetch(plan, sampled, [](int32_t) { return true; });
    sampling.assign(1, SeqSampling{});
    batch = structured.launch(plan, sampling, rows);
    ASSERT_NE(batch.rows, nullptr);
    EXPECT_EQ(sampling[0].mask_row, 0);
    EXPECT_EQ(structured.last_prefetched_masks(), 1);
    batch.finish();
  }
  // The choice is complete: only a stop token goes on.
  mask = batch.rows->row(sampling[0].mask_row);
  EXPECT_TRUE(grammar::bitmask_allows(mask, eos_[0]));
  EXPECT_FALSE(grammar::bitmask_allows(mask, yes_[0]));
  EXPECT_FALSE(grammar::bitmask_allows(mask, banana_[0]));

  // A token outside the grammar (here one its mask refused) ends the output: it becomes EOS.
  std::vector<int32_t> sampled = {banana_[0]};
  structured.collect(plan, rows, sampled);
  EXPECT_EQ(sampled[0], eos_[0]);
  structured.remove(7);
  EXPECT_FALSE(structured.has(7));
}

TEST_F(StructuredOutputTest, AGrammarForAnotherVocabularyIsRefused) {
  StructuredOutput structured(vocab_ + 64, kMaxNumSeqs, eos_, 0);
  auto tokens = std::make_shared<RequestTokens>();
  tokens->all = {1};
  tokens->num_prompt = 1;
  EXPECT_THROW(structured.add(1, choice_, tokens), Error);
}

}  // namespace
}  // namespace pagedlm
