// Parsing JSON that comes from outside (request bodies, model files, model output) with a bound
// on its nesting depth, in time linear in the text whatever its shape.
//
// Depth: nlohmann's parser is iterative, but everything done with the value it returns (copies,
// dump, comparisons, conversion to Jinja values, our schema walkers) recurses once per level, so
// a 40 KB body of nested brackets would overflow the stack of whichever thread touches it. Text
// that nests deeper than the bound is refused before any such walk.
//
// Time: the bound is checked by our own SAX handler, not by nlohmann's callback parser
// (`Json::parse(text, callback)`): after every object that closes, that parser scans the
// enclosing container from its start for a discarded element, so `[{},{},...]` or
// `{"k0":{},"k1":{},...}` parse in time quadratic in their length (2-core Intel Xeon,
// 2026-12-02: 40,000 `{}` in an array 5.7 s, as values of an object 61 s; 330,000 of them in
// a 990 KB body over a minute). The handler below builds the same value in one pass. An
// ordered_json object (request bodies keep their key order) is a vector of pairs whose
// operator[] searches it from the start, so keys are appended directly and found again through
// a hash index while their object is open: 200,000 keys took 59 s the other way.
//
// Abandoning: a server that shuts down has no use for the value of a body still being parsed
// (8 MB of `{}` take seconds and hundreds of MB), so the parse can watch a flag and stop at
// the next value once it is up.
#pragma once

#include <atomic>
#include <functional>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_map>
#include <utility>
#include <vector>

#include "pagedlm/core/error.h"

namespace pagedlm {

// Far deeper than any real request, config or tokenizer file (they nest a handful of levels),
// and shallow enough that a recursive walk stays a few hundred frames from the stack's end.
inline constexpr int kMaxJsonDepth = 128;

namespace json_detail {

// nlohmann's SAX interface (json::sax_parse), building the value as nlohmann's DOM parser does
// (a repeated key keeps its last value) and refusing containers past `max_depth`. `path_`
// holds the containers being filled, innermost last; an element is added only to the
// innermost, so pointers into outer ones stay valid while it grows.
template <typename Json>
class BoundedDomBuilder {
 public:
  using number_integer_t = typename Json::number_integer_t;
  using number_unsigned_t = typename Json::number_unsigned_t;
  using number_float_t = typename Json::number_float_t;
  using string_t = typename Json::string_t;
  using binary_t = typename Json::binary_t;

  // Each callback returns false, which ends sax_parse, once `abandon` (when given) is up.
  BoundedDomBuilder(Json& root, int max_depth, const std::atomic<bool>* abandon)
      : root_(root), max_depth_(max_depth), abandon_(abandon) {}

  bool null() { return go_on() && add(Json(nullptr)) != nullptr; }
  bool boolean(bool value) { return go_on() && add(Json(value)) != nullptr; }
  bool number_integer(number_integer_t value) { return go_on() && add(Json(value)) != nullptr; }
  bool number_unsigned(number_unsigned_t value) { return go_on() && add(Json(value)) != nullptr; }
  bool number_float(number_float_t value, const string_t& /*text*/) {
    return go_on() && add(Json(value)) != nullptr;
  }
  bool string(string_t& value) { return go_on() && add(Json(std::move(value))) != nullptr; }
  bool binary(binary_t& value) { return go_on() && add(Json::binary(std::move(value))) != nullptr; }

  bool start_object(std::size_t /*elements*/) { return go_on() && open(Json::object()); }
  bool start_array(std::size_t /*elements*/) { return go_on() && open(Json::array()); }
  bool end_object() { return go_on() && close(); }
  bool end_array() { return go_on() && close(); }

  bool key(string_t& name) {
    key_ = std::move(name);
    return go_on();
  }

  template <class Exception>
  bool parse_error(std::size_t /*position*/, const std::string& /*last_token*/,
                   const Exception& error) {
    throw error;
  }

 private:
  // Where an open ordered object's keys sit, by their hash: a repeated key is found without a
  // search, and no key is copied. Empty for other containers.
  using KeyIndex = std::unordered_map<std::size_t, std::size_t>;
  static constexpr bool kOrderedObjects = std::is_same_v<Json, nlohmann::ordered_json>;

  struct Open {
    Json* container;
    KeyIndex keys;
  };

  // A relaxed load per value: nothing is read through the flag, and a parse that sees it a few
  // values late only does those few more.
  bool go_on() const { return abandon_ == nullptr || !abandon_->load(std::memory_order_relaxed); }

  Json* add(Json&& value) {
    if (path_.empty()) {
      root_ = std::move(value);
      return &root_;
    }
    Open& open = path_.back();
    Json& parent = *open.container;
    if (parent.is_array()) {
      auto& elements = parent.template get_ref<typename Json::array_t&>();
      elements.push_back(std::move(value));
      return &elements.back();
    }
    auto& members = parent.template get_ref<typename Json::object_t&>();
    if constexpr (kOrderedObjects) {
      // A repeated key keeps its last value, in its first place, as ordered_json's parser does.
      auto& entries = static_cast<typename Json::object_t::Container&>(members);
      const auto [it, added] = open.keys.try_emplace(std::hash<string_t>{}(key_), entries.size());
      if (!added) {
        // The same hash: the same key but for a collision, where the search is the fallback.
        std::size_t at = it->second;
        if (entries[at].first != key_) {
          at = 0;
          while (at < entries.size() && entries[at].first != key_) ++at;
        }
        if (at < entries.size()) {
          entries[at].second = std::move(value);
          return &entries[at].second;
        }
      }
      entries.emplace_back(std::move(key_), std::move(value));
      return &entries.back().second;
    } else {
      Json& slot = members[key_];  // a repeated key keeps its last value
      slot = std::move(value);
      return &slot;
    }
  }

  bool open(Json&& container) {
    if (static_cast<int>(path_.size()) >= max_depth_) {
      fail("JSON nested deeper than ", max_depth_, " levels");
    }
    path_.push_back(Open{add(std::move(container)), {}});
    return true;
  }

  bool close() {
    path_.pop_back();
    return true;
  }

  Json& root_;
  const int max_depth_;
  const std::atomic<bool>* abandon_;
  std::vector<Open> path_;
  string_t key_;
};

}  // namespace json_detail

// What parse_json throws when its `abandon` flag came up before the text's end.
class JsonParseAbandoned : public std::runtime_error {
 public:
  JsonParseAbandoned() : std::runtime_error("JSON parse abandoned") {}
};

// Parses `text`. Throws pagedlm::Error when arrays and objects nest more than `max_depth`
// levels, and a nlohmann exception when the text is not JSON: parse_error, or out_of_range for
// a number too large for a double (1e999). With `abandon`, the parse looks at it before each
// value and key, and throws JsonParseAbandoned once it is up.
template <typename Json = nlohmann::json>
Json parse_json(std::string_view text, int max_depth = kMaxJsonDepth,
                const std::atomic<bool>* abandon = nullptr) {
  Json root;
  json_detail::BoundedDomBuilder<Json> builder(root, max_depth, abandon);
  if (!Json::sax_parse(text, &builder)) throw JsonParseAbandoned();
  return root;
}

// The same, for callers that treat bad text as "not JSON": a discarded value (is_discarded())
// for malformed or too deep text instead of an exception.
template <typename Json = nlohmann::json>
Json try_parse_json(std::string_view text, int max_depth = kMaxJsonDepth) {
  try {
    return parse_json<Json>(text, max_depth);
  } catch (const Error&) {
  } catch (const typename Json::exception&) {
  }
  return Json(Json::value_t::discarded);
}

}  // namespace pagedlm
