// JSON from outside is parsed with a depth bound (core/json.h), and the loaders that read it
// refuse nesting past the bound with an Error naming the file. Size bounds of tokenizer files
// live here too.
#include <gtest/gtest.h>

#include <string>

#include "pagedlm/core/json.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm {
namespace {

std::string nested(int depth) { return std::string(depth, '[') + std::string(depth, ']'); }

TEST(Json, DepthBound) {
  EXPECT_EQ(parse_json(nested(kMaxJsonDepth)).dump().size(), 2u * kMaxJsonDepth);
  EXPECT_THROW(parse_json(nested(kMaxJsonDepth + 1)), Error);
  EXPECT_THROW(parse_json(R"({"a": [{"b": )" + nested(kMaxJsonDepth) + "}]}"), Error);
  EXPECT_THROW(parse_json(nested(1000000)), Error);  // far past the stack's worth of frames
  // Brackets inside strings are text, not nesting.
  EXPECT_EQ(parse_json("\"" + nested(1000) + "\"").get<std::string>(), nested(1000));
  EXPECT_THROW(parse_json("[1,"), nlohmann::json::parse_error);
  EXPECT_TRUE(try_parse_json(nested(kMaxJsonDepth + 1)).is_discarded());
  EXPECT_TRUE(try_parse_json("[1,").is_discarded());
  EXPECT_EQ(try_parse_json<nlohmann::ordered_json>(R"({"b": 1, "a": [2]})").dump(),
            R"({"b":1,"a":[2]})");
}

TEST(Json, DeepTokenizerJsonIsRefused) {
  const std::string text =
      R"({"model": {"type": "BPE", "vocab": {}, "merges": )" + nested(100000) + "}}";
  try {
    Tokenizer::from_tokenizer_json_text(text, "deep/tokenizer.json");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("deep/tokenizer.json"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("nests deeper"), std::string::npos) << e.what();
  }
}

// One huge token id (in the vocab or among the added tokens) used to size the id tables by
// itself: 2e9 ids asked for 64 GB (ASan reports it under fuzz_tokenizer_json), INT32_MAX
// overflowed the size.
TEST(Json, HugeTokenIdsAreRefused) {
  for (const char* text :
       {R"({"model": {"type": "BPE", "vocab": {"a": 2000000000}, "merges": []}})",
        R"({"added_tokens": [{"id": 2147483647, "content": "<x>"}],
            "model": {"type": "BPE", "vocab": {"a": 0}, "merges": []}})"}) {
    try {
      Tokenizer::from_tokenizer_json_text(text, "huge/tokenizer.json");
      FAIL() << "no error for " << text;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("not a valid token id"), std::string::npos) << e.what();
    }
  }
  TokenizerSpec spec;  // another loader's spec is checked the same way
  spec.tokens = {"a"};
  spec.added_tokens.push_back({.id = kMaxVocabSize, .content = "<x>"});
  EXPECT_THROW(Tokenizer{spec}, Error);
}

}  // namespace
}  // namespace pagedlm
