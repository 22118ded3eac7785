// The grammar layer on SmolLM2's tokenizer: masks checked against the vocabulary's bytes (each
// allowed token must continue a string the grammar accepts, and every such token is allowed),
// matchers that reach the end of a grammar accept EOS and terminate, and bad grammars are
// refused with GrammarError before or during compilation.
#include "pagedlm/grammar/grammar.h"

#include <gtest/gtest.h>

#include <chrono>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::grammar {
namespace {

const std::string kTestdata = PAGEDLM_TESTDATA;
constexpr int32_t kEos = 2;  // SmolLM2's <|im_end|>

const Tokenizer& smollm2() {
  static const Tokenizer t =
      Tokenizer::from_tokenizer_json(kTestdata + "/tokenizer/smollm2/tokenizer.json");
  return t;
}

GrammarCompiler& compiler() {
  static GrammarCompiler c(smollm2(), smollm2().vocab_size(), {kEos});
  return c;
}

bool allowed(const std::vector<int32_t>& mask, int32_t token) {
  return (static_cast<uint32_t>(mask[token / 32]) >> (token % 32)) & 1u;
}

GrammarSpec choice(std::vector<std::string> choices) {
  GrammarSpec spec;
  spec.kind = GrammarSpec::Kind::kChoice;
  spec.choices = std::move(choices);
  return spec;
}

GrammarSpec schema(const std::string& text) {
  GrammarSpec spec;
  spec.kind = GrammarSpec::Kind::kJsonSchema;
  spec.text = text;
  spec.strict = true;
  return spec;
}

// For a choice grammar the allowed set is known from the vocabulary alone: non-special tokens
// whose bytes extend `written` along one of the choices (and, once a choice is complete, EOS).
TEST(Grammar, ChoiceMaskIsExactlyTheTokensThatContinueAChoice) {
  const std::vector<std::string> choices = {"red", "green", "blue"};
  Matcher m(compiler().compile(choice(choices)));
  const Tokenizer& tok = smollm2();
  std::vector<int32_t> mask(bitmask_words(tok.vocab_size()));
  std::string written;
  const std::string target = "green";
  while (true) {
    ASSERT_TRUE(m.fill_mask(mask.data()));
    int32_t allowed_count = 0;
    for (int32_t id = 0; id < tok.vocab_size(); ++id) {
      bool expect = false;
      if (id == kEos) {
        for (const std::string& c : choices) expect |= c == written;
      } else if (!tok.is_special(id)) {
        const std::string bytes = tok.token_to_bytes(id);
        for (const std::string& c : choices) {
          expect |= !bytes.empty() && c.compare(0, written.size(), written) == 0 &&
                    c.size() >= written.size() + bytes.size() &&
                    c.compare(written.size(), bytes.size(), bytes) == 0;
        }
      }
      ASSERT_EQ(allowed(mask, id), expect) << "token " << id << " after '" << written << "'";
      allowed_count += expect;
    }
    ASSERT_GT(allowed_count, 0);
    if (written == target) break;
    // Advance by the longest allowed token that stays on "green".
    int32_t best = -1;
    size_t best_len = 0;
    for (int32_t id = 0; id < tok.vocab_size(); ++id) {
      if (id == kEos || !allowed(mask, id)) continue;
      const std::string& bytes = tok.token_to_bytes(id);
      if (target.compare(written.size(), bytes.size(), bytes) == 0 && bytes.size() > best_len) {
        best = id;
        best_len = bytes.size();
      }
    }
    ASSERT_GE(best, 0);
    ASSERT_TRUE(m.accept(best));
    written += tok.token_to_bytes(best);
  }
  EXPECT_FALSE(m.terminated());
  EXPECT_FALSE(m.accept(tok.encode("x", false).at(0)));  // refused, state unchanged
  EXPECT_TRUE(m.accept(kEos));
  EXPECT_TRUE(m.terminated());
}

TEST(Grammar, JsonSchemaWalkEndsInAValidDocument) {
  // Greedy walk that always takes the lowest allowed id: whatever the path, the text written
  // when the matcher allows EOS must be a complete document of the schema's shape.
  Matcher m(compiler().compile(
      schema(R"({"type":"object","properties":{"ok":{"type":"boolean"}},"required":["ok"]})")));
  const Tokenizer& tok = smollm2();
  std::vector<int32_t> mask(bitmask_words(tok.vocab_size()));
  std::string written;
  for (int step = 0; step < 64 && !m.terminated(); ++step) {
    ASSERT_TRUE(m.fill_mask(mask.data()));
    int32_t pick = -1;
    for (int32_t id = 0; id < tok.vocab_size() && pick < 0; ++id) {
      if (allowed(mask, id)) pick = id;
    }
    ASSERT_GE(pick, 0);
    if (pick == kEos) {
      ASSERT_TRUE(m.accept(pick));
      break;
    }
    ASSERT_TRUE(m.accept(pick));
    written += tok.token_to_bytes(pick);
  }
  EXPECT_TRUE(m.terminated());
  const auto doc = nlohmann::json::parse(written, nullptr, /*allow_exceptions=*/false);
  ASSERT_TRUE(doc.is_object()) << written;
  EXPECT_EQ(doc.size(), 1u) << written;
  EXPECT_TRUE(doc.contains("ok") && doc["ok"].is_boolean()) << written;
}

TEST(Grammar, CompiledGrammarsAreCached) {
  const auto a = compiler().compile(schema(R"({"type":"integer"})"));
  const int64_t bytes = compiler().cache_bytes();
  EXPECT_GT(bytes, 0);
  const auto b = compiler().compile(schema(R"({"type":"integer"})"));
  EXPECT_EQ(compiler().cache_bytes(), bytes);  // served from the cache, nothing added
  EXPECT_EQ(a.get(), b.get());                 // the same compiled grammar, from the recent ones
  Matcher m(b);
  EXPECT_EQ(m.vocab_size(), smollm2().vocab_size());
}

// The recent grammars hold at most a quarter of the cache's bytes: with no room, a grammar is
// compiled (found in xgrammar's cache) again rather than kept.
TEST(Grammar, RecentGrammarsStayWithinTheirBytes) {
  CompilerLimits limits;
  limits.cache_bytes = 4;
  GrammarCompiler tiny(smollm2(), smollm2().vocab_size(), {kEos}, limits);
  const auto a = tiny.compile(schema(R"({"type":"integer"})"));
  EXPECT_NE(tiny.compile(schema(R"({"type":"integer"})")).get(), a.get());
}

// The recent grammars are told apart by everything a grammar depends on.
TEST(Grammar, DifferentSpecsGetDifferentGrammars) {
  GrammarSpec strict = schema(R"({"type":"object","properties":{"a":{"type":"integer"}}})");
  GrammarSpec loose = strict;
  loose.strict = false;
  EXPECT_NE(compiler().compile(strict).get(), compiler().compile(loose).get());
  GrammarSpec tagged = strict;
  tagged.prefix = "<tool_call>";
  EXPECT_NE(compiler().compile(strict).get(), compiler().compile(tagged).get());
  GrammarSpec regex;
  regex.kind = GrammarSpec::Kind::kRegex;
  regex.text = "ab|c";
  GrammarSpec ebnf = regex;
  ebnf.kind = GrammarSpec::Kind::kEbnf;
  ebnf.text = R"(root ::= "ab" | "c")";
  EXPECT_NE(compiler().compile(regex).get(), compiler().compile(ebnf).get());
  // Choices "ab", "c" and "a", "bc" write the same bytes in a row, not the same fields.
  Matcher first(compiler().compile(choice({"ab", "c"})));
  Matcher second(compiler().compile(choice({"a", "bc"})));
  const Tokenizer& tok = smollm2();
  EXPECT_TRUE(first.accept(tok.encode("c", false).at(0)));
  EXPECT_FALSE(second.accept(tok.encode("c", false).at(0)));
}

void expect_refused(const GrammarSpec& spec, const std::string& fragment) {
  try {
    compiler().compile(spec);
    ADD_FAILURE() << "compiled: " << spec.text;
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    // The reason reaches API clients (400): xgrammar's own source files are no part of it.
    EXPECT_EQ(std::string(e.what()).find(".cc:"), std::string::npos) << e.what();
  }
}

TEST(Grammar, BadSchemasAreRefused) {
  expect_refused(schema("{\"type\": "), "not valid JSON");
  // multipleOf only where xgrammar enforces it: an integer step on an integer, at most 1024.
  expect_refused(schema(R"({"type":"number","multipleOf":3})"), "'multipleOf' is supported on");
  expect_refused(schema(R"({"type":"integer","multipleOf":2.5})"), "'multipleOf' is supported on");
  expect_refused(schema(R"({"type":"integer","multipleOf":5000})"), "from 1 to 1024");
  expect_refused(schema(R"({"properties":{"a":{"not":{"type":"string"}}}})"),
                 "at /properties/a: the keyword 'not'");
  expect_refused(schema(R"({"$ref":"http://example.com/s.json"})"), "only local '$ref'");
  expect_refused(schema(R"({"type":"string","pattern":"a+","maxLength":3})"), "'pattern' together");
  expect_refused(schema(R"({"type":"string","format":"email","maxLength":30})"),
                 "'format' together");
  expect_refused(schema(R"({"type":"string","format":"credit-card"})"), "is not supported");
  std::string deep;
  for (int i = 0; i < 200; ++i) deep += R"({"type":"object","properties":{"a":)";
  deep += R"({"type":"integer"})";
  for (int i = 0; i < 200; ++i) deep += "}}";
  expect_refused(schema(deep), "nests deeper than");
  std::string big = R"({"enum":[)";
  for (int i = 0; i < 5000; ++i) big += (i ? "," : "") + std::to_string(i);
  expect_refused(schema(big + "]}"), "enum values");
  expect_refused(schema(R"({"type":"string","pattern":"(a"})"), "cannot be compiled");
  expect_refused(schema(std::string(1 << 19, ' ')), "longer than");
}

TEST(Grammar, BadGrammarsAndChoicesAreRefused) {
  GrammarSpec ebnf;
  ebnf.kind = GrammarSpec::Kind::kEbnf;
  ebnf.text = "root ::= \"a\" | undefined_rule";
  expect_refused(ebnf, "cannot be compiled");
  ebnf.text = "";
  expect_refused(ebnf, "is empty");
  GrammarSpec regex;
  regex.kind = GrammarSpec::Kind::kRegex;
  regex.text = "[a-";
  expect_refused(regex, "cannot be compiled");
  expect_refused(choice({}), "at least one");
  expect_refused(choice({"a", ""}), "must not be empty");
}

TEST(Grammar, CompileTimeIsBounded) {
  CompilerLimits limits;
  limits.compile_timeout = std::chrono::milliseconds(0);
  GrammarCompiler bounded(smollm2(), smollm2().vocab_size(), {kEos}, limits);
  GrammarSpec spec = schema(R"({"type":"object","properties":{"x":{"type":"string"}}})");
  try {
    bounded.compile(spec);
    ADD_FAILURE() << "a zero time bound let a compilation through";
  } catch (const GrammarError& e) {
    EXPECT_NE(std::string(e.what()).find("did not compile within 0 ms"), std::string::npos)
        << e.what();
  }
  // The abandoned compilation finishes on its own thread; let it land before the process ends.
  std::this_thread::sleep_for(std::chrono::seconds(2));
}

}  // namespace
}  // namespace pagedlm::grammar
