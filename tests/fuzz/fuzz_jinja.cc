// Chat templates: parsing and rendering a template from a model file (ChatTemplate, which
// drives jinja::Template as the server does). Input: the template's source. A bad template may
// only throw pagedlm::Error, at parse time or while rendering.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "fuzz_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/chat_template.h"

namespace {

using ojson = nlohmann::ordered_json;

// A conversation touching what templates read: system, tool calls and results, list content.
const ojson& messages() {
  static const ojson m = ojson::parse(R"([
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
    {"role": "assistant", "content": null, "reasoning_content": "Look it up.",
     "tool_calls": [{"type": "function", "id": "call_1",
       "function": {"name": "get_weather", "arguments": {"city": "Paris", "n": [1, 2.5]}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
    {"role": "assistant", "content": "21 degrees."},
    {"role": "user", "content": "Thanks \u00e9\u4e2d"}
  ])");
  return m;
}

const ojson& extra() {
  static const ojson e = ojson::parse(R"({
    "tools": [{"type": "function", "function": {"name": "get_weather",
      "description": "Weather", "parameters": {"type": "object",
        "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
    "enable_thinking": false, "date_string": "01 Dec 2026"
  })");
  return e;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  try {
    const pagedlm::ChatTemplate tmpl(std::string(pagedlm::fuzz::as_text(data, size)), "<s>",
                                     "</s>");
    (void)tmpl.render(messages(), /*add_generation_prompt=*/true, extra());
  } catch (const pagedlm::Error&) {
  }
  return 0;
}
