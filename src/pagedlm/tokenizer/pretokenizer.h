// Pre-tokenization: cutting text into the pieces BPE runs on, with Unicode-aware regexes (PCRE2).
// Every HF pre-tokenizer we support is a chain of "isolated" splits: a step cuts each current
// piece into its regex matches and the gaps between them, and a regex never sees past the piece it
// runs on (so `\s+(?!\S)` at the end of a piece does not look at the next one).
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

namespace pagedlm {

// The split patterns of the pre-tokenizers we know (HF tokenizer.json / llama.cpp llama-vocab.cpp).
// GPT-2 ByteLevel(use_regex=true), in HF's form with the trailing `|\s+`.
inline constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// Digits(individual_digits=true): every numeric character is its own piece.
inline constexpr const char* kDigitsPattern = R"(\p{N})";
// Digits(individual_digits=false): runs of numeric characters.
inline constexpr const char* kDigitRunsPattern = R"(\p{N}+)";
inline constexpr const char* kQwen2Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kLlama3Pattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

// A compiled PCRE2 pattern (UTF + UCP, JIT-compiled when the library supports it). Immutable and
// safe to share between threads: every search allocates its own match data.
class Regex {
 public:
  // `literal` matches the pattern text verbatim (HF Split with a String pattern).
  explicit Regex(std::string pattern, bool literal = false);

  const std::string& pattern() const { return pattern_; }
  bool literal() const { return literal_; }

  // Appends the [begin, end) byte ranges of the non-overlapping, non-empty matches in `subject`,
  // which must be valid UTF-8 (not re-checked here).
  void find_all(std::string_view subject, std::vector<std::pair<size_t, size_t>>* matches) const;
  // Whether the pattern matches at the very start of `subject` (valid UTF-8).
  bool matches_at_start(std::string_view subject) const;

 private:
  std::string pattern_;
  bool literal_;
  std::shared_ptr<void> code_;  // pcre2_code_8, freed with pcre2_code_free_8
};

class PreTokenizer {
 public:
  // The pre-tokenizer llama.cpp names in the GGUF key tokenizer.ggml.pre; unknown names throw.
  static PreTokenizer from_gguf_name(const std::string& name);

  // Adds an isolated split step after the existing ones.
  void add_split(std::string pattern, bool literal = false);
  const std::vector<Regex>& steps() const { return steps_; }

  // Cuts `text` (valid UTF-8, checked: invalid input throws pagedlm::Error) into pieces that
  // concatenate back to it. The views point into `text`.
  std::vector<std::string_view> split(std::string_view text) const;

 private:
  std::vector<Regex> steps_;
};

}  // namespace pagedlm
