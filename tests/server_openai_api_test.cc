// The OpenAI request parsers (server/openai_api.h) on what a chat's message list may cost:
// a list longer than the context is refused before the template renders it.
#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "pagedlm/server/openai_api.h"
#include "pagedlm/tokenizer/chat_template.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::server {
namespace {

using json = nlohmann::ordered_json;

std::string read_text(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

class OpenAiApiTest : public ::testing::Test {
 protected:
  OpenAiApiTest()
      : tokenizer_(
            Tokenizer::from_tokenizer_json(PAGEDLM_TESTDATA "/tokenizer/tiny/tokenizer.json")),
        template_(read_text(PAGEDLM_TESTDATA "/chat_templates/qwen3.jinja"), "", "<|im_end|>") {
    info_.name = "test-model";
    info_.tokenizer = &tokenizer_;
    info_.chat_template = &template_;
    info_.vocab_size = tokenizer_.vocab_size();
    info_.max_model_len = 512;
    info_.max_prompt_tokens = 384;  // the context: the smaller of the two
  }

  static json chat_of(size_t num_messages) {
    json messages = json::array();
    for (size_t i = 0; i < num_messages; ++i) {
      messages.push_back({{"role", i % 2 == 0 ? "user" : "assistant"}, {"content", "hi"}});
    }
    return {{"messages", messages}};
  }

  Tokenizer tokenizer_;
  ChatTemplate template_;
  ModelInfo info_;
};

TEST_F(OpenAiApiTest, TokenizeTakesAsManyMessagesAsTheContextHasTokens) {
  const std::vector<int32_t> ids = parse_tokenize_request(chat_of(384), info_);
  // Each message costs several tokens (its role's markers and its text), so the rule only
  // refuses lists that could never fit.
  EXPECT_GT(ids.size(), 4u * 384);
}

TEST_F(OpenAiApiTest, MoreMessagesThanTheContextHasTokensAreRefused) {
  for (bool tokenize : {false, true}) {
    try {
      if (tokenize) {
        parse_tokenize_request(chat_of(385), info_);
      } else {
        parse_completion_request(chat_of(385), /*chat=*/true, info_);
      }
      ADD_FAILURE() << "385 messages accepted (tokenize: " << tokenize << ")";
    } catch (const ApiError& e) {
      EXPECT_EQ(e.status(), 400);
      EXPECT_EQ(e.param(), "messages");
      EXPECT_NE(std::string(e.what()).find("maximum context length is 384 tokens. However, "
                                           "'messages' lists 385 messages"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST_F(OpenAiApiTest, AChatWithinTheMessageLimitIsStillRefusedForItsTokens) {
  // 100 short messages pass the count but not the token limit: the exact count is reported.
  try {
    parse_completion_request(chat_of(100), /*chat=*/true, info_);
    ADD_FAILURE() << "a prompt past the context accepted";
  } catch (const ApiError& e) {
    EXPECT_EQ(e.param(), "messages");
    EXPECT_NE(std::string(e.what()).find("However, your prompt has "), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace pagedlm::server
