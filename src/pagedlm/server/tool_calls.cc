#include "pagedlm/server/tool_calls.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace pagedlm::server {

namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

constexpr const char* kWhitespace = " \t\r\n";

// The call a JSON text holds, if it is one; `args_key` names its arguments object.
bool parse_call(const std::string& body, const char* args_key, ToolCall* call) {
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const nlohmann::json args = j.value(args_key, nlohmann::json::object());
  if (!args.is_object()) return false;
  call->name = j["name"].get<std::string>();
  call->arguments = args.dump();
  return true;
}

ParsedReply parse_tags(const std::string& text) {
  ParsedReply out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t open = text.find(kOpen, at);
    const size_t close = open == std::string::npos ? open : text.find(kClose, open + kOpen.size());
    if (close == std::string::npos) break;
    ToolCall call;
    if (parse_call(text.substr(open + kOpen.size(), close - open - kOpen.size()), "arguments",
                   &call)) {
      out.content += text.substr(at, open - at);
      out.calls.push_back(std::move(call));
    } else {
      out.content += text.substr(at, close + kClose.size() - at);
    }
    at = close + kClose.size();
  }
  if (at < text.size()) out.content += text.substr(at);
  return out;
}

}  // namespace

ToolCallFormat tool_call_format(const std::string& chat_template_source) {
  if (chat_template_source.find(kOpen) != std::string::npos &&
      chat_template_source.find(kClose) != std::string::npos) {
    return ToolCallFormat::kTags;
  }
  // Llama 3.x writes an assistant call as {"name": ..., "parameters": ...}.
  if (chat_template_source.find("tool_call") != std::string::npos &&
      chat_template_source.find("\"parameters\": ") != std::string::npos) {
    return ToolCallFormat::kJsonReply;
  }
  return ToolCallFormat::kNone;
}

ParsedReply parse_tool_calls(ToolCallFormat format, const std::string& text) {
  if (format == ToolCallFormat::kTags) return parse_tags(text);
  ParsedReply out;
  ToolCall call;
  if (format == ToolCallFormat::kJsonReply && parse_call(text, "parameters", &call)) {
    out.calls.push_back(std::move(call));
  } else {
    out.content = text;
  }
  return out;
}

std::string ToolCallStream::push(const std::string& text) {
  text_ += text;
  if (held_ || format_ == ToolCallFormat::kNone) {
    if (format_ != ToolCallFormat::kNone) return {};
    sent_ = text_.size();
    return text;
  }
  if (format_ == ToolCallFormat::kJsonReply) {
    // A reply that opens with '{' may be a call: it waits for the end. Any other reply is text.
    const size_t first = text_.find_first_not_of(kWhitespace);
    if (first == std::string::npos) return {};
    held_ = text_[first] == '{';
    if (held_) return {};
    format_ = ToolCallFormat::kNone;
    std::string out = text_.substr(sent_);
    sent_ = text_.size();
    return out;
  }
  size_t release = text_.size();
  if (const size_t open = text_.find(kOpen, sent_); open != std::string::npos) {
    release = open;
    held_ = true;
  } else {
    // Keep back a tail that may still grow into the tag.
    for (size_t n = std::min(kOpen.size() - 1, text_.size() - sent_); n > 0; --n) {
      if (text_.compare(text_.size() - n, n, kOpen, 0, n) == 0) {
        release = text_.size() - n;
        break;
      }
    }
  }
  std::string out = text_.substr(sent_, release - sent_);
  sent_ = release;
  return out;
}

ParsedReply ToolCallStream::finish(std::string* unsent) {
  ParsedReply reply = parse_tool_calls(format_, text_);
  // What went out is a prefix of the text before the first block, so of the content too.
  *unsent = reply.content.substr(sent_);
  sent_ = text_.size();
  held_ = true;
  return reply;
}

}  // namespace pagedlm::server
