// A token mask's host cost (xgrammar's FillNextTokenBitmask through grammar::Matcher) on
// SmolLM2's 49,152-token vocabulary, at each position of one JSON document of the schema
// scripts/gpu_host/structured_bench.py serves: the positions inside strings with a maxLength are
// the ones that cost (xgrammar 0.1.27 checked every string token against the bounded repetition
// at run time: 400-760 us a mask on one EPYC thread, against ~10 us with 0.2.9). Reports the
// mean fill and accept time per token of the document (counters `fill_us`, `accept_us`) and the
// dearest fill (`max_fill_us`), the best of the iterations at each position.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <string>
#include <vector>

#include "pagedlm/grammar/grammar.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm {
namespace {

constexpr int32_t kEos = 2;  // SmolLM2's <|im_end|>

// structured_bench.py's SCHEMA.
const char* kSchema = R"({"type": "object", "properties": {
  "title": {"type": "string", "maxLength": 40},
  "status": {"enum": ["draft", "review", "published"]},
  "items": {"type": "array", "minItems": 1, "maxItems": 40, "items": {"type": "object",
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "qty": {"type": "integer", "minimum": 0, "maximum": 999},
                   "price": {"type": "number"},
                   "tags": {"type": "array", "maxItems": 3,
                            "items": {"type": "string", "maxLength": 12}}},
    "required": ["name", "qty", "price", "tags"]}}},
  "required": ["title", "status", "items"]})";

// A document of that schema as xgrammar writes it without free whitespace (", " and ": ").
const char* kDocument =
    R"J({"title": "Small Hardware Store Inventory", "status": "draft", "items": [)J"
    R"J({"name": "Hammer", "qty": 12, "price": 9.99, "tags": ["tools", "steel"]}, )J"
    R"J({"name": "Screwdriver set", "qty": 30, "price": 14.5, "tags": ["tools"]}, )J"
    R"J({"name": "Nails (1 lb)", "qty": 200, "price": 3.25, "tags": ["fasteners", "bulk"]}, )J"
    R"J({"name": "Paint brush", "qty": 45, "price": 4.75, "tags": []}]})J";

void BM_JsonSchemaMasks(benchmark::State& state) {
  const Tokenizer tok = Tokenizer::from_tokenizer_json(std::string(PAGEDLM_TESTDATA) +
                                                       "/tokenizer/smollm2/tokenizer.json");
  grammar::GrammarCompiler compiler(tok, tok.vocab_size(), {kEos});
  grammar::GrammarSpec spec;
  spec.kind = grammar::GrammarSpec::Kind::kJsonSchema;
  spec.text = kSchema;
  const grammar::CompiledGrammarPtr compiled = compiler.compile(spec);
  const std::vector<int32_t> ids = tok.encode(kDocument, /*add_special_tokens=*/false);
  std::vector<int32_t> mask(grammar::bitmask_words(tok.vocab_size()));
  std::vector<double> fill_us(ids.size(), 1e30), accept_us(ids.size(), 1e30);
  using Clock = std::chrono::steady_clock;
  const auto us = [](Clock::duration d) {
    return std::chrono::duration<double, std::micro>(d).count();
  };
  for (auto _ : state) {
    grammar::Matcher matcher(compiled);
    for (size_t i = 0; i < ids.size(); ++i) {
      const auto t0 = Clock::now();
      matcher.fill_mask(mask.data());
      const auto t1 = Clock::now();
      if (!matcher.accept(ids[i])) {
        state.SkipWithError("the grammar refused a token of the document");
        return;
      }
      const auto t2 = Clock::now();
      fill_us[i] = std::min(fill_us[i], us(t1 - t0));
      accept_us[i] = std::min(accept_us[i], us(t2 - t1));
    }
    benchmark::DoNotOptimize(mask.data());
  }
  double fill = 0, accept = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    fill += fill_us[i];
    accept += accept_us[i];
  }
  state.counters["tokens"] = static_cast<double>(ids.size());
  state.counters["fill_us"] = fill / ids.size();
  state.counters["accept_us"] = accept / ids.size();
  state.counters["max_fill_us"] = *std::max_element(fill_us.begin(), fill_us.end());
}
BENCHMARK(BM_JsonSchemaMasks)->Unit(benchmark::kMillisecond)->Iterations(10);

}  // namespace
}  // namespace pagedlm

BENCHMARK_MAIN();
