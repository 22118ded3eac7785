#include "pagedlm/tokenizer/chat_template.h"

#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/core/file.h"
#include "pagedlm/core/json.h"
#include "pagedlm/tokenizer/jinja.h"

namespace pagedlm {
namespace {

using ojson = nlohmann::ordered_json;

// Text-only content parts joined into one string; nullopt for other content, which is left as
// the client sent it.
std::optional<std::string> joined_text_parts(const ojson& content) {
  if (!content.is_array() || content.empty()) return std::nullopt;
  std::string text;
  for (size_t i = 0; i < content.size(); ++i) {
    const ojson& part = content[i];
    if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
        !part["text"].is_string()) {
      return std::nullopt;
    }
    if (i) text += "\n";
    text += part["text"].get<std::string>();
  }
  return text;
}

// transformers copies a message's reasoning (reasoning_content, thinking or reasoning) to
// both "thinking" (first) and "reasoning_content" (last) before rendering; nullopt for a
// message without reasoning.
std::optional<ojson> alias_reasoning(const ojson& message) {
  for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
    auto it = message.find(key);
    if (it == message.end() || it->is_null()) continue;
    // Python's {"thinking": r, **message, "reasoning_content": r}: a key keeps the position
    // it was first inserted at.
    const ojson& reasoning = *it;
    ojson out = ojson::object();
    out["thinking"] = reasoning;
    for (const auto& [k, v] : message.items()) out[k] = v;
    out["reasoning_content"] = reasoning;
    return out;
  }
  return std::nullopt;
}

// A message as templates see it: reasoning aliased, text-only content parts joined. Most
// messages need neither and are converted without a copy (a request may carry tens of
// thousands).
jinja::Value prepared_message(const ojson& message) {
  std::optional<ojson> changed = alias_reasoning(message);
  const ojson& aliased = changed ? *changed : message;
  auto content = aliased.find("content");
  if (content != aliased.end()) {
    if (std::optional<std::string> text = joined_text_parts(*content)) {
      if (!changed) changed = message;
      (*changed)["content"] = std::move(*text);
    }
  }
  return jinja::Value::from_json(changed ? *changed : message);
}

std::string token_text(const ojson& config, const char* key) {
  auto it = config.find(key);
  if (it == config.end()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_object() && it->contains("content")) return (*it)["content"].get<std::string>();
  return "";
}

}  // namespace

ChatTemplate::ChatTemplate(std::string source, std::string bos_token, std::string eos_token)
    : source_(std::move(source)),
      bos_token_(std::move(bos_token)),
      eos_token_(std::move(eos_token)),
      template_(std::make_unique<jinja::Template>(source_)) {}

ChatTemplate::~ChatTemplate() = default;
ChatTemplate::ChatTemplate(ChatTemplate&&) noexcept = default;
ChatTemplate& ChatTemplate::operator=(ChatTemplate&&) noexcept = default;

std::string ChatTemplate::render(const ojson& messages, bool add_generation_prompt,
                                 const ojson& extra) const {
  PAGEDLM_CHECK(messages.is_array(), "chat messages must be a JSON array");
  PAGEDLM_CHECK(extra.is_object() || extra.is_null(), "chat template variables must be an object");
  std::vector<jinja::Value> prepared;
  prepared.reserve(messages.size());
  for (const auto& message : messages) {
    PAGEDLM_CHECK(message.is_object(), "each chat message must be a JSON object, got ",
                  message.dump());
    prepared.push_back(prepared_message(message));
  }
  std::vector<std::pair<std::string, jinja::Value>> context = {
      {"messages", jinja::Value::list(std::move(prepared))},
      {"tools", jinja::Value::none()},
      {"documents", jinja::Value::none()},
      {"add_generation_prompt", jinja::Value::boolean(add_generation_prompt)},
      {"bos_token", jinja::Value::string(bos_token_)},
      {"eos_token", jinja::Value::string(eos_token_)},
  };
  if (extra.is_object()) {
    for (const auto& [key, value] : extra.items()) {
      context.emplace_back(key, jinja::Value::from_json(value));
    }
  }
  return template_->render(context);
}

std::string select_chat_template(const ojson& value) {
  if (value.is_string()) return value.get<std::string>();
  PAGEDLM_CHECK(value.is_array(), "chat_template must be a string or a list of named templates");
  for (const auto& entry : value) {
    if (entry.is_object() && entry.value("name", "") == "default" && entry.contains("template") &&
        entry["template"].is_string()) {
      return entry["template"].get<std::string>();
    }
  }
  fail("chat_template list has no template named \"default\"");
}

ChatTemplate load_chat_template(const std::string& model_dir) {
  namespace fs = std::filesystem;
  fs::path dir(model_dir);
  ojson config = ojson::object();
  fs::path config_path = dir / "tokenizer_config.json";
  if (fs::exists(config_path)) {
    try {
      config = parse_json<ojson>(read_file(config_path.string()));
    } catch (const ojson::exception& e) {  // parse_error, or out_of_range for 1e999
      fail("cannot parse ", config_path.string(), ": ", e.what());
    } catch (const Error& e) {
      fail("cannot parse ", config_path.string(), ": ", e.what());
    }
  }
  std::string source;
  fs::path jinja_path = dir / "chat_template.jinja";
  if (fs::exists(jinja_path)) {
    source = read_file(jinja_path.string());
  } else if (config.contains("chat_template") && !config["chat_template"].is_null()) {
    source = select_chat_template(config["chat_template"]);
  } else {
    fail("no chat template in ", model_dir,
         " (neither chat_template.jinja nor tokenizer_config.json \"chat_template\")");
  }
  return ChatTemplate(std::move(source), token_text(config, "bos_token"),
                      token_text(config, "eos_token"));
}

}  // namespace pagedlm
