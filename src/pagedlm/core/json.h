// Parsing JSON that comes from outside (request bodies, model files, model output) with a bound
// on its nesting depth. nlohmann's parser is iterative, but everything done with the value it
// returns (copies, dump, comparisons, conversion to Jinja values, our schema walkers) recurses
// once per level, so a 40 KB body of nested brackets would overflow the stack of whichever
// thread touches it. Text that nests deeper than the bound is refused before any such walk.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>

#include "pagedlm/core/error.h"

namespace pagedlm {

// Far deeper than any real request, config or tokenizer file (they nest a handful of levels),
// and shallow enough that a recursive walk stays a few hundred frames from the stack's end.
inline constexpr int kMaxJsonDepth = 128;

// Parses `text`. Throws pagedlm::Error when arrays and objects nest more than `max_depth`
// levels, and a nlohmann exception when the text is not JSON: parse_error, or out_of_range for
// a number too large for a double (1e999).
template <typename Json = nlohmann::json>
Json parse_json(std::string_view text, int max_depth = kMaxJsonDepth) {
  // The callback sees each container open at its depth (0 for the root) before anything
  // inside it is parsed, so the deep part is never built.
  auto bound = [max_depth](int depth, typename Json::parse_event_t event, Json&) {
    const bool opens =
        event == Json::parse_event_t::object_start || event == Json::parse_event_t::array_start;
    if (opens && depth >= max_depth) fail("JSON nested deeper than ", max_depth, " levels");
    return true;
  };
  return Json::parse(text, bound);
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
