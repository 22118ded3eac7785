// The OpenAI request parsers (server/openai_api.h) on one request body, as the server runs
// them: the JSON with its depth bound, then the /v1/completions, /v1/chat/completions,
// /tokenize and /detokenize schemas against a small model with a tokenizer and the Qwen3 chat
// template (tools, reasoning). Malformed JSON may throw what parse_json documents (a 400 in
// the server); the parsers may only throw ApiError (a 4xx naming the field) or pagedlm::Error
// (a 400). Shared by fuzz_openai_request (any body, every endpoint) and fuzz_json_shapes
// (bodies shaped to be slow to parse, one endpoint each).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/core/json.h"
#include "pagedlm/server/openai_api.h"
#include "pagedlm/tokenizer/chat_template.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::fuzz {

using request_json = nlohmann::ordered_json;
using pagedlm::server::ApiError;

inline const pagedlm::server::ModelInfo& model() {
  static const pagedlm::Tokenizer tokenizer =
      pagedlm::Tokenizer::from_tokenizer_json(PAGEDLM_TESTDATA "/tokenizer/tiny/tokenizer.json");
  static const pagedlm::ChatTemplate chat_template(
      pagedlm::fuzz::read_file(PAGEDLM_TESTDATA "/chat_templates/qwen3.jinja"), "", "<|im_end|>");
  static const pagedlm::server::ModelInfo info = [] {
    pagedlm::server::ModelInfo m;
    m.name = "fuzz-model";
    m.tokenizer = &tokenizer;
    m.chat_template = &chat_template;
    m.parse_reasoning = true;
    m.vocab_size = tokenizer.vocab_size();
    m.max_model_len = 512;
    m.max_prompt_tokens = 384;
    return m;
  }();
  return info;
}

inline void check_completion(const pagedlm::server::CompletionRequest& r) {
  PAGEDLM_FUZZ_EXPECT(!r.prompts.empty());
  PAGEDLM_FUZZ_EXPECT(r.max_tokens.size() == r.prompts.size());
  PAGEDLM_FUZZ_EXPECT(r.n >= 1 &&
                      static_cast<int64_t>(r.prompts.size()) * r.n <= pagedlm::server::kMaxChoices);
  for (size_t i = 0; i < r.prompts.size(); ++i) {
    const int64_t len = static_cast<int64_t>(r.prompts[i].size());
    PAGEDLM_FUZZ_EXPECT(len >= 1 && len < model().max_prompt_tokens);
    PAGEDLM_FUZZ_EXPECT(r.max_tokens[i] >= 1 && len + r.max_tokens[i] <= model().max_model_len);
    for (int32_t id : r.prompts[i]) PAGEDLM_FUZZ_EXPECT(id >= 0 && id < model().vocab_size);
  }
}

// Runs one parser; a refusal must be a 4xx.
template <typename F>
void refused_cleanly(F&& parse) {
  try {
    parse();
  } catch (const ApiError& e) {
    PAGEDLM_FUZZ_EXPECT(e.status() >= 400 && e.status() < 500);
  } catch (const pagedlm::Error&) {
  }
}

// The server's endpoints; a request goes to exactly one of them.
enum class Endpoint { kCompletions, kChatCompletions, kTokenize, kDetokenize };

// Parses `text` as the server parses a request body, or returns nullopt where the server
// refuses the JSON itself.
inline std::optional<request_json> parsed_body(std::string_view text) {
  try {
    return pagedlm::parse_json<request_json>(text);
  } catch (const pagedlm::Error&) {
    return std::nullopt;  // nested too deep
  } catch (const request_json::exception&) {
    return std::nullopt;  // not JSON: parse_error, or out_of_range for a number like 1e999
  }
}

// Runs `endpoint`'s parser on `body` and checks what it makes of it.
inline void check_endpoint(const request_json& body, Endpoint endpoint) {
  const pagedlm::server::ModelInfo& info = model();
  switch (endpoint) {
    case Endpoint::kCompletions:
    case Endpoint::kChatCompletions: {
      const bool chat = endpoint == Endpoint::kChatCompletions;
      refused_cleanly([&] { check_completion(parse_completion_request(body, chat, info)); });
      return;
    }
    case Endpoint::kTokenize:
      refused_cleanly([&] {
        for (int32_t id : parse_tokenize_request(body, info)) {
          PAGEDLM_FUZZ_EXPECT(id >= 0 && id < info.vocab_size);
        }
      });
      return;
    case Endpoint::kDetokenize:
      refused_cleanly([&] {
        for (int32_t id : parse_detokenize_request(body, info)) {
          PAGEDLM_FUZZ_EXPECT(id >= 0 && id < info.vocab_size);
        }
      });
      return;
  }
}

// Every endpoint's parser on one body.
inline void check_request_body(std::string_view text) {
  const std::optional<request_json> body = parsed_body(text);
  if (!body) return;
  for (Endpoint endpoint : {Endpoint::kCompletions, Endpoint::kChatCompletions, Endpoint::kTokenize,
                            Endpoint::kDetokenize}) {
    check_endpoint(*body, endpoint);
  }
}

}  // namespace pagedlm::fuzz
