#include "pagedlm/grammar/string_format.h"

#include <algorithm>
#include <bitset>
#include <cctype>
#include <cstdio>
#include <functional>
#include <limits>
#include <map>
#include <string_view>
#include <utility>
#include <vector>

#include "pagedlm/grammar/grammar.h"

namespace pagedlm::grammar {
namespace {

// Every format here is over ASCII; a set of its characters.
using CharSet = std::bitset<128>;

// "a-zA-Z0-9._~-": single characters and x-y ranges (a '-' last is itself).
CharSet chars(std::string_view spec) {
  CharSet set;
  for (size_t i = 0; i < spec.size(); ++i) {
    if (i + 2 < spec.size() && spec[i + 1] == '-') {
      const auto first = static_cast<unsigned char>(spec[i]);
      const auto last = static_cast<unsigned char>(spec[i + 2]);
      for (size_t c = first; c <= last; ++c) set.set(c);
      i += 2;
    } else {
      set.set(static_cast<unsigned char>(spec[i]));
    }
  }
  return set;
}

// A regular expression as a tree; each use of a subexpression is built anew into the automaton,
// so that one may appear in several places.
struct Re {
  enum class Kind { kChars, kSeq, kAlt, kRepeat };
  Kind kind = Kind::kSeq;
  CharSet set;            // kChars
  std::vector<Re> parts;  // kSeq, kAlt; kRepeat: the one repeated
  int min = 0, max = 0;   // kRepeat; max -1: no upper bound
};

Re cls(std::string_view spec) {
  Re re;
  re.kind = Re::Kind::kChars;
  re.set = chars(spec);
  return re;
}
Re seq(std::vector<Re> parts) {
  Re re;
  re.parts = std::move(parts);
  return re;
}
Re alt(std::vector<Re> parts) {
  Re re;
  re.kind = Re::Kind::kAlt;
  re.parts = std::move(parts);
  return re;
}
Re lit(std::string_view text) {
  std::vector<Re> parts;
  for (char c : text) parts.push_back(cls(std::string_view(&c, 1)));
  return seq(std::move(parts));
}
Re rep(Re part, int min, int max) {
  Re re;
  re.kind = Re::Kind::kRepeat;
  re.parts.push_back(std::move(part));
  re.min = min;
  re.max = max;
  return re;
}
Re opt(Re part) { return rep(std::move(part), 0, 1); }
Re star(Re part) { return rep(std::move(part), 0, -1); }
Re plus(Re part) { return rep(std::move(part), 1, -1); }

// --- The formats (RFC 3339 section 5.6, RFC 5321 section 4.1.2, RFC 4122, RFC 3986) ---

Re digit() { return cls("0-9"); }
Re hexdig() { return cls("0-9A-Fa-f"); }

// full-date: a year from 0001 (Python's and RFC 3339 validators refuse year 0), a month, and a
// day that the month has; 29 February only in leap years.
Re full_date() {
  const Re year =
      alt({seq({cls("1-9"), rep(digit(), 3, 3)}), seq({lit("0"), cls("1-9"), rep(digit(), 2, 2)}),
           seq({lit("00"), cls("1-9"), digit()}), seq({lit("000"), cls("1-9")})});
  // Divisible by 4 and not by 100, or by 400 (0000 is no year here).
  const Re by4 = alt(
      {seq({lit("0"), cls("48")}), seq({cls("2468"), cls("048")}), seq({cls("13579"), cls("26")})});
  const Re leap_year = alt({seq({digit(), digit(), by4}), seq({by4, lit("00")})});
  const Re day28 =
      alt({seq({lit("0"), cls("1-9")}), seq({lit("1"), digit()}), seq({lit("2"), cls("0-8")})});
  const Re day30 = alt({seq({lit("0"), cls("1-9")}), seq({cls("12"), digit()}), lit("30")});
  const Re day31 = alt({day30, lit("31")});
  const Re month31 =
      alt({lit("01"), lit("03"), lit("05"), lit("07"), lit("08"), lit("10"), lit("12")});
  const Re month30 = alt({lit("04"), lit("06"), lit("09"), lit("11")});
  return alt({seq({year, lit("-"), month31, lit("-"), day31}),
              seq({year, lit("-"), month30, lit("-"), day30}), seq({year, lit("-02-"), day28}),
              seq({leap_year, lit("-02-29")})});
}

// full-time: hours, minutes, seconds (no leap second: the validators refuse 60), an optional
// fraction and a zone ("Z" or an offset). T and Z either case, as RFC 3339 allows.
Re full_time() {
  const Re hour = alt({seq({cls("01"), digit()}), seq({lit("2"), cls("0-3")})});
  const Re sixty = seq({cls("0-5"), digit()});
  const Re offset = alt({cls("Zz"), seq({cls("+-"), hour, lit(":"), sixty})});
  return seq({hour, lit(":"), sixty, lit(":"), sixty, opt(seq({lit("."), plus(digit())})), offset});
}

Re uuid() {
  return seq({rep(hexdig(), 8, 8), lit("-"), rep(hexdig(), 4, 4), lit("-"), rep(hexdig(), 4, 4),
              lit("-"), rep(hexdig(), 4, 4), lit("-"), rep(hexdig(), 12, 12)});
}

// dec-octet of RFC 3986: 0 to 255 without a leading zero.
Re ipv4() {
  const Re octet = alt({digit(), seq({cls("1-9"), digit()}), seq({lit("1"), digit(), digit()}),
                        seq({lit("2"), cls("0-4"), digit()}), seq({lit("25"), cls("0-5")})});
  return seq({octet, rep(seq({lit("."), octet}), 3, 3)});
}

// IPv6address of RFC 3986 section 3.2.2: eight 16-bit pieces, one run of them written "::", the
// last two optionally as an IPv4 address.
Re ipv6() {
  const Re h16 = rep(hexdig(), 1, 4);
  const Re h16c = seq({h16, lit(":")});
  const Re ls32 = alt({seq({h16, lit(":"), h16}), ipv4()});
  // [ *n( h16 ":" ) h16 ]: up to n + 1 pieces before the "::".
  const auto before = [&](int n) { return opt(seq({rep(h16c, 0, n), h16})); };
  return alt({seq({rep(h16c, 6, 6), ls32}), seq({lit("::"), rep(h16c, 5, 5), ls32}),
              seq({opt(h16), lit("::"), rep(h16c, 4, 4), ls32}),
              seq({before(1), lit("::"), rep(h16c, 3, 3), ls32}),
              seq({before(2), lit("::"), rep(h16c, 2, 2), ls32}),
              seq({before(3), lit("::"), h16c, ls32}), seq({before(4), lit("::"), ls32}),
              seq({before(5), lit("::"), h16}), seq({before(6), lit("::")})});
}

// Mailbox of RFC 5321 with a dot-string local part (the quoted form needs JSON escapes, whose
// length is not the string's) and a domain of letter-digit-hyphen labels.
Re email() {
  const Re atext = cls("A-Za-z0-9!#$%&'*+/=?^_`{|}~-");
  const Re let_dig = cls("A-Za-z0-9");
  const Re label = seq({let_dig, opt(seq({star(cls("A-Za-z0-9-")), let_dig}))});
  return seq({plus(atext), star(seq({lit("."), plus(atext)})), lit("@"), label,
              star(seq({lit("."), label}))});
}

// URI of RFC 3986 section 3, with a registered-name host (which covers IPv4 addresses; the
// bracketed IP literals are left out).
Re uri() {
  const Re unreserved_or_sub = cls("A-Za-z0-9._~!$&'()*+,;=-");
  const Re pct = seq({lit("%"), hexdig(), hexdig()});
  const Re pchar = alt({unreserved_or_sub, pct, cls(":@")});
  const Re segment = star(pchar);
  const Re path_abempty = star(seq({lit("/"), segment}));
  const Re rootless = seq({plus(pchar), path_abempty});
  const Re userinfo = star(alt({unreserved_or_sub, pct, lit(":")}));
  const Re host = star(alt({unreserved_or_sub, pct}));
  const Re authority =
      seq({opt(seq({userinfo, lit("@")})), host, opt(seq({lit(":"), star(digit())}))});
  const Re hier = alt({seq({lit("//"), authority, path_abempty}), seq({lit("/"), opt(rootless)}),
                       rootless, seq({})});
  const Re query = star(alt({pchar, cls("/?")}));
  return seq({cls("A-Za-z"), star(cls("A-Za-z0-9+.-")), lit(":"), hier, opt(seq({lit("?"), query})),
              opt(seq({lit("#"), query}))});
}

// (format name, its expression)
const std::map<std::string, Re>& formats() {
  static const std::map<std::string, Re> table = {
      {"date", full_date()},
      {"time", full_time()},
      {"date-time", seq({full_date(), cls("Tt"), full_time()})},
      {"uuid", uuid()},
      {"ipv4", ipv4()},
      {"ipv6", ipv6()},
      {"email", email()},
      {"uri", uri()},
  };
  return table;
}

// --- Automata ---

size_t first_char(const CharSet& set) {
  size_t c = 0;
  while (!set.test(c)) ++c;
  return c;
}

// Thompson's construction: each expression between a `from` and a `to` state.
struct Nfa {
  std::vector<std::vector<std::pair<CharSet, int>>> moves;
  std::vector<std::vector<int>> empty_moves;

  int add_state() {
    moves.emplace_back();
    empty_moves.emplace_back();
    return static_cast<int>(moves.size()) - 1;
  }

  void build(const Re& re, int from, int to) {
    switch (re.kind) {
      case Re::Kind::kChars:
        moves[from].emplace_back(re.set, to);
        return;
      case Re::Kind::kSeq: {
        int at = from;
        for (size_t i = 0; i < re.parts.size(); ++i) {
          const int next = i + 1 == re.parts.size() ? to : add_state();
          build(re.parts[i], at, next);
          at = next;
        }
        if (re.parts.empty()) empty_moves[from].push_back(to);
        return;
      }
      case Re::Kind::kAlt:
        for (const Re& part : re.parts) {
          const int a = add_state();
          const int b = add_state();
          empty_moves[from].push_back(a);
          build(part, a, b);
          empty_moves[b].push_back(to);
        }
        return;
      case Re::Kind::kRepeat: {
        int at = from;
        for (int i = 0; i < re.min; ++i) {
          const int next = add_state();
          build(re.parts[0], at, next);
          at = next;
        }
        if (re.max < 0) {
          const int loop = add_state();
          const int back = add_state();
          empty_moves[at].push_back(loop);
          build(re.parts[0], loop, back);
          empty_moves[back].push_back(loop);
          empty_moves[loop].push_back(to);
          return;
        }
        for (int i = re.min; i < re.max; ++i) {
          empty_moves[at].push_back(to);
          const int next = add_state();
          build(re.parts[0], at, next);
          at = next;
        }
        empty_moves[at].push_back(to);
        return;
      }
    }
  }

  std::vector<int> closure(std::vector<int> states) const {
    std::vector<bool> seen(moves.size());
    for (int s : states) seen[s] = true;
    for (size_t i = 0; i < states.size(); ++i) {
      for (int t : empty_moves[states[i]]) {
        if (!seen[t]) {
          seen[t] = true;
          states.push_back(t);
        }
      }
    }
    std::sort(states.begin(), states.end());
    return states;
  }
};

// A deterministic automaton over character classes (sets of characters no NFA move tells
// apart). next[s][k]: the state after class k from s, -1 for none.
struct Dfa {
  std::vector<CharSet> classes;
  std::vector<std::vector<int>> next;
  std::vector<bool> accepting;
  int start = 0;
};

Dfa determinize(const Nfa& nfa, int start, int accept) {
  Dfa dfa;
  dfa.classes.push_back(CharSet().set());
  for (const auto& moves : nfa.moves) {
    for (const auto& [set, to] : moves) {
      std::vector<CharSet> refined;
      for (const CharSet& c : dfa.classes) {
        if ((c & set).any()) refined.push_back(c & set);
        if ((c & ~set).any()) refined.push_back(c & ~set);
      }
      dfa.classes = std::move(refined);
    }
  }
  std::map<std::vector<int>, int> index;
  std::vector<std::vector<int>> sets = {nfa.closure({start})};
  index[sets[0]] = 0;
  for (size_t d = 0; d < sets.size(); ++d) {
    dfa.next.emplace_back(dfa.classes.size(), -1);
    dfa.accepting.push_back(std::binary_search(sets[d].begin(), sets[d].end(), accept));
    for (size_t k = 0; k < dfa.classes.size(); ++k) {
      const size_t c = first_char(dfa.classes[k]);
      std::vector<int> targets;
      for (int s : sets[d]) {
        for (const auto& [set, to] : nfa.moves[s]) {
          if (set.test(c)) targets.push_back(to);
        }
      }
      if (targets.empty()) continue;
      std::vector<int> closed = nfa.closure(std::move(targets));
      auto [it, inserted] = index.emplace(closed, static_cast<int>(sets.size()));
      if (inserted) sets.push_back(std::move(closed));
      dfa.next[d][k] = it->second;
    }
  }
  return dfa;
}

// Moore's partition refinement: states with the same future merged, so that the grammar has one
// rule per distinct future and length.
Dfa minimize(const Dfa& dfa) {
  const size_t n = dfa.next.size();
  std::vector<int> part(n);
  for (size_t s = 0; s < n; ++s) part[s] = dfa.accepting[s] ? 1 : 0;
  for (size_t parts = 0;;) {
    std::map<std::vector<int>, int> ids;
    std::vector<int> refined(n);
    for (size_t s = 0; s < n; ++s) {
      std::vector<int> signature = {part[s]};
      for (int t : dfa.next[s]) signature.push_back(t < 0 ? -1 : part[t]);
      refined[s] = ids.emplace(std::move(signature), static_cast<int>(ids.size())).first->second;
    }
    part = std::move(refined);
    if (ids.size() == parts) break;
    parts = ids.size();
  }
  Dfa out;
  out.classes = dfa.classes;
  const int count = *std::max_element(part.begin(), part.end()) + 1;
  out.next.assign(count, std::vector<int>(dfa.classes.size(), -1));
  out.accepting.assign(count, false);
  for (size_t s = 0; s < n; ++s) {
    out.accepting[part[s]] = dfa.accepting[s];
    for (size_t k = 0; k < dfa.classes.size(); ++k) {
      if (dfa.next[s][k] >= 0) out.next[part[s]][k] = part[dfa.next[s][k]];
    }
  }
  out.start = part[dfa.start];
  return out;
}

// An EBNF character class; all but letters and digits as \u escapes, which nothing after them
// can extend.
std::string char_class(const CharSet& set) {
  std::string out = "[";
  const auto put = [&](size_t c) {
    if (std::isalnum(static_cast<int>(c)) != 0) {
      out += static_cast<char>(c);
    } else {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04zx", c);
      out += buf;
    }
  };
  for (size_t c = 0; c < set.size(); ++c) {
    if (!set.test(c)) continue;
    size_t end = c;
    while (end + 1 < set.size() && set.test(end + 1)) ++end;
    put(c);
    if (end > c + 1) out += '-';
    if (end > c) put(end);
    c = end;
  }
  return out + "]";
}

Dfa format_automaton(const std::string& format) {
  static const std::map<std::string, Dfa> automata = [] {
    std::map<std::string, Dfa> out;
    for (const auto& [name, re] : formats()) {
      Nfa nfa;
      const int start = nfa.add_state();
      const int accept = nfa.add_state();
      nfa.build(re, start, accept);
      out.emplace(name, minimize(determinize(nfa, start, accept)));
    }
    return out;
  }();
  return automata.at(format);
}

// The length of the longest string the automaton accepts; -1 when there is none, the accepted
// strings running through a cycle.
int64_t longest(const Dfa& dfa) {
  const size_t n = dfa.next.size();
  // Longest accepted suffix from each state (-2: none), by depth-first search; a state met
  // again while on the path closes a cycle.
  std::vector<int64_t> suffix(n, -3);  // -3: not visited, -4: on the path
  bool cycle = false;
  const std::function<int64_t(int)> visit = [&](int q) -> int64_t {
    if (suffix[q] == -4) {
      cycle = true;
      return -2;
    }
    if (suffix[q] != -3) return suffix[q];
    suffix[q] = -4;
    int64_t best = dfa.accepting[q] ? 0 : -2;
    for (int t : dfa.next[q]) {
      if (t < 0) continue;
      const int64_t after = visit(t);
      if (after >= 0) best = std::max(best, after + 1);
    }
    suffix[q] = best;
    return best;
  };
  const int64_t from_start = visit(dfa.start);
  return cycle ? -1 : std::max<int64_t>(from_start, -1);
}

}  // namespace

bool is_built_string_format(const std::string& format) { return formats().count(format) != 0; }

std::string string_format_ebnf(const std::string& format, int64_t min_length, int64_t max_length,
                               const std::string& rule, size_t max_rules) {
  if (!is_built_string_format(format)) {
    throw GrammarError("the format \"" + format + "\" has no built grammar");
  }
  const Dfa dfa = format_automaton(format);
  const std::string bound =
      "from " + std::to_string(min_length) +
      (max_length < 0 ? " characters up" : " to " + std::to_string(max_length) + " characters");
  // A bound past the format's longest string is no bound; one past int32 neither, in practice
  // (no reply gets that long; xgrammar reads maxLength so too).
  const int64_t most = longest(dfa);
  if (most >= 0 && (max_length < 0 || max_length > most)) max_length = most;
  if (max_length > std::numeric_limits<int32_t>::max()) max_length = -1;
  // The counter: characters so far, up to max_length; with no upper bound it stops at
  // min_length, past which every length is as good.
  const int64_t top = max_length < 0 ? min_length : max_length;
  const auto states = static_cast<int64_t>(dfa.next.size());
  // Each count from 0 to top has a rule on the way to a long enough string, so a top past
  // max_rules is refused before the product (states * top pairs) is laid out.
  if (static_cast<uint64_t>(top) >= max_rules) {
    throw GrammarError("a \"" + format + "\" string of " + bound + " needs over " +
                       std::to_string(top) + " grammar rules, more than the " +
                       std::to_string(max_rules) + " allowed");
  }
  if (top >= (int64_t{1} << 24) / states) {
    throw GrammarError("a \"" + format + "\" string of " + bound +
                       " needs too large a grammar to enforce");
  }
  const auto id = [&](int q, int64_t i) { return static_cast<int64_t>(q) * (top + 1) + i; };
  const auto step = [&](int64_t i) -> int64_t {
    if (max_length < 0) return std::min(i + 1, top);
    return i + 1 <= top ? i + 1 : -1;
  };
  const size_t total = static_cast<size_t>((top + 1) * states);
  // Forward from (start, 0), then backward from the accepting pairs among those reached.
  std::vector<bool> reached(total, false);
  std::vector<std::vector<int64_t>> into(total);
  std::vector<int64_t> order = {id(dfa.start, 0)};
  reached[order[0]] = true;
  for (size_t at = 0; at < order.size(); ++at) {
    const int q = static_cast<int>(order[at] / (top + 1));
    const int64_t i = order[at] % (top + 1);
    const int64_t j = step(i);
    if (j < 0) continue;
    for (int t : dfa.next[q]) {
      if (t < 0) continue;
      const int64_t to = id(t, j);
      into[to].push_back(order[at]);
      if (!reached[to]) {
        reached[to] = true;
        order.push_back(to);
      }
    }
  }
  std::vector<bool> live(total, false);
  std::vector<int64_t> work;
  for (int64_t s : order) {
    if (dfa.accepting[s / (top + 1)] && s % (top + 1) >= min_length) {
      live[s] = true;
      work.push_back(s);
    }
  }
  for (size_t at = 0; at < work.size(); ++at) {
    for (int64_t from : into[work[at]]) {
      if (!live[from]) {
        live[from] = true;
        work.push_back(from);
      }
    }
  }
  if (!live[order[0]]) {
    throw GrammarError("no \"" + format + "\" string has a length " + bound);
  }
  std::vector<int64_t> kept;
  for (int64_t s : order) {
    if (live[s]) kept.push_back(s);
  }
  if (kept.size() > max_rules) {
    throw GrammarError("a \"" + format + "\" string of " + bound + " needs " +
                       std::to_string(kept.size()) + " grammar rules, more than the " +
                       std::to_string(max_rules) + " allowed");
  }
  std::map<int64_t, size_t> number;
  for (int64_t s : kept) number.emplace(s, number.size());
  const auto name = [&](int64_t s) {
    const size_t n = number.at(s);
    return n == 0 ? rule : rule + "_" + std::to_string(n);
  };
  std::string ebnf;
  for (int64_t s : kept) {
    const int q = static_cast<int>(s / (top + 1));
    const int64_t i = s % (top + 1);
    const int64_t j = step(i);
    // The classes that lead to each live target, joined.
    std::map<int64_t, CharSet> by_target;
    if (j >= 0) {
      for (size_t k = 0; k < dfa.classes.size(); ++k) {
        const int t = dfa.next[q][k];
        if (t >= 0 && live[id(t, j)]) by_target[id(t, j)] |= dfa.classes[k];
      }
    }
    std::string alternatives;
    for (const auto& [target, set] : by_target) {
      alternatives += (alternatives.empty() ? "" : " | ") + char_class(set) + " " + name(target);
    }
    if (dfa.accepting[q] && i >= min_length)
      alternatives += alternatives.empty() ? "\"\"" : " | \"\"";
    ebnf += name(s) + " ::= " + alternatives + "\n";
  }
  return ebnf;
}

}  // namespace pagedlm::grammar
