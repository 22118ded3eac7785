// The OpenAI request schema: parses and validates /v1/completions and /v1/chat/completions
// bodies into native requests (prompt token ids + sampling), and builds the error bodies.
// HTTP-independent so it can be tested without a socket.
#pragma once

#include <algorithm>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedlm/grammar/grammar.h"
#include "pagedlm/ops/sampling.h"
#include "pagedlm/sched/sampling_params.h"
#include "pagedlm/serving/generation.h"
#include "pagedlm/serving/tool_calls.h"
#include "pagedlm/tokenizer/chat_template.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::server {

using serving::ToolCall;
using serving::ToolCallFormat;

// A request the server refuses, with its HTTP status and OpenAI error fields.
class ApiError : public std::runtime_error {
 public:
  ApiError(int status, const std::string& message, std::string param = "",
           std::string type = "invalid_request_error");
  int status() const { return status_; }
  const std::string& param() const { return param_; }
  const std::string& type() const { return type_; }

 private:
  int status_;
  std::string param_;
  std::string type_;
};

// {"error": {"message", "type", "param", "code"}}; param is null when empty.
nlohmann::ordered_json error_body(const std::string& message, const std::string& type,
                                  const std::string& param, int code);

// What the parsers need to know about the served model.
struct ModelInfo {
  std::string name;
  const Tokenizer* tokenizer = nullptr;         // null (random weights): only token-id prompts work
  const ChatTemplate* chat_template = nullptr;  // null: chat is refused
  bool parse_reasoning = false;  // chat replies' <think> blocks become reasoning_content
  int64_t vocab_size = 0;
  int64_t max_model_len = 0;
  int64_t max_prompt_tokens = 0;                // what the KV page pool holds for one sequence
  grammar::GrammarCompiler* grammar = nullptr;  // null: structured output is refused

  // The most tokens one sequence can hold: the model's context, or less where the pool is
  // smaller.
  int64_t context_tokens() const { return std::min(max_model_len, max_prompt_tokens); }
};

// The most choices one HTTP request may ask for (prompts x n), which bounds its memory.
inline constexpr int32_t kMaxChoices = 128;
// OpenAI's bound on top logprobs, which is also the most the engine's samplers return.
inline constexpr int32_t kMaxTopLogprobs = ops::kMaxTopLogprobs;
static_assert(kMaxTopLogprobs == 20, "OpenAI's API allows 0-20 top logprobs");
// OpenAI's own bound on a request's tools.
inline constexpr size_t kMaxTools = 128;

// What a request asks to generate (serving/generation.h: prompts, sampling, n, stop strings,
// logprobs, tool calls parsed with tool_choice "auto" on a template whose call form is read,
// reasoning split on a server that parses it, and the grammar of response_format, tool_choice
// "required"/named, regex, choice or grammar, compiled by server/structured_output.h), and how
// the answer is rendered.
struct CompletionRequest : serving::GenerationSpec {
  bool chat = false;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  std::string model;
};

// The model's tokenizer; throws ApiError 400 naming `param` when the model has none.
const Tokenizer& require_tokenizer(const ModelInfo& model, const char* param);

// Throws ApiError (400 for bad values and types, 404 for an unknown model).
CompletionRequest parse_completion_request(const nlohmann::ordered_json& body, bool chat,
                                           const ModelInfo& model);

// /tokenize: {"prompt": ...} or {"messages": ...}; returns the token ids.
std::vector<int32_t> parse_tokenize_request(const nlohmann::ordered_json& body,
                                            const ModelInfo& model);
// /detokenize: {"tokens": [...]}; returns the ids, checked against the vocabulary.
std::vector<int32_t> parse_detokenize_request(const nlohmann::ordered_json& body,
                                              const ModelInfo& model);

}  // namespace pagedlm::server
