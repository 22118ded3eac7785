#include "pagedlm/server/structured_output.h"

#include <optional>
#include <string>
#include <utility>
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
    std::optional<serving::ForcedToolCall> forced;
    try {
      forced = serving::forced_tool_call(field(body, "tools"), *tc, template_format);
    } catch (const serving::ToolChoiceError& e) {
      bad(e.field(), e.what());
    }
    if (forced) {
      take("tool_choice");
      out.forced_tool_calls = forced->format;
      spec = std::move(forced->spec);
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
