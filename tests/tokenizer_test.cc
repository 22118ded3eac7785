// Parity of the tokenizer with the HF `tokenizers` library on the SmolLM2 vocabulary
// (testdata/tokenizer, written by scripts/make_tokenizer_reference.py), the streaming decoder,
// and the errors of the tokenizer.json loader.
#include "pagedlm/tokenizer/tokenizer.h"

#include <gtest/gtest.h>

#include <atomic>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <sstream>
#include <thread>

#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/unicode.h"

namespace pagedlm {
namespace {

using nlohmann::json;

const std::string kTestdata = std::string(PAGEDLM_TESTDATA) + "/tokenizer";
const std::string kSmolTokenizer = kTestdata + "/smollm2/tokenizer.json";

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in) << path;
  std::ostringstream out;
  out << in.rdbuf();
  return out.str();
}

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

std::string printable(const std::string& bytes) {
  return json(unicode::to_valid_utf8(bytes)).dump();
}

struct Case {
  std::string category;
  std::string text;  // raw bytes, possibly invalid UTF-8
  std::vector<int32_t> ids;
  std::string decoded;
  std::string decoded_skip_special;
  json doc;
};

const std::vector<Case>& cases() {
  static const std::vector<Case> all = [] {
    const json doc = json::parse(read_file(kTestdata + "/smollm2_cases.json"));
    std::vector<Case> out;
    for (const json& c : doc.at("cases")) {
      out.push_back({c.at("category"), from_hex(c.at("text_hex")),
                     c.at("ids").get<std::vector<int32_t>>(), c.at("decoded"),
                     c.at("decoded_skip_special"), c});
    }
    return out;
  }();
  return all;
}

const Tokenizer& smollm2() {
  static const Tokenizer tokenizer = Tokenizer::from_tokenizer_json(kSmolTokenizer);
  return tokenizer;
}

TEST(TokenizerReference, HasEnoughVariedCases) {
  ASSERT_GE(cases().size(), 2000u);
  std::set<std::string> categories;
  size_t invalid = 0;
  for (const Case& c : cases()) {
    categories.insert(c.category);
    invalid += !unicode::is_valid_utf8(c.text);
  }
  EXPECT_GE(categories.size(), 10u);
  EXPECT_GE(invalid, 100u);
}

TEST(Tokenizer, KnownVectors) {
  const Tokenizer& tok = smollm2();
  EXPECT_EQ(tok.encode("Hello world! 123"),
            (std::vector<int32_t>{19556, 905, 17, 216, 33, 34, 35}));
  EXPECT_EQ(tok.encode("\n"), (std::vector<int32_t>{198}));
  EXPECT_EQ(tok.encode(""), (std::vector<int32_t>{}));
}

TEST(Tokenizer, SmolLM2Metadata) {
  const Tokenizer& tok = smollm2();
  EXPECT_EQ(tok.vocab_size(), 49152);
  EXPECT_EQ(tok.model().num_merges(), 48900u);
  EXPECT_EQ(tok.bos_id(), 1);  // from tokenizer_config.json beside tokenizer.json
  EXPECT_EQ(tok.eos_id(), 2);
  for (int32_t id = 0; id <= 16; ++id) {
    EXPECT_TRUE(tok.is_special(id)) << id;
    EXPECT_EQ(tok.token_type(id), TokenType::kControl);
  }
  EXPECT_FALSE(tok.is_special(17));
  EXPECT_FALSE(tok.is_special(-1));
  EXPECT_FALSE(tok.is_special(49152));
  EXPECT_EQ(tok.token_to_piece(1), "<|im_start|>");
  EXPECT_EQ(tok.token_to_piece(198), "Ċ");
  EXPECT_EQ(tok.token_to_bytes(198), "\n");
  EXPECT_EQ(tok.token_to_piece(216), "Ġ");
  EXPECT_EQ(tok.token_to_id("Ċ"), 198);
  EXPECT_EQ(tok.token_to_id("<|im_end|>"), 2);
  EXPECT_EQ(tok.token_to_id("no such token"), std::nullopt);
  EXPECT_EQ(tok.token_to_piece(-5), "");
  EXPECT_EQ(tok.token_to_piece(1 << 30), "");
}

TEST(Tokenizer, EncodeMatchesReference) {
  const Tokenizer& tok = smollm2();
  int failures = 0;
  for (const Case& c : cases()) {
    const std::vector<int32_t> ids = tok.encode(c.text);
    if (ids != c.ids && ++failures <= 10) {
      ADD_FAILURE() << c.category << " " << printable(c.text) << "\n got " << json(ids).dump()
                    << "\nwant " << json(c.ids).dump();
    }
  }
  EXPECT_EQ(failures, 0) << "of " << cases().size();
}

TEST(Tokenizer, SpecialTokensAsTextMatchReference) {
  const Tokenizer& tok = smollm2();
  int compared = 0;
  for (const Case& c : cases()) {
    if (!c.doc.contains("ids_no_special")) continue;
    ++compared;
    EXPECT_EQ(tok.encode(c.text, /*add_special_tokens=*/true, /*parse_special=*/false),
              c.doc["ids_no_special"].get<std::vector<int32_t>>())
        << printable(c.text);
  }
  EXPECT_GE(compared, 100);
}

TEST(Tokenizer, DecodeMatchesReference) {
  const Tokenizer& tok = smollm2();
  for (const Case& c : cases()) {
    EXPECT_EQ(tok.decode(c.ids), c.decoded) << c.category << " " << printable(c.text);
    EXPECT_EQ(tok.decode(c.ids, /*skip_special_tokens=*/true), c.decoded_skip_special)
        << c.category << " " << printable(c.text);
  }
}

TEST(Tokenizer, DecodeSkipsIdsOutsideTheVocabulary) {
  const Tokenizer& tok = smollm2();
  EXPECT_EQ(tok.decode(std::vector<int32_t>{19556, -1, 49152, 1 << 30, 905}), "Hello world");
}

TEST(Tokenizer, InvalidUtf8IsReplacedLikePython) {
  int compared = 0;
  for (const Case& c : cases()) {
    if (!c.doc.contains("sanitized_hex")) {
      EXPECT_TRUE(unicode::is_valid_utf8(c.text)) << printable(c.text);
      continue;
    }
    ++compared;
    EXPECT_FALSE(unicode::is_valid_utf8(c.text));
    EXPECT_EQ(unicode::to_valid_utf8(c.text), from_hex(c.doc["sanitized_hex"]))
        << printable(c.text);
  }
  EXPECT_GE(compared, 100);
}

// Every chunk must be valid UTF-8 on its own, so a client can print it immediately.
void expect_stream_equals_decode(const Tokenizer& tok, const std::vector<int32_t>& ids,
                                 bool skip_special, const std::string& label) {
  StreamDecoder stream(tok, skip_special);
  std::string streamed;
  for (int32_t id : ids) {
    const std::string chunk = stream.push(id);
    ASSERT_TRUE(unicode::is_valid_utf8(chunk)) << label;
    streamed += chunk;
  }
  const std::string tail = stream.finish();
  ASSERT_TRUE(unicode::is_valid_utf8(tail)) << label;
  streamed += tail;
  EXPECT_EQ(streamed, tok.decode(ids, skip_special)) << label;
}

TEST(StreamDecoder, ConcatenationEqualsDecode) {
  const Tokenizer& tok = smollm2();
  for (const Case& c : cases()) {
    expect_stream_equals_decode(tok, c.ids, false, c.category + " " + printable(c.text));
    expect_stream_equals_decode(tok, c.ids, true, c.category + " " + printable(c.text));
  }
}

TEST(StreamDecoder, HoldsBackPartialCharacters) {
  const Tokenizer& tok = smollm2();
  // One id per byte of "é😀": each byte symbol that is in the vocabulary is its own token.
  const std::string text = "\xC3\xA9\xF0\x9F\x98\x80";
  std::vector<int32_t> ids;
  for (char byte : text) {
    const auto id = tok.token_to_id(unicode::byte_to_symbol(static_cast<uint8_t>(byte)));
    ASSERT_TRUE(id.has_value()) << static_cast<int>(static_cast<uint8_t>(byte));
    ids.push_back(*id);
  }
  StreamDecoder stream(tok);
  EXPECT_EQ(stream.push(ids[0]), "");
  EXPECT_EQ(stream.push(ids[1]), "é");
  EXPECT_EQ(stream.push(ids[2]), "");
  EXPECT_EQ(stream.push(ids[3]), "");
  EXPECT_EQ(stream.push(ids[4]), "");
  EXPECT_EQ(stream.push(ids[5]), "😀");
  EXPECT_EQ(stream.finish(), "");

  // An unfinished character is flushed as one U+FFFD; a byte that can never start one at once.
  EXPECT_EQ(stream.push(ids[2]), "");
  EXPECT_EQ(stream.push(ids[3]), "");
  EXPECT_EQ(stream.finish(), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.push(ids[3]), "\xEF\xBF\xBD");
  EXPECT_EQ(stream.push(ids[2]), "");
  EXPECT_EQ(stream.push(tok.encode("a")[0]),
            "\xEF\xBF\xBD"
            "a");
}

TEST(StreamDecoder, RandomIdSequences) {
  const Tokenizer& tok = smollm2();
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> any_id(0, tok.vocab_size() - 1);
  for (int trial = 0; trial < 300; ++trial) {
    std::vector<int32_t> ids(1 + rng() % 40);
    for (int32_t& id : ids) id = any_id(rng);
    expect_stream_equals_decode(tok, ids, trial % 2 == 0, "trial " + std::to_string(trial));
  }
}

TEST(Tokenizer, RoundTripsValidText) {
  const Tokenizer& tok = smollm2();
  for (const Case& c : cases()) {
    if (!unicode::is_valid_utf8(c.text)) continue;
    // Bytes missing from the SmolLM2 vocabulary are dropped, so only texts without them round-trip.
    bool all_bytes_known = true;
    for (char byte : c.text) {
      all_bytes_known &= tok.token_to_id(unicode::byte_to_symbol(byte)).has_value();
    }
    if (all_bytes_known) EXPECT_EQ(tok.decode(tok.encode(c.text)), c.text) << printable(c.text);
  }
}

// encode() is const and shares its piece cache between threads.
TEST(Tokenizer, ConcurrentEncodesAgree) {
  const Tokenizer tok = Tokenizer::from_tokenizer_json(kSmolTokenizer);
  std::vector<std::thread> threads;
  std::atomic<int> failures{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (size_t i = t; i < cases().size(); i += 2) {
        if (tok.encode(cases()[i].text) != cases()[i].ids) ++failures;
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  EXPECT_EQ(failures.load(), 0);
}

TEST(Tokenizer, LongInputs) {
  const Tokenizer& tok = smollm2();
  const std::string spaces(1 << 20, ' ');
  const std::vector<int32_t> ids = tok.encode(spaces);
  EXPECT_EQ(tok.decode(ids), spaces);
  std::string mixed;
  std::mt19937 rng(3);
  for (int i = 0; i < 200000; ++i) mixed.push_back(static_cast<char>(rng() % 256));
  EXPECT_TRUE(unicode::is_valid_utf8(tok.decode(tok.encode(mixed))));
}

// The reference file stores merges as pairs; the older "a b" string form must load identically.
TEST(TokenizerJson, StringMergesEqualPairMerges) {
  json doc = json::parse(read_file(kSmolTokenizer));
  for (json& merge : doc["model"]["merges"]) {
    merge = merge[0].get<std::string>() + " " + merge[1].get<std::string>();
  }
  const Tokenizer strings = Tokenizer::from_tokenizer_json_text(doc.dump(), "string merges");
  for (size_t i = 0; i < cases().size(); i += 7) {
    EXPECT_EQ(strings.encode(cases()[i].text), cases()[i].ids) << printable(cases()[i].text);
  }
}

TEST(PreTokenizer, Qwen2AndLlama3SplitsMatchReference) {
  PreTokenizer qwen2, llama3;
  qwen2.add_split(kQwen2Pattern);
  llama3.add_split(kLlama3Pattern);
  int failures = 0;
  for (const Case& c : cases()) {
    const std::string text = unicode::to_valid_utf8(c.text);
    for (const auto& [pre, key] : {std::pair{&qwen2, "qwen2_pieces"}, {&llama3, "llama3_pieces"}}) {
      std::vector<std::string> pieces;
      for (std::string_view piece : pre->split(text)) pieces.emplace_back(piece);
      const auto want = c.doc[key].get<std::vector<std::string>>();
      if (pieces != want && ++failures <= 10) {
        ADD_FAILURE() << key << " " << printable(c.text) << "\n got " << json(pieces).dump()
                      << "\nwant " << json(want).dump();
      }
    }
  }
  EXPECT_EQ(failures, 0);
}

TEST(PreTokenizer, GgufNames) {
  EXPECT_EQ(PreTokenizer::from_gguf_name("smollm").steps().size(), 2u);
  EXPECT_EQ(PreTokenizer::from_gguf_name("qwen2").steps()[0].pattern(), kQwen2Pattern);
  EXPECT_EQ(PreTokenizer::from_gguf_name("llama-bpe").steps()[0].pattern(), kLlama3Pattern);
  try {
    PreTokenizer::from_gguf_name("mystery");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("mystery"), std::string::npos) << e.what();
  }
  EXPECT_THROW(PreTokenizer::from_gguf_name("smollm").split("\xFF"), Error);
}

TEST(Unicode, ByteAlphabet) {
  EXPECT_EQ(unicode::byte_to_symbol(' '), "Ġ");
  EXPECT_EQ(unicode::byte_to_symbol('\n'), "Ċ");
  EXPECT_EQ(unicode::byte_to_symbol('A'), "A");
  std::set<std::string> symbols;
  for (int b = 0; b < 256; ++b) {
    const std::string& s = unicode::byte_to_symbol(static_cast<uint8_t>(b));
    symbols.insert(s);
    EXPECT_EQ(unicode::symbols_to_bytes(s), std::string(1, static_cast<char>(b)));
  }
  EXPECT_EQ(symbols.size(), 256u);
  // A token with a character outside the alphabet decodes to its own UTF-8 bytes.
  EXPECT_EQ(unicode::symbols_to_bytes("a b"), "a b");
}

TEST(Unicode, MaximalSubparts) {
  using unicode::Utf8Status;
  EXPECT_EQ(unicode::next_utf8_char("\xE2\x82\xAC", 0).code_point, 0x20ACu);
  EXPECT_EQ(unicode::next_utf8_char("\xE2\x82", 0).status, Utf8Status::kIncomplete);
  EXPECT_EQ(unicode::next_utf8_char("\xE2\x82x", 0).status, Utf8Status::kInvalid);
  EXPECT_EQ(unicode::next_utf8_char("\xE2\x82x", 0).length, 2u);
  EXPECT_EQ(unicode::next_utf8_char("\xED\xA0\x80", 0).length, 1u);      // surrogate
  EXPECT_EQ(unicode::next_utf8_char("\xF4\x90\x80\x80", 0).length, 1u);  // above U+10FFFF
  EXPECT_EQ(unicode::next_utf8_char("\xC0\x80", 0).length, 1u);          // overlong
  EXPECT_EQ(unicode::to_valid_utf8("a\xF0\x9F\x98"), "a\xEF\xBF\xBD");
}

// --- A Llama 3 shaped tokenizer.json with added-token flags ---------------------------------

TEST(TokenizerJson, TinyLlama3ShapedMatchesReference) {
  const Tokenizer tok = Tokenizer::from_tokenizer_json(kTestdata + "/tiny/tokenizer.json");
  EXPECT_EQ(tok.vocab_size(), 806);
  EXPECT_EQ(tok.bos_id(), -1);  // no tokenizer_config.json beside it
  const json doc = json::parse(read_file(kTestdata + "/tiny_cases.json"));
  ASSERT_GE(doc.at("cases").size(), 400u);
  for (const json& c : doc.at("cases")) {
    const std::string text = c.at("text");
    const auto ids = c.at("ids").get<std::vector<int32_t>>();
    EXPECT_EQ(tok.encode(text), ids) << json(text).dump();
    EXPECT_EQ(tok.encode(text, /*add_special_tokens=*/false),
              c.at("ids_no_add").get<std::vector<int32_t>>())
        << json(text).dump();
    EXPECT_EQ(tok.encode(text, /*add_special_tokens=*/false, /*parse_special=*/false),
              c.at("ids_no_special").get<std::vector<int32_t>>())
        << json(text).dump();
    EXPECT_EQ(tok.decode(ids), c.at("decoded").get<std::string>()) << json(text).dump();
    EXPECT_EQ(tok.decode(ids, true), c.at("decoded_skip_special").get<std::string>())
        << json(text).dump();
  }
}

// --- Malformed tokenizer.json ---------------------------------------------------------------

// A small valid byte-level BPE tokenizer.json to break in various ways.
json tiny_tokenizer_json() {
  json vocab = json::object();
  for (int b = 0; b < 256; ++b) vocab[unicode::byte_to_symbol(static_cast<uint8_t>(b))] = b;
  vocab["he"] = 256;
  vocab["hel"] = 257;
  return {
      {"version", "1.0"},
      {"added_tokens", json::array({{{"id", 258},
                                     {"content", "<eos>"},
                                     {"special", true},
                                     {"lstrip", false},
                                     {"rstrip", false},
                                     {"single_word", false},
                                     {"normalized", false}}})},
      {"normalizer", nullptr},
      {"pre_tokenizer", {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", true}}},
      {"post_processor", nullptr},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model",
       {{"type", "BPE"},
        {"unk_token", nullptr},
        {"vocab", vocab},
        {"merges", json::array({"h e", json::array({"he", "l"})})}}},
  };
}

void expect_error_naming(const std::string& text, const std::string& needle) {
  try {
    Tokenizer::from_tokenizer_json_text(text, "bad.json");
    ADD_FAILURE() << "expected an error naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("bad.json"), std::string::npos) << e.what();
  }
}

TEST(TokenizerJson, TinyTokenizerLoads) {
  const Tokenizer tok = Tokenizer::from_tokenizer_json_text(tiny_tokenizer_json().dump(), "tiny");
  EXPECT_EQ(tok.vocab_size(), 259);
  EXPECT_EQ(tok.encode("hello<eos>"), (std::vector<int32_t>{257, 'l', 'o', 258}));
  EXPECT_TRUE(tok.is_special(258));
  EXPECT_EQ(tok.decode(tok.encode("hello<eos>"), true), "hello");
}

TEST(TokenizerJson, MalformedFilesGiveErrorsNamingTheField) {
  auto broken = [](auto&& edit) {
    json doc = tiny_tokenizer_json();
    edit(doc);
    return doc.dump();
  };
  expect_error_naming(broken([](json& d) { d.erase("model"); }), "model is missing");
  expect_error_naming(broken([](json& d) { d["model"] = 3; }), "model must be an object");
  expect_error_naming(broken([](json& d) { d["model"].erase("vocab"); }), "model.vocab");
  expect_error_naming(broken([](json& d) { d["model"]["vocab"] = json::array(); }),
                      "model.vocab must be an object");
  expect_error_naming(broken([](json& d) { d["model"]["vocab"]["x"] = "one"; }),
                      "model.vocab[\"x\"]");
  expect_error_naming(broken([](json& d) { d["model"]["merges"] = "h e"; }),
                      "model.merges must be an array");
  expect_error_naming(broken([](json& d) { d["model"]["merges"][0] = 5; }), "model.merges[0]");
  expect_error_naming(broken([](json& d) { d["model"]["merges"][0] = "he"; }), "model.merges[0]");
  expect_error_naming(broken([](json& d) { d["model"]["merges"][1] = json::array({"he"}); }),
                      "model.merges[1]");
  expect_error_naming(broken([](json& d) { d["model"]["merges"].push_back("x yz"); }),
                      "not in the vocabulary");
  expect_error_naming(broken([](json& d) { d["model"]["type"] = "WordPiece"; }), "model.type");
  expect_error_naming(broken([](json& d) { d["model"]["byte_fallback"] = true; }),
                      "model.byte_fallback");
  expect_error_naming(broken([](json& d) { d["model"]["unk_token"] = "<unk>"; }),
                      "model.unk_token");
  expect_error_naming(broken([](json& d) { d["added_tokens"][0] = "oops"; }),
                      "added_tokens[0] must be an object");
  expect_error_naming(broken([](json& d) { d["added_tokens"][0].erase("id"); }),
                      "added_tokens[0].id is missing");
  expect_error_naming(broken([](json& d) { d["added_tokens"][0]["id"] = -3; }),
                      "added_tokens[0].id");
  expect_error_naming(broken([](json& d) { d["added_tokens"][0]["content"] = 1; }),
                      "added_tokens[0].content");
  expect_error_naming(broken([](json& d) { d["added_tokens"][0]["special"] = "yes"; }),
                      "added_tokens[0].special");
  expect_error_naming(broken([](json& d) { d["added_tokens"] = json::object(); }),
                      "added_tokens must be an array");
  expect_error_naming(broken([](json& d) { d["pre_tokenizer"] = nullptr; }), "pre_tokenizer");
  expect_error_naming(broken([](json& d) { d["pre_tokenizer"]["type"] = "Whitespace"; }),
                      "pre_tokenizer.type");
  expect_error_naming(
      broken([](json& d) {
        d["pre_tokenizer"] = {
            {"type", "Sequence"},
            {"pretokenizers",
             json::array(
                 {{{"type", "Split"}, {"pattern", {{"Regex", "(("}}}, {"behavior", "Isolated"}}})}};
      }),
      "regex");
  expect_error_naming(broken([](json& d) {
                        d["normalizer"] = {{"type", "Lowercase"}};
                      }),
                      "normalizer.type");
  expect_error_naming(broken([](json& d) {
                        d["decoder"] = {{"type", "WordPiece"}};
                      }),
                      "decoder.type");
  expect_error_naming(broken([](json& d) {
                        d["post_processor"] = {{"type", "BertProcessing"}};
                      }),
                      "post_processor.type");
  expect_error_naming("[1, 2]", "must be an object");
  expect_error_naming("", "not valid JSON");

  // Cut the real file anywhere: always an Error, never a crash.
  const std::string full = read_file(kSmolTokenizer);
  for (size_t cut : {size_t{1}, size_t{100}, full.size() / 3, full.size() - 2}) {
    expect_error_naming(full.substr(0, cut), "not valid JSON");
  }
  EXPECT_THROW(Tokenizer::from_tokenizer_json(kTestdata + "/does-not-exist.json"), Error);
}

}  // namespace
}  // namespace pagedlm
