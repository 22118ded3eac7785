#include "pagedlm/tokenizer/unicode.h"

#include <array>

namespace pagedlm::unicode {
namespace {

bool is_continuation(uint8_t byte) { return (byte & 0xC0) == 0x80; }

struct ByteAlphabet {
  std::array<std::string, 256> symbol;
  std::array<int16_t, 512> byte_of;  // every symbol is below U+0200

  ByteAlphabet() {
    byte_of.fill(-1);
    int next_extra = 0;
    for (int b = 0; b < 256; ++b) {
      bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE);
      char32_t cp = printable ? static_cast<char32_t>(b) : 0x100 + next_extra++;
      append_utf8(cp, &symbol[b]);
      byte_of[cp] = static_cast<int16_t>(b);
    }
  }
};

const ByteAlphabet& alphabet() {
  static const ByteAlphabet table;
  return table;
}

}  // namespace

Utf8Char next_utf8_char(std::string_view text, size_t pos) {
  const auto* s = reinterpret_cast<const uint8_t*>(text.data());
  const size_t n = text.size();
  const uint8_t b0 = s[pos];
  if (b0 < 0x80) return {b0, 1, Utf8Status::kValid};

  uint32_t need;                 // continuation bytes after b0
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte (Table 3-7)
  char32_t cp;
  if (b0 >= 0xC2 && b0 <= 0xDF) {
    need = 1;
    cp = b0 & 0x1F;
  } else if (b0 >= 0xE0 && b0 <= 0xEF) {
    need = 2;
    cp = b0 & 0x0F;
    if (b0 == 0xE0) lo = 0xA0;
    if (b0 == 0xED) hi = 0x9F;  // excludes the surrogates
  } else if (b0 >= 0xF0 && b0 <= 0xF4) {
    need = 3;
    cp = b0 & 0x07;
    if (b0 == 0xF0) lo = 0x90;
    if (b0 == 0xF4) hi = 0x8F;  // nothing above U+10FFFF
  } else {
    return {0, 1, Utf8Status::kInvalid};
  }
  uint32_t length = 1;
  for (uint32_t k = 0; k < need; ++k) {
    if (pos + length >= n) return {0, length, Utf8Status::kIncomplete};
    const uint8_t b = s[pos + length];
    const bool ok = k == 0 ? (b >= lo && b <= hi) : is_continuation(b);
    if (!ok) return {0, length, Utf8Status::kInvalid};
    cp = (cp << 6) | (b & 0x3F);
    ++length;
  }
  return {cp, length, Utf8Status::kValid};
}

bool is_valid_utf8(std::string_view text) {
  for (size_t pos = 0; pos < text.size();) {
    if (static_cast<uint8_t>(text[pos]) < 0x80) {
      ++pos;
      continue;
    }
    const Utf8Char c = next_utf8_char(text, pos);
    if (c.status != Utf8Status::kValid) return false;
    pos += c.length;
  }
  return true;
}

std::string to_valid_utf8(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (size_t pos = 0; pos < text.size();) {
    const Utf8Char c = next_utf8_char(text, pos);
    if (c.status == Utf8Status::kValid) {
      out.append(text.substr(pos, c.length));
    } else {
      append_utf8(kReplacementChar, &out);
    }
    pos += c.length;
  }
  return out;
}

void append_utf8(char32_t cp, std::string* out) {
  if (cp < 0x80) {
    out->push_back(static_cast<char>(cp));
  } else if (cp < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else if (cp < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
  }
}

bool is_whitespace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

const std::string& byte_to_symbol(uint8_t byte) { return alphabet().symbol[byte]; }

int symbol_to_byte(char32_t cp) {
  return cp < alphabet().byte_of.size() ? alphabet().byte_of[cp] : -1;
}

std::string bytes_to_symbols(std::string_view bytes) {
  std::string out;
  out.reserve(bytes.size() * 2);
  for (char b : bytes) out += byte_to_symbol(static_cast<uint8_t>(b));
  return out;
}

std::string symbols_to_bytes(std::string_view token) {
  std::string out;
  out.reserve(token.size());
  for (size_t pos = 0; pos < token.size();) {
    const Utf8Char c = next_utf8_char(token, pos);
    const int byte = c.status == Utf8Status::kValid ? symbol_to_byte(c.code_point) : -1;
    if (byte < 0) return std::string(token);
    out.push_back(static_cast<char>(byte));
    pos += c.length;
  }
  return out;
}

}  // namespace pagedlm::unicode
