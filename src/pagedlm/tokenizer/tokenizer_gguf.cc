// Tokenizer::from_gguf: the byte-level BPE vocabulary llama.cpp stores under tokenizer.ggml.*.
// Kept apart from the tokenizer.json loader so that only users of GGUF link the GGUF reader.
#include <variant>

#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm {
namespace {

// llama.cpp's "llama-bpe" (LLAMA3) pre-tokenizer type also turns on ignore_merges, as the
// Llama 3 tokenizer.json does.
bool uses_ignore_merges(const std::string& pre) {
  return pre == "llama-bpe" || pre == "llama3" || pre == "llama-v3";
}

int32_t optional_id(const GgufFile& gguf, const std::string& key) {
  const GgufValue* value = gguf.find(key);
  if (value == nullptr) return -1;
  PAGEDLM_CHECK(value->is_int(), key, " must be an integer");
  return static_cast<int32_t>(value->as_int());
}

bool optional_flag(const GgufFile& gguf, const std::string& key, bool fallback) {
  const GgufValue* value = gguf.find(key);
  if (value == nullptr) return fallback;
  const bool* flag = std::get_if<bool>(&value->value);
  PAGEDLM_CHECK(flag != nullptr, key, " must be a bool");
  return *flag;
}

}  // namespace

Tokenizer Tokenizer::from_gguf(const GgufFile& gguf) {
  const std::string& model = gguf.get_string("tokenizer.ggml.model");
  PAGEDLM_CHECK(model == "gpt2", gguf.path(), ": tokenizer.ggml.model is '", model,
                "'; only 'gpt2' (byte-level BPE) is supported");
  const GgufValue* pre_value = gguf.find("tokenizer.ggml.pre");
  PAGEDLM_CHECK(pre_value != nullptr, gguf.path(), ": tokenizer.ggml.pre is missing");
  const std::string& pre = pre_value->as_string();

  TokenizerSpec spec;
  spec.pre_tokenizer = PreTokenizer::from_gguf_name(pre);
  spec.bpe.ignore_merges = uses_ignore_merges(pre);
  spec.tokens = gguf.get_string_array("tokenizer.ggml.tokens");
  const size_t num_tokens = spec.tokens.size();

  std::vector<int64_t> types;
  if (gguf.find("tokenizer.ggml.token_type") != nullptr) {
    types = gguf.get_int_array("tokenizer.ggml.token_type");
    PAGEDLM_CHECK(types.size() == num_tokens, gguf.path(), ": tokenizer.ggml.token_type has ",
                  types.size(), " entries for ", num_tokens, " tokens");
  }
  for (size_t id = 0; id < types.size(); ++id) {
    PAGEDLM_CHECK(types[id] >= 0 && types[id] <= static_cast<int64_t>(TokenType::kByte),
                  gguf.path(), ": tokenizer.ggml.token_type[", id, "] = ", types[id],
                  " is not a token type");
    const auto type = static_cast<TokenType>(types[id]);
    spec.token_types.push_back(type);
    // llama.cpp matches control and user-defined tokens verbatim in the text, like HF added
    // tokens; control ones are the special tokens.
    if (type == TokenType::kControl || type == TokenType::kUserDefined) {
      AddedToken added;
      added.id = static_cast<int32_t>(id);
      added.content = spec.tokens[id];
      added.special = type == TokenType::kControl;
      spec.added_tokens.push_back(std::move(added));
    }
  }

  const std::vector<std::string> merges = gguf.get_string_array("tokenizer.ggml.merges");
  spec.merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string& merge = merges[i];
    const size_t space = merge.find(' ', 1);
    PAGEDLM_CHECK(space != std::string::npos && space + 1 < merge.size(), gguf.path(),
                  ": tokenizer.ggml.merges[", i, "] '", merge, "' is not \"left right\"");
    spec.merges.emplace_back(merge.substr(0, space), merge.substr(space + 1));
  }

  spec.bos_id = optional_id(gguf, "tokenizer.ggml.bos_token_id");
  spec.eos_id = optional_id(gguf, "tokenizer.ggml.eos_token_id");
  if (optional_flag(gguf, "tokenizer.ggml.add_bos_token", false)) {
    PAGEDLM_CHECK(spec.bos_id >= 0, gguf.path(), ": add_bos_token is set without a bos id");
    spec.prefix_ids.push_back(spec.bos_id);
  }
  if (optional_flag(gguf, "tokenizer.ggml.add_eos_token", false)) {
    PAGEDLM_CHECK(spec.eos_id >= 0, gguf.path(), ": add_eos_token is set without an eos id");
    spec.suffix_ids.push_back(spec.eos_id);
  }
  return Tokenizer(std::move(spec));
}

}  // namespace pagedlm
