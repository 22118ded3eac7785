// Tool calls in a chat reply. A model given OpenAI's `tools` (through its chat template) answers
// with calls in the template's own markup; the server turns them into the API's `tool_calls`.
// Three forms are read, told apart by the template that writes them:
//   tags (Qwen2.5, Qwen3, Hermes 3), one call per block, text around them allowed:
//     <tool_call>
//     {"name": "get_weather", "arguments": {"city": "Paris"}}
//     </tool_call>
//   JSON reply (Llama 3.1-3.3's JSON tool calling): the whole reply is one call,
//     {"name": "get_weather", "parameters": {"city": "Paris"}}
//   marker and list (Mistral v0.3), the calls after the marker, text before it allowed:
//     [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]
//   The marker is a special token, which decoding drops: the server writes kMistralMarker into
//   the reply's text where the model produced it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "pagedlm/engine/stop_strings.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::serving {

struct ToolCall {
  std::string name;
  std::string arguments;  // the JSON text of an object, as the API carries it
};

struct ParsedReply {
  std::string content;  // the text outside the calls' blocks, as written
  std::vector<ToolCall> calls;
};

enum class ToolCallFormat { kNone, kTags, kJsonReply, kMarkerList };

inline constexpr std::string_view kMistralMarker = "[TOOL_CALLS]";

// The form the chat template writes calls in (kNone: one this parser does not read).
ToolCallFormat tool_call_format(const std::string& chat_template_source);

// kMarkerList: the marker's token id when the tokenizer has it as a special token, which
// decoding drops (the server writes kMistralMarker back where the model produced it); -1
// otherwise (other forms, or a marker the decoded text already holds).
int32_t dropped_call_marker(const Tokenizer& tokenizer, ToolCallFormat format);

// Splits a finished reply. What is not a call stays in the content as text: a block that is
// unclosed, or whose body is not a JSON object with a string "name" and an object "arguments"
// ("parameters" in the JSON-reply form; either may be absent); a JSON reply that is not such an
// object; a marker not followed by a JSON list of such objects (the whole reply stays text).
ParsedReply parse_tool_calls(ToolCallFormat format, const std::string& text);

// A malformed `tools` list or `tool_choice`; field() names the one at fault (the server answers
// 400 with it, the Python binding raises ValueError).
class ToolChoiceError : public std::invalid_argument {
 public:
  ToolChoiceError(std::string field, const std::string& message)
      : std::invalid_argument(message), field_(std::move(field)) {}
  const std::string& field() const { return field_; }

 private:
  std::string field_;
};

// What tool_choice "required" or a named function ({"type": "function", "function": {"name":
// ...}}) makes of the reply: exactly one call to one of the allowed tools, its arguments held to
// that tool's parameter schema by a grammar, written in `format`: the template's tags where it
// uses them, else a bare JSON reply (which the JSON-reply parser reads).
struct ForcedToolCall {
  grammar::GrammarSpec spec;
  ToolCallFormat format = ToolCallFormat::kNone;
};

// tool_choice as OpenAI's chat API takes it, tools its `tools` list (null: none given).
// "auto", "none": nothing forced (nullopt). Throws ToolChoiceError for any other value, a named
// tool missing from `tools`, or a malformed tool among those forced.
std::optional<ForcedToolCall> forced_tool_call(const nlohmann::ordered_json* tools,
                                               const nlohmann::ordered_json& tool_choice,
                                               ToolCallFormat template_format);

// A streamed reply that may hold calls: text goes out as it comes until a call may begin (an
// opening tag or the marker, or what may still grow into one; a JSON reply's first '{'); from
// there on it waits for the end of the reply.
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolCallFormat format);
  // The reply's next piece; returns what can be sent as content now.
  std::string push(std::string_view text);
  // At the end: `reply` is every piece pushed, parsed; `unsent` gets the part of its content
  // not sent yet.
  ParsedReply finish(const std::string& reply, std::string* unsent) const;

 private:
  ToolCallFormat format_;
  StopStringMatcher opening_tag_;  // kTags, kMarkerList: releases the text before the first tag
  std::string leading_;            // kJsonReply: the whitespace before the first character
  enum class Json { kUndecided, kText, kHeld } json_ = Json::kUndecided;
  size_t sent_ = 0;
};

}  // namespace pagedlm::serving
