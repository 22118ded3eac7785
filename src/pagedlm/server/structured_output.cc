#include "pagedlm/server/structured_output.h"

#include <string>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/core/json.h"
#include "pagedlm/server/openai_api.h"

namespace pagedlm::server {

namespace {

using json = nlohmann::ordered_json;
using grammar::GrammarSpec;

[[noreturn]] void bad(const std::string& param, const std::string& message) {
  throw ApiError(400, message, param);
}

const json* field(const json& body, const char* key) {
  auto it = body.find(key);
  return it == body.end() || it->is_null() ? nullptr : &*it;
}

// The JSON schema of one call to `tool` in the given form: {"name": <its name>, <args_key>:
// <its parameters>}.
json call_schema(const json& tool, const char* args_key) {
  if (!tool.is_object() || tool.value("type", "function") != "function" ||
      !tool.contains("function") || !tool["function"].is_object() ||
      !tool["function"].contains("name") || !tool["function"]["name"].is_string()) {
    bad("tools", "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}");
  }
  const json& fn = tool["function"];
  json params = fn.contains("parameters") && !fn["parameters"].is_null() ? fn["parameters"]
                                                                         : json{{"type", "object"}};
  return json{{"type", "object"},
              {"properties", {{"name", {{"const", fn["name"]}}}, {args_key, params}}},
              {"required", {"name", args_key}},
              {"additionalProperties", false}};
}

}  // namespace

StructuredOutput parse_structured_output(const json& body, bool chat,
                                         grammar::GrammarCompiler* compiler,
                                         ToolCallFormat template_format) {
  StructuredOutput out;
  GrammarSpec spec;
  std::string param;  // the field the grammar came from
  auto take = [&](const char* name) {
    if (!param.empty()) {
      bad(name,
          "'" + param + "' and '" + name + "' cannot be combined: one constraint per request");
    }
    param = name;
  };

  if (const json* format = field(body, "response_format")) {
    if (!format->is_object() || !format->contains("type") || !(*format)["type"].is_string()) {
      bad("response_format", "'response_format' must be an object with a string 'type'");
    }
    const std::string type = (*format)["type"];
    if (type == "json_object") {
      take("response_format");
      spec.kind = GrammarSpec::Kind::kJsonObject;
    } else if (type == "json_schema") {
      take("response_format");
      const json* js = field(*format, "json_schema");
      if (!js || !js->is_object() || !js->contains("schema")) {
        bad("response_format", "'json_schema' needs an object with a 'schema'");
      }
      const json& schema = (*js)["schema"];
      if (!schema.is_object() && !schema.is_boolean()) {
        bad("response_format", "'json_schema.schema' must be a JSON schema object");
      }
      spec.kind = GrammarSpec::Kind::kJsonSchema;
      spec.text = schema.dump();
      if (const json* strict = field(*js, "strict")) {
        if (!strict->is_boolean()) bad("response_format", "'json_schema.strict' must be a boolean");
        spec.strict = strict->get<bool>();
      }
    } else if (type != "text") {
      bad("response_format",
          "'response_format.type' must be 'text', 'json_object' or "
          "'json_schema', got '" +
              type + "'");
    }
  }
  // Ours and vLLM's names (guided_*) for the same constraints; naming two is a conflict.
  struct TextConstraint {
    const char* name;
    GrammarSpec::Kind kind;
    const char* form;
  };
  for (const auto& [name, kind, form] :
       {TextConstraint{"regex", GrammarSpec::Kind::kRegex, "a string"},
        TextConstraint{"guided_regex", GrammarSpec::Kind::kRegex, "a string"},
        TextConstraint{"grammar", GrammarSpec::Kind::kEbnf, "a string (EBNF, root rule 'root')"},
        TextConstraint{"guided_grammar", GrammarSpec::Kind::kEbnf,
                       "a string (EBNF, root rule 'root')"}}) {
    if (const json* text = field(body, name)) {
      take(name);
      if (!text->is_string()) bad(name, cat("'", name, "' must be ", form));
      spec.kind = kind;
      spec.text = text->get<std::string>();
    }
  }
  for (const char* name : {"choice", "guided_choice"}) {
    if (const json* choice = field(body, name)) {
      take(name);
      if (!choice->is_array()) bad(name, cat("'", name, "' must be a list of strings"));
      spec.kind = GrammarSpec::Kind::kChoice;
      for (const json& c : *choice) {
        if (!c.is_string()) bad(name, cat("'", name, "' must be a list of strings"));
        spec.choices.push_back(c.get<std::string>());
      }
    }
  }
  // vLLM's guided_json: the schema itself, as an object or as JSON text.
  if (const json* schema = field(body, "guided_json")) {
    take("guided_json");
    json parsed = schema->is_string() ? try_parse_json<json>(schema->get<std::string>()) : *schema;
    if (!parsed.is_object() && !parsed.is_boolean()) {
      bad("guided_json", "'guided_json' must be a JSON schema (an object, or its JSON text)");
    }
    spec.kind = GrammarSpec::Kind::kJsonSchema;
    spec.text = parsed.dump();
  }
  if (const json* tc = chat ? field(body, "tool_choice") : nullptr) {
    const json* tools = field(body, "tools");
    std::vector<const json*> forced;  // the tools the call may name
    if (tc->is_string() && *tc == "required") {
      if (!tools || !tools->is_array() || tools->empty()) {
        bad("tool_choice", "tool_choice 'required' needs a non-empty 'tools' list");
      }
      for (const json& t : *tools) forced.push_back(&t);
    } else if (tc->is_object()) {
      const json* fn = field(*tc, "function");
      if (tc->value("type", "") != "function" || !fn || !fn->is_object() || !fn->contains("name") ||
          !(*fn)["name"].is_string()) {
        bad("tool_choice",
            "a named tool_choice is {\"type\": \"function\", \"function\": "
            "{\"name\": ...}}");
      }
      if (!tools || !tools->is_array()) bad("tool_choice", "a named tool_choice needs 'tools'");
      for (const json& t : *tools) {
        if (t.is_object() && t.contains("function") && t["function"].is_object() &&
            t["function"].value("name", "") == (*fn)["name"].get<std::string>()) {
          forced.push_back(&t);
        }
      }
      if (forced.empty()) {
        bad("tool_choice", "tool_choice names '" + (*fn)["name"].get<std::string>() +
                               "', which is not among the 'tools'");
      }
    } else if (!tc->is_string() || (*tc != "auto" && *tc != "none")) {
      bad("tool_choice", "'tool_choice' must be 'auto', 'none', 'required' or a named function");
    }
    if (!forced.empty()) {
      take("tool_choice");
      // Templates with <tool_call> tags get their own form; every other model writes the call
      // as a bare JSON reply, which the JSON-reply parser reads.
      const bool tags = template_format == ToolCallFormat::kTags;
      out.forced_tool_calls = tags ? ToolCallFormat::kTags : ToolCallFormat::kJsonReply;
      const char* args_key = tags ? "arguments" : "parameters";
      json any = json::array();
      for (const json* t : forced) any.push_back(call_schema(*t, args_key));
      spec.kind = GrammarSpec::Kind::kJsonSchema;
      spec.text = (any.size() == 1 ? any[0] : json{{"anyOf", any}}).dump();
      spec.strict = true;
      if (tags) {
        spec.prefix = "<tool_call>\n";
        spec.suffix = "\n</tool_call>";
      }
    }
  }
  if (param.empty()) return out;
  if (compiler == nullptr) {
    bad(param, "this server has no tokenizer (random weights), so no structured output");
  }
  try {
    out.grammar = compiler->compile(spec);
  } catch (const grammar::GrammarError& e) {
    bad(param, e.what());
  }
  return out;
}

}  // namespace pagedlm::server
