// The grammar layer on SmolLM2's tokenizer: masks checked against the vocabulary's bytes (each
// allowed token must continue a string the grammar accepts, and every such token is allowed),
// matchers that reach the end of a grammar accept EOS and terminate, and bad grammars are
// refused with GrammarError before or during compilation.
#include "pagedlm/grammar/grammar.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
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
  expect_refused(schema(R"({"type":"string","format":"hostname","maxLength":30})"),
                 "together with 'minLength' or 'maxLength' is not supported");
  expect_refused(schema(R"({"type":"string","format":"email","pattern":"a"})"),
                 "'pattern' together with 'format'");
  expect_refused(schema(R"({"format":"email","enum":["a@b"]})"), "beside 'enum' without a 'type'");
  expect_refused(schema(R"({"type":"string","format":"uuid","maxLength":-1})"),
                 "'maxLength' must be a non-negative integer");
  // No uuid is shorter than 36 characters, no date longer than 10.
  expect_refused(schema(R"({"type":"string","format":"uuid","maxLength":30})"),
                 "no \"uuid\" string has a length from 0 to 30 characters");
  // A URI of up to 2048 characters takes some 40000 rules (the URI automaton's states times
  // the lengths), more than a compilation may build.
  expect_refused(schema(R"({"type":"string","format":"uri","maxLength":2048})"),
                 "grammar rules, more than the 2048 allowed");
  expect_refused(schema(R"({"type":"string","format":"email","minLength":100000000})"),
                 "needs over 100000000 grammar rules, more than the 2048 allowed");
  expect_refused(schema(R"({"type":"string","format":"date","minLength":11})"),
                 "no \"date\" string has a length from 11 characters up");
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

// Whether the grammar takes `text` whole, then EOS.
bool takes(const CompiledGrammarPtr& grammar, const std::string& text) {
  Matcher m(grammar);
  for (int32_t id : smollm2().encode(text, false)) {
    if (!m.accept(id)) return false;
  }
  return m.accept(kEos) && m.terminated();
}

struct FormatCase {
  std::string schema;
  std::vector<std::string> valid;    // strings of the format within the bound
  std::vector<std::string> refused;  // outside the format or the bound
};

// A format with a length bound (and without one) holds both: the examples are the RFCs' own
// (RFC 3339 section 5.8, RFC 4122 section 3, RFC 4291 section 2.2, RFC 3986 section 1.1.2) and
// strings that the RFCs or the bound rule out.
TEST(Grammar, StringFormatsHoldTheirLengthBounds) {
  const std::vector<FormatCase> cases = {
      {R"({"type":"string","format":"email","maxLength":20})",
       {"a@b.co", "user@localhost", "o'neil+x@mail.ex"},
       {"first.last@example.com", "a..b@c.de", "@b.co", "a@-b.co", "a@b.co-", "a b@c.de", "ab"}},
      {R"({"type":"string","format":"email"})",
       {"first.last@example.com", "a@b", "x@" + std::string(300, 'y') + ".example"},
       {"first..last@example.com", "a@b.", "a@b_c.d", ""}},
      {R"({"type":"string","format":"email","minLength":10,"maxLength":12})",
       {"a@bcdefg.hi", "john@doe.com"},
       {"a@b.cd", "johnny@doe.com"}},
      {R"({"type":"string","format":"date"})",
       {"1985-04-12", "2024-02-29", "2000-02-29", "1937-01-01"},
       {"2023-02-29", "1900-02-29", "2023-04-31", "0000-01-01", "2023-13-01", "2023-1-01"}},
      {R"({"type":"string","format":"time","minLength":12,"maxLength":14})",
       {"23:20:50.52Z", "16:39:57-08:00", "12:30:05.250z"},
       {"23:20:50Z", "12:30:05.1+01:00", "12:30:60.00Z", "24:00:00.00Z"}},
      {R"({"type":"string","format":"date-time","maxLength":22})",
       {"1985-04-12T23:20:50.5Z", "1996-12-19T16:39:57Z", "1990-12-31t23:59:59z"},
       {"1985-04-12T23:20:50.52Z", "1996-12-19T16:39:57-08:00", "1996-12-19 16:39:57Z"}},
      {R"({"type":"string","format":"uuid","minLength":36})",
       {"f81d4fae-7dec-11d0-a765-00a0c91e6bf6"},
       {"f81d4fae7dec11d0a76500a0c91e6bf6", "f81d4fae-7dec-11d0-a765-00a0c91e6bf"}},
      // Bounds past the format's longest string, or past int32, bound nothing.
      {R"({"type":"string","format":"uuid","maxLength":18446744073709551615})",
       {"f81d4fae-7dec-11d0-a765-00a0c91e6bf6"},
       {"f81d4fae-7dec-11d0-a765-00a0c91e6bf"}},
      {R"({"type":"string","format":"email","maxLength":3000000000})",
       {"x@" + std::string(300, 'y')},
       {"x@"}},
      {R"({"type":"string","format":"ipv4","maxLength":9})",
       {"127.0.0.1", "10.0.0.10", "0.0.0.0"},
       {"192.168.0.1", "01.2.3.4", "256.1.1.1", "1.2.3"}},
      {R"({"type":"string","format":"ipv6","maxLength":16})",
       {"::1", "2001:DB8::417A", "FF01::101", "::", "::13.1.68.3", "::FFFF:1.2.3.4"},
       {"2001:DB8::8:800:417A", "1:2:3:4:5:6:7:8:9", "1::2::3", "12345::", ":1"}},
      {R"({"type":"string","format":"uri","maxLength":30})",
       {"ftp://ftp.is.co.za/rfc/rfc1808", "mailto:John.Doe@example.com",
        "urn:oasis:names:specification", "tel:+1-816-555-1212", "http://user@host:80/"},
       {"http://www.ietf.org/rfc/rfc2396.txt", "1http://x", "http://exa mple.com", "no-scheme",
        "http://a/%zz"}},
  };
  for (const FormatCase& c : cases) {
    const CompiledGrammarPtr g = compiler().compile(schema(c.schema));
    for (const std::string& text : c.valid) {
      EXPECT_TRUE(takes(g, "\"" + text + "\"")) << c.schema << " refused " << text;
    }
    for (const std::string& text : c.refused) {
      EXPECT_FALSE(takes(g, "\"" + text + "\"")) << c.schema << " took " << text;
    }
  }
}

// Random walks through a bounded format, in an object and behind a tool call's tags: every
// finished one is a document whose string has a length within the bound and an "@".
TEST(Grammar, BoundedFormatWalksStayInTheBound) {
  GrammarSpec spec = schema(
      R"({"type":"object","properties":{"to":{"$ref":"#/$defs/mail"}},"required":["to"],)"
      R"("$defs":{"mail":{"type":"string","format":"email","minLength":8,"maxLength":16}}})");
  spec.prefix = "<tool_call>";
  spec.suffix = "</tool_call>";
  const Tokenizer& tok = smollm2();
  std::vector<int32_t> mask(bitmask_words(tok.vocab_size()));
  std::mt19937 random(7);
  for (int walk = 0; walk < 24; ++walk) {
    Matcher m(compiler().compile(spec));
    std::string written;
    for (int step = 0; step < 200 && !m.terminated(); ++step) {
      ASSERT_TRUE(m.fill_mask(mask.data()));
      std::vector<int32_t> options;
      for (int32_t id = 0; id < tok.vocab_size(); ++id) {
        if (allowed(mask, id)) options.push_back(id);
      }
      ASSERT_FALSE(options.empty()) << written;
      const int32_t pick = options[random() % options.size()];
      ASSERT_TRUE(m.accept(pick));
      if (pick != kEos) written += tok.token_to_bytes(pick);
    }
    ASSERT_TRUE(m.terminated()) << written;
    ASSERT_EQ(written.rfind("<tool_call>", 0), 0u) << written;
    ASSERT_GE(written.size(), 23u) << written;
    ASSERT_EQ(written.substr(written.size() - 12), "</tool_call>") << written;
    const auto doc = nlohmann::json::parse(written.substr(11, written.size() - 23), nullptr,
                                           /*allow_exceptions=*/false);
    ASSERT_TRUE(doc.is_object() && doc.contains("to") && doc["to"].is_string()) << written;
    const std::string to = doc["to"];
    EXPECT_GE(to.size(), 8u) << to;
    EXPECT_LE(to.size(), 16u) << to;
    EXPECT_NE(to.find('@'), std::string::npos) << to;
  }
}

// Random walks through each built format, alone and with a length bound: every walk ends (the
// grammar never leaves a string without a way to finish) within its bound. With
// PAGEDLM_FORMAT_SAMPLES set, the strings go to that file as JSON lines {"schema", "value"}, which
// tests/grammar_formats_test.py checks with jsonschema's format checkers: whether each string
// is of its format is for a validator pagedlm did not write to say.
TEST(Grammar, FormatWalksEndWithinTheirBounds) {
  struct Bounded {
    std::string format;
    int64_t min_length, max_length;  // -1: none
  };
  const std::vector<Bounded> formats = {
      {"email", 0, -1}, {"email", 6, 30}, {"date", 0, -1},      {"date", 10, 10},
      {"time", 0, -1},  {"time", 12, 20}, {"date-time", 0, -1}, {"date-time", 0, 28},
      {"uuid", 0, -1},  {"uuid", 36, 40}, {"ipv4", 0, -1},      {"ipv4", 10, 13},
      {"ipv6", 0, -1},  {"ipv6", 20, 30}, {"uri", 0, -1},       {"uri", 12, 40}};
  const char* path = std::getenv("PAGEDLM_FORMAT_SAMPLES");
  std::ofstream samples;
  if (path != nullptr) samples.open(path);
  const Tokenizer& tok = smollm2();
  std::vector<int32_t> mask(bitmask_words(tok.vocab_size()));
  std::mt19937 random(11);
  for (const Bounded& f : formats) {
    nlohmann::json doc = {{"type", "string"}, {"format", f.format}};
    if (f.min_length > 0) doc["minLength"] = f.min_length;
    if (f.max_length >= 0) doc["maxLength"] = f.max_length;
    const CompiledGrammarPtr g = compiler().compile(schema(doc.dump()));
    int finished = 0;
    for (int walk = 0; walk < 60; ++walk) {
      Matcher m(g);
      std::string written;
      for (int step = 0; step < 150 && !m.terminated(); ++step) {
        ASSERT_TRUE(m.fill_mask(mask.data()));
        std::vector<int32_t> options, single_bytes;
        for (int32_t id = 0; id < tok.vocab_size(); ++id) {
          if (!allowed(mask, id)) continue;
          options.push_back(id);
          if (id != kEos && tok.token_to_bytes(id).size() == 1) single_bytes.push_back(id);
        }
        ASSERT_FALSE(options.empty()) << written;
        // Every other step a one-byte token, if any, so that the walks reach the automaton's
        // corners rather than only what long tokens spell.
        const std::vector<int32_t>& from =
            step % 2 == 1 && !single_bytes.empty() ? single_bytes : options;
        const int32_t pick = from[random() % from.size()];
        ASSERT_TRUE(m.accept(pick));
        if (pick != kEos) written += tok.token_to_bytes(pick);
      }
      if (!m.terminated()) continue;  // 150 tokens of an unbounded format: no finished string
      ++finished;
      const auto value = nlohmann::json::parse(written, nullptr, /*allow_exceptions=*/false);
      ASSERT_TRUE(value.is_string()) << written;
      const auto length = static_cast<int64_t>(value.get<std::string>().size());
      EXPECT_GE(length, f.min_length) << written;
      if (f.max_length >= 0) EXPECT_LE(length, f.max_length) << written;
      if (samples.is_open())
        samples << nlohmann::json{{"schema", doc}, {"value", value}}.dump() << "\n";
    }
    EXPECT_GE(finished, 10) << doc.dump();
  }
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
