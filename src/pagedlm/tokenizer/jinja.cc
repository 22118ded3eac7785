#include "pagedlm/tokenizer/jinja.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <ctime>
#include <string_view>
#include <unordered_map>

#include "pagedlm/core/error.h"

namespace pagedlm::jinja {
namespace {

using Kind = Value::Kind;

// Raised by raise_exception(); carries the template's own message, which callers show as is.
class TemplateException : public Error {
 public:
  using Error::Error;
};

// ---------------------------------------------------------------------------------------------
// Integers and sizes. Python's integers are unbounded; ours are int64, so a result outside
// them is an error rather than undefined behaviour. What one operation builds (range(), a
// repeated string or list, padding) is checked against kMaxValueItems / kMaxValueBytes before
// it is built, as every string, list and the output are once built (jinja_value.h).

// Fails when an integer operation `op` overflowed (checked before its result is used).
void check_no_overflow(bool overflowed, const std::string& op) {
  PAGEDLM_CHECK(!overflowed, "integer overflow in '", op, "' (integers are 64-bit here)");
}

// Whether int(d) fits int64 (false for inf and NaN): 2^63 is exact as a double, and every
// double below it converts without overflow.
bool fits_int64(double d) { return d >= -9223372036854775808.0 && d < 9223372036854775808.0; }

// Python's int(x) of a float.
int64_t float_to_int(double d) {
  PAGEDLM_CHECK(std::isfinite(d), "cannot convert float ", d, " to integer");
  PAGEDLM_CHECK(fits_int64(d), "float ", d, " does not fit a 64-bit integer");
  return static_cast<int64_t>(d);
}

// How many of `unit` (items or bytes) `count` repetitions make; fails past `limit`.
int64_t built_size(int64_t unit, int64_t count, int64_t limit) {
  if (count <= 0 || unit == 0) return 0;
  PAGEDLM_CHECK(unit <= limit / count, "a template value would exceed ", limit,
                unit == 1 ? " bytes" : " items");
  return unit * count;
}

// ---------------------------------------------------------------------------------------------
// Python string helpers (code point based).

std::string strip_chars(const std::string& s, const Value& chars, bool left, bool right) {
  std::u32string u = utf8_decode(s);
  std::u32string set;
  bool whitespace = chars.is_undefined() || chars.is_none();
  if (!whitespace) set = utf8_decode(chars.str());
  auto strip = [&](char32_t c) {
    return whitespace ? is_python_space(c) : set.find(c) != std::u32string::npos;
  };
  size_t begin = 0, end = u.size();
  if (left) {
    while (begin < end && strip(u[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strip(u[end - 1])) --end;
  }
  return utf8_encode(u.substr(begin, end - begin));
}

char32_t ascii_upper(char32_t c) { return c >= U'a' && c <= U'z' ? c - 32 : c; }
char32_t ascii_lower(char32_t c) { return c >= U'A' && c <= U'Z' ? c + 32 : c; }
bool is_cased_letter(char32_t c) { return (c >= U'a' && c <= U'z') || (c >= U'A' && c <= U'Z'); }

std::string map_chars(const std::string& s, char32_t (*fn)(char32_t)) {
  std::u32string u = utf8_decode(s);
  for (auto& c : u) c = fn(c);
  return utf8_encode(u);
}

// Python's str.title(): a letter after a non-letter is upper-cased, the rest lower-cased.
std::string python_title(const std::string& s) {
  std::u32string u = utf8_decode(s);
  bool prev_cased = false;
  for (auto& c : u) {
    c = prev_cased ? ascii_lower(c) : ascii_upper(c);
    prev_cased = is_cased_letter(c);
  }
  return utf8_encode(u);
}

std::string python_capitalize(const std::string& s) {
  std::u32string u = utf8_decode(s);
  for (size_t i = 0; i < u.size(); ++i) u[i] = i == 0 ? ascii_upper(u[i]) : ascii_lower(u[i]);
  return utf8_encode(u);
}

std::vector<Value> python_split(const std::string& s, const Value& sep, int64_t maxsplit) {
  std::vector<Value> out;
  if (sep.is_undefined() || sep.is_none()) {
    std::u32string u = utf8_decode(s);
    size_t i = 0;
    while (i < u.size()) {
      while (i < u.size() && is_python_space(u[i])) ++i;
      if (i == u.size()) break;
      if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        size_t end = u.size();
        while (end > i && is_python_space(u[end - 1])) --end;
        out.push_back(Value::string(utf8_encode(u.substr(i, end - i))));
        break;
      }
      size_t j = i;
      while (j < u.size() && !is_python_space(u[j])) ++j;
      out.push_back(Value::string(utf8_encode(u.substr(i, j - i))));
      i = j;
    }
    return out;
  }
  const std::string& d = sep.as_string();
  PAGEDLM_CHECK(!d.empty(), "empty separator");
  size_t start = 0;
  while (true) {
    size_t hit = s.find(d, start);
    if (hit == std::string::npos ||
        (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit)) {
      out.push_back(Value::string(s.substr(start)));
      return out;
    }
    out.push_back(Value::string(s.substr(start, hit - start)));
    start = hit + d.size();
  }
}

std::string python_replace(const std::string& s, const std::string& old, const std::string& with,
                           int64_t count) {
  std::string out;
  if (old.empty()) {
    // Python inserts the replacement between every code point (and at both ends).
    std::u32string u = utf8_decode(s);
    int64_t done = 0;
    for (size_t i = 0; i <= u.size(); ++i) {
      if (count < 0 || done < count) {
        out += with;
        ++done;
      }
      if (i < u.size()) out += utf8_encode(u.substr(i, 1));
    }
    return out;
  }
  size_t start = 0;
  int64_t done = 0;
  while (count < 0 || done < count) {
    size_t hit = s.find(old, start);
    if (hit == std::string::npos) break;
    out += s.substr(start, hit - start) + with;
    start = hit + old.size();
    ++done;
  }
  return out + s.substr(start);
}

// Python's slice index normalization for a sequence of `size` items.
std::vector<size_t> slice_indices(int64_t size, const Value& start_v, const Value& stop_v,
                                  const Value& step_v) {
  int64_t step = step_v.is_none() || step_v.is_undefined() ? 1 : step_v.as_int();
  PAGEDLM_CHECK(step != 0, "slice step cannot be zero");
  auto clamp = [&](const Value& v, int64_t dflt) {
    if (v.is_none() || v.is_undefined()) return dflt;
    int64_t i = v.as_int();
    if (i < 0) i += size;
    if (step > 0) return std::clamp<int64_t>(i, 0, size);
    return std::clamp<int64_t>(i, -1, size - 1);
  };
  int64_t start = clamp(start_v, step > 0 ? 0 : size - 1);
  int64_t stop = clamp(stop_v, step > 0 ? size : -1);
  std::vector<size_t> out;
  // A step past the end would overflow i; it ends the loop instead.
  for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
    out.push_back(static_cast<size_t>(i));
    if (__builtin_add_overflow(i, step, &i)) break;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Argument access for filters, tests and methods: Python-style positional-or-keyword.

class Args {
 public:
  // Position of a parameter that can only be given by keyword.
  static constexpr size_t kKeywordOnly = static_cast<size_t>(-1);

  // `what` names the callee in errors: "strip", or "filter" with the filter's `name`. Both
  // outlive the Args (they are literals or the caller's); nothing is built unless it fails.
  Args(const CallArgs& args, std::string_view what, std::string_view name = {})
      : args_(args), what_(what), name_(name) {}

  // The i-th parameter, given by position or by `name`; Undefined if absent.
  Value get(size_t i, const char* name) const {
    if (i < args_.positional.size()) return args_.positional[i];
    for (const auto& [key, value] : args_.keyword) {
      if (key == name) return value;
    }
    return Value();
  }
  Value get(size_t i, const char* name, const Value& dflt) const {
    Value v = get(i, name);
    return v.is_undefined() ? dflt : v;
  }
  std::string string(size_t i, const char* name) const {
    Value v = get(i, name);
    PAGEDLM_CHECK(v.is_string(), what_, name_.empty() ? "" : " '", name_, name_.empty() ? "" : "'",
                  ": argument '", name, "' must be a string, got ", v.type_name());
    return v.as_string();
  }

 private:
  const CallArgs& args_;
  std::string_view what_;
  std::string_view name_;
};

std::vector<Value> iterate(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return {};
    case Kind::kList:
      return v.as_list();
    case Kind::kDict: {
      std::vector<Value> keys;
      for (const auto& [key, value] : v.as_dict().items) keys.push_back(Value::string(key));
      return keys;
    }
    case Kind::kString: {
      std::vector<Value> chars;
      for (char32_t c : utf8_decode(v.as_string())) {
        chars.push_back(Value::string(utf8_encode(std::u32string(1, c))));
      }
      return chars;
    }
    default:
      fail("'", v.type_name(), "' object is not iterable");
  }
}

int64_t length_of(const Value& v) {
  switch (v.kind()) {
    case Kind::kUndefined:
      return 0;
    case Kind::kString:
      return static_cast<int64_t>(utf8_decode(v.as_string()).size());
    case Kind::kList:
      return static_cast<int64_t>(v.as_list().size());
    case Kind::kDict:
      return static_cast<int64_t>(v.as_dict().items.size());
    default:
      fail("object of type '", v.type_name(), "' has no len()");
  }
}

Value items_of(const Value& v) {
  std::vector<Value> pairs;
  for (const auto& [key, value] : v.as_dict().items) {
    pairs.push_back(Value::tuple({Value::string(key), value}));
  }
  return Value::list(std::move(pairs));
}

// Python's a < b for the types templates compare.
bool less_than(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) return a.as_double() < b.as_double();
  if (a.is_string() && b.is_string()) return a.as_string() < b.as_string();
  if (a.is_list() && b.is_list()) {
    const auto& x = a.as_list();
    const auto& y = b.as_list();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!x[i].equals(y[i])) return less_than(x[i], y[i]);
    }
    return x.size() < y.size();
  }
  fail("'<' not supported between instances of '", a.type_name(), "' and '", b.type_name(), "'");
}

bool contains(const Value& container, const Value& item) {
  switch (container.kind()) {
    case Kind::kUndefined:
      return false;
    case Kind::kString:
      PAGEDLM_CHECK(item.is_string(), "'in <string>' requires string as left operand, not ",
                    item.type_name());
      return container.as_string().find(item.as_string()) != std::string::npos;
    case Kind::kList:
      for (const auto& x : container.as_list()) {
        if (x.equals(item)) return true;
      }
      return false;
    case Kind::kDict:
      return item.is_string() && container.as_dict().find(item.as_string()) != nullptr;
    default:
      fail("argument of type '", container.type_name(), "' is not iterable");
  }
}

Value to_int_value(const Value& v, const Value& dflt) {
  if (v.kind() == Kind::kInt || v.kind() == Kind::kBool) return Value::integer(v.as_int());
  if (v.kind() == Kind::kFloat) return Value::integer(float_to_int(v.as_double()));
  if (v.is_string()) {
    std::string s = strip_chars(v.as_string(), Value(), true, true);
    try {
      size_t used = 0;
      int64_t i = std::stoll(s, &used);
      if (used == s.size()) return Value::integer(i);
    } catch (const std::exception&) {
    }
    try {
      size_t used = 0;
      double d = std::stod(s, &used);
      // Jinja's int filter falls back to the default where Python's int() raises.
      if (used == s.size() && fits_int64(d)) return Value::integer(static_cast<int64_t>(d));
    } catch (const std::exception&) {
    }
  }
  return dflt;
}

// ---------------------------------------------------------------------------------------------
// Tests (`x is name`).

bool apply_test(const std::string& name, const Value& v, const std::vector<Value>& args) {
  auto arg = [&](size_t i) {
    PAGEDLM_CHECK(i < args.size(), "test '", name, "' needs an argument");
    return args[i];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_dict();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.kind() == Kind::kInt;
  if (name == "float") return v.kind() == Kind::kFloat;
  if (name == "boolean") return v.kind() == Kind::kBool;
  if (name == "true") return v.kind() == Kind::kBool && v.as_bool();
  if (name == "false") return v.kind() == Kind::kBool && !v.as_bool();
  if (name == "iterable") {
    return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
  }
  if (name == "sequence") {
    return v.is_undefined() || v.is_string() || v.is_list() || v.is_dict();
  }
  if (name == "callable") return v.kind() == Kind::kFunction;
  if (name == "odd") return v.as_int() % 2 != 0;
  if (name == "even") return v.as_int() % 2 == 0;
  if (name == "divisibleby") {
    const int64_t d = arg(0).as_int();
    PAGEDLM_CHECK(d != 0, "integer division or modulo by zero");
    return d == -1 || v.as_int() % d == 0;  // INT64_MIN % -1 traps
  }
  if (name == "lower" || name == "upper") {
    std::string s = v.str();
    bool cased = false;
    for (char c : s) {
      if (std::isalpha(static_cast<unsigned char>(c))) {
        cased = true;
        if ((name == "lower") != (std::islower(static_cast<unsigned char>(c)) != 0)) return false;
      }
    }
    return cased;
  }
  if (name == "eq" || name == "equalto" || name == "==") return v.equals(arg(0));
  if (name == "ne" || name == "!=") return !v.equals(arg(0));
  if (name == "lt" || name == "lessthan" || name == "<") return less_than(v, arg(0));
  if (name == "gt" || name == "greaterthan" || name == ">") return less_than(arg(0), v);
  if (name == "le" || name == "<=") return !less_than(arg(0), v);
  if (name == "ge" || name == ">=") return !less_than(v, arg(0));
  if (name == "in") return contains(arg(0), v);
  if (name == "sameas") {
    const Value& o = arg(0);
    if (v.kind() != o.kind()) return false;
    if (v.is_none() || v.is_undefined()) return true;
    if (v.kind() == Kind::kBool) return v.as_bool() == o.as_bool();
    return v.equals(o);
  }
  fail("no test named '", name, "'");
}

// ---------------------------------------------------------------------------------------------
// The renderer.

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(const std::vector<std::pair<std::string, Value>>& context) {
    frames_.emplace_back();
    for (const auto& [name, value] : context) frames_.back()[name] = value;
  }

  void run(const Body& body, std::string& out) { exec(body, out); }

 private:
  using Frame = std::unordered_map<std::string, Value>;

  [[noreturn]] static void runtime_error(int line, const std::string& message) {
    fail("chat template error at line ", line, ": ", message);
  }

  Value lookup(const std::string& name) const {
    for (auto it = frames_.rbegin(); it != frames_.rend(); ++it) {
      auto found = it->find(name);
      if (found != it->end()) return found->second;
    }
    return builtin(name);
  }

  Value builtin(const std::string& name) const {
    if (name == "range") {
      return Value::function(name, [](const CallArgs& a) {
        std::vector<int64_t> n;
        for (const auto& v : a.positional) n.push_back(v.as_int());
        PAGEDLM_CHECK(!n.empty() && n.size() <= 3, "range expected 1 to 3 arguments");
        int64_t start = n.size() == 1 ? 0 : n[0];
        int64_t stop = n.size() == 1 ? n[0] : n[1];
        int64_t step = n.size() == 3 ? n[2] : 1;
        PAGEDLM_CHECK(step != 0, "range() arg 3 must not be zero");
        std::vector<Value> out;
        for (int64_t i = start; step > 0 ? i < stop : i > stop;) {
          PAGEDLM_CHECK(static_cast<int64_t>(out.size()) < kMaxValueItems, "range() of more than ",
                        kMaxValueItems, " items");
          out.push_back(Value::integer(i));
          if (__builtin_add_overflow(i, step, &i)) break;
        }
        return Value::list(std::move(out));
      });
    }
    if (name == "namespace" || name == "dict") {
      bool is_namespace = name == "namespace";
      return Value::function(name, [is_namespace](const CallArgs& a) {
        auto attrs = std::make_shared<Dict>();
        for (const auto& v : a.positional) {
          PAGEDLM_CHECK(v.is_dict(), "namespace()/dict() takes a mapping positionally");
          for (const auto& [key, value] : v.as_dict().items) attrs->set(key, value);
        }
        for (const auto& [key, value] : a.keyword) attrs->set(key, value);
        return is_namespace ? Value::make_namespace(attrs) : Value::dict(attrs);
      });
    }
    if (name == "raise_exception") {
      return Value::function(name, [](const CallArgs& a) -> Value {
        throw TemplateException(a.positional.empty() ? "" : a.positional[0].str());
      });
    }
    if (name == "strftime_now") {
      return Value::function(name, [](const CallArgs& a) {
        PAGEDLM_CHECK(!a.positional.empty() && a.positional[0].is_string(),
                      "strftime_now expects a format string");
        std::time_t now = std::time(nullptr);
        std::tm local{};
        localtime_r(&now, &local);
        char buf[256];
        size_t n = std::strftime(buf, sizeof(buf), a.positional[0].as_string().c_str(), &local);
        return Value::string(std::string(buf, n));
      });
    }
    return Value::undefined(name);
  }

  Flow exec(const Body& body, std::string& out) {
    for (const auto& stmt : body) {
      Flow flow = exec(*stmt, out);
      if (flow != Flow::kNormal) return flow;
    }
    return Flow::kNormal;
  }

  Flow exec(const Stmt& s, std::string& out) {
    switch (s.kind) {
      case Stmt::Kind::kText:
        out += s.text;
        check_text_size(out.size());
        return Flow::kNormal;
      case Stmt::Kind::kOutput: {
        const Value v = eval(*s.expr);
        if (v.is_string()) {
          out += v.as_string();  // str() would copy it first
        } else {
          out += v.str();
        }
        check_text_size(out.size());
        return Flow::kNormal;
      }
      case Stmt::Kind::kIf:
        for (size_t i = 0; i < s.conditions.size(); ++i) {
          if (eval(*s.conditions[i]).truthy()) return exec(s.bodies[i], out);
        }
        if (s.bodies.size() > s.conditions.size()) return exec(s.bodies.back(), out);
        return Flow::kNormal;
      case Stmt::Kind::kFor:
        exec_for(s, out);
        return Flow::kNormal;
      case Stmt::Kind::kSet: {
        Value v = eval(*s.expr);
        if (!s.attr.empty()) {
          Value target = lookup(s.targets[0]);
          if (!target.is_namespace()) {
            runtime_error(s.line, "cannot assign attribute on non-namespace object");
          }
          target.namespace_attrs().set(s.attr, std::move(v));
        } else {
          assign(s.targets, v, s.line);
        }
        return Flow::kNormal;
      }
      case Stmt::Kind::kSetBlock: {
        std::string captured;
        exec(s.bodies[0], captured);
        frames_.back()[s.targets[0]] = Value::string(std::move(captured));
        return Flow::kNormal;
      }
      case Stmt::Kind::kMacro:
        frames_.back()[s.text] = make_macro(s);
        return Flow::kNormal;
      case Stmt::Kind::kBreak:
        return Flow::kBreak;
      case Stmt::Kind::kContinue:
        return Flow::kContinue;
    }
    return Flow::kNormal;
  }

  void assign(const std::vector<std::string>& targets, const Value& v, int line) {
    if (targets.size() == 1) {
      frames_.back()[targets[0]] = v;
      return;
    }
    std::vector<Value> items = iterate(v);
    if (items.size() != targets.size()) {
      runtime_error(line,
                    cat("cannot unpack ", items.size(), " values into ", targets.size(), " names"));
    }
    for (size_t i = 0; i < targets.size(); ++i) frames_.back()[targets[i]] = items[i];
  }

  void exec_for(const Stmt& s, std::string& out) {
    const Value seq = eval(*s.expr);
    // A list is iterated in place (lists never change once made, and `seq` holds this one);
    // anything else, and a filtered loop, gets a vector of its own.
    std::vector<Value> own;
    const std::vector<Value>* items = &own;
    try {
      if (seq.is_list() && !s.condition) {
        items = &seq.as_list();
      } else {
        own = iterate(seq);
      }
    } catch (const Error& e) {
      runtime_error(s.line, e.what());
    }
    if (s.condition) {
      std::vector<Value> kept;
      for (auto& item : own) {
        frames_.emplace_back();
        assign(s.targets, item, s.line);
        bool keep = eval(*s.condition).truthy();
        frames_.pop_back();
        if (keep) kept.push_back(std::move(item));
      }
      own = std::move(kept);
    }
    if (items->empty()) {
      if (s.bodies.size() > 1) exec(s.bodies[1], out);
      return;
    }
    const int64_t n = static_cast<int64_t>(items->size());
    // One frame for the loop, emptied at each iteration (what one sets does not reach the next)
    // but for the entries of the loop's own names, which are set again at once: this runs once
    // per item, e.g. per message of a request that may hold tens of thousands, and so reuses
    // what it can.
    frames_.emplace_back();
    const size_t frame = frames_.size() - 1;
    std::shared_ptr<Dict> loop;
    for (int64_t i = 0; i < n; ++i) {
      Frame& vars = frames_[frame];
      for (auto it = vars.begin(); it != vars.end();) {
        if (it->first == "loop" ||
            std::find(s.targets.begin(), s.targets.end(), it->first) != s.targets.end()) {
          it->second = Value();
          ++it;
        } else {
          it = vars.erase(it);
        }
      }
      assign(s.targets, (*items)[i], s.line);
      vars.insert_or_assign("loop", loop_object(loop, *items, i));
      if (exec(s.bodies[0], out) == Flow::kBreak) break;
    }
    frames_.pop_back();
  }

  // `loop` in iteration i of a loop over `items`, in `loop`: the previous iteration's dict when
  // nothing else holds it any more, its values set anew, else a new one (a value never changes
  // once a template can see it: one that kept `loop` past its iteration keeps what it saw).
  static Value loop_object(std::shared_ptr<Dict>& loop, const std::vector<Value>& items,
                           int64_t i) {
    static constexpr const char* kNames[] = {"index",  "index0",   "revindex", "revindex0",
                                             "first",  "last",     "length",   "depth",
                                             "depth0", "previtem", "nextitem", "cycle"};
    static const Value kNoPrevItem = Value::undefined("previtem");
    static const Value kNoNextItem = Value::undefined("nextitem");
    if (!loop || loop.use_count() > 1) {
      loop = std::make_shared<Dict>();
      loop->items.reserve(std::size(kNames));
      for (const char* name : kNames) loop->items.emplace_back(name, Value());
    }
    const int64_t n = static_cast<int64_t>(items.size());
    size_t next = 0;  // the values in kNames' order
    auto put = [&](Value value) { loop->items[next++].second = std::move(value); };
    put(Value::integer(i + 1));
    put(Value::integer(i));
    put(Value::integer(n - i));
    put(Value::integer(n - i - 1));
    put(Value::boolean(i == 0));
    put(Value::boolean(i == n - 1));
    put(Value::integer(n));
    put(Value::integer(1));
    put(Value::integer(0));
    put(i > 0 ? items[i - 1] : kNoPrevItem);
    put(i + 1 < n ? items[i + 1] : kNoNextItem);
    put(Value::function("cycle", [i](const CallArgs& a) {
      PAGEDLM_CHECK(!a.positional.empty(), "no items for cycling given");
      return a.positional[i % a.positional.size()];
    }));
    return Value::dict(loop);
  }

  Value make_macro(const Stmt& s) {
    return Value::function(s.text, [this, &s](const CallArgs& a) {
      PAGEDLM_CHECK(a.positional.size() <= s.targets.size(), "macro '", s.text, "' takes at most ",
                    s.targets.size(), " arguments");
      Frame frame;
      for (size_t i = 0; i < s.targets.size(); ++i) {
        Value v = i < a.positional.size() ? a.positional[i] : Value::undefined(s.targets[i]);
        for (const auto& [key, value] : a.keyword) {
          if (key == s.targets[i]) v = value;
        }
        if (v.is_undefined() && s.defaults[i]) v = eval(*s.defaults[i]);
        frame[s.targets[i]] = v;
      }
      // A macro that calls itself without end must fail, not overflow the native stack.
      constexpr int kMaxMacroDepth = 200;
      PAGEDLM_CHECK(macro_depth_ < kMaxMacroDepth, "maximum recursion depth exceeded in macro '",
                    s.text, "'");
      ++macro_depth_;
      frames_.push_back(std::move(frame));
      std::string out;
      exec(s.bodies[0], out);
      frames_.pop_back();
      --macro_depth_;
      return Value::string(std::move(out));
    });
  }

  // -------------------------------------------------------------------------------------------
  // Expressions.

  // Runs `f`, reporting an Error it throws as a template error at `line` (one that already
  // names its line, and raise_exception's message, pass unchanged).
  template <typename F>
  static decltype(auto) at_line(int line, F&& f) {
    try {
      return f();
    } catch (const TemplateException&) {
      throw;
    } catch (const Error& err) {
      std::string what = err.what();
      if (what.rfind("chat template", 0) == 0) throw;
      runtime_error(line, what);
    }
  }

  Value eval(const Expr& e) {
    return at_line(e.line, [&] { return eval_unchecked(e); });
  }

  Value eval_unchecked(const Expr& e) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName:
        return lookup(e.name);
      case Expr::Kind::kList:
      case Expr::Kind::kTuple: {
        std::vector<Value> items;
        for (const auto& a : e.args) items.push_back(eval(*a));
        if (e.kind == Expr::Kind::kTuple) return Value::tuple(std::move(items));
        return Value::list(std::move(items));
      }
      case Expr::Kind::kDict: {
        auto d = std::make_shared<Dict>();
        for (size_t i = 0; i < e.args.size(); i += 2) {
          Value key = eval(*e.args[i]);
          PAGEDLM_CHECK(key.is_string(), "dict keys must be strings here, got ", key.type_name());
          d->set(key.as_string(), eval(*e.args[i + 1]));
        }
        return Value::dict(d);
      }
      case Expr::Kind::kAttr:
        return get_attr(eval(*e.args[0]), e.name);
      case Expr::Kind::kItem:
        return get_item(eval(*e.args[0]), eval(*e.args[1]));
      case Expr::Kind::kSlice: {
        Value target = eval(*e.args[0]);
        Value parts[3];
        for (int i = 0; i < 3; ++i) parts[i] = e.args[i + 1] ? eval(*e.args[i + 1]) : Value();
        return slice(target, parts[0], parts[1], parts[2]);
      }
      case Expr::Kind::kCall: {
        Value callee = eval(*e.args[0]);
        CallArgs args = eval_args(e);
        if (callee.is_undefined()) undefined_error(callee, "called");
        PAGEDLM_CHECK(callee.kind() == Kind::kFunction, "'", callee.type_name(),
                      "' object is not callable");
        return callee.as_function()(args);
      }
      case Expr::Kind::kFilter:
        return apply_filter(e.name, eval(*e.args[0]), eval_args(e));
      case Expr::Kind::kTest: {
        Value v = eval(*e.args[0]);
        CallArgs args = eval_args(e);
        return Value::boolean(apply_test(e.name, v, args.positional) != e.negated);
      }
      case Expr::Kind::kNot:
        return Value::boolean(!eval(*e.args[0]).truthy());
      case Expr::Kind::kNeg: {
        Value v = eval(*e.args[0]);
        require_defined(v);
        if (v.kind() == Kind::kFloat) return Value::number(-v.as_double());
        PAGEDLM_CHECK(v.is_number(), "bad operand type for unary -: '", v.type_name(), "'");
        check_no_overflow(v.as_int() == INT64_MIN, "-");
        return Value::integer(-v.as_int());
      }
      case Expr::Kind::kBinary:
        if (is_concatenation(e)) return eval_concatenation(e);
        return binary(e.name, eval(*e.args[0]), eval(*e.args[1]));
      case Expr::Kind::kCompare: {
        Value lhs = eval(*e.args[0]);
        for (size_t i = 0; i < e.ops.size(); ++i) {
          Value rhs = eval(*e.args[i + 1]);
          if (!compare(e.ops[i], lhs, rhs)) return Value::boolean(false);
          lhs = std::move(rhs);
        }
        return Value::boolean(true);
      }
      case Expr::Kind::kAnd: {
        Value lhs = eval(*e.args[0]);
        return lhs.truthy() ? eval(*e.args[1]) : lhs;
      }
      case Expr::Kind::kOr: {
        Value lhs = eval(*e.args[0]);
        return lhs.truthy() ? lhs : eval(*e.args[1]);
      }
      case Expr::Kind::kCond:
        if (eval(*e.args[0]).truthy()) return eval(*e.args[1]);
        return e.args[2] ? eval(*e.args[2]) : Value::undefined();
    }
    return Value();
  }

  static bool is_concatenation(const Expr& e) {
    return e.kind == Expr::Kind::kBinary && (e.name == "+" || e.name == "~");
  }

  // The result so far of a chain of + and ~.
  struct Concatenation {
    Value value;       // unless is_text
    std::string text;  // a string result, while operands are strings
    bool is_text = false;
  };

  // A + or ~ with the + and ~ to its left (`a + b + c` is `(a + b) + c`, as templates build
  // prompts), string operands appended to one buffer: one step at a time, every step would copy
  // the string so far into a new value. Operands are evaluated, and errors raised, in the same
  // order and at the same lines as one step at a time.
  Value eval_concatenation(const Expr& e) {
    Concatenation acc;
    concatenate(e, acc);
    return acc.is_text ? Value::string(std::move(acc.text)) : std::move(acc.value);
  }

  void concatenate(const Expr& e, Concatenation& acc) {
    const Expr& lhs = *e.args[0];
    if (is_concatenation(lhs)) {
      concatenate(lhs, acc);
    } else {
      acc.value = eval(lhs);
    }
    const Value rhs = eval(*e.args[1]);
    at_line(e.line, [&] {
      // binary()'s string cases: ~ joins str() of any two values, + joins two strings.
      if (e.name == "~" || ((acc.is_text || acc.value.is_string()) && rhs.is_string())) {
        if (!acc.is_text) {
          acc.text = acc.value.str();
          acc.is_text = true;
        }
        if (rhs.is_string()) {
          acc.text += rhs.as_string();
        } else {
          acc.text += rhs.str();
        }
        check_text_size(acc.text.size());
        return;
      }
      if (acc.is_text) {
        acc.value = Value::string(std::move(acc.text));
        acc.text.clear();
        acc.is_text = false;
      }
      acc.value = binary(e.name, acc.value, rhs);
    });
  }

  CallArgs eval_args(const Expr& e) {
    CallArgs args;
    // args[0] is the callee, the filtered value or the tested value.
    for (size_t i = 1; i < e.args.size(); ++i) args.positional.push_back(eval(*e.args[i]));
    for (const auto& [key, expr] : e.kwargs) args.keyword.emplace_back(key, eval(*expr));
    return args;
  }

  // Jinja's default Undefined prints as nothing but fails when used as a value.
  [[noreturn]] static void undefined_error(const Value& v, const std::string& doing) {
    std::string what = v.undefined_name().empty() ? "undefined value"
                                                  : "'" + v.undefined_name() + "' is undefined";
    fail(what, doing.empty() ? "" : " (" + doing + ")");
  }

  static void require_defined(const Value& v) {
    if (v.is_undefined()) undefined_error(v, "");
  }

  static Value get_attr(const Value& obj, const std::string& name) {
    if (obj.is_undefined()) undefined_error(obj, "reading attribute '" + name + "'");
    Value method = bound_method(obj, name);
    if (!method.is_undefined()) return method;
    if (obj.is_dict() || obj.is_namespace()) {
      const Value* v = obj.is_dict() ? obj.as_dict().find(name) : obj.namespace_attrs().find(name);
      if (v) return *v;
    }
    return Value::undefined(name);
  }

  // Jinja's subscript: the item first, then an attribute of that name.
  static Value get_item(const Value& obj, const Value& key) {
    if (obj.is_undefined()) undefined_error(obj, "reading item " + key.repr());
    if ((obj.is_list() || obj.is_string()) && key.is_number() && key.kind() != Kind::kFloat) {
      int64_t size = length_of(obj);
      int64_t i = key.as_int();
      if (i < 0) i += size;
      if (i < 0 || i >= size) return Value::undefined();
      if (obj.is_list()) return obj.as_list()[i];
      return Value::string(utf8_encode(utf8_decode(obj.as_string()).substr(i, 1)));
    }
    if (obj.is_dict() && key.is_string()) {
      const Value* v = obj.as_dict().find(key.as_string());
      if (v) return *v;
    }
    if (key.is_string()) return get_attr(obj, key.as_string());
    return Value::undefined();
  }

  static Value slice(const Value& target, const Value& start, const Value& stop,
                     const Value& step) {
    if (target.is_list()) {
      const auto& items = target.as_list();
      std::vector<Value> out;
      for (size_t i : slice_indices(items.size(), start, stop, step)) out.push_back(items[i]);
      return Value::list(std::move(out));
    }
    if (target.is_string()) {
      std::u32string u = utf8_decode(target.as_string());
      std::u32string out;
      for (size_t i : slice_indices(u.size(), start, stop, step)) out += u[i];
      return Value::string(utf8_encode(out));
    }
    require_defined(target);
    fail("'", target.type_name(), "' object is not subscriptable");
  }

  static Value binary(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") return Value::string(a.str() + b.str());
    require_defined(a);
    require_defined(b);
    if (a.is_number() && b.is_number()) {
      bool floats = a.kind() == Kind::kFloat || b.kind() == Kind::kFloat;
      double x = a.as_double(), y = b.as_double();
      int64_t i = a.as_int(), j = b.as_int();
      int64_t r = 0;
      if (op == "+") {
        if (floats) return Value::number(x + y);
        check_no_overflow(__builtin_add_overflow(i, j, &r), op);
        return Value::integer(r);
      }
      if (op == "-") {
        if (floats) return Value::number(x - y);
        check_no_overflow(__builtin_sub_overflow(i, j, &r), op);
        return Value::integer(r);
      }
      if (op == "*") {
        if (floats) return Value::number(x * y);
        check_no_overflow(__builtin_mul_overflow(i, j, &r), op);
        return Value::integer(r);
      }
      if (op == "/") {
        PAGEDLM_CHECK(y != 0.0, "division by zero");
        return Value::number(x / y);
      }
      if (op == "//" || op == "%") {
        PAGEDLM_CHECK(y != 0.0, "integer division or modulo by zero");
        if (floats) {
          double q = std::floor(x / y);
          return op == "//" ? Value::number(q) : Value::number(x - q * y);
        }
        // Python floors; C++ truncates. The remainder is corrected on its own (i - q * j can
        // overflow), and j == -1 kept apart (INT64_MIN / -1 overflows, INT64_MIN % -1 traps).
        if (op == "%") {
          if (j == -1) return Value::integer(0);
          int64_t m = i % j;
          if (m != 0 && (m < 0) != (j < 0)) m += j;
          return Value::integer(m);
        }
        check_no_overflow(i == INT64_MIN && j == -1, op);
        int64_t q = i / j;
        if ((i % j != 0) && ((i < 0) != (j < 0))) --q;
        return Value::integer(q);
      }
      if (op == "**") {
        if (!floats && j >= 0) {
          // 0, 1 and -1 never overflow, whatever the exponent; any other base overflows within
          // 63 steps, so the loop is short.
          if (i == 0 || i == 1) return Value::integer(j == 0 ? 1 : i);
          if (i == -1) return Value::integer(j % 2 == 0 ? 1 : -1);
          int64_t p = 1;
          for (int64_t k = 0; k < j; ++k) check_no_overflow(__builtin_mul_overflow(p, i, &p), op);
          return Value::integer(p);
        }
        return Value::number(std::pow(x, y));
      }
    }
    if (op == "+" && a.is_string() && b.is_string()) {
      return Value::string(a.as_string() + b.as_string());
    }
    if (op == "+" && a.is_list() && b.is_list()) {
      std::vector<Value> items = a.as_list();
      items.insert(items.end(), b.as_list().begin(), b.as_list().end());
      return Value::list(std::move(items));
    }
    if (op == "*" && (a.is_string() || a.is_list()) && b.kind() == Kind::kInt) {
      if (a.is_string()) {
        built_size(static_cast<int64_t>(a.as_string().size()), b.as_int(), kMaxValueBytes);
      } else {
        built_size(static_cast<int64_t>(a.as_list().size()), b.as_int(), kMaxValueItems);
      }
      std::vector<Value> items;
      std::string s;
      for (int64_t k = 0; k < b.as_int(); ++k) {
        if (a.is_string()) {
          s += a.as_string();
        } else {
          items.insert(items.end(), a.as_list().begin(), a.as_list().end());
        }
      }
      return a.is_string() ? Value::string(s) : Value::list(std::move(items));
    }
    fail("unsupported operand type(s) for ", op, ": '", a.type_name(), "' and '", b.type_name(),
         "'");
  }

  static bool compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==") return a.equals(b);
    if (op == "!=") return !a.equals(b);
    if (op == "in") return contains(b, a);
    if (op == "not in") return !contains(b, a);
    require_defined(a);
    require_defined(b);
    if (op == "<") return less_than(a, b);
    if (op == ">") return less_than(b, a);
    if (op == "<=") return !less_than(b, a);
    return !less_than(a, b);  // >=
  }

  // Methods of strings and dicts that templates call; Undefined when there is no such method
  // (unnamed: get_attr, the only caller, names what it returns, and every `message.content`
  // would otherwise allocate a name only to drop it).
  static Value bound_method(const Value& self, const std::string& name) {
    auto method = [&](Function fn) { return Value::function(name, std::move(fn)); };
    if (self.is_string()) {
      // Methods capture the string Value (shared, not copied) and read it when called.
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        bool left = name != "rstrip", right = name != "lstrip";
        return method([self, left, right](const CallArgs& a) {
          const std::string& s = self.as_string();
          return Value::string(strip_chars(s, Args(a, "strip").get(0, "chars"), left, right));
        });
      }
      if (name == "split") {
        return method([self](const CallArgs& a) {
          const std::string& s = self.as_string();
          Args args(a, "split");
          Value sep = args.get(0, "sep");
          return Value::list(
              python_split(s, sep, args.get(1, "maxsplit", Value::integer(-1)).as_int()));
        });
      }
      if (name == "startswith" || name == "endswith") {
        bool starts = name == "startswith";
        return method([self, starts](const CallArgs& a) {
          const std::string& s = self.as_string();
          Value arg = Args(a, "startswith").get(0, "prefix");
          std::vector<Value> options = arg.is_list() ? arg.as_list() : std::vector<Value>{arg};
          for (const auto& o : options) {
            PAGEDLM_CHECK(o.is_string(), "startswith/endswith expects strings");
            const std::string& p = o.as_string();
            if (p.size() <= s.size() &&
                s.compare(starts ? 0 : s.size() - p.size(), p.size(), p) == 0) {
              return Value::boolean(true);
            }
          }
          return Value::boolean(false);
        });
      }
      if (name == "upper" || name == "lower") {
        bool upper = name == "upper";
        return method([self, upper](const CallArgs&) {
          const std::string& s = self.as_string();
          return Value::string(map_chars(s, upper ? ascii_upper : ascii_lower));
        });
      }
      if (name == "title") {
        return method(
            [self](const CallArgs&) { return Value::string(python_title(self.as_string())); });
      }
      if (name == "capitalize") {
        return method(
            [self](const CallArgs&) { return Value::string(python_capitalize(self.as_string())); });
      }
      if (name == "replace") {
        return method([self](const CallArgs& a) {
          const std::string& s = self.as_string();
          Args args(a, "replace");
          return Value::string(python_replace(s, args.string(0, "old"), args.string(1, "new"),
                                              args.get(2, "count", Value::integer(-1)).as_int()));
        });
      }
      if (name == "find") {
        return method([self](const CallArgs& a) {
          const std::string& s = self.as_string();
          size_t hit = s.find(Args(a, "find").string(0, "sub"));
          if (hit == std::string::npos) return Value::integer(-1);
          return Value::integer(static_cast<int64_t>(utf8_decode(s.substr(0, hit)).size()));
        });
      }
      if (name == "join") {
        return method([self](const CallArgs& a) {
          const std::string& s = self.as_string();
          std::string out;
          bool first = true;
          for (const auto& v : iterate(Args(a, "join").get(0, "iterable"))) {
            if (!first) out += s;
            first = false;
            out += v.str();
          }
          return Value::string(out);
        });
      }
      return Value();
    }
    if (self.is_dict()) {
      if (name == "items") {
        return method([self](const CallArgs&) { return items_of(self); });
      }
      if (name == "keys" || name == "values") {
        bool keys = name == "keys";
        return method([self, keys](const CallArgs&) {
          std::vector<Value> out;
          for (const auto& [k, v] : self.as_dict().items) {
            out.push_back(keys ? Value::string(k) : v);
          }
          return Value::list(std::move(out));
        });
      }
      if (name == "get") {
        return method([self](const CallArgs& a) {
          Args args(a, "get");
          Value key = args.get(0, "key");
          const Value* v = key.is_string() ? self.as_dict().find(key.as_string()) : nullptr;
          return v ? *v : args.get(1, "default", Value::none());
        });
      }
    }
    return Value();
  }

  // -------------------------------------------------------------------------------------------
  // Filters.

  // The attribute path of selectattr/map/join(attribute=...): "a.b" reads a, then b.
  static Value attribute_path(const Value& item, const Value& path) {
    if (path.kind() == Kind::kInt) return get_item(item, path);
    Value v = item;
    for (const auto& part : python_split(path.str(), Value::string("."), -1)) {
      v = get_item(v, part);
    }
    return v;
  }

  Value apply_filter(const std::string& name, const Value& v, const CallArgs& call) {
    Args args(call, "filter", name);
    if (name == "trim") {
      return Value::string(strip_chars(v.str(), args.get(0, "chars"), true, true));
    }
    if (name == "upper") return Value::string(map_chars(v.str(), ascii_upper));
    if (name == "lower") return Value::string(map_chars(v.str(), ascii_lower));
    if (name == "capitalize") return Value::string(python_capitalize(v.str()));
    if (name == "title") {
      // Jinja's title starts a word after whitespace and - ( { [ <, unlike str.title().
      std::u32string u = utf8_decode(v.str());
      bool word_start = true;
      for (auto& c : u) {
        bool boundary =
            is_python_space(c) || c == U'-' || c == U'(' || c == U'{' || c == U'[' || c == U'<';
        if (!boundary) c = word_start ? ascii_upper(c) : ascii_lower(c);
        word_start = boundary;
      }
      return Value::string(utf8_encode(u));
    }
    if (name == "length" || name == "count") return Value::integer(length_of(v));
    if (name == "first") {
      std::vector<Value> items = iterate(v);
      return items.empty() ? Value::undefined() : items.front();
    }
    if (name == "last") {
      std::vector<Value> items = iterate(v);
      return items.empty() ? Value::undefined() : items.back();
    }
    if (name == "join") {
      std::string sep = args.get(0, "d", Value::string("")).str();
      Value attribute = args.get(1, "attribute");
      std::string out;
      bool first = true;
      for (const auto& item : iterate(v)) {
        if (!first) out += sep;
        first = false;
        out += (attribute.is_undefined() ? item : attribute_path(item, attribute)).str();
      }
      return Value::string(out);
    }
    if (name == "replace") {
      return Value::string(python_replace(v.str(), args.get(0, "old").str(),
                                          args.get(1, "new").str(),
                                          args.get(2, "count", Value::integer(-1)).as_int()));
    }
    if (name == "default" || name == "d") {
      bool boolean = args.get(1, "boolean", Value::boolean(false)).truthy();
      if (v.is_undefined() || (boolean && !v.truthy())) {
        return args.get(0, "default_value", Value::string(""));
      }
      return v;
    }
    if (name == "tojson") {
      // transformers' tojson: json.dumps(x, ensure_ascii=False, indent=None, ...).
      Value indent = args.get(1, "indent");
      int width = -1;  // none: one line
      if (indent.is_number()) {
        // json.dumps treats a negative indent as 0; a huge one would only build a huge string.
        PAGEDLM_CHECK(indent.as_int() <= 1024, "tojson indent ", indent.as_int(), " is too large");
        width = static_cast<int>(std::max<int64_t>(indent.as_int(), 0));
      }
      return Value::string(v.to_json(args.get(0, "ensure_ascii").truthy(), width));
    }
    if (name == "string") return Value::string(v.str());
    if (name == "safe" || name == "e" || name == "escape") {
      PAGEDLM_CHECK(name == "safe", "filter '", name, "' is not supported");
      return v;
    }
    if (name == "int") return to_int_value(v, args.get(0, "default", Value::integer(0)));
    if (name == "float") {
      if (v.is_number()) return Value::number(v.as_double());
      try {
        return Value::number(std::stod(v.str()));
      } catch (const std::exception&) {
        return args.get(0, "default", Value::number(0.0));
      }
    }
    if (name == "list") return Value::list(iterate(v));
    if (name == "items") {
      if (v.is_undefined()) return Value::list({});
      PAGEDLM_CHECK(v.is_dict(), "can only get item pairs from a mapping, got ", v.type_name());
      return items_of(v);
    }
    if (name == "abs") {
      if (v.kind() == Kind::kFloat) return Value::number(std::fabs(v.as_double()));
      check_no_overflow(v.as_int() == INT64_MIN, "abs");
      return Value::integer(std::llabs(v.as_int()));
    }
    if (name == "reverse") {
      if (v.is_string()) return slice(v, Value(), Value(), Value::integer(-1));
      std::vector<Value> items = iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::list(std::move(items));
    }
    if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
      bool by_attr = name == "selectattr" || name == "rejectattr";
      bool keep_if = name == "select" || name == "selectattr";
      size_t test_pos = by_attr ? 1 : 0;
      const auto& pos = call.positional;
      std::string test = pos.size() > test_pos ? pos[test_pos].str() : "";
      std::vector<Value> test_args(pos.begin() + std::min(pos.size(), test_pos + 1), pos.end());
      std::vector<Value> out;
      for (const auto& item : iterate(v)) {
        Value subject = by_attr ? attribute_path(item, pos.at(0)) : item;
        bool passed = test.empty() ? subject.truthy() : apply_test(test, subject, test_args);
        if (passed == keep_if) out.push_back(item);
      }
      return Value::list(std::move(out));
    }
    if (name == "map") {
      std::vector<Value> out;
      Value attribute = args.get(Args::kKeywordOnly, "attribute");
      for (const auto& item : iterate(v)) {
        if (!attribute.is_undefined()) {
          Value got = attribute_path(item, attribute);
          out.push_back(got.is_undefined() ? args.get(Args::kKeywordOnly, "default", got) : got);
        } else {
          PAGEDLM_CHECK(!call.positional.empty(), "map needs a filter name or attribute=");
          CallArgs rest{{call.positional.begin() + 1, call.positional.end()}, call.keyword};
          out.push_back(apply_filter(call.positional[0].str(), item, rest));
        }
      }
      return Value::list(std::move(out));
    }
    if (name == "indent") {
      Value width = args.get(0, "width", Value::integer(4));
      // Python's " " * width: nothing for a negative width.
      std::string pad = width.is_string()
                            ? width.as_string()
                            : std::string(built_size(1, width.as_int(), kMaxValueBytes), ' ');
      bool first = args.get(1, "first", Value::boolean(false)).truthy();
      bool blank = args.get(2, "blank", Value::boolean(false)).truthy();
      std::vector<Value> lines = python_split(v.str(), Value::string("\n"), -1);
      std::string out;
      for (size_t i = 0; i < lines.size(); ++i) {
        const std::string& line = lines[i].as_string();
        if (i > 0) out += "\n";
        if ((i > 0 || first) && (blank || !strip_chars(line, Value(), true, true).empty())) {
          out += pad;
        }
        out += line;
      }
      return Value::string(out);
    }
    if (name == "sum") {
      Value attribute = args.get(0, "attribute");
      Value total = args.get(1, "start", Value::integer(0));
      for (const auto& item : iterate(v)) {
        total =
            binary("+", total, attribute.is_undefined() ? item : attribute_path(item, attribute));
      }
      return total;
    }
    if (name == "attr") return get_attr(v, args.string(0, "name"));
    if (name == "dictsort") {
      PAGEDLM_CHECK(v.is_dict(), "dictsort expects a mapping");
      std::vector<Value> pairs = items_of(v).as_list();
      std::stable_sort(pairs.begin(), pairs.end(), [](const Value& a, const Value& b) {
        return less_than(a.as_list()[0], b.as_list()[0]);
      });
      return Value::list(std::move(pairs));
    }
    fail("no filter named '", name, "'");
  }

  std::vector<Frame> frames_;
  int macro_depth_ = 0;
};

}  // namespace

Template::Template(const std::string& source)
    : body_(std::make_shared<const Body>(parse_template(source))) {}

std::string Template::render(const std::vector<std::pair<std::string, Value>>& context) const {
  std::string out;
  Renderer(context).run(*body_, out);
  return out;
}

}  // namespace pagedlm::jinja
