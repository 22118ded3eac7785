// Tokenizer::from_gguf against from_tokenizer_json on the same SmolLM2 vocabulary (the json was
// built from the GGUF by scripts/make_tokenizer_reference.py and checked against HF tokenizers),
// plus the errors for GGUF tokenizers we do not support.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "default_model_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/tokenizer/tokenizer.h"
#include "pagedlm/tokenizer/unicode.h"

namespace pagedlm {
namespace {

namespace fs = std::filesystem;

const std::string kTestdata = std::string(PAGEDLM_TESTDATA) + "/tokenizer";

std::string from_hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2) {
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  }
  return out;
}

TEST(TokenizerGguf, SmolLM2MatchesTokenizerJsonOnAllCases) {
  REQUIRE_DEFAULT_MODEL();
  const GgufFile gguf = GgufFile::open(default_model_path());
  const Tokenizer from_gguf = Tokenizer::from_gguf(gguf);
  const Tokenizer from_json = Tokenizer::from_tokenizer_json(kTestdata + "/smollm2/tokenizer.json");

  EXPECT_EQ(from_gguf.vocab_size(), from_json.vocab_size());
  EXPECT_EQ(from_gguf.bos_id(), 1);
  EXPECT_EQ(from_gguf.eos_id(), 2);
  EXPECT_EQ(from_gguf.model().num_merges(), 48900u);
  for (int32_t id = 0; id < from_json.vocab_size(); ++id) {
    ASSERT_EQ(from_gguf.token_to_piece(id), from_json.token_to_piece(id)) << id;
    ASSERT_EQ(from_gguf.is_special(id), from_json.is_special(id)) << id;
  }

  std::ifstream in(kTestdata + "/smollm2_cases.json");
  const nlohmann::json doc = nlohmann::json::parse(in);
  size_t compared = 0;
  for (const nlohmann::json& c : doc.at("cases")) {
    const std::string text = from_hex(c.at("text_hex"));
    const std::vector<int32_t> ids = from_gguf.encode(text);
    ASSERT_EQ(ids, from_json.encode(text)) << c.at("text_hex");
    EXPECT_EQ(ids, c.at("ids").get<std::vector<int32_t>>()) << c.at("text_hex");
    EXPECT_EQ(from_gguf.decode(ids), c.at("decoded").get<std::string>());
    ++compared;
  }
  EXPECT_GE(compared, 2000u);
}

// A GGUF v3 file holding only metadata, for the error paths.
class GgufWriter {
 public:
  void string(const std::string& key, const std::string& value) {
    header(key, kString);
    raw_string(value);
  }
  void u32(const std::string& key, uint32_t value) {
    header(key, kUint32);
    pod(value);
  }
  void strings(const std::string& key, const std::vector<std::string>& values) {
    header(key, kArray);
    pod(kString);
    pod(static_cast<uint64_t>(values.size()));
    for (const std::string& v : values) raw_string(v);
  }
  void int32s(const std::string& key, const std::vector<int32_t>& values) {
    header(key, kArray);
    pod(kInt32);
    pod(static_cast<uint64_t>(values.size()));
    for (int32_t v : values) pod(v);
  }
  std::string write(const fs::path& path) const {
    std::ofstream out(path, std::ios::binary);
    out.write("GGUF", 4);
    const uint32_t version = 3;
    const uint64_t num_tensors = 0;
    out.write(reinterpret_cast<const char*>(&version), sizeof(version));
    out.write(reinterpret_cast<const char*>(&num_tensors), sizeof(num_tensors));
    out.write(reinterpret_cast<const char*>(&count_), sizeof(count_));
    out << body_.str();
    return path.string();
  }

 private:
  static constexpr uint32_t kUint32 = 4, kInt32 = 5, kString = 8, kArray = 9;
  template <typename T>
  void pod(T value) {
    body_.write(reinterpret_cast<const char*>(&value), sizeof(value));
  }
  void raw_string(const std::string& s) {
    pod(static_cast<uint64_t>(s.size()));
    body_ << s;
  }
  void header(const std::string& key, uint32_t type) {
    ++count_;
    raw_string(key);
    pod(type);
  }
  std::ostringstream body_;
  uint64_t count_ = 0;
};

// The 256 byte symbols plus "he": enough for a working byte-level vocabulary.
GgufWriter tiny_gguf(const std::string& model, const std::string& pre) {
  std::vector<std::string> tokens = {"<|endoftext|>"};
  for (int b = 0; b < 256; ++b) tokens.push_back(unicode::byte_to_symbol(static_cast<uint8_t>(b)));
  tokens.push_back("he");
  std::vector<int32_t> types(tokens.size(), 1);
  types[0] = 3;
  GgufWriter w;
  w.string("general.architecture", "llama");
  w.string("tokenizer.ggml.model", model);
  if (!pre.empty()) w.string("tokenizer.ggml.pre", pre);
  w.strings("tokenizer.ggml.tokens", tokens);
  w.int32s("tokenizer.ggml.token_type", types);
  w.strings("tokenizer.ggml.merges", {"h e"});
  w.u32("tokenizer.ggml.eos_token_id", 0);
  return w;
}

void expect_error_naming(const GgufWriter& writer, const std::string& needle) {
  const fs::path path = fs::temp_directory_path() /
                        ("pagedlm_tokenizer_gguf_" + std::to_string(::getpid()) + ".gguf");
  writer.write(path);
  try {
    Tokenizer::from_gguf(GgufFile::open(path.string()));
    ADD_FAILURE() << "expected an error naming " << needle;
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
  fs::remove(path);
}

TEST(TokenizerGguf, TinyVocabularyLoads) {
  const fs::path path = fs::temp_directory_path() /
                        ("pagedlm_tokenizer_gguf_ok_" + std::to_string(::getpid()) + ".gguf");
  tiny_gguf("gpt2", "smollm").write(path);
  const Tokenizer tok = Tokenizer::from_gguf(GgufFile::open(path.string()));
  fs::remove(path);
  EXPECT_EQ(tok.vocab_size(), 258);
  EXPECT_EQ(tok.eos_id(), 0);
  EXPECT_TRUE(tok.is_special(0));
  const std::vector<int32_t> ids = tok.encode("he said<|endoftext|>");
  EXPECT_EQ(ids.front(), 257);
  EXPECT_EQ(ids.back(), 0);
  EXPECT_EQ(tok.decode(ids), "he said<|endoftext|>");
}

TEST(TokenizerGguf, UnsupportedTokenizersGiveErrors) {
  expect_error_naming(tiny_gguf("llama", "smollm"), "tokenizer.ggml.model");
  expect_error_naming(tiny_gguf("gpt2", "mystery-pre"), "mystery-pre");
  expect_error_naming(tiny_gguf("gpt2", ""), "tokenizer.ggml.pre");
}

}  // namespace
}  // namespace pagedlm
