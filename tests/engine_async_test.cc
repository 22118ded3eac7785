// Asynchronous scheduling (EngineOptions::async_scheduling) on the CPU, whose worker runs the same
// engine path as the GPU's (step N + 1 planned and launched before step N is collected, pending
// rows taking N's tokens in the worker): a mixed workload of the SmolLM2 GGUF (greedy, seeded
// sampling, penalties, logit bias, stop ids, max_tokens (0 too), a grammar, logprobs, prefix hits,
// a chunked prefill, preemption in a small page pool, a request cancelled mid-stream as a stop
// string would) gives the same tokens with it on and off, and no request gets a token past its
// stop: the tokens its events streamed are those its output holds.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "default_model_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/grammar/grammar.h"

namespace pagedlm {
namespace {

const char* kSchema = R"({"type":"object","properties":{"age":{"type":"integer"}},
  "required":["age"]})";

struct Outcome {
  std::map<int, std::vector<int32_t>> outputs;   // by request index
  std::map<int, std::vector<int32_t>> streamed;  // the tokens of its events
  std::map<int, FinishReason> reasons;
  int64_t preemptions = 0, prefix_hits = 0;
};

Outcome run(const TextModel& model, int32_t async, const std::vector<Request>& requests,
            const grammar::CompiledGrammarPtr& schema, int grammar_index, int logprobs_index,
            int cancel_index, int32_t cancel_after) {
  EngineOptions opts;
  opts.threads = 2;
  opts.page_size = 16;
  opts.num_pages = 12;               // 192 slots for ~9 requests of ~27 pages together: preemption
  opts.max_num_batched_tokens = 64;  // the long prompt is prefilled in chunks
  opts.max_num_seqs = 8;
  opts.async_scheduling = async;
  Engine engine(model.checkpoint, opts);
  Outcome out;
  std::map<int64_t, int> index_of;
  // The first request runs alone first, so that the later ones find its prompt cached.
  for (int i = 0; i < static_cast<int>(requests.size()); ++i) {
    const int64_t id = engine.add_request(requests[i]);
    index_of[id] = i;
    if (i == grammar_index) engine.set_grammar(id, schema);
    if (i == logprobs_index) engine.enable_logprobs(id, 2);
    if (i == 0) {
      while (engine.has_unfinished()) {
        for (const RequestEvent& e : engine.step()) {
          if (e.token >= 0) out.streamed[0].push_back(e.token);
          if (e.finished) {
            out.reasons[0] = e.reason;
            out.outputs[0] = engine.take_output(e.request_id).tokens;
          }
        }
      }
    }
  }
  while (engine.has_unfinished()) {
    for (const RequestEvent& e : engine.step()) {
      const int i = index_of.at(e.request_id);
      EXPECT_FALSE(out.outputs.count(i)) << "request " << i << " has an event after its output";
      if (e.token >= 0) out.streamed[i].push_back(e.token);
      if (e.finished) {
        out.reasons[i] = e.reason;
        out.outputs[i] = engine.take_output(e.request_id).tokens;
      } else if (i == cancel_index &&
                 static_cast<int32_t>(out.streamed[i].size()) == cancel_after) {
        // What the serving loop does when a stop string shows up in a request's text.
        EXPECT_TRUE(engine.cancel(e.request_id));
        out.reasons[i] = FinishReason::kCancelled;
        out.outputs[i] = engine.take_output(e.request_id).tokens;
      }
    }
  }
  const SchedulerStats stats = engine.stats();
  EXPECT_EQ(stats.pages_used, 0) << "pages leaked";
  out.preemptions = stats.preemptions;
  out.prefix_hits = stats.prefix_hit_tokens;
  return out;
}

TEST(EngineAsync, MixedWorkloadSameTokensOnAndOff) {
  REQUIRE_DEFAULT_MODEL();
  const TextModel model = load_text_model(default_model_path());
  const int32_t vocab = static_cast<int32_t>(model.checkpoint.config.vocab_size);
  grammar::GrammarCompiler compiler(*model.tokenizer, vocab, model.checkpoint.config.eos_token_ids);
  grammar::GrammarSpec spec;
  spec.kind = grammar::GrammarSpec::Kind::kJsonSchema;
  spec.text = kSchema;
  spec.strict = true;
  const grammar::CompiledGrammarPtr schema = compiler.compile(spec);

  const std::vector<int32_t> shared =
      model.tokenizer->encode("The history of the city begins with a small harbour where");
  auto request = [&](const std::string& text, int32_t max_tokens, float temperature,
                     uint64_t seed) {
    Request r;
    r.prompt = text.empty() ? shared : model.tokenizer->encode(text);
    r.sampling.max_tokens = max_tokens;
    r.sampling.temperature = temperature;
    r.sampling.top_p = temperature > 0 ? 0.9f : 1.f;
    r.sampling.seed = seed;
    return r;
  };
  std::string long_text;
  for (int i = 0; i < 12; ++i) long_text += "Item " + std::to_string(i) + " is on the list. ";
  std::vector<Request> requests;
  requests.push_back(request("", 24, 0.f, 0));  // 0: greedy, alone first
  Request hit = request("", 20, 0.8f, 11);      // 1: seeded, prefix hit
  hit.prompt.push_back(model.tokenizer->encode(" fishermen").at(0));
  requests.push_back(hit);
  Request penalized = request("Write a list of fruits:", 28, 0.7f, 12);  // 2: penalties, bias
  penalized.sampling.repetition_penalty = 1.3f;
  penalized.sampling.presence_penalty = 0.5f;
  penalized.sampling.frequency_penalty = 0.4f;
  penalized.sampling.logit_bias = {{model.tokenizer->encode(" apple").at(0), 3.f}};
  requests.push_back(penalized);
  requests.push_back(request("Count: one, two, three,", 30, 0.f, 0));   // 3: stop id (below)
  requests.push_back(request("A person as JSON:", 40, 1.f, 13));        // 4: grammar
  requests.push_back(request("The weather today", 10, 0.9f, 14));       // 5: logprobs
  requests.push_back(request(long_text, 16, 0.f, 0));                   // 6: chunked prefill
  requests.push_back(request("Once upon a time", 1, 0.f, 0));           // 7: one token
  requests.push_back(request("My favourite colour is", 26, 0.6f, 15));  // 8: cancelled
  requests.push_back(request("def add(a, b):", 32, 0.f, 0));            // 9: greedy
  requests.push_back(request("Nothing to add", 0, 0.f, 0));             // 10: the prompt alone
  // These run to max_tokens, so that the pool runs out while the others stop where EOS comes.
  for (const int i : {0, 2, 6, 9}) requests[i].sampling.ignore_eos = true;
  const int grammar_index = 4, logprobs_index = 5, cancel_index = 8;
  constexpr int32_t kCancelAfter = 6;

  // Request 3 stops at the fourth token it generates without a stop id (greedy: the same alone
  // as in a batch, which engine_property_test asserts).
  int32_t stop = -1;
  {
    EngineOptions opts;
    opts.threads = 2;
    opts.num_pages = 16;
    Engine alone(model.checkpoint, opts);
    Request first_four = requests[3];
    first_four.sampling.max_tokens = 4;
    first_four.sampling.ignore_eos = true;
    const std::vector<int32_t> tokens = alone.generate({first_four})[0].tokens;
    ASSERT_EQ(tokens.size(), 4u);
    stop = tokens[3];
  }
  requests[3].sampling.stop_token_ids = {stop};

  const Outcome sync_run =
      run(model, 0, requests, schema, grammar_index, logprobs_index, cancel_index, kCancelAfter);
  const Outcome async_run =
      run(model, 1, requests, schema, grammar_index, logprobs_index, cancel_index, kCancelAfter);
  EXPECT_GT(sync_run.preemptions, 0) << "the page pool was meant to force preemption";
  EXPECT_GT(async_run.preemptions, 0) << "the page pool was meant to force preemption";
  EXPECT_GT(async_run.prefix_hits, 0) << "request 1 was meant to hit request 0's pages";
  for (int i = 0; i < static_cast<int>(requests.size()); ++i) {
    ASSERT_TRUE(sync_run.outputs.count(i) && async_run.outputs.count(i)) << "request " << i;
    EXPECT_EQ(async_run.outputs.at(i), sync_run.outputs.at(i)) << "request " << i;
    EXPECT_EQ(async_run.reasons.at(i), sync_run.reasons.at(i)) << "request " << i;
    // What was streamed (billed) is exactly what the output holds.
    for (const Outcome* run : {&sync_run, &async_run}) {
      const auto it = run->streamed.find(i);
      const std::vector<int32_t> streamed =
          it == run->streamed.end() ? std::vector<int32_t>{} : it->second;
      EXPECT_EQ(streamed, run->outputs.at(i)) << "request " << i;
    }
    const std::vector<int32_t>& got = async_run.outputs.at(i);
    ASSERT_LE(got.size(), static_cast<size_t>(requests[i].sampling.max_tokens)) << "request " << i;
  }
  // The stop id ends request 3 at its first occurrence, which is its last token.
  const std::vector<int32_t>& stopped = async_run.outputs.at(3);
  ASSERT_FALSE(stopped.empty());
  EXPECT_EQ(stopped.back(), stop);
  EXPECT_EQ(std::count(stopped.begin(), stopped.end(), stop), 1);
  EXPECT_EQ(async_run.reasons.at(3), FinishReason::kStop);
  EXPECT_EQ(async_run.outputs.at(7).size(), 1u);
  EXPECT_TRUE(async_run.outputs.at(10).empty());
  EXPECT_EQ(async_run.reasons.at(10), FinishReason::kLength);
  EXPECT_EQ(async_run.outputs.at(cancel_index).size(), static_cast<size_t>(kCancelAfter));
  const std::vector<int32_t>& eos = model.checkpoint.config.eos_token_ids;
  for (int i = 0; i < static_cast<int>(requests.size()); ++i) {
    if (requests[i].sampling.ignore_eos) {
      EXPECT_EQ(async_run.outputs.at(i).size(),
                static_cast<size_t>(requests[i].sampling.max_tokens))
          << "request " << i;
      continue;
    }
    const std::vector<int32_t>& got = async_run.outputs.at(i);
    for (size_t t = 0; t + 1 < got.size(); ++t) {
      EXPECT_EQ(std::count(eos.begin(), eos.end(), got[t]), 0)
          << "request " << i << " went on past an EOS at token " << t;
    }
  }
}

}  // namespace
}  // namespace pagedlm
