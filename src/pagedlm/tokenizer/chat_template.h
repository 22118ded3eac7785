// Chat templates: turns an OpenAI-style message list into the prompt text a model was trained
// on, by rendering the model's Jinja2 template exactly as transformers' apply_chat_template
// does (same Jinja environment, same variables, same tojson).
#pragma once

#include <memory>
#include <nlohmann/json.hpp>
#include <string>

namespace pagedlm {

namespace jinja {
class Template;
}

class ChatTemplate {
 public:
  // Parses `source` now, so a broken template fails at load time (pagedlm::Error with line).
  ChatTemplate(std::string source, std::string bos_token, std::string eos_token);
  ~ChatTemplate();
  ChatTemplate(ChatTemplate&&) noexcept;
  ChatTemplate& operator=(ChatTemplate&&) noexcept;

  // messages: [{"role": ..., "content": ...}, ...] plus whatever else templates read
  // (tool_calls, tool_call_id, reasoning_content). A content given as a list of
  // {"type": "text", "text": ...} parts is joined with "\n" first, as vLLM does for templates
  // that expect string content; a list with other part types is passed through untouched.
  // extra: more template variables (tools, documents, date_string, enable_thinking, ...);
  // tools and documents are none unless given, as in transformers.
  // JSON objects keep their key order (ordered_json) because tojson prints keys in the order
  // the client sent them; a plain nlohmann::json converts implicitly (sorted keys).
  // Throws pagedlm::Error: the template's own message for raise_exception(...), or
  // "chat template error at line N: ..." for other runtime errors.
  std::string render(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                     const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  const std::string& source() const { return source_; }
  const std::string& bos_token() const { return bos_token_; }
  const std::string& eos_token() const { return eos_token_; }

 private:
  std::string source_;
  std::string bos_token_;
  std::string eos_token_;
  std::unique_ptr<jinja::Template> template_;
};

// The template string of a tokenizer_config.json "chat_template" value: either the string
// itself, or, for a list of {"name", "template"} entries, the one named "default".
std::string select_chat_template(const nlohmann::ordered_json& value);

// Loads the chat template of a Hugging Face model folder: chat_template.jinja when present
// (newer repos; transformers prefers it), else tokenizer_config.json's "chat_template". The
// bos and eos tokens come from tokenizer_config.json (a string or an {"content": ...} object).
// Throws pagedlm::Error naming the folder when it has no template.
ChatTemplate load_chat_template(const std::string& model_dir);

}  // namespace pagedlm
