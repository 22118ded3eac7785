// A model as text users see it: weights, tokenizer and (when the model has one) chat template,
// loaded from an HF folder or a GGUF file.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "pagedlm/model/checkpoint.h"
#include "pagedlm/tokenizer/chat_template.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm {

struct TextModel {
  Checkpoint checkpoint;
  std::unique_ptr<Tokenizer> tokenizer;       // null for an HF folder without tokenizer.json
  std::optional<ChatTemplate> chat_template;  // empty when the model ships none
};

TextModel load_text_model(const std::string& path, const LoadProgress& progress = {});

// Replaces the model's chat template by the Jinja file at `path` (its BOS/EOS from the
// tokenizer). Throws pagedlm::Error when the file cannot be read or the model has no tokenizer.
void replace_chat_template(TextModel& model, const std::string& path);

}  // namespace pagedlm
