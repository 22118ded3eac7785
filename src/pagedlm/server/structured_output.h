// Structured output in OpenAI requests: response_format (json_object, json_schema with strict),
// tool_choice "required" or a named function (the reply is one call to a given tool, its
// arguments held to the tool's parameter schema), and the request-body extensions `regex`,
// `choice` (a list of strings) and `grammar` (EBNF/GBNF, root rule "root"), also under vLLM's
// names guided_regex, guided_choice and guided_grammar, and vLLM's guided_json (a schema). At
// most one of them per request. The grammar is compiled here, on the HTTP worker's thread
// (grammar/grammar.h bounds the time and caches the result), so the engine thread only ever gets
// a compiled one.
#pragma once

#include <nlohmann/json.hpp>

#include "pagedlm/grammar/grammar.h"
#include "pagedlm/serving/tool_calls.h"

namespace pagedlm::server {

using serving::ToolCallFormat;

struct StructuredOutput {
  grammar::CompiledGrammarPtr grammar;  // null: unconstrained
  // tool_choice "required" or named: the form the forced call is written in, which the reply's
  // parser reads (kNone otherwise).
  ToolCallFormat forced_tool_calls = ToolCallFormat::kNone;
};

// Throws ApiError 400 (with the field at fault) for a malformed, unsupported or uncompilable
// request; compiler null: the model has no tokenizer, and structured output is refused.
// template_format: the call form of the model's chat template (kNone when it has none).
StructuredOutput parse_structured_output(const nlohmann::ordered_json& body, bool chat,
                                         grammar::GrammarCompiler* compiler,
                                         ToolCallFormat template_format);

}  // namespace pagedlm::server
