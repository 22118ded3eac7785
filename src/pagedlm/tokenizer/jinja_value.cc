#include "pagedlm/tokenizer/jinja_value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>

#include "pagedlm/core/error.h"

namespace pagedlm::jinja {

// Containers carry their nesting (1 + their deepest item's), so a template building deeper and
// deeper lists in a loop fails at kMaxValueDepth, and ==, <, tojson and freeing, which recurse
// into lists and dicts only, stay within it. (A namespace's nesting is that of its attributes
// when it was made.)
uint16_t Value::container_nesting(int deepest_item) {
  PAGEDLM_CHECK(deepest_item < kMaxValueDepth, "chat template: a value nests deeper than ",
                kMaxValueDepth, " levels");
  return static_cast<uint16_t>(deepest_item + 1);
}

uint16_t Value::items_nesting(const Dict& dict) {
  int deepest = 0;
  for (const auto& [key, item] : dict.items) deepest = std::max<int>(deepest, item.nesting_);
  return container_nesting(deepest);
}

void check_text_size(size_t bytes) {
  PAGEDLM_CHECK(bytes <= static_cast<size_t>(kMaxValueBytes),
                "chat template: a value or the "
                "output would pass ",
                kMaxValueBytes, " bytes");
}

Value Value::list(std::vector<Value> items) {
  PAGEDLM_CHECK(items.size() <= static_cast<size_t>(kMaxValueItems),
                "chat template: a list would pass ", kMaxValueItems, " items");
  Value v(Kind::kList);
  int deepest = 0;
  for (const Value& item : items) deepest = std::max<int>(deepest, item.nesting_);
  v.nesting_ = container_nesting(deepest);
  v.list_ = std::make_shared<std::vector<Value>>(std::move(items));
  return v;
}

Value Value::tuple(std::vector<Value> items) {
  Value v = list(std::move(items));
  v.tuple_ = true;
  return v;
}

Value Value::dict(std::shared_ptr<Dict> dict) {
  Value v(Kind::kDict);
  v.nesting_ = items_nesting(*dict);
  v.dict_ = std::move(dict);
  return v;
}

Value Value::make_namespace(std::shared_ptr<Dict> attrs) {
  Value v(Kind::kNamespace);
  v.nesting_ = items_nesting(*attrs);
  v.dict_ = std::move(attrs);
  return v;
}

Value Value::function(std::string name, Function fn) {
  Value v(Kind::kFunction);
  v.fn_ = std::make_shared<FunctionBox>(FunctionBox{std::move(name), std::move(fn)});
  return v;
}

namespace {

// Throws when a walk is about to go past kMaxValueDepth levels (`depth`: levels above).
void check_value_depth(int depth) {
  PAGEDLM_CHECK(depth < kMaxValueDepth, "chat template: a value nests deeper than ", kMaxValueDepth,
                " levels");
}

}  // namespace

Value Value::from_json(const nlohmann::ordered_json& j, int depth) {
  check_value_depth(depth);
  switch (j.type()) {
    case nlohmann::ordered_json::value_t::null:
      return none();
    case nlohmann::ordered_json::value_t::boolean:
      return boolean(j.get<bool>());
    case nlohmann::ordered_json::value_t::number_integer:
      return integer(j.get<int64_t>());
    case nlohmann::ordered_json::value_t::number_unsigned:
      return integer(static_cast<int64_t>(j.get<uint64_t>()));
    case nlohmann::ordered_json::value_t::number_float:
      return number(j.get<double>());
    case nlohmann::ordered_json::value_t::string:
      return string(j.get<std::string>());
    case nlohmann::ordered_json::value_t::array: {
      std::vector<Value> items;
      items.reserve(j.size());
      for (const auto& item : j) items.push_back(from_json(item, depth + 1));
      return list(std::move(items));
    }
    case nlohmann::ordered_json::value_t::object: {
      auto d = std::make_shared<Dict>();
      d->items.reserve(j.size());
      for (const auto& [key, item] : j.items())
        d->items.emplace_back(key, from_json(item, depth + 1));
      return dict(std::move(d));
    }
    default:
      fail("chat template: unsupported JSON value of type ", j.type_name());
  }
}

const std::string& Value::undefined_name() const {
  static const std::string kUnnamed;
  return kind_ == Kind::kUndefined && str_ ? *str_ : kUnnamed;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
    case Kind::kInt:
      return int_ != 0;
    case Kind::kFloat:
      return float_ != 0.0;
    case Kind::kString:
      return !str_->empty();
    case Kind::kList:
      return !list_->empty();
    case Kind::kDict:
      return !dict_->items.empty();
    case Kind::kNamespace:
    case Kind::kFunction:
      return true;
  }
  return false;
}

std::string format_python_float(double f) {
  if (std::isnan(f)) return "nan";
  if (std::isinf(f)) return f > 0 ? "inf" : "-inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), f, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // like "-1.2345e+02"
  size_t e = sci.find('e');
  int exponent = std::stoi(sci.substr(e + 1));
  std::string mantissa = sci.substr(0, e);
  std::string sign;
  if (mantissa[0] == '-') {
    sign = "-";
    mantissa.erase(0, 1);
  }
  std::string digits;
  for (char c : mantissa) {
    if (c != '.') digits += c;
  }
  if (exponent < -4 || exponent >= 16) {
    std::string out = sign + digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof(ebuf), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return out + ebuf;
  }
  std::string out;
  if (exponent < 0) {
    out = "0." + std::string(-exponent - 1, '0') + digits;
  } else if (static_cast<int>(digits.size()) <= exponent + 1) {
    out = digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
  }
  return sign + out;
}

namespace {

// Python repr() of a string: single quotes unless the text has a ' and no ".
std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos;
  bool has_double = s.find('"') != std::string::npos;
  char quote = has_single && !has_double ? '"' : '\'';
  std::string out(1, quote);
  for (char32_t c : utf8_decode(s)) {
    if (c == static_cast<char32_t>(quote) || c == U'\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == U'\n') {
      out += "\\n";
    } else if (c == U'\r') {
      out += "\\r";
    } else if (c == U'\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f || (c >= 0x80 && c < 0xa0)) {
      char buf[8];
      std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
      out += buf;
    } else {
      out += utf8_encode(std::u32string(1, c));
    }
  }
  out += quote;
  return out;
}

void append_json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (char32_t c : utf8_decode(s)) {
    switch (c) {
      case U'"':
        out += "\\\"";
        break;
      case U'\\':
        out += "\\\\";
        break;
      case U'\n':
        out += "\\n";
        break;
      case U'\r':
        out += "\\r";
        break;
      case U'\t':
        out += "\\t";
        break;
      case U'\b':
        out += "\\b";
        break;
      case U'\f':
        out += "\\f";
        break;
      default: {
        char buf[16];
        if (c < 0x20 || (ensure_ascii && c >= 0x7f)) {
          if (c >= 0x10000) {
            char32_t v = c - 0x10000;
            std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", 0xd800 + (v >> 10),
                          0xdc00 + (v & 0x3ff));
          } else {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
          }
          out += buf;
        } else {
          out += utf8_encode(std::u32string(1, c));
        }
      }
    }
  }
  out += '"';
}

}  // namespace

std::string Value::str() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return *str_;
    default:
      return repr();
  }
}

std::string Value::repr(int depth) const {
  check_value_depth(depth);
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return int_ ? "True" : "False";
    case Kind::kInt:
      return std::to_string(int_);
    case Kind::kFloat:
      return format_python_float(float_);
    case Kind::kString:
      return repr_string(*str_);
    case Kind::kList: {
      std::string out = tuple_ ? "(" : "[";
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) out += ", ";
        out += (*list_)[i].repr(depth + 1);
        check_text_size(out.size());
      }
      if (tuple_) return out + (list_->size() == 1 ? ",)" : ")");
      return out + "]";
    }
    case Kind::kDict:
    case Kind::kNamespace: {
      std::string out = kind_ == Kind::kNamespace ? "<Namespace {" : "{";
      for (size_t i = 0; i < dict_->items.size(); ++i) {
        if (i) out += ", ";
        out += repr_string(dict_->items[i].first) + ": " + dict_->items[i].second.repr(depth + 1);
        check_text_size(out.size());
      }
      return out + (kind_ == Kind::kNamespace ? "}>" : "}");
    }
    case Kind::kFunction:
      return "<function " + fn_->name + ">";
  }
  return "";
}

std::string Value::to_json(bool ensure_ascii, int indent) const {
  std::string out;
  append_json(out, ensure_ascii, indent, 0);
  return out;
}

void Value::append_json(std::string& out, bool ensure_ascii, int indent, int depth) const {
  // json.dumps puts each item on its own line when indent is given (even indent=0), and uses
  // ", " between items otherwise.
  auto newline = [&](int level) {
    out += '\n';
    out.append(static_cast<size_t>(indent) * level, ' ');
  };
  switch (kind_) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += int_ ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(int_);
      return;
    case Kind::kFloat:
      if (std::isnan(float_)) {
        out += "NaN";
      } else if (std::isinf(float_)) {
        out += float_ > 0 ? "Infinity" : "-Infinity";
      } else {
        out += format_python_float(float_);
      }
      return;
    case Kind::kString:
      append_json_string(out, *str_, ensure_ascii);
      return;
    case Kind::kList: {
      if (list_->empty()) {
        out += "[]";
        return;
      }
      out += '[';
      for (size_t i = 0; i < list_->size(); ++i) {
        if (i) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        (*list_)[i].append_json(out, ensure_ascii, indent, depth + 1);
        check_text_size(out.size());
      }
      if (indent >= 0) newline(depth);
      out += ']';
      return;
    }
    case Kind::kDict: {
      if (dict_->items.empty()) {
        out += "{}";
        return;
      }
      out += '{';
      for (size_t i = 0; i < dict_->items.size(); ++i) {
        if (i) out += indent >= 0 ? "," : ", ";
        if (indent >= 0) newline(depth + 1);
        append_json_string(out, dict_->items[i].first, ensure_ascii);
        out += ": ";
        dict_->items[i].second.append_json(out, ensure_ascii, indent, depth + 1);
        check_text_size(out.size());
      }
      if (indent >= 0) newline(depth);
      out += '}';
      return;
    }
    default:
      fail("Object of type ", type_name(), " is not JSON serializable");
  }
}

bool Value::equals(const Value& other) const {
  if (is_number() && other.is_number()) {
    if (kind_ == Kind::kFloat || other.kind_ == Kind::kFloat) {
      return as_double() == other.as_double();
    }
    return int_ == other.int_;
  }
  if (kind_ != other.kind_) return false;
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return *str_ == *other.str_;
    case Kind::kList: {
      if (tuple_ != other.tuple_ || list_->size() != other.list_->size()) return false;
      for (size_t i = 0; i < list_->size(); ++i) {
        if (!(*list_)[i].equals((*other.list_)[i])) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (dict_->items.size() != other.dict_->items.size()) return false;
      for (const auto& [key, value] : dict_->items) {
        const Value* theirs = other.dict_->find(key);
        if (!theirs || !value.equals(*theirs)) return false;
      }
      return true;
    }
    default:
      return dict_ == other.dict_ && fn_ == other.fn_;
  }
}

std::string Value::type_name() const {
  switch (kind_) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kNamespace:
      return "Namespace";
    case Kind::kFunction:
      return "function";
  }
  return "";
}

const Value* Dict::find(std::string_view key) const {
  for (const auto& [k, v] : items) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Dict::set(const std::string& key, Value value) {
  for (auto& [k, v] : items) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  items.emplace_back(key, std::move(value));
}

std::u32string utf8_decode(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    auto b = static_cast<unsigned char>(s[i]);
    int len = b < 0x80 ? 1 : (b >> 5) == 0x6 ? 2 : (b >> 4) == 0xe ? 3 : (b >> 3) == 0x1e ? 4 : 0;
    if (len == 0 || i + len > s.size()) {
      // Invalid UTF-8 is kept byte by byte (as U+DC80.. surrogates, like Python's
      // surrogateescape) so that it survives a round trip.
      out += static_cast<char32_t>(0xdc00 + b);
      ++i;
      continue;
    }
    char32_t c = len == 1 ? b : len == 2 ? (b & 0x1f) : len == 3 ? (b & 0x0f) : (b & 0x07);
    for (int k = 1; k < len; ++k) c = (c << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
    out += c;
    i += len;
  }
  return out;
}

std::string utf8_encode(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) {
    if (c >= 0xdc80 && c <= 0xdcff) {
      out += static_cast<char>(c - 0xdc00);
    } else if (c < 0x80) {
      out += static_cast<char>(c);
    } else if (c < 0x800) {
      out += static_cast<char>(0xc0 | (c >> 6));
      out += static_cast<char>(0x80 | (c & 0x3f));
    } else if (c < 0x10000) {
      out += static_cast<char>(0xe0 | (c >> 12));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (c & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (c >> 18));
      out += static_cast<char>(0x80 | ((c >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((c >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (c & 0x3f));
    }
  }
  return out;
}

bool is_python_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

}  // namespace pagedlm::jinja
