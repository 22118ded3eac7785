#define PCRE2_CODE_UNIT_WIDTH 8
#include "pagedlm/tokenizer/pretokenizer.h"

#include <pcre2.h>

#include <memory>

#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/unicode.h"

namespace pagedlm {
namespace {

pcre2_code* as_code(const std::shared_ptr<void>& code) {
  return static_cast<pcre2_code*>(code.get());
}

std::string pcre2_message(int error_code) {
  PCRE2_UCHAR buffer[256];
  pcre2_get_error_message(error_code, buffer, sizeof(buffer));
  return reinterpret_cast<const char*>(buffer);
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* data) const { pcre2_match_data_free(data); }
};

}  // namespace

Regex::Regex(std::string pattern, bool literal) : pattern_(std::move(pattern)), literal_(literal) {
  uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
  if (literal_) options |= PCRE2_LITERAL;
  PAGEDLM_CHECK(unicode::is_valid_utf8(pattern_), "regex pattern is not valid UTF-8");
  int error_code = 0;
  PCRE2_SIZE error_offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern_.data()), pattern_.size(),
                                   options, &error_code, &error_offset, nullptr);
  PAGEDLM_CHECK(code != nullptr, "cannot compile regex /", pattern_, "/ at offset ", error_offset,
                ": ", pcre2_message(error_code));
  code_ =
      std::shared_ptr<void>(code, [](void* c) { pcre2_code_free(static_cast<pcre2_code*>(c)); });
  // JIT is an optimisation only: without it (unsupported CPU or build) the interpreter is used.
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);
}

void Regex::find_all(std::string_view subject,
                     std::vector<std::pair<size_t, size_t>>* matches) const {
  pcre2_code* code = as_code(code_);
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create_from_pattern(code, nullptr));
  PAGEDLM_CHECK(data != nullptr, "out of memory creating regex match data");
  const auto* s = reinterpret_cast<PCRE2_SPTR>(subject.data());
  size_t offset = 0;
  while (offset < subject.size()) {
    const int rc =
        pcre2_match(code, s, subject.size(), offset, PCRE2_NO_UTF_CHECK, data.get(), nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    PAGEDLM_CHECK(rc >= 0, "regex /", pattern_, "/ failed: ", pcre2_message(rc));
    const PCRE2_SIZE* ovector = pcre2_get_ovector_pointer(data.get());
    const size_t begin = ovector[0], end = ovector[1];
    if (end > begin) {
      matches->emplace_back(begin, end);
      offset = end;
    } else {
      // An empty match yields no piece; step over one whole character so we stay on a boundary.
      offset = begin + unicode::next_utf8_char(subject, begin).length;
    }
  }
}

bool Regex::matches_at_start(std::string_view subject) const {
  pcre2_code* code = as_code(code_);
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create_from_pattern(code, nullptr));
  PAGEDLM_CHECK(data != nullptr, "out of memory creating regex match data");
  const int rc = pcre2_match(code, reinterpret_cast<PCRE2_SPTR>(subject.data()), subject.size(), 0,
                             PCRE2_ANCHORED | PCRE2_NO_UTF_CHECK, data.get(), nullptr);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  PAGEDLM_CHECK(rc >= 0, "regex /", pattern_, "/ failed: ", pcre2_message(rc));
  return true;
}

PreTokenizer PreTokenizer::from_gguf_name(const std::string& name) {
  PreTokenizer pre;
  if (name == "smollm" || name == "starcoder" || name == "refact") {
    pre.add_split(kDigitsPattern);
    pre.add_split(kGpt2Pattern);
  } else if (name == "gpt-2" || name == "gpt2") {
    pre.add_split(kGpt2Pattern);
  } else if (name == "qwen2" || name == "deepseek-r1-qwen") {
    pre.add_split(kQwen2Pattern);
  } else if (name == "llama-bpe" || name == "llama3" || name == "llama-v3") {
    pre.add_split(kLlama3Pattern);
  } else {
    fail("unsupported pre-tokenizer '", name,
         "' (tokenizer.ggml.pre); known: smollm, starcoder, refact, gpt-2, qwen2, "
         "deepseek-r1-qwen, llama-bpe, llama3, llama-v3");
  }
  return pre;
}

void PreTokenizer::add_split(std::string pattern, bool literal) {
  steps_.emplace_back(std::move(pattern), literal);
}

std::vector<std::string_view> PreTokenizer::split(std::string_view text) const {
  PAGEDLM_CHECK(unicode::is_valid_utf8(text), "pre-tokenizer input is not valid UTF-8");
  std::vector<std::string_view> pieces;
  if (text.empty()) return pieces;
  pieces.push_back(text);
  std::vector<std::string_view> next;
  std::vector<std::pair<size_t, size_t>> matches;
  for (const Regex& step : steps_) {
    next.clear();
    for (std::string_view piece : pieces) {
      matches.clear();
      step.find_all(piece, &matches);
      size_t last = 0;
      for (const auto& [begin, end] : matches) {
        if (begin > last) next.push_back(piece.substr(last, begin - last));
        next.push_back(piece.substr(begin, end - begin));
        last = end;
      }
      if (last < piece.size()) next.push_back(piece.substr(last));
    }
    pieces.swap(next);
  }
  return pieces;
}

}  // namespace pagedlm
