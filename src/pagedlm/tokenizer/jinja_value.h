// Values of the Jinja2 subset that chat templates use. They follow Python's semantics (str(),
// repr(), truthiness, ==, json.dumps) because the reference renderer is Python Jinja2 and the
// rendered prompt must match it byte for byte.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagedlm::jinja {

class Value;
struct Dict;

// The deepest lists and dicts may nest. Values come from requests (messages, tools) or are made
// by the template, possibly in a loop, and walking or freeing them recurses once per level:
// making a deeper one, or reading deeper JSON, fails with an Error instead of running off the
// stack. Requests are parsed with a lower bound (kMaxJsonDepth), so templates can wrap them.
inline constexpr int kMaxValueDepth = 256;

// The most items a list may hold and bytes a string, or a value's text (repr, tojson) or the
// rendered output, may take: far beyond any chat template or request (bodies are 8 MB at most
// by default), so that a hostile template (doubling a string in a loop, range(10**10), ...)
// fails with an Error instead of exhausting memory or time.
inline constexpr int64_t kMaxValueItems = int64_t{1} << 20;
inline constexpr int64_t kMaxValueBytes = int64_t{1} << 24;

// Throws pagedlm::Error when text of `bytes` bytes would pass kMaxValueBytes.
void check_text_size(size_t bytes);

// Arguments of a call: positional, then keyword in source order.
struct CallArgs {
  std::vector<Value> positional;
  std::vector<std::pair<std::string, Value>> keyword;
};

using Function = std::function<Value(const CallArgs&)>;

class Value {
 public:
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kFunction
  };

  Value() = default;  // Undefined
  static Value undefined(std::string name = "") {
    Value v;
    v.str_ = std::make_shared<std::string>(std::move(name));
    return v;
  }
  static Value none() { return Value(Kind::kNone); }
  static Value boolean(bool b) {
    Value v(Kind::kBool);
    v.int_ = b;
    return v;
  }
  static Value integer(int64_t i) {
    Value v(Kind::kInt);
    v.int_ = i;
    return v;
  }
  static Value number(double f) {
    Value v(Kind::kFloat);
    v.float_ = f;
    return v;
  }
  static Value string(std::string s) {
    check_text_size(s.size());
    Value v(Kind::kString);
    v.str_ = std::make_shared<std::string>(std::move(s));
    return v;
  }
  static Value list(std::vector<Value> items);
  // A Python tuple (from dict.items(), the items filter or a "(a, b)" literal): a list that
  // prints as "(a, b)".
  static Value tuple(std::vector<Value> items);
  static Value dict(std::shared_ptr<Dict> dict);
  // A namespace() object: the only value templates may change after creating it (`set ns.x`).
  static Value make_namespace(std::shared_ptr<Dict> attrs);
  static Value function(std::string name, Function fn);
  // Throws pagedlm::Error for JSON nested deeper than kMaxValueDepth.
  static Value from_json(const nlohmann::ordered_json& j) { return from_json(j, 0); }

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_list() const { return kind_ == Kind::kList; }
  bool is_dict() const { return kind_ == Kind::kDict; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_number() const {
    return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool;
  }

  bool as_bool() const { return int_ != 0; }
  int64_t as_int() const { return int_; }
  double as_double() const { return kind_ == Kind::kFloat ? float_ : static_cast<double>(int_); }
  const std::string& as_string() const { return *str_; }
  // Name of the variable an Undefined came from, for error messages.
  const std::string& undefined_name() const;
  const std::vector<Value>& as_list() const { return *list_; }
  const Dict& as_dict() const { return *dict_; }
  Dict& namespace_attrs() const { return *dict_; }
  const Function& as_function() const { return fn_->fn; }

  // Python truthiness: empty containers, 0, "", None and Undefined are false.
  bool truthy() const;
  // Python str(): what {{ value }} prints. Undefined prints nothing.
  std::string str() const;
  // Python repr(), used by str() of lists and dicts.
  std::string repr() const { return repr(0); }
  // Python json.dumps(value, ensure_ascii, indent) with HF's defaults (keys in insertion order).
  std::string to_json(bool ensure_ascii, int indent) const;
  // Python == (1 == 1.0 == True; containers compare deeply).
  bool equals(const Value& other) const;
  // A short type name for error messages, like Jinja's "'dict object'".
  std::string type_name() const;

 private:
  struct FunctionBox {
    std::string name;
    Function fn;
  };
  explicit Value(Kind kind) : kind_(kind) {}
  // The walks above, `depth` levels below where they started. repr() counts its own depth:
  // it prints namespaces' attributes, which change after they are made (one may even hold
  // itself), so their nesting is not known.
  static Value from_json(const nlohmann::ordered_json& j, int depth);
  std::string repr(int depth) const;
  // The nesting of a container whose deepest item has `deepest_item`; throws past the bound.
  static uint16_t container_nesting(int deepest_item);
  static uint16_t items_nesting(const Dict& dict);
  void append_json(std::string& out, bool ensure_ascii, int indent, int depth) const;

  Kind kind_ = Kind::kUndefined;
  bool tuple_ = false;
  uint16_t nesting_ = 0;  // levels of containers, this one included (0 for a scalar)
  int64_t int_ = 0;
  double float_ = 0.0;
  std::shared_ptr<std::string> str_;
  std::shared_ptr<std::vector<Value>> list_;
  std::shared_ptr<Dict> dict_;
  std::shared_ptr<FunctionBox> fn_;
};

// A mapping with string keys that keeps insertion order, as Python dicts do (tojson and
// iteration print keys in the order the caller gave them).
struct Dict {
  std::vector<std::pair<std::string, Value>> items;

  const Value* find(std::string_view key) const;
  void set(const std::string& key, Value value);
};

// UTF-8 helpers: Jinja strings are sequences of code points, so length, indexing and slicing
// count code points, not bytes.
std::u32string utf8_decode(std::string_view s);
std::string utf8_encode(std::u32string_view s);
// Python's str.isspace() for one code point.
bool is_python_space(char32_t c);
// Python repr() of a float: shortest round-trip digits, ".0" for integral values, and an
// exponent outside [1e-4, 1e16).
std::string format_python_float(double f);

}  // namespace pagedlm::jinja
