// A model ready to serve text: the checkpoint, its tokenizer and its chat template, loaded from
// a Hugging Face folder or a GGUF file. The one loader the CLI and the server share.
#pragma once

#include <optional>
#include <string>

#include "pagedlm/io/checkpoint.h"
#include "pagedlm/tokenizer/chat_template.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm {

struct TextModel {
  std::string name;  // the file or folder name, without a .gguf suffix
  Checkpoint checkpoint;
  Tokenizer tokenizer;
  // Absent when the model has none (base models); chat_template_error then says why.
  std::optional<ChatTemplate> chat_template;
  std::string chat_template_error;
};

// `path`: an HF folder (config.json, tokenizer.json, tokenizer_config.json or
// chat_template.jinja) or a .gguf file (tokenizer.ggml.* and tokenizer.chat_template metadata;
// the template's bos and eos tokens are the vocabulary's strings for its bos and eos ids).
TextModel load_text_model(const std::string& path, const LoadProgress& progress = {});

}  // namespace pagedlm
