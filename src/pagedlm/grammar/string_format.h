// The JSON-schema string formats whose grammar pagedlm builds itself, so that a format and a
// length bound hold together: xgrammar 0.2.9 enforces a format and drops minLength/maxLength
// beside it. Its format expressions also admit strings that RFC 3339 and RFC 3986 reject (30
// February, IPv4 octets with a leading zero) and the second 60, which RFC 3339 allows at a leap
// second only and the usual validators (rfc3339-validator, which jsonschema checks with) refuse.
//
// Each format is a regular language over printable ASCII, so that a string's length in
// characters (what minLength and maxLength count) is its length in bytes, and a string needs no
// JSON escape. The language runs through a deterministic automaton, which is crossed with a
// character counter: its states (state, characters so far) become the rules of a right-linear
// EBNF grammar that accepts exactly the format's strings whose length lies in the bound.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace pagedlm::grammar {

// Whether `format` is one of those built here: email, date, time, date-time, uuid, ipv4, ipv6,
// uri.
bool is_built_string_format(const std::string& format);

// EBNF rules for the strings of `format` (without the JSON quotes) of min_length to max_length
// characters (max_length < 0: no upper bound). The first rule is named `rule`; the others
// start with `rule` + "_". Throws GrammarError when no string of the format has such a length,
// or when the grammar would need more than max_rules rules.
std::string string_format_ebnf(const std::string& format, int64_t min_length, int64_t max_length,
                               const std::string& rule, size_t max_rules);

}  // namespace pagedlm::grammar
