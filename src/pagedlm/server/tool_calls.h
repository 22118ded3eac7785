// Tool calls in a chat reply. A model given OpenAI's `tools` (through its chat template) answers
// with calls in the template's own markup; the server turns them into the API's `tool_calls`.
// Read here: the form of the Qwen2.5, Qwen3 and Hermes templates, one call per block,
//   <tool_call>
//   {"name": "get_weather", "arguments": {"city": "Paris"}}
//   </tool_call>
// Other templates' forms (Llama 3.1's bare JSON, Mistral's [TOOL_CALLS]) are not parsed: their
// replies stay text.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

namespace pagedlm::server {

struct ToolCall {
  std::string name;
  std::string arguments;  // the JSON text of an object, as the API carries it
};

struct ParsedReply {
  std::string content;  // the text outside the calls' blocks, as written
  std::vector<ToolCall> calls;
};

// Whether the chat template writes calls as <tool_call> blocks.
bool template_uses_tool_call_tags(const std::string& chat_template_source);

// Splits a finished reply. A block that is unclosed, or whose body is not a JSON object with a
// string "name" (and an object "arguments", or none), stays in the content as text.
ParsedReply parse_tool_calls(const std::string& text);

// A streamed reply that may hold calls: text goes out as it comes until an opening tag (or the
// start of what may become one) appears; from there on it waits for the end of the reply.
class ToolCallStream {
 public:
  // Appends decoded text; returns what can be sent as content now.
  std::string push(const std::string& text);
  // At the end of the reply: the whole reply parsed, and the part of its content not yet sent.
  ParsedReply finish(std::string* unsent);

 private:
  std::string text_;
  size_t sent_ = 0;
  bool held_ = false;
};

}  // namespace pagedlm::server
