// Constrained decoding: a request's output held to a JSON schema, a regex, a list of choices or
// an EBNF grammar. xgrammar (built from its pinned PyPI sdist, scripts/fetch_xgrammar.sh) does the
// work: it compiles a grammar against the tokenizer's vocabulary once, and a per-request matcher
// then gives, at each step, the bitmask of tokens that keep the output inside the grammar.
//
// This layer sits on the tokenizer (it reads the vocabulary's bytes) and below the engine, which
// hands each step's masks to the sampler; it knows nothing of devices or the scheduler.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace pagedlm {
class Tokenizer;
}

namespace pagedlm::grammar {

// A grammar the client asked for that cannot be used (malformed, unsupported, too large, too
// slow to compile): the server answers 400 with what().
class GrammarError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct GrammarSpec {
  enum class Kind { kJsonObject, kJsonSchema, kRegex, kChoice, kEbnf };
  Kind kind = Kind::kJsonObject;
  std::string text;                  // the schema, regex or EBNF (root rule "root")
  std::vector<std::string> choices;  // kChoice: the output is exactly one of these
  // kJsonSchema: OpenAI's strict. xgrammar's strict mode treats absent additionalProperties and
  // additionalItems as false; off, they follow JSON Schema (anything allowed).
  bool strict = false;
  // kJsonSchema: literal text before and after the JSON (a tool call's tags).
  std::string prefix, suffix;
};

struct CompilerLimits {
  size_t max_text_bytes = size_t{1} << 18;  // a schema, regex or grammar
  int max_json_depth = 32;                  // nesting of the schema document itself
  size_t max_enum_values = 1024;            // enum members and choices, in total
  // Rules of the grammars pagedlm builds for string formats with a length bound
  // (string_format.h), in one schema: up to (maxLength + 1) times the format's automaton states
  // (email 5, uri 21, ipv6 151). xgrammar compiles such a rule in 0.2-6 ms (email and uri the
  // slowest: most tokens fit their characters), so an email of up to 254 characters (1257 rules)
  // takes some 5 s on a loaded 2-core Xeon.
  size_t max_format_rules = 2048;
  // Compiled grammars kept (xgrammar's own cache, least recently used out first).
  int64_t cache_bytes = int64_t{256} << 20;
  std::chrono::milliseconds compile_timeout{10000};
  // Compilations running at once, timed-out ones that are still finishing included: a flood of
  // pathological schemas gets errors, not a pile of threads.
  int max_running_compiles = 4;
};

class CompiledGrammar;
using CompiledGrammarPtr = std::shared_ptr<const CompiledGrammar>;

// Compiles specs for one tokenizer (so the cache is keyed by the spec and, through the compiler,
// the tokenizer). Thread safe; compile() runs on the caller's thread, never the engine's.
class GrammarCompiler {
 public:
  // vocab_size: the model's logits width (>= the tokenizer's; the extra ids are never allowed).
  // stop_token_ids: the tokens that end a finished output (the model's EOS ids).
  GrammarCompiler(const Tokenizer& tokenizer, int32_t vocab_size,
                  std::vector<int32_t> stop_token_ids, CompilerLimits limits = {});
  ~GrammarCompiler();

  // Validates, compiles (or finds in the cache) and returns the grammar; throws GrammarError.
  CompiledGrammarPtr compile(const GrammarSpec& spec);

  int32_t vocab_size() const;
  int64_t cache_bytes() const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;  // shared with compilations that outlive a timeout
};

// int32 words of a token bitmask for a vocabulary: bit (t % 32) of word t / 32 set = token t
// allowed.
int32_t bitmask_words(int64_t vocab_size);
// Whether a bitmask of that layout allows `token`.
inline bool bitmask_allows(const int32_t* words, int32_t token) {
  return ((static_cast<uint32_t>(words[token / 32]) >> (token % 32)) & 1u) != 0;
}

// One request's position in its grammar. Not thread safe; lives on the engine thread.
class Matcher {
 public:
  explicit Matcher(CompiledGrammarPtr grammar);
  ~Matcher();
  Matcher(Matcher&&) noexcept;
  Matcher& operator=(Matcher&&) noexcept;

  // Writes the allowed-token bitmask (bitmask_words(vocab) words). Returns false when every
  // token is allowed (the mask need not be applied).
  bool fill_mask(int32_t* words);
  // Advances past a sampled token; false if the grammar does not allow it (nothing changes).
  bool accept(int32_t token);
  // The grammar is complete and a stop token was accepted.
  bool terminated() const;
  // The logits width the grammar was compiled for.
  int64_t vocab_size() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedlm::grammar
