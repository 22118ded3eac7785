// Tokenizer::from_tokenizer_json: the HF tokenizer.json structures used by byte-level BPE models
// (SmolLM2, Qwen2, Llama 3). Anything we cannot reproduce exactly is refused with an Error naming
// the field, rather than loaded into a tokenizer that would silently disagree with HF.
// One exception: Qwen2's NFC normalizer is accepted and not applied, which only matters for text
// that is not already in NFC.
#include <algorithm>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "pagedlm/core/error.h"
#include "pagedlm/core/file.h"
#include "pagedlm/core/json.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm {
namespace {

using nlohmann::json;

// Typed access to a JSON document whose every failure names the source and the field path.
class JsonFields {
 public:
  explicit JsonFields(std::string source) : source_(std::move(source)) {}

  [[noreturn]] void error(const std::string& where, const std::string& what) const {
    fail(source_, ": ", where, " ", what);
  }

  // obj[key], which must exist and not be null.
  const json& get(const json& obj, const std::string& key, const std::string& where) const {
    const json* value = find(obj, key, where);
    if (value == nullptr) error(join(where, key), "is missing");
    return *value;
  }
  // obj[key] or nullptr when absent or null.
  const json* find(const json& obj, const std::string& key, const std::string& where) const {
    if (!obj.is_object()) error(where, cat("must be an object, got ", obj.type_name()));
    auto it = obj.find(key);
    return it == obj.end() || it->is_null() ? nullptr : &*it;
  }

  const std::string& string(const json& value, const std::string& where) const {
    if (!value.is_string()) error(where, cat("must be a string, got ", value.type_name()));
    return value.get_ref<const std::string&>();
  }
  int64_t integer(const json& value, const std::string& where) const {
    if (!value.is_number_integer())
      error(where, cat("must be an integer, got ", value.type_name()));
    return value.get<int64_t>();
  }
  int32_t id(const json& value, const std::string& where) const {
    const int64_t v = integer(value, where);
    if (v < 0 || v >= kMaxVocabSize) {
      error(where, cat("is not a valid token id: ", v, " (ids are below ", kMaxVocabSize, ")"));
    }
    return static_cast<int32_t>(v);
  }
  const json& array(const json& value, const std::string& where) const {
    if (!value.is_array()) error(where, cat("must be an array, got ", value.type_name()));
    return value;
  }
  const json& object(const json& value, const std::string& where) const {
    if (!value.is_object()) error(where, cat("must be an object, got ", value.type_name()));
    return value;
  }
  // obj[key] as a bool, `fallback` when absent or null.
  bool flag(const json& obj, const std::string& key, const std::string& where,
            bool fallback) const {
    const json* value = find(obj, key, where);
    if (value == nullptr) return fallback;
    if (!value->is_boolean()) {
      error(join(where, key), cat("must be a boolean, got ", value->type_name()));
    }
    return value->get<bool>();
  }
  std::string type_of(const json& node, const std::string& where) const {
    return string(get(node, "type", where), join(where, "type"));
  }

  static std::string join(const std::string& where, const std::string& key) {
    return where.empty() ? key : where + "." + key;
  }
  static std::string index(const std::string& where, size_t i) { return cat(where, "[", i, "]"); }

 private:
  std::string source_;
};

void parse_model(const JsonFields& f, const json& root, TokenizerSpec* spec) {
  const json& model = f.get(root, "model", "");
  f.object(model, "model");
  if (const json* type = f.find(model, "type", "model")) {
    const std::string& name = f.string(*type, "model.type");
    if (name != "BPE") f.error("model.type", cat("is '", name, "'; only BPE is supported"));
  }
  if (f.flag(model, "byte_fallback", "model", false)) {
    f.error("model.byte_fallback", "is true; byte fallback (SentencePiece BPE) is not supported");
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json* value = f.find(model, key, "model");
    if (value != nullptr && !f.string(*value, cat("model.", key)).empty()) {
      f.error(cat("model.", key), "is set; subword affixes are not supported");
    }
  }
  if (const json* dropout = f.find(model, "dropout", "model");
      dropout != nullptr && !(dropout->is_number() && dropout->get<double>() == 0.0)) {
    f.error("model.dropout", "is set; BPE dropout is not supported for inference");
  }

  const json& vocab = f.object(f.get(model, "vocab", "model"), "model.vocab");
  if (vocab.empty()) f.error("model.vocab", "is empty");
  for (const auto& [token, value] : vocab.items()) {
    const int32_t id = f.id(value, cat("model.vocab[\"", token, "\"]"));
    if (id >= static_cast<int32_t>(spec->tokens.size())) spec->tokens.resize(id + 1);
    if (!spec->tokens[id].empty()) {
      f.error("model.vocab",
              cat("gives id ", id, " to both '", spec->tokens[id], "' and '", token, "'"));
    }
    if (token.empty()) f.error("model.vocab", cat("has an empty token (id ", id, ")"));
    spec->tokens[id] = token;
  }

  const json& merges = f.array(f.get(model, "merges", "model"), "model.merges");
  spec->merges.reserve(merges.size());
  for (size_t i = 0; i < merges.size(); ++i) {
    const std::string where = JsonFields::index("model.merges", i);
    const json& merge = merges[i];
    if (merge.is_string()) {
      // "a b": tokens never contain a space in the byte-level alphabet (it is spelled Ġ).
      const std::string& text = merge.get_ref<const std::string&>();
      const size_t space = text.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == text.size() ||
          text.find(' ', space + 1) != std::string::npos) {
        f.error(where, cat("'", text, "' is not of the form \"left right\""));
      }
      spec->merges.emplace_back(text.substr(0, space), text.substr(space + 1));
    } else if (merge.is_array()) {
      if (merge.size() != 2) f.error(where, cat("has ", merge.size(), " parts, expected 2"));
      spec->merges.emplace_back(f.string(merge[0], where + "[0]"),
                                f.string(merge[1], where + "[1]"));
    } else {
      f.error(where, cat("must be a \"left right\" string or a [left, right] pair, got ",
                         merge.type_name()));
    }
  }

  spec->bpe.ignore_merges = f.flag(model, "ignore_merges", "model", false);
  spec->bpe.fuse_unk = f.flag(model, "fuse_unk", "model", false);
  if (const json* unk = f.find(model, "unk_token", "model")) {
    const std::string& token = f.string(*unk, "model.unk_token");
    if (!vocab.contains(token))
      f.error("model.unk_token", cat("'", token, "' is not in the vocab"));
    spec->bpe.unk_id = vocab[token].get<int32_t>();
  }
}

void parse_added_tokens(const JsonFields& f, const json& root, TokenizerSpec* spec) {
  const json* added = f.find(root, "added_tokens", "");
  if (added == nullptr) return;
  f.array(*added, "added_tokens");
  for (size_t i = 0; i < added->size(); ++i) {
    const std::string where = JsonFields::index("added_tokens", i);
    const json& entry = f.object((*added)[i], where);
    AddedToken token;
    token.id = f.id(f.get(entry, "id", where), where + ".id");
    token.content = f.string(f.get(entry, "content", where), where + ".content");
    if (token.content.empty()) f.error(where + ".content", "is empty");
    token.special = f.flag(entry, "special", where, false);
    token.lstrip = f.flag(entry, "lstrip", where, false);
    token.rstrip = f.flag(entry, "rstrip", where, false);
    token.single_word = f.flag(entry, "single_word", where, false);
    token.normalized = f.flag(entry, "normalized", where, !token.special);
    spec->added_tokens.push_back(std::move(token));
  }
}

// Appends the steps of one HF pre-tokenizer node; returns whether it contains a ByteLevel step.
bool parse_pre_tokenizer(const JsonFields& f, const json& node, const std::string& where,
                         PreTokenizer* pre) {
  const std::string type = f.type_of(node, where);
  if (type == "Sequence") {
    const json& steps = f.array(f.get(node, "pretokenizers", where), where + ".pretokenizers");
    bool byte_level = false;
    for (size_t i = 0; i < steps.size(); ++i) {
      byte_level |=
          parse_pre_tokenizer(f, steps[i], JsonFields::index(where + ".pretokenizers", i), pre);
    }
    return byte_level;
  }
  if (type == "ByteLevel") {
    if (f.flag(node, "add_prefix_space", where, false)) {
      f.error(where + ".add_prefix_space", "is true; prefix spaces are not supported");
    }
    if (f.flag(node, "use_regex", where, true)) pre->add_split(kGpt2Pattern);
    return true;
  }
  if (type == "Digits") {
    pre->add_split(f.flag(node, "individual_digits", where, false) ? kDigitsPattern
                                                                   : kDigitRunsPattern);
    return false;
  }
  if (type == "Split") {
    const json& pattern = f.object(f.get(node, "pattern", where), where + ".pattern");
    const std::string behavior = f.string(f.get(node, "behavior", where), where + ".behavior");
    if (behavior != "Isolated") {
      f.error(where + ".behavior", cat("is '", behavior, "'; only Isolated is supported"));
    }
    if (f.flag(node, "invert", where, false)) f.error(where + ".invert", "is true; not supported");
    if (const json* regex = f.find(pattern, "Regex", where + ".pattern")) {
      try {
        pre->add_split(f.string(*regex, where + ".pattern.Regex"));
      } catch (const Error& e) {
        f.error(where + ".pattern.Regex", e.what());
      }
    } else if (const json* literal = f.find(pattern, "String", where + ".pattern")) {
      pre->add_split(f.string(*literal, where + ".pattern.String"), /*literal=*/true);
    } else {
      f.error(where + ".pattern", "has neither Regex nor String");
    }
    return false;
  }
  f.error(where + ".type", cat("'", type, "' is not a supported pre-tokenizer"));
}

void parse_normalizer(const JsonFields& f, const json& root) {
  const json* normalizer = f.find(root, "normalizer", "");
  if (normalizer == nullptr) return;
  const std::string type = f.type_of(*normalizer, "normalizer");
  if (type != "NFC") f.error("normalizer.type", cat("'", type, "' is not supported"));
}

void parse_decoder(const JsonFields& f, const json& root) {
  const json* decoder = f.find(root, "decoder", "");
  if (decoder == nullptr) return;
  const std::string type = f.type_of(*decoder, "decoder");
  if (type != "ByteLevel") {
    f.error("decoder.type", cat("'", type, "' is not supported; byte-level BPE needs ByteLevel"));
  }
}

// TemplateProcessing's "single" template gives the ids put around one sequence (Llama 3: BOS).
void parse_post_processor(const JsonFields& f, const json& node, const std::string& where,
                          TokenizerSpec* spec) {
  const std::string type = f.type_of(node, where);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    const json& steps = f.array(f.get(node, "processors", where), where + ".processors");
    for (size_t i = 0; i < steps.size(); ++i) {
      parse_post_processor(f, steps[i], JsonFields::index(where + ".processors", i), spec);
    }
    return;
  }
  if (type != "TemplateProcessing") {
    f.error(where + ".type", cat("'", type, "' is not a supported post-processor"));
  }
  const json& single = f.array(f.get(node, "single", where), where + ".single");
  const json& specials = f.object(f.get(node, "special_tokens", where), where + ".special_tokens");
  bool seen_sequence = false;
  for (size_t i = 0; i < single.size(); ++i) {
    const std::string item_where = JsonFields::index(where + ".single", i);
    const json& item = f.object(single[i], item_where);
    if (f.find(item, "Sequence", item_where) != nullptr) {
      seen_sequence = true;
      continue;
    }
    const json& special = f.get(item, "SpecialToken", item_where);
    const std::string& name = f.string(f.get(special, "id", item_where + ".SpecialToken"),
                                       item_where + ".SpecialToken.id");
    const std::string special_where = cat(where, ".special_tokens[\"", name, "\"]");
    if (!specials.contains(name)) f.error(special_where, "is missing");
    const json& ids = f.array(f.get(specials[name], "ids", special_where), special_where + ".ids");
    for (size_t k = 0; k < ids.size(); ++k) {
      const int32_t id = f.id(ids[k], JsonFields::index(special_where + ".ids", k));
      (seen_sequence ? spec->suffix_ids : spec->prefix_ids).push_back(id);
    }
  }
}

// bos/eos live in tokenizer_config.json, either as a string or as {"content": ...}.
// The id of `content` among the added tokens, then the vocabulary; -1 when neither has it.
int32_t find_token(const TokenizerSpec& spec, const std::string& content) {
  for (const AddedToken& added : spec.added_tokens) {
    if (added.content == content) return added.id;
  }
  auto it = std::find(spec.tokens.begin(), spec.tokens.end(), content);
  return it == spec.tokens.end() ? -1 : static_cast<int32_t>(it - spec.tokens.begin());
}

void read_tokenizer_config(const std::filesystem::path& path, TokenizerSpec* spec) {
  if (!std::filesystem::exists(path)) return;
  const JsonFields f(path.string());
  json config = try_parse_json<json>(read_file(path.string()));
  if (config.is_discarded())
    f.error("", cat("is not valid JSON (or nests deeper than ", kMaxJsonDepth, " levels)"));
  f.object(config, "(root)");
  auto token_id = [&](const char* key) -> int32_t {
    const json* value = f.find(config, key, "");
    if (value == nullptr) return -1;
    const std::string& content = value->is_object()
                                     ? f.string(f.get(*value, "content", key), cat(key, ".content"))
                                     : f.string(*value, key);
    const int32_t id = find_token(*spec, content);
    if (id < 0) f.error(key, cat("'", content, "' is not a token of the tokenizer"));
    return id;
  };
  spec->bos_id = token_id("bos_token");
  spec->eos_id = token_id("eos_token");
}

TokenizerSpec spec_from_json(std::string_view json_text, const std::string& source) {
  const JsonFields f(source);
  json root = try_parse_json<json>(json_text);
  if (root.is_discarded()) {
    f.error("", cat("is not valid JSON (truncated or corrupt, or nests deeper than ", kMaxJsonDepth,
                    " levels)"));
  }
  f.object(root, "(root)");

  TokenizerSpec spec;
  parse_model(f, root, &spec);
  parse_added_tokens(f, root, &spec);
  parse_normalizer(f, root);
  const json* pre = f.find(root, "pre_tokenizer", "");
  if (pre == nullptr || !parse_pre_tokenizer(f, *pre, "pre_tokenizer", &spec.pre_tokenizer)) {
    f.error("pre_tokenizer", "has no ByteLevel step; only byte-level BPE is supported");
  }
  parse_decoder(f, root);
  if (const json* post = f.find(root, "post_processor", "")) {
    parse_post_processor(f, *post, "post_processor", &spec);
  }
  return spec;
}

// Problems found while building (merges outside the vocabulary, ...) name the file too.
Tokenizer build(TokenizerSpec spec, const std::string& source) {
  try {
    return Tokenizer(std::move(spec));
  } catch (const Error& e) {
    fail(source, ": ", e.what());
  }
}

}  // namespace

Tokenizer Tokenizer::from_tokenizer_json_text(std::string_view json_text,
                                              const std::string& source) {
  return build(spec_from_json(json_text, source), source);
}

Tokenizer Tokenizer::from_tokenizer_json(const std::string& path) {
  TokenizerSpec spec = spec_from_json(read_file(path), path);

  read_tokenizer_config(std::filesystem::path(path).parent_path() / "tokenizer_config.json", &spec);
  return build(std::move(spec), path);
}

}  // namespace pagedlm
