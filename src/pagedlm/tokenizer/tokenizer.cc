#include "pagedlm/tokenizer/tokenizer.h"

#include <algorithm>

#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/unicode.h"

namespace pagedlm {
namespace {

const std::string kEmpty;

// Start of the character that ends at `end` (text[..end) is valid UTF-8 and non-empty).
size_t previous_char_start(std::string_view text, size_t end) {
  size_t pos = end - 1;
  while (pos > 0 && (static_cast<uint8_t>(text[pos]) & 0xC0) == 0x80) --pos;
  return pos;
}

// Bytes of whitespace at the end of text[0, end), never reaching before `floor`.
size_t whitespace_before(std::string_view text, size_t end, size_t floor) {
  size_t begin = end;
  while (begin > floor) {
    const size_t pos = previous_char_start(text, begin);
    if (!unicode::is_whitespace(unicode::next_utf8_char(text, pos).code_point)) break;
    begin = pos;
  }
  return end - begin;
}

size_t whitespace_after(std::string_view text, size_t begin) {
  size_t end = begin;
  while (end < text.size()) {
    const unicode::Utf8Char c = unicode::next_utf8_char(text, end);
    if (!unicode::is_whitespace(c.code_point)) break;
    end += c.length;
  }
  return end - begin;
}

void check_id(int32_t id, int32_t vocab_size, const char* what) {
  PAGEDLM_CHECK(id >= -1 && id < vocab_size, what, " id ", id, " is outside the vocabulary of ",
                vocab_size);
}

}  // namespace

Tokenizer::Tokenizer(TokenizerSpec spec)
    : bpe_(spec.tokens, spec.merges, spec.bpe),
      pre_tokenizer_(std::move(spec.pre_tokenizer)),
      added_tokens_(std::move(spec.added_tokens)),
      bos_id_(spec.bos_id),
      eos_id_(spec.eos_id),
      prefix_ids_(std::move(spec.prefix_ids)),
      suffix_ids_(std::move(spec.suffix_ids)),
      word_char_(R"([\p{Alphabetic}\p{N}_])") {
  PAGEDLM_CHECK(!spec.tokens.empty(), "the tokenizer vocabulary is empty");
  PAGEDLM_CHECK(spec.token_types.empty() || spec.token_types.size() == spec.tokens.size(),
                "token types: ", spec.token_types.size(), " entries for ", spec.tokens.size(),
                " tokens");
  PAGEDLM_CHECK(spec.tokens.size() <= static_cast<size_t>(kMaxVocabSize), "the vocabulary has ",
                spec.tokens.size(), " tokens, more than ", kMaxVocabSize);
  int32_t size = static_cast<int32_t>(spec.tokens.size());
  for (const AddedToken& added : added_tokens_) {
    PAGEDLM_CHECK(added.id >= 0 && added.id < kMaxVocabSize, "added token '", added.content,
                  "' has id ", added.id, ", outside [0, ", kMaxVocabSize, ")");
    PAGEDLM_CHECK(!added.content.empty(), "added token ", added.id, " has empty content");
    PAGEDLM_CHECK(unicode::is_valid_utf8(added.content), "added token ", added.id,
                  " is not valid UTF-8");
    size = std::max(size, added.id + 1);
  }

  pieces_ = std::move(spec.tokens);
  pieces_.resize(size);
  token_types_ = std::move(spec.token_types);
  token_types_.resize(size, TokenType::kNormal);
  for (int32_t id = 0; id < size; ++id) {
    if (pieces_[id].empty()) token_types_[id] = TokenType::kUndefined;
  }
  special_.assign(size, false);
  for (const AddedToken& added : added_tokens_) {
    pieces_[added.id] = added.content;
    special_[added.id] = added.special;
    token_types_[added.id] = added.special ? TokenType::kControl : TokenType::kUserDefined;
  }
  bytes_.resize(size);
  for (int32_t id = 0; id < size; ++id) bytes_[id] = unicode::symbols_to_bytes(pieces_[id]);

  check_id(bos_id_, size, "bos");
  check_id(eos_id_, size, "eos");
  for (int32_t id : prefix_ids_) check_id(id, size, "post-processor");
  for (int32_t id : suffix_ids_) check_id(id, size, "post-processor");

  // HF matches added tokens leftmost-longest; sorting longest first makes the first hit at a
  // position the longest one.
  std::stable_sort(
      added_tokens_.begin(), added_tokens_.end(),
      [](const AddedToken& a, const AddedToken& b) { return a.content.size() > b.content.size(); });
  for (size_t i = 0; i < added_tokens_.size(); ++i) {
    added_by_first_byte_[static_cast<uint8_t>(added_tokens_[i].content[0])].push_back(
        static_cast<int32_t>(i));
  }
}

int32_t Tokenizer::longest_added_at(std::string_view text, size_t pos, bool normalized_pass) const {
  for (int32_t index : added_by_first_byte_[static_cast<uint8_t>(text[pos])]) {
    const AddedToken& added = added_tokens_[index];
    if (added.normalized == normalized_pass &&
        text.compare(pos, added.content.size(), added.content) == 0) {
      return index;
    }
  }
  return -1;
}

// Mirrors HF AddedVocabulary::find_matches: a match is consumed even when its flags then reject
// it (a special token with parse_special off, a single_word token inside a word), and the
// lstrip/rstrip whitespace is absorbed into the token's span.
void Tokenizer::split_added(std::string_view text, bool normalized_pass, bool parse_special,
                            std::vector<Segment>* out) const {
  size_t emitted = 0;  // text[0, emitted) is already in `out`
  size_t pos = 0;
  while (pos < text.size()) {
    const int32_t index = longest_added_at(text, pos, normalized_pass);
    if (index < 0) {
      ++pos;
      continue;
    }
    const AddedToken& added = added_tokens_[index];
    size_t begin = pos, end = pos + added.content.size();
    pos = end;
    if (added.special && !parse_special) continue;
    if (added.single_word) {
      const bool word_before =
          begin > 0 && word_char_.matches_at_start(text.substr(previous_char_start(text, begin)));
      const bool word_after = end < text.size() && word_char_.matches_at_start(text.substr(end));
      if (word_before || word_after) continue;
    }
    if (added.lstrip) begin -= whitespace_before(text, begin, emitted);
    if (added.rstrip) end += whitespace_after(text, end);
    if (begin > emitted) out->push_back({text.substr(emitted, begin - emitted), -1});
    out->push_back({text.substr(begin, end - begin), index});
    emitted = end;
    pos = end;
  }
  if (emitted < text.size()) out->push_back({text.substr(emitted), -1});
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens,
                                       bool parse_special) const {
  std::string repaired;
  if (!unicode::is_valid_utf8(text)) {
    repaired = unicode::to_valid_utf8(text);
    text = repaired;
  }
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = prefix_ids_;

  // Tokens with normalized=false are matched on the raw text first, the others on what remains,
  // in the order HF applies them around its (here absent) normalizer.
  std::vector<Segment> raw_segments, segments;
  split_added(text, /*normalized_pass=*/false, parse_special, &raw_segments);
  for (const Segment& segment : raw_segments) {
    if (segment.added_index >= 0) {
      segments.push_back(segment);
    } else {
      split_added(segment.text, /*normalized_pass=*/true, parse_special, &segments);
    }
  }
  for (const Segment& segment : segments) {
    if (segment.added_index >= 0) {
      ids.push_back(added_tokens_[segment.added_index].id);
      continue;
    }
    for (std::string_view piece : pre_tokenizer_.split(segment.text))
      bpe_.encode_piece(piece, &ids);
  }
  if (add_special_tokens) ids.insert(ids.end(), suffix_ids_.begin(), suffix_ids_.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  std::string bytes;
  for (int32_t id : ids) {
    if (id < 0 || id >= vocab_size() || (skip_special_tokens && special_[id])) continue;
    bytes += bytes_[id];
  }
  return unicode::is_valid_utf8(bytes) ? bytes : unicode::to_valid_utf8(bytes);
}

const std::string& Tokenizer::token_to_piece(int32_t id) const {
  return id >= 0 && id < vocab_size() ? pieces_[id] : kEmpty;
}

const std::string& Tokenizer::token_to_bytes(int32_t id) const {
  return id >= 0 && id < vocab_size() ? bytes_[id] : kEmpty;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view piece) const {
  for (const AddedToken& added : added_tokens_) {
    if (added.content == piece) return added.id;
  }
  const int32_t id = bpe_.find(piece);
  if (id >= 0) return id;
  return std::nullopt;
}

bool Tokenizer::is_special(int32_t id) const {
  return id >= 0 && id < vocab_size() && special_[id];
}

TokenType Tokenizer::token_type(int32_t id) const {
  return id >= 0 && id < vocab_size() ? token_types_[id] : TokenType::kUndefined;
}

StreamDecoder::StreamDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(&tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string StreamDecoder::push(int32_t id) {
  if (skip_special_tokens_ && tokenizer_->is_special(id)) return {};
  pending_ += tokenizer_->token_to_bytes(id);
  std::string out;
  size_t pos = 0;
  while (pos < pending_.size()) {
    const unicode::Utf8Char c = unicode::next_utf8_char(pending_, pos);
    if (c.status == unicode::Utf8Status::kIncomplete) break;
    if (c.status == unicode::Utf8Status::kValid) {
      out.append(pending_, pos, c.length);
    } else {
      unicode::append_utf8(unicode::kReplacementChar, &out);
    }
    pos += c.length;
  }
  pending_.erase(0, pos);
  return out;
}

std::string StreamDecoder::finish() {
  std::string out = unicode::to_valid_utf8(pending_);
  pending_.clear();
  return out;
}

}  // namespace pagedlm
