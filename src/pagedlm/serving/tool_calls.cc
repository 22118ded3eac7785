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

namespace {

using ordered_json = nlohmann::ordered_json;

const ordered_json* field(const ordered_json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

// The JSON schema of one call to `tool` in the given form: {"name": <its name>, <args_key>:
// <its parameters>}.
ordered_json call_schema(const ordered_json& tool, const char* args_key) {
  if (!tool.is_object() || tool.value("type", "function") != "function" ||
      !tool.contains("function") || !tool["function"].is_object() ||
      !tool["function"].contains("name") || !tool["function"]["name"].is_string()) {
    throw ToolChoiceError(
        "tools", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  const ordered_json& fn = tool["function"];
  ordered_json params = fn.contains("parameters") && !fn["parameters"].is_null()
                            ? fn["parameters"]
                            : ordered_json{{"type", "object"}};
  return ordered_json{{"type", "object"},
                      {"properties", {{"name", {{"const", fn["name"]}}}, {args_key, params}}},
                      {"required", {"name", args_key}},
                      {"additionalProperties", false}};
}

}  // namespace

std::optional<ForcedToolCall> forced_tool_call(const ordered_json* tools,
                                               const ordered_json& tool_choice,
                                               ToolCallFormat template_format) {
  const auto bad = [](const std::string& message) {
    throw ToolChoiceError("tool_choice", message);
  };
  std::vector<const ordered_json*> forced;  // the tools the call may name
  if (tool_choice.is_string() && tool_choice == "required") {
    if (!tools || !tools->is_array() || tools->empty()) {
      bad("tool_choice 'required' needs a non-empty 'tools' list");
    }
    for (const ordered_json& t : *tools) forced.push_back(&t);
  } else if (tool_choice.is_object()) {
    const ordered_json* fn = field(tool_choice, "function");
    if (tool_choice.value("type", "") != "function" || !fn || !fn->is_object() ||
        !fn->contains("name") || !(*fn)["name"].is_string()) {
      bad("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}");
    }
    if (!tools || !tools->is_array()) bad("a named tool_choice needs 'tools'");
    const std::string& name = (*fn)["name"].get_ref<const std::string&>();
    for (const ordered_json& t : *tools) {
      if (t.is_object() && t.contains("function") && t["function"].is_object() &&
          t["function"].value("name", "") == name) {
        forced.push_back(&t);
      }
    }
    if (forced.empty()) bad("tool_choice names '" + name + "', which is not among the 'tools'");
  } else if (!tool_choice.is_string() || (tool_choice != "auto" && tool_choice != "none")) {
    bad("'tool_choice' must be 'auto', 'none', 'required' or a named function");
  }
  if (forced.empty()) return std::nullopt;
  ForcedToolCall out;
  // Templates with <tool_call> tags get their own form; every other model writes the call as a
  // bare JSON reply, which the JSON-reply parser reads.
  const bool tags = template_format == ToolCallFormat::kTags;
  out.format = tags ? ToolCallFormat::kTags : ToolCallFormat::kJsonReply;
  const char* args_key = tags ? "arguments" : "parameters";
  ordered_json any = ordered_json::array();
  for (const ordered_json* t : forced) any.push_back(call_schema(*t, args_key));
  out.spec.kind = grammar::GrammarSpec::Kind::kJsonSchema;
  out.spec.text = (any.size() == 1 ? any[0] : ordered_json{{"anyOf", any}}).dump();
  out.spec.strict = true;
  if (tags) {
    out.spec.prefix = "<tool_call>\n";
    out.spec.suffix = "\n</tool_call>";
  }
  return out;
}

}  // namespace pagedlm::serving
