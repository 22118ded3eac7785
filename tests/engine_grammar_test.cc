// The engine's structured output on the SmolLM2 GGUF, on the CPU and (when there is one) the GPU:
// greedy and sampled requests held to a JSON schema, mixed in one batch with unconstrained ones,
// end with "stop" on a document that parses and has the schema's shape; max_tokens cuts one
// short with "length"; on the CPU an unconstrained request's tokens do not change when
// constrained ones share its batch.
#include <gtest/gtest.h>

#include <filesystem>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "default_model_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/io/model_cache.h"

namespace pagedlm {
namespace {

const char* kSchema = R"({"type":"object","properties":{
  "name":{"type":"string","maxLength":16},
  "age":{"type":"integer","minimum":0,"maximum":99},
  "tags":{"type":"array","items":{"enum":["a","b","c"]},"minItems":1,"maxItems":3}},
  "required":["name","age","tags"]})";

void check_shape(const std::string& text) {
  const auto doc = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(doc.is_object()) << text;
  ASSERT_TRUE(doc.contains("name") && doc["name"].is_string()) << text;
  EXPECT_LE(doc["name"].get<std::string>().size(), 16u) << text;
  ASSERT_TRUE(doc.contains("age") && doc["age"].is_number_integer()) << text;
  EXPECT_GE(doc["age"].get<int>(), 0);
  EXPECT_LE(doc["age"].get<int>(), 99);
  ASSERT_TRUE(doc.contains("tags") && doc["tags"].is_array()) << text;
  EXPECT_GE(doc["tags"].size(), 1u);
  EXPECT_LE(doc["tags"].size(), 3u);
  for (const auto& t : doc["tags"]) EXPECT_TRUE(t == "a" || t == "b" || t == "c") << text;
  EXPECT_EQ(doc.size(), 3u) << text;
}

// constrained_tokens: the constrained requests' outputs, in the order they were added.
void run_on(Device device, int32_t prefetch_masks,
            std::vector<std::vector<int32_t>>* constrained_tokens = nullptr) {
  REQUIRE_DEFAULT_MODEL();
  const std::string path = default_model_path();
  const TextModel model = load_text_model(path);
  grammar::GrammarCompiler compiler(*model.tokenizer,
                                    static_cast<int32_t>(model.checkpoint.config.vocab_size),
                                    model.checkpoint.config.eos_token_ids);
  grammar::GrammarSpec spec;
  spec.kind = grammar::GrammarSpec::Kind::kJsonSchema;
  spec.text = kSchema;
  spec.strict = true;
  const grammar::CompiledGrammarPtr schema = compiler.compile(spec);

  EngineOptions opts;
  opts.device = device;
  opts.threads = 2;
  opts.num_pages = 256;
  opts.prefetch_masks = prefetch_masks;
  Engine engine(model.checkpoint, opts);
  const std::vector<int32_t> prompt = model.tokenizer->encode("A person as JSON:");
  auto request = [&](float temperature, uint64_t seed, int32_t max_tokens) {
    Request r;
    r.prompt = prompt;
    r.sampling.temperature = temperature;
    r.sampling.top_p = temperature > 0 ? 0.95f : 1.f;
    r.sampling.seed = seed;
    r.sampling.max_tokens = max_tokens;
    return r;
  };
  // Alone first: the unconstrained reference.
  const std::vector<int32_t> alone = engine.generate({request(0.8f, 99, 24)})[0].tokens;

  std::vector<int64_t> constrained;
  for (int i = 0; i < 3; ++i) {
    const int64_t id = engine.add_request(request(i == 0 ? 0.f : 1.f, 100 + i, 64));
    engine.set_grammar(id, schema);
    constrained.push_back(id);
  }
  const int64_t cut = engine.add_request(request(0.f, 1, 3));
  engine.set_grammar(cut, schema);
  const int64_t free_id = engine.add_request(request(0.8f, 99, 24));
  // One more, cancelled and taken after its third token while its next mask may be filling.
  const int64_t dropped = engine.add_request(request(1.f, 7, 64));
  engine.set_grammar(dropped, schema);
  int64_t prefetched = 0;
  for (int i = 0; i < 3; ++i) {
    engine.step();
    prefetched += engine.last_prefetched_masks();
  }
  ASSERT_TRUE(engine.cancel(dropped));
  const RequestOutput dropped_out = engine.take_output(dropped);
  EXPECT_EQ(dropped_out.reason, FinishReason::kCancelled);
  // Every constrained request samples each token under a mask; prefetching, all but its first
  // come from the prefetch (nothing is preempted here).
  auto masks_after_the_first = static_cast<int64_t>(dropped_out.tokens.size()) - 1;
  while (engine.has_unfinished()) {
    engine.step();
    prefetched += engine.last_prefetched_masks();
  }

  for (int64_t id : constrained) {
    const RequestOutput out = engine.take_output(id);
    ASSERT_EQ(out.reason, FinishReason::kStop) << "request " << id;
    std::vector<int32_t> text_tokens = out.tokens;
    ASSERT_FALSE(text_tokens.empty());
    text_tokens.pop_back();  // the EOS the grammar ended with
    check_shape(model.tokenizer->decode(text_tokens));
    if (constrained_tokens != nullptr) constrained_tokens->push_back(out.tokens);
    masks_after_the_first += static_cast<int64_t>(out.tokens.size()) - 1;
  }
  const RequestOutput short_out = engine.take_output(cut);
  EXPECT_EQ(short_out.reason, FinishReason::kLength);
  EXPECT_EQ(short_out.tokens.size(), 3u);
  masks_after_the_first += 2;
  const bool prefetching = prefetch_masks > 0 || (prefetch_masks < 0 && device == Device::kCuda);
  EXPECT_EQ(prefetched, prefetching ? masks_after_the_first : 0);
  // The CPU is batch invariant; the GPU's bf16 GEMMs may round differently with the batch.
  const std::vector<int32_t> shared = engine.take_output(free_id).tokens;
  if (device == Device::kCpu) EXPECT_EQ(shared, alone);

  // A grammar cannot join a request that has started, nor one that ignores EOS.
  Request late = request(0.f, 0, 8);
  const int64_t late_id = engine.add_request(late);
  engine.step();
  EXPECT_THROW(engine.set_grammar(late_id, schema), Error);
  Request ignoring = request(0.f, 0, 8);
  ignoring.sampling.ignore_eos = true;
  EXPECT_THROW(engine.set_grammar(engine.add_request(ignoring), schema), Error);
}

// Masks filled in the step that uses them and masks prefetched as the tokens before them were
// accepted allow the same tokens: the same requests sample the same outputs.
TEST(EngineGrammar, Cpu) {
  std::vector<std::vector<int32_t>> in_step, prefetched;
  run_on(Device::kCpu, 0, &in_step);
  if (HasFatalFailure()) return;
  run_on(Device::kCpu, 1, &prefetched);
  EXPECT_EQ(prefetched, in_step);
}

TEST(EngineGrammar, Cuda) {
  if (!cuda_device_available()) GTEST_SKIP() << "no GPU";
  run_on(Device::kCuda, -1);  // prefetched, the GPU's default
  run_on(Device::kCuda, 0);
}

}  // namespace
}  // namespace pagedlm
