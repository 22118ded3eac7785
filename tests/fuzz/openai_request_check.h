// The OpenAI request parsers (server/openai_api.h) on one request body, as the server runs
// them: the JSON with its depth bound, then the /v1/completions, /v1/chat/completions,
// /tokenize and /detokenize schemas against a small model with a tokenizer and the Qwen3 chat
// template (tools, reasoning). Malformed JSON may throw what parse_json documents (a 400 in
// the server); the parsers may only throw ApiError (a 4xx naming the field) or pagedlm::Error
// (a 400). Shared by fuzz_openai_request (any body) and fuzz_json_shapes (bodies shaped to be
// slow to parse).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
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

// Parses `text` as the server parses a request body and checks what each parser makes of it.
inline void check_request_body(std::string_view text) {
  const pagedlm::server::ModelInfo& info = model();
  request_json body;
  try {
    body = pagedlm::parse_json<request_json>(text);
  } catch (const pagedlm::Error&) {
    return;  // nested too deep
  } catch (const request_json::exception&) {
    return;  // not JSON: parse_error, or out_of_range for a number like 1e999
  }
  for (bool chat : {false, true}) {
    refused_cleanly([&] { check_completion(parse_completion_request(body, chat, info)); });
  }
  refused_cleanly([&] {
    for (int32_t id : parse_tokenize_request(body, info)) {
      PAGEDLM_FUZZ_EXPECT(id >= 0 && id < info.vocab_size);
    }
  });
  refused_cleanly([&] {
    for (int32_t id : parse_detokenize_request(body, info)) {
      PAGEDLM_FUZZ_EXPECT(id >= 0 && id < info.vocab_size);
    }
  });
}

}  // namespace pagedlm::fuzz
