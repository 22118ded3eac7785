#include "pagedlm/grammar/grammar.h"

#include <xgrammar/xgrammar.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <future>
#include <limits>
#include <list>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <utility>

#include "pagedlm/grammar/string_format.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::grammar {

class CompiledGrammar {
 public:
  explicit CompiledGrammar(xgrammar::CompiledGrammar g) : grammar(std::move(g)) {}
  xgrammar::CompiledGrammar grammar;
};

namespace {

// xgrammar's logger starts a message with "[HH:MM:SS] /its/source/file.cc:LINE: "; clients need
// only the parser's reason after it.
std::string parser_reason(std::string message) {
  if (message.rfind('[', 0) == 0) {
    const size_t close = message.find("] ");
    if (close != std::string::npos) message.erase(0, close + 2);
  }
  const size_t source = message.find(".cc:");
  if (source != std::string::npos && message.find(' ') > source) {
    const size_t colon = message.find(": ", source + 4);
    if (colon != std::string::npos) message.erase(0, colon + 2);
  }
  return message;
}

using nlohmann::json;

// Keywords xgrammar 0.2.9 reads past with a warning (json_schema_converter.cc): the output
// would not be held to them, so a schema that uses them is refused rather than half enforced.
constexpr const char* kUnsupportedKeywords[] = {
    "not",         "if",       "then",        "else",       "dependentRequired", "dependentSchemas",
    "uniqueItems", "contains", "minContains", "maxContains"};

// The formats xgrammar 0.2.9 enforces on its own (JSONFormatToRegexPattern), without a length
// bound; string_format.h builds the others it knows.
constexpr const char* kXgrammarFormats[] = {"duration",      "hostname",
                                            "uri-reference", "uri-template",
                                            "json-pointer",  "relative-json-pointer"};
constexpr const char* kBuiltFormatNames = "email, date, time, date-time, uuid, ipv4, ipv6 and uri";

// A string of a built format in the schema, replaced there by the pattern "^placeholder$".
struct BuiltString {
  std::string placeholder;  // also the name of its grammar's first rule
  std::string format;
  int64_t min_length = 0;
  int64_t max_length = -1;  // -1: none
};

// A JSON schema as xgrammar is to read it: the built strings' formats and lengths replaced by
// placeholders, whose grammars compile_now puts in.
struct PreparedSchema {
  std::string text;
  std::vector<BuiltString> strings;
};

// The largest integer multipleOf xgrammar 0.2.9 enforces (kIntegerMultipleOfMax); it ignores a
// larger one, a fractional one and any on numbers.
constexpr int64_t kMaxIntegerMultipleOf = 1024;

// where + "/" + a + "/" + b, a JSON-pointer-like place in the schema for error messages.
std::string child(const std::string& where, const std::string& a, const std::string& b) {
  std::string out = where;
  out.append("/").append(a).append("/").append(b);
  return out;
}

struct SchemaCheck {
  const CompilerLimits& limits;
  size_t enum_values = 0;

  [[noreturn]] static void fail(const std::string& where, const std::string& what) {
    throw GrammarError("unsupported JSON schema at " + (where.empty() ? "/" : where) + ": " + what);
  }

  // The strings whose format (and length bound) pagedlm builds itself, by placeholder.
  std::vector<BuiltString> built;
  // A prefix of placeholders that the schema's own text does not contain.
  std::string placeholder_prefix;

  // A string's format and length keywords: a format built here (string_format.h) becomes a
  // placeholder pattern, which compile_now replaces with the format's grammar; the others go to
  // xgrammar alone, which cannot bound their length.
  void check_string(json& s, const std::string& where) {
    const bool has_length = s.contains("minLength") || s.contains("maxLength");
    const auto format = s.find("format");
    if (format == s.end() || !may_be_string(s, where)) {
      if (s.contains("pattern") && has_length) {
        fail(where, "'pattern' together with 'minLength' or 'maxLength' is not supported");
      }
      return;
    }
    if (!format->is_string()) fail(where, "'format' must be a string");
    const std::string name = format->get<std::string>();
    if (s.contains("pattern")) {
      fail(where, "'pattern' together with 'format' is not supported");
    }
    if (!is_built_string_format(name)) {
      if (std::find(std::begin(kXgrammarFormats), std::end(kXgrammarFormats), name) ==
          std::end(kXgrammarFormats)) {
        fail(where, "the format " + format->dump() + " is not supported");
      }
      if (has_length) {
        fail(where, "the format " + format->dump() +
                        " together with 'minLength' or 'maxLength' is not supported (lengths are "
                        "enforced beside the formats " +
                        kBuiltFormatNames + ")");
      }
      return;
    }
    BuiltString string{"", name, length(s, "minLength", where).value_or(0),
                       length(s, "maxLength", where).value_or(-1)};
    const auto same = std::find_if(built.begin(), built.end(), [&](const BuiltString& b) {
      return b.format == string.format && b.min_length == string.min_length &&
             b.max_length == string.max_length;
    });
    if (same != built.end()) {
      string.placeholder = same->placeholder;
    } else {
      string.placeholder = placeholder_prefix + std::to_string(built.size());
      built.push_back(string);
    }
    s.erase("format");
    s.erase("minLength");
    s.erase("maxLength");
    s["pattern"] = "^" + string.placeholder + "$";
    // Without a type xgrammar reads the pattern as it read the format: any value, strings
    // unchecked. The value is held to a string of the format (other types are left out).
    if (!s.contains("type")) s["type"] = "string";
  }

  // Whether the schema allows strings by its "type" (absent: any type). A format constrains
  // strings only, so beside a type without "string" it has nothing to do.
  static bool may_be_string(const json& s, const std::string& where) {
    const auto type = s.find("type");
    if (type == s.end()) {
      // xgrammar reads these keywords and not the format beside them.
      for (const char* k : {"enum", "const", "anyOf", "oneOf", "allOf", "$ref"}) {
        if (s.contains(k)) {
          fail(where, std::string("'format' beside '") + k + "' without a 'type' is not supported");
        }
      }
      return true;
    }
    if (type->is_array()) return std::find(type->begin(), type->end(), "string") != type->end();
    return *type == "string";
  }

  // minLength or maxLength: absent, or a non-negative integer.
  static std::optional<int64_t> length(const json& s, const char* key, const std::string& where) {
    const auto it = s.find(key);
    if (it == s.end()) return std::nullopt;
    if (it->is_number_unsigned()) {
      return static_cast<int64_t>(
          std::min<uint64_t>(it->get<uint64_t>(), std::numeric_limits<int64_t>::max()));
    }
    if (!it->is_number_integer() || it->get<int64_t>() < 0) {
      fail(where, std::string("'") + key + "' must be a non-negative integer");
    }
    return it->get<int64_t>();
  }

  // Walks the schema positions of the document (not property names or enum values), rewriting
  // the built formats in place.
  void visit(json& s, const std::string& where) {
    if (s.is_boolean()) return;
    if (!s.is_object()) fail(where, "a schema must be an object or a boolean");
    for (const char* k : kUnsupportedKeywords) {
      if (s.contains(k)) fail(where, std::string("the keyword '") + k + "' is not supported");
    }
    check_string(s, where);
    if (auto it = s.find("multipleOf"); it != s.end()) {
      if (s.value("type", json()) != "integer" || !it->is_number_integer() ||
          it->get<int64_t>() < 1 || it->get<int64_t>() > kMaxIntegerMultipleOf) {
        fail(where, "'multipleOf' is supported on integers only, as an integer from 1 to " +
                        std::to_string(kMaxIntegerMultipleOf));
      }
    }
    if (auto it = s.find("$ref"); it != s.end()) {
      if (!it->is_string() || (*it != "#" && it->get<std::string>().rfind("#/", 0) != 0)) {
        fail(where, "only local '$ref's ('#' or '#/...') are supported");
      }
    }
    if (auto it = s.find("allOf"); it != s.end() && (!it->is_array() || it->size() > 1)) {
      fail(where, "'allOf' with more than one schema is not supported");
    }
    for (const char* k : {"enum"}) {
      if (auto it = s.find(k); it != s.end()) {
        if (!it->is_array()) fail(where, "'enum' must be an array");
        enum_values += it->size();
      }
    }
    if (enum_values > limits.max_enum_values) {
      fail(where, "more than " + std::to_string(limits.max_enum_values) + " enum values");
    }
    for (const char* k : {"properties", "patternProperties", "$defs", "definitions"}) {
      if (auto it = s.find(k); it != s.end()) {
        if (!it->is_object()) fail(where, std::string("'") + k + "' must be an object");
        for (auto& [name, sub] : it->items()) visit(sub, child(where, k, name));
      }
    }
    for (const char* k : {"anyOf", "oneOf", "allOf", "prefixItems"}) {
      if (auto it = s.find(k); it != s.end()) {
        if (!it->is_array()) fail(where, std::string("'") + k + "' must be an array");
        for (size_t i = 0; i < it->size(); ++i) {
          visit((*it)[i], child(where, k, std::to_string(i)));
        }
      }
    }
    for (const char* k : {"items", "additionalProperties", "propertyNames", "unevaluatedProperties",
                          "unevaluatedItems", "additionalItems"}) {
      if (auto it = s.find(k); it != s.end()) {
        if (it->is_array()) {
          for (size_t i = 0; i < it->size(); ++i) {
            visit((*it)[i], child(where, k, std::to_string(i)));
          }
        } else {
          visit(*it, std::string(where).append("/").append(k));
        }
      }
    }
  }
};

// Parses a JSON document, refusing nesting deeper than max_depth before xgrammar (whose schema
// converter recurses) ever sees it.
json parse_bounded(const std::string& text, int max_depth, const char* what) {
  bool too_deep = false;
  json doc = json::parse(
      text,
      [&](int depth, json::parse_event_t, json&) {
        if (depth > max_depth) too_deep = true;
        return true;
      },
      /*allow_exceptions=*/false);
  if (too_deep) {
    throw GrammarError(std::string(what) + " nests deeper than " + std::to_string(max_depth) +
                       " levels");
  }
  if (doc.is_discarded()) throw GrammarError(std::string(what) + " is not valid JSON");
  return doc;
}

// A choice as an EBNF string literal: quotes and backslashes escaped, control characters as \x.
std::string ebnf_literal(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// The tokenizer's vocabulary as xgrammar reads it: each token's bytes; special tokens (chat
// markers, EOS) as "" so that no grammar ever writes them as text.
std::vector<std::string> encoded_vocab(const Tokenizer& tokenizer) {
  std::vector<std::string> vocab(tokenizer.vocab_size());
  for (int32_t id = 0; id < tokenizer.vocab_size(); ++id) {
    if (!tokenizer.is_special(id)) vocab[id] = tokenizer.token_to_bytes(id);
  }
  return vocab;
}

// Everything a compiled grammar depends on, as one string: each field length-prefixed, so
// that no two specs share a key.
std::string spec_key(const GrammarSpec& spec) {
  std::string key;
  const auto add = [&](const std::string& field) {
    key += std::to_string(field.size());
    key += ':';
    key += field;
  };
  key += static_cast<char>('0' + static_cast<int>(spec.kind));
  key += spec.strict ? 's' : 'n';
  add(spec.text);
  add(spec.prefix);
  add(spec.suffix);
  for (const std::string& c : spec.choices) add(c);
  return key;
}

}  // namespace

struct GrammarCompiler::Impl {
  Impl(const Tokenizer& tokenizer, int32_t vocab, std::vector<int32_t> stops, CompilerLimits l)
      : limits(l),
        vocab_size(vocab),
        info(encoded_vocab(tokenizer), xgrammar::VocabType::RAW, vocab, std::move(stops)),
        // One thread per compilation: the request's own thread does the work.
        compiler(info, /*max_threads=*/1, /*cache_enabled=*/true, l.cache_bytes) {}

  // The schema's grammar with each built string's placeholder pattern replaced by the rules of
  // its format and length bound. xgrammar prints a pattern as a Regex(...) expression and reads
  // the printed grammar back, so the swap happens in that text.
  xgrammar::Grammar schema_grammar(const PreparedSchema& schema, bool strict) const {
    // Compact JSON (no free whitespace): fewer tokens, and no run of spaces to get lost in.
    xgrammar::Grammar grammar = xgrammar::Grammar::FromJSONSchema(
        schema.text, /*any_whitespace=*/false, std::nullopt, std::nullopt, strict);
    if (schema.strings.empty()) return grammar;
    std::string ebnf = grammar.ToString();
    std::string rules;
    size_t rules_left = limits.max_format_rules;
    for (const BuiltString& string : schema.strings) {
      const std::string regex = "Regex(\"^" + string.placeholder + "$\", json_string=true)";
      bool used = false;
      for (size_t at = ebnf.find(regex); at != std::string::npos; at = ebnf.find(regex, at)) {
        ebnf.replace(at, regex.size(), string.placeholder);
        used = true;
      }
      // Had xgrammar written the pattern some other way (as a string of its own rules), the
      // placeholder would stand in the grammar as literal text to be written.
      if (ebnf.find("\"" + string.placeholder) != std::string::npos ||
          ebnf.find("^" + string.placeholder) != std::string::npos) {
        throw std::logic_error("xgrammar wrote the pattern of a \"" + string.format +
                               "\" string in a form pagedlm does not replace");
      }
      // A string under an unreferenced definition has no place in the grammar.
      if (!used) continue;
      const std::string built = string_format_ebnf(
          string.format, string.min_length, string.max_length, string.placeholder, rules_left);
      rules_left -= static_cast<size_t>(std::count(built.begin(), built.end(), '\n'));
      rules += built;
    }
    return xgrammar::Grammar::FromEBNF(ebnf + rules, "root");
  }

  xgrammar::CompiledGrammar compile_now(const GrammarSpec& spec, const PreparedSchema& schema) {
    switch (spec.kind) {
      case GrammarSpec::Kind::kJsonObject:
        return compiler.CompileBuiltinJSONGrammar();
      case GrammarSpec::Kind::kJsonSchema: {
        if (spec.prefix.empty() && spec.suffix.empty()) {
          if (!schema.strings.empty()) {
            return compiler.CompileGrammar(schema_grammar(schema, spec.strict));
          }
          return compiler.CompileJSONSchema(schema.text, /*any_whitespace=*/false, std::nullopt,
                                            std::nullopt, spec.strict);
        }
        std::vector<xgrammar::Grammar> parts;
        if (!spec.prefix.empty()) {
          parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.prefix)));
        }
        parts.push_back(schema_grammar(schema, spec.strict));
        if (!spec.suffix.empty()) {
          parts.push_back(xgrammar::Grammar::FromEBNF("root ::= " + ebnf_literal(spec.suffix)));
        }
        return compiler.CompileGrammar(xgrammar::Grammar::Concat(parts));
      }
      case GrammarSpec::Kind::kRegex:
        return compiler.CompileRegex(spec.text);
      case GrammarSpec::Kind::kEbnf:
        return compiler.CompileGrammar(spec.text, "root");
      case GrammarSpec::Kind::kChoice: {
        std::string ebnf = "root ::= ";
        for (size_t i = 0; i < spec.choices.size(); ++i) {
          ebnf += (i ? " | " : "") + ebnf_literal(spec.choices[i]);
        }
        return compiler.CompileGrammar(ebnf, "root");
      }
    }
    throw GrammarError("unknown grammar kind");
  }

  // The grammars compiled last, by spec_key (under mu): a request whose grammar is among them
  // gets it on its own thread at once, without validation, a compile slot or a thread (1-4 us
  // a hit on a 2-core AMD EPYC, against 140-690 us through xgrammar's cache, which takes a compile
  // thread and slot). At most kRecentGrammars of them and a quarter of cache_bytes: they keep
  // their grammars alive after xgrammar's cache has let them go.
  CompiledGrammarPtr recent(const std::string& key) {
    std::lock_guard<std::mutex> lock(mu);
    const auto it = recent_index.find(key);
    if (it == recent_index.end()) return nullptr;
    recent_list.splice(recent_list.begin(), recent_list, it->second);
    return it->second->grammar;
  }
  void remember(const std::string& key, CompiledGrammarPtr grammar) {
    const int64_t bytes = static_cast<int64_t>(key.size() + grammar->grammar.MemorySizeBytes());
    std::lock_guard<std::mutex> lock(mu);
    if (recent_index.count(key) != 0) return;
    recent_list.push_front({key, std::move(grammar), bytes});
    recent_index[key] = recent_list.begin();
    recent_bytes += bytes;
    while (recent_list.size() > kRecentGrammars || recent_bytes > limits.cache_bytes / 4) {
      recent_bytes -= recent_list.back().bytes;
      recent_index.erase(recent_list.back().key);
      recent_list.pop_back();
    }
  }
  static constexpr size_t kRecentGrammars = 64;
  struct Recent {
    std::string key;
    CompiledGrammarPtr grammar;
    int64_t bytes = 0;  // the key's and the grammar's
  };

  CompilerLimits limits;
  int32_t vocab_size;
  xgrammar::TokenizerInfo info;
  xgrammar::GrammarCompiler compiler;
  std::mutex mu;
  std::condition_variable slot_freed;
  int running = 0;  // compilations whose thread has not ended (under mu)
  // Most recently used first (under mu).
  std::list<Recent> recent_list;
  std::unordered_map<std::string, std::list<Recent>::iterator> recent_index;
  int64_t recent_bytes = 0;
};

GrammarCompiler::GrammarCompiler(const Tokenizer& tokenizer, int32_t vocab_size,
                                 std::vector<int32_t> stop_token_ids, CompilerLimits limits) {
  if (vocab_size < tokenizer.vocab_size()) {
    throw GrammarError("the model's vocabulary (" + std::to_string(vocab_size) +
                       ") is smaller than the tokenizer's (" +
                       std::to_string(tokenizer.vocab_size()) + ")");
  }
  impl_ = std::make_shared<Impl>(tokenizer, vocab_size, std::move(stop_token_ids), limits);
}

GrammarCompiler::~GrammarCompiler() = default;

int32_t GrammarCompiler::vocab_size() const { return impl_->vocab_size; }

int64_t GrammarCompiler::cache_bytes() const { return impl_->compiler.GetCacheSizeBytes(); }

CompiledGrammarPtr GrammarCompiler::compile(const GrammarSpec& spec) {
  const CompilerLimits& limits = impl_->limits;
  const char* what = spec.kind == GrammarSpec::Kind::kJsonSchema ? "the JSON schema"
                     : spec.kind == GrammarSpec::Kind::kRegex    ? "the regex"
                                                                 : "the grammar";
  if (spec.text.size() > limits.max_text_bytes) {
    throw GrammarError(std::string(what) + " is longer than " +
                       std::to_string(limits.max_text_bytes) + " bytes");
  }
  const std::string key = spec_key(spec);
  if (CompiledGrammarPtr hit = impl_->recent(key)) return hit;
  PreparedSchema schema;
  switch (spec.kind) {
    case GrammarSpec::Kind::kJsonSchema: {
      // Placeholders are "pagedlmformat" + a number, with as many more "x"s as it takes for
      // the schema not to hold one already.
      std::string prefix = "pagedlmformat";
      while (spec.text.find(prefix) != std::string::npos) prefix += 'x';
      SchemaCheck check{limits, 0, {}, prefix};
      json doc = parse_bounded(spec.text, limits.max_json_depth, what);
      check.visit(doc, "");
      if (check.built.empty()) {
        schema.text = spec.text;
      } else {
        schema.text = doc.dump();
        schema.strings = std::move(check.built);
      }
      break;
    }
    case GrammarSpec::Kind::kRegex:
    case GrammarSpec::Kind::kEbnf:
      if (spec.text.empty()) throw GrammarError(std::string(what) + " is empty");
      break;
    case GrammarSpec::Kind::kChoice: {
      if (spec.choices.empty()) throw GrammarError("choice needs at least one string");
      if (spec.choices.size() > limits.max_enum_values) {
        throw GrammarError("choice has more than " + std::to_string(limits.max_enum_values) +
                           " strings");
      }
      size_t bytes = 0;
      for (const std::string& c : spec.choices) {
        if (c.empty()) throw GrammarError("choice strings must not be empty");
        bytes += c.size();
      }
      if (bytes > limits.max_text_bytes) throw GrammarError("choice strings are too long");
      break;
    }
    case GrammarSpec::Kind::kJsonObject:
      break;
  }

  // The compilation runs on its own thread so that the caller can give up on it after
  // compile_timeout; the thread holds the compiler alive until it ends and then lands its
  // result in the cache.
  const auto deadline = std::chrono::steady_clock::now() + limits.compile_timeout;
  {
    // A slot among max_running_compiles, waited for within the same time bound.
    std::unique_lock<std::mutex> lock(impl_->mu);
    if (!impl_->slot_freed.wait_until(
            lock, deadline, [&] { return impl_->running < limits.max_running_compiles; })) {
      throw GrammarError(std::string(what) + " could not start compiling within " +
                         std::to_string(limits.compile_timeout.count()) +
                         " ms: too many grammars are compiling");
    }
    ++impl_->running;
  }
  auto promise = std::make_shared<std::promise<xgrammar::CompiledGrammar>>();
  std::future<xgrammar::CompiledGrammar> result = promise->get_future();
  std::thread([impl = impl_, spec, schema = std::move(schema), promise] {
    try {
      promise->set_value(impl->compile_now(spec, schema));
    } catch (...) {
      promise->set_exception(std::current_exception());
    }
    {
      std::lock_guard<std::mutex> lock(impl->mu);
      --impl->running;
    }
    impl->slot_freed.notify_one();
  }).detach();
  if (result.wait_until(deadline) != std::future_status::ready) {
    throw GrammarError(std::string(what) + " did not compile within " +
                       std::to_string(limits.compile_timeout.count()) + " ms");
  }
  try {
    auto compiled = std::make_shared<const CompiledGrammar>(result.get());
    impl_->remember(key, compiled);
    return compiled;
  } catch (const GrammarError&) {
    throw;
  } catch (const std::exception& e) {
    // xgrammar reports a bad schema, regex or grammar by throwing with its parser's message.
    throw GrammarError(std::string(what) + " cannot be compiled: " + parser_reason(e.what()));
  }
}

int32_t bitmask_words(int64_t vocab_size) {
  return xgrammar::GetBitmaskSize(static_cast<int>(vocab_size));
}

struct Matcher::Impl {
  explicit Impl(CompiledGrammarPtr g)
      : grammar(std::move(g)),
        matcher(grammar->grammar),
        words(bitmask_words(grammar->grammar.GetTokenizerInfo().GetVocabSize())) {}
  CompiledGrammarPtr grammar;
  xgrammar::GrammarMatcher matcher;
  int64_t words;
};

Matcher::Matcher(CompiledGrammarPtr grammar) : impl_(std::make_unique<Impl>(std::move(grammar))) {}
Matcher::~Matcher() = default;
Matcher::Matcher(Matcher&&) noexcept = default;
Matcher& Matcher::operator=(Matcher&&) noexcept = default;

bool Matcher::fill_mask(int32_t* words) {
  int64_t shape = impl_->words;
  DLTensor t{};
  t.data = words;
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = xgrammar::GetBitmaskDLType();
  t.shape = &shape;
  t.strides = nullptr;
  t.byte_offset = 0;
  return impl_->matcher.FillNextTokenBitmask(&t);
}

bool Matcher::accept(int32_t token) { return impl_->matcher.AcceptToken(token); }

bool Matcher::terminated() const { return impl_->matcher.IsTerminated(); }

int64_t Matcher::vocab_size() const {
  return impl_->grammar->grammar.GetTokenizerInfo().GetVocabSize();
}

}  // namespace pagedlm::grammar
