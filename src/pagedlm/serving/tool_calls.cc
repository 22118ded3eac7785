#include "pagedlm/serving/tool_calls.h"

#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "pagedlm/core/json.h"

namespace pagedlm::serving {

namespace {

constexpr std::string_view kOpen = "<tool_call>";
constexpr std::string_view kClose = "</tool_call>";

constexpr const char* kWhitespace = " \t\r\n";

// The call a JSON value is, if it is one; `args_key` names its arguments object.
bool call_from_json(const nlohmann::json& j, const char* args_key, ToolCall* call) {
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const nlohmann::json args = j.value(args_key, nlohmann::json::object());
  if (!args.is_object()) return false;
  call->name = j["name"].get<std::string>();
  call->arguments = args.dump();
  return true;
}

// The same from a JSON text.
bool parse_call(const std::string& body, const char* args_key, ToolCall* call) {
  // The model's output is as untrusted as a request: a reply of nested brackets is not a call.
  return call_from_json(try_parse_json(body), args_key, call);
}

// The text that opens a call, in the forms that have one.
std::vector<std::string> call_openers(ToolCallFormat format) {
  if (format == ToolCallFormat::kTags) return {std::string(kOpen)};
  if (format == ToolCallFormat::kMarkerList) return {std::string(kMistralMarker)};
  return {};
}

// kMarkerList: the text before the first marker, then a JSON list of calls to the end.
ParsedReply parse_marker_list(const std::string& text) {
  ParsedReply out;
  const size_t marker = text.find(kMistralMarker);
  const nlohmann::json list =
      marker == std::string::npos
          ? nlohmann::json()
          : try_parse_json(std::string_view(text).substr(marker + kMistralMarker.size()));
  if (list.is_array() && !list.empty()) {
    for (const nlohmann::json& item : list) {
      ToolCall call;
      if (!call_from_json(item, "arguments", &call)) {
        out.calls.clear();
        break;
      }
      out.calls.push_back(std::move(call));
    }
  }
  out.content = out.calls.empty() ? text : text.substr(0, marker);
  return out;
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
  if (chat_template_source.find(kMistralMarker) != std::string::npos) {
    return ToolCallFormat::kMarkerList;
  }
  // Llama 3.x writes an assistant call as {"name": ..., "parameters": ...}.
  if (chat_template_source.find("tool_call") != std::string::npos &&
      chat_template_source.find("\"parameters\": ") != std::string::npos) {
    return ToolCallFormat::kJsonReply;
  }
  return ToolCallFormat::kNone;
}

int32_t dropped_call_marker(const Tokenizer& tokenizer, ToolCallFormat format) {
  if (format != ToolCallFormat::kMarkerList) return -1;
  const std::optional<int32_t> id = tokenizer.token_to_id(kMistralMarker);
  return id && tokenizer.is_special(*id) ? *id : -1;
}

ParsedReply parse_tool_calls(ToolCallFormat format, const std::string& text) {
  if (format == ToolCallFormat::kTags) return parse_tags(text);
  if (format == ToolCallFormat::kMarkerList) return parse_marker_list(text);
  ParsedReply out;
  ToolCall call;
  if (format == ToolCallFormat::kJsonReply && parse_call(text, "parameters", &call)) {
    out.calls.push_back(std::move(call));
  } else {
    out.content = text;
  }
  return out;
}

ToolCallStream::ToolCallStream(ToolCallFormat format)
    : format_(format), opening_tag_(call_openers(format)) {}

std::string ToolCallStream::push(std::string_view text) {
  std::string out;
  if (format_ == ToolCallFormat::kTags || format_ == ToolCallFormat::kMarkerList) {
    out = opening_tag_.push(text);  // nothing once the tag has appeared
  } else if (format_ == ToolCallFormat::kNone || json_ == Json::kText) {
    out = text;
  } else if (json_ == Json::kUndecided) {
    // A reply that opens with '{' may be a call and waits for the end; any other is text.
    leading_ += text;
    const size_t first = leading_.find_first_not_of(kWhitespace);
    if (first != std::string::npos) {
      json_ = leading_[first] == '{' ? Json::kHeld : Json::kText;
      if (json_ == Json::kText) out.swap(leading_);
    }
  }
  sent_ += out.size();
  return out;
}

ParsedReply ToolCallStream::finish(const std::string& reply, std::string* unsent) const {
  ParsedReply parsed = parse_tool_calls(format_, reply);
  // What went out is a prefix of the text before the first call, so of the content too.
  *unsent = parsed.content.substr(sent_);
  return parsed;
}

}  // namespace pagedlm::serving
