#include "pagedlm/server/tool_calls.h"

#include <algorithm>
#include <nlohmann/json.hpp>

namespace pagedlm::server {

namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

// The call a block's body holds, if it is one.
bool parse_call(const std::string& body, ToolCall* call) {
  const nlohmann::json j = nlohmann::json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const nlohmann::json args = j.value("arguments", nlohmann::json::object());
  if (!args.is_object()) return false;
  call->name = j["name"].get<std::string>();
  call->arguments = args.dump();
  return true;
}

}  // namespace

bool template_uses_tool_call_tags(const std::string& chat_template_source) {
  return chat_template_source.find(kOpen) != std::string::npos &&
         chat_template_source.find(kClose) != std::string::npos;
}

ParsedReply parse_tool_calls(const std::string& text) {
  ParsedReply out;
  size_t at = 0;
  while (at < text.size()) {
    const size_t open = text.find(kOpen, at);
    const size_t close = open == std::string::npos ? open : text.find(kClose, open + kOpen.size());
    if (close == std::string::npos) break;
    ToolCall call;
    if (parse_call(text.substr(open + kOpen.size(), close - open - kOpen.size()), &call)) {
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

std::string ToolCallStream::push(const std::string& text) {
  text_ += text;
  if (held_) return {};
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
  ParsedReply reply = parse_tool_calls(text_);
  // What went out is a prefix of the text before the first block, so of the content too.
  *unsent = reply.content.substr(sent_);
  sent_ = text_.size();
  held_ = true;
  return reply;
}

}  // namespace pagedlm::server
