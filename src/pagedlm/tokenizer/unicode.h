// UTF-8 helpers for the tokenizer: validation, replacement of invalid sequences, and the GPT-2
// byte-level alphabet (bytes_to_unicode, openai/gpt-2 src/encoder.py).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace pagedlm::unicode {

inline constexpr char32_t kReplacementChar = 0xFFFD;

enum class Utf8Status : uint8_t {
  kValid,       // a complete, well-formed character
  kInvalid,     // an ill-formed sequence: `length` bytes are its maximal subpart
  kIncomplete,  // the text ends inside a character that could still become well-formed
};

struct Utf8Char {
  char32_t code_point = 0;  // only meaningful when kValid
  uint32_t length = 1;      // bytes consumed, always >= 1
  Utf8Status status = Utf8Status::kValid;
};

// Reads one character at text[pos] (pos < text.size()). Ill-formed input is consumed by "maximal
// subparts" (Unicode §3.9, Table 3-7), the rule both Python's decode('utf-8', 'replace') and Rust's
// String::from_utf8_lossy follow, so replacing each subpart by U+FFFD matches the HF pipeline.
Utf8Char next_utf8_char(std::string_view text, size_t pos);

bool is_valid_utf8(std::string_view text);

// Replaces every maximal ill-formed subpart (including a truncated final character) by U+FFFD.
std::string to_valid_utf8(std::string_view text);

void append_utf8(char32_t code_point, std::string* out);

// Unicode White_Space property (what Rust's char::is_whitespace tests).
bool is_whitespace(char32_t code_point);

// The byte-level alphabet: each byte maps to one printable code point; this is its UTF-8 spelling.
const std::string& byte_to_symbol(uint8_t byte);
// The byte a symbol stands for, or -1 when the code point is not in the alphabet.
int symbol_to_byte(char32_t code_point);

// Spells raw bytes in the byte-level alphabet ("hi there" -> "hiĠthere").
std::string bytes_to_symbols(std::string_view bytes);
// Inverse of bytes_to_symbols, as HF's ByteLevel decoder does it per token: if every character is
// in the alphabet, the bytes they stand for; otherwise the token's own UTF-8 bytes unchanged.
std::string symbols_to_bytes(std::string_view token);

}  // namespace pagedlm::unicode
