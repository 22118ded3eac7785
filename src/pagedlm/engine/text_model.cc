#include "pagedlm/engine/text_model.h"

#include <filesystem>

#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"

namespace pagedlm {

namespace {

std::string model_name(const std::string& path) {
  std::filesystem::path p(path);
  if (p.filename().empty()) p = p.parent_path();  // "dir/" names the folder
  std::string name = p.filename().string();
  if (p.extension() == ".gguf") name = p.stem().string();
  return name;
}

}  // namespace

TextModel load_text_model(const std::string& path, const LoadProgress& progress) {
  const bool is_dir = std::filesystem::is_directory(path);
  std::optional<Tokenizer> tokenizer;
  std::optional<ChatTemplate> chat_template;
  std::string chat_template_error;
  if (is_dir) {
    tokenizer.emplace(Tokenizer::from_tokenizer_json(path + "/tokenizer.json"));
    try {
      chat_template.emplace(load_chat_template(path));
    } catch (const Error& e) {
      chat_template_error = e.what();
    }
  } else {
    const GgufFile gguf = GgufFile::open(path);
    tokenizer.emplace(Tokenizer::from_gguf(gguf));
    if (gguf.find("tokenizer.chat_template") != nullptr) {
      auto piece = [&](int32_t id) { return id >= 0 ? tokenizer->token_to_piece(id) : ""; };
      chat_template.emplace(gguf.get_string("tokenizer.chat_template"), piece(tokenizer->bos_id()),
                            piece(tokenizer->eos_id()));
    } else {
      chat_template_error = cat(path, " has no tokenizer.chat_template metadata");
    }
  }
  return TextModel{model_name(path), load_checkpoint(path, progress), std::move(*tokenizer),
                   std::move(chat_template), std::move(chat_template_error)};
}

}  // namespace pagedlm
