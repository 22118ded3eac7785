#include "pagedlm/engine/text_model.h"

#include <filesystem>

#include "pagedlm/core/error.h"
#include "pagedlm/core/file.h"
#include "pagedlm/io/gguf.h"

namespace pagedlm {

namespace {

std::string token_text(const Tokenizer& tokenizer, int32_t id) {
  return id >= 0 && id < tokenizer.vocab_size() ? tokenizer.token_to_bytes(id) : std::string();
}

// A template from its source, its BOS/EOS texts from the model's tokenizer (GGUF and
// --chat-template files carry no tokenizer_config.json).
void set_chat_template(TextModel& model, std::string source) {
  const Tokenizer& tok = *model.tokenizer;
  model.chat_template.emplace(std::move(source), token_text(tok, tok.bos_id()),
                              token_text(tok, tok.eos_id()));
}

}  // namespace

TextModel load_text_model(const std::string& path, const LoadProgress& progress) {
  TextModel model;
  model.checkpoint = load_checkpoint(path, progress);
  if (std::filesystem::is_directory(path)) {
    // Token-level use (tests, benchmarks) needs no tokenizer.
    const std::string tokenizer_json = path + "/tokenizer.json";
    if (!std::filesystem::exists(tokenizer_json)) return model;
    model.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_tokenizer_json(tokenizer_json));
    try {
      model.chat_template.emplace(load_chat_template(path));
    } catch (const Error&) {
      // A base model without a chat template still serves plain completions.
    }
    return model;
  }
  const GgufFile gguf = GgufFile::open(path);
  if (!gguf.find("tokenizer.ggml.model")) return model;  // token ids only, as for folders above
  model.tokenizer = std::make_unique<Tokenizer>(Tokenizer::from_gguf(gguf));
  if (const GgufValue* tmpl = gguf.find("tokenizer.chat_template")) {
    set_chat_template(model, tmpl->as_string());
  }
  return model;
}

void replace_chat_template(TextModel& model, const std::string& path) {
  PAGEDLM_CHECK(model.tokenizer != nullptr, "a chat template needs the model's tokenizer");
  set_chat_template(model, read_file(path));
}

}  // namespace pagedlm
