// Byte-level BPE tokenizer (GPT-2 family: SmolLM2, Qwen2, Llama 3), loaded from an HF
// tokenizer.json or from a GGUF vocabulary, matching the HF `tokenizers` library id for id.
//
// Encoding: invalid UTF-8 is first replaced by U+FFFD per maximal ill-formed subpart (what
// Python's bytes.decode('utf-8', 'replace') hands to HF), then added tokens are cut out by exact
// match (leftmost, longest first), then each remaining segment is pre-tokenized and BPE-encoded.
// Decoding: tokens are mapped back to bytes and invalid UTF-8 in the result becomes U+FFFD.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "pagedlm/tokenizer/bpe.h"
#include "pagedlm/tokenizer/pretokenizer.h"

namespace pagedlm {

class GgufFile;

// llama.cpp's token types (GGUF tokenizer.ggml.token_type).
enum class TokenType : int32_t {
  kUndefined = 0,
  kNormal = 1,
  kUnknown = 2,
  kControl = 3,
  kUserDefined = 4,
  kUnused = 5,
  kByte = 6,
};

// Token ids are below this. Every id up to the largest costs its table entries (~70 bytes), so
// one hostile id in a tokenizer file could otherwise ask for gigabytes; real vocabularies stay
// well under it (Gemma 3: 262k).
inline constexpr int32_t kMaxVocabSize = int32_t{1} << 22;

// A token matched verbatim in the input before pre-tokenization (HF AddedToken).
struct AddedToken {
  int32_t id = -1;
  std::string content;
  bool special = false;      // skipped by decode(skip_special_tokens); ignored if !parse_special
  bool lstrip = false;       // the match swallows whitespace on its left
  bool rstrip = false;       // ... and on its right
  bool single_word = false;  // only matches when not inside a word
  bool normalized = false;   // matched after normalization (we have none, so in a second pass)
};

// Everything a loader extracts; Tokenizer's constructor validates it.
struct TokenizerSpec {
  std::vector<std::string> tokens;     // id -> token in the byte-level alphabet; "" = unused id
  std::vector<TokenType> token_types;  // empty, or one per id
  std::vector<std::pair<std::string, std::string>> merges;
  std::vector<AddedToken> added_tokens;  // ids may lie beyond `tokens`
  PreTokenizer pre_tokenizer;
  BpeOptions bpe;
  int32_t bos_id = -1;
  int32_t eos_id = -1;
  // What encode(add_special_tokens = true) puts around the text (e.g. BOS for Llama 3).
  std::vector<int32_t> prefix_ids;
  std::vector<int32_t> suffix_ids;
};

class Tokenizer {
 public:
  explicit Tokenizer(TokenizerSpec spec);

  // HF tokenizer.json: BPE model, byte-level pre-tokenizer. bos/eos come from a
  // tokenizer_config.json beside it when there is one. Every problem throws pagedlm::Error naming
  // the file and the field.
  static Tokenizer from_tokenizer_json(const std::string& path);
  // The same from the JSON text; `source` names it in errors.
  static Tokenizer from_tokenizer_json_text(std::string_view json_text, const std::string& source);
  // GGUF metadata tokenizer.ggml.* with model "gpt2" (defined in tokenizer_gguf.cc).
  static Tokenizer from_gguf(const GgufFile& gguf);

  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true,
                              bool parse_special = true) const;
  // Ids outside the vocabulary are skipped, as HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  // The token's string: the vocabulary entry (byte-level alphabet) or an added token's content.
  // Empty for unused or out-of-range ids.
  const std::string& token_to_piece(int32_t id) const;
  // The raw bytes the token decodes to (possibly part of a UTF-8 character).
  const std::string& token_to_bytes(int32_t id) const;
  std::optional<int32_t> token_to_id(std::string_view piece) const;

  int32_t vocab_size() const { return static_cast<int32_t>(pieces_.size()); }
  int32_t bos_id() const { return bos_id_; }  // -1 when unknown
  int32_t eos_id() const { return eos_id_; }
  bool is_special(int32_t id) const;
  TokenType token_type(int32_t id) const;
  const std::vector<AddedToken>& added_tokens() const { return added_tokens_; }
  const PreTokenizer& pre_tokenizer() const { return pre_tokenizer_; }
  const BpeModel& model() const { return bpe_; }

 private:
  // A run of the input: either one added token or text still to pre-tokenize.
  struct Segment {
    std::string_view text;
    int32_t added_index = -1;
  };
  void split_added(std::string_view text, bool normalized_pass, bool parse_special,
                   std::vector<Segment>* out) const;
  // Index into added_tokens_ of the longest token of this pass starting at text[pos], or -1.
  int32_t longest_added_at(std::string_view text, size_t pos, bool normalized_pass) const;

  BpeModel bpe_;
  PreTokenizer pre_tokenizer_;
  std::vector<AddedToken> added_tokens_;           // sorted by content length, longest first
  std::vector<int32_t> added_by_first_byte_[256];  // indices into added_tokens_, longest first
  std::vector<std::string> pieces_;                // id -> token_to_piece
  std::vector<std::string> bytes_;                 // id -> token_to_bytes
  std::vector<TokenType> token_types_;             // id -> type
  std::vector<bool> special_;                      // id -> is_special
  int32_t bos_id_ = -1;
  int32_t eos_id_ = -1;
  std::vector<int32_t> prefix_ids_;
  std::vector<int32_t> suffix_ids_;
  Regex word_char_;  // what single_word treats as part of a word
};

// Incremental decoding for streaming output: feed ids one at a time, get text that never ends in
// the middle of a UTF-8 character. Bytes that can still become a character are held back; bytes
// that never can are emitted as U+FFFD at once. The concatenation of every push() and finish()
// equals Tokenizer::decode of all the ids.
class StreamDecoder {
 public:
  explicit StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens = false);

  std::string push(int32_t id);
  // Emits what is held back (an incomplete character becomes U+FFFD) and resets.
  std::string finish();

 private:
  const Tokenizer* tokenizer_;
  bool skip_special_tokens_;
  std::string pending_;
};

}  // namespace pagedlm
