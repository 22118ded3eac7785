// pagedlm generate: runs prompts (text, chat or token ids) through one continuous batch and
// prints what each produced; a single prompt streams. Ctrl-C stops it within a step with what
// each prompt produced so far.
#include <chrono>
#include <cstdlib>
#include <fstream>
#include <map>
#include <optional>
#include <sstream>

#include "pagedlm/cli/commands.h"
#include "pagedlm/cli/interrupt.h"
#include "pagedlm/cli/model_path.h"
#include "pagedlm/core/file.h"
#include "pagedlm/engine/stop_strings.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/grammar/grammar.h"

namespace pagedlm::cli {

namespace {

std::vector<int32_t> parse_token_list(const std::string& text) {
  std::istringstream in(text);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    size_t used = 0;
    long long v = -1;
    try {
      v = std::stoll(word, &used);
    } catch (const std::logic_error&) {
      used = 0;
    }
    PAGEDLM_CHECK(used == word.size() && v >= 0 && v <= INT32_MAX, "bad token id '", word,
                  "' in --tokens");
    ids.push_back(static_cast<int32_t>(v));
  }
  PAGEDLM_CHECK(!ids.empty(), "--tokens holds no token ids");
  return ids;
}

std::vector<std::string> read_lines(const std::string& path) {
  std::ifstream in(path);
  PAGEDLM_CHECK(in.good(), "cannot read prompts file ", path);
  std::vector<std::string> lines;
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  PAGEDLM_CHECK(!lines.empty(), "prompts file ", path, " holds no prompts");
  return lines;
}

std::string token_ids_text(const std::vector<int32_t>& ids) {
  std::string text = "tokens:";
  for (int32_t t : ids) text += " " + std::to_string(t);
  return text;
}

const char* reason_name(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
    case FinishReason::kNone:
      break;
  }
  return "none";
}

void print_cache(const Engine& engine, bool page_tables) {
  if (page_tables) {
    std::printf(
        "--- KV cache: page tables (* = page shared with another sequence, - = released behind "
        "the window, p<-s:n = page p got its first n tokens copied from cached page s)\n");
  }
  for (const SequenceView& s : page_tables ? engine.sequence_map() : std::vector<SequenceView>{}) {
    std::printf("seq %lld: %d tokens, %d from the prefix cache, pages [",
                static_cast<long long>(s.request_id), s.num_tokens, s.num_cached_tokens);
    for (size_t i = 0; i < s.pages.size(); ++i) {
      if (i) std::printf(" ");
      if (s.pages[i] == SequenceView::kReleasedPage) {
        std::printf("-");
      } else if (static_cast<int32_t>(i) == s.copy_page_index) {
        std::printf("%d<-%d:%d%s", s.pages[i], s.copy_src_page, s.num_copied_tokens,
                    s.page_shared[i] ? "*" : "");
      } else {
        std::printf("%d%s", s.pages[i], s.page_shared[i] ? "*" : "");
      }
    }
    std::printf("]\n");
  }
  const SchedulerStats st = engine.stats();
  std::printf(
      "pages: %d total, %d used, %d free (%d cached); prefix cache: %lld of %lld prompt tokens "
      "hit (%lld copied by %lld partial-page hits); %lld preemptions\n",
      st.pages_total, st.pages_used, st.pages_free, st.pages_cached,
      static_cast<long long>(st.prefix_hit_tokens), static_cast<long long>(st.prefix_query_tokens),
      static_cast<long long>(st.prefix_partial_hit_tokens),
      static_cast<long long>(st.prefix_partial_hits), static_cast<long long>(st.preemptions));
}

struct Args {
  std::string model, prompts_file, system, chat_template, json_schema, grammar;
  std::vector<std::string> prompts, token_prompts, stop;
  bool chat = false, show_cache = false;
  SamplingParams sampling;
  uint64_t seed = 0;
  EngineFlags flags;
};

// The prompt token ids, from text (optionally through the chat template) or given directly.
std::vector<std::vector<int32_t>> build_prompts(const Args& args, const TextModel& model,
                                                std::vector<std::string>* labels) {
  std::vector<std::vector<int32_t>> prompts;
  std::vector<std::string> texts = args.prompts;
  if (!args.prompts_file.empty()) {
    for (std::string& line : read_lines(args.prompts_file)) texts.push_back(std::move(line));
  }
  PAGEDLM_CHECK(texts.empty() || model.tokenizer, "the model has no tokenizer: use --tokens");
  for (const std::string& text : texts) {
    labels->push_back(text);
    if (!args.chat) {
      prompts.push_back(model.tokenizer->encode(text));
      continue;
    }
    PAGEDLM_CHECK(model.chat_template.has_value(), "--chat: the model has no chat template");
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (!args.system.empty()) messages.push_back({{"role", "system"}, {"content", args.system}});
    messages.push_back({{"role", "user"}, {"content", text}});
    prompts.push_back(model.tokenizer->encode(model.chat_template->render(messages, true)));
  }
  for (const std::string& ids : args.token_prompts) {
    labels->push_back("tokens: " + ids);
    prompts.push_back(parse_token_list(ids));
  }
  PAGEDLM_CHECK(!prompts.empty(), "give at least one --prompt, --prompts-file or --tokens");
  return prompts;
}

// One request's text as it streams: detokenized without splitting characters, cut at the
// first stop string.
struct TextOutput {
  TextOutput(const Tokenizer& tokenizer, const std::vector<std::string>& stop)
      : decoder(tokenizer, /*skip_special_tokens=*/true), matcher(stop) {}
  // Returns the newly printable text.
  std::string push(int32_t token) { return keep(matcher.push(decoder.push(token))); }
  std::string finish() {
    std::string tail = matcher.stopped() ? std::string() : decoder.finish();
    return keep(matcher.push(tail) + matcher.finish());
  }
  std::string keep(std::string piece) {
    text += piece;
    return piece;
  }
  StreamDecoder decoder;
  StopStringMatcher matcher;
  std::string text;
};

void run_generate(const Args& args) {
  // Ctrl-C ends the load and the engine's start-up at once; from the first step on it stops
  // with what each prompt produced so far, within a step (between two layers of a long CPU step).
  catch_stop_signals();
  std::optional<StopSignalsEndAtOnce> starting(std::in_place);
  const EngineOptions options = args.flags.resolve();  // a bad --device fails before the load
  TextModel model = load_text_model(resolve_model_path(args.model), progress_bar());
  if (!args.chat_template.empty()) replace_chat_template(model, args.chat_template);
  std::vector<std::string> labels;
  const auto prompts = build_prompts(args, model, &labels);
  const Tokenizer* tokenizer = model.tokenizer.get();
  PAGEDLM_CHECK(args.stop.empty() || tokenizer, "--stop needs a model with a tokenizer");
  // --json-schema / --grammar: every output is held to it (compiled once for all prompts).
  grammar::CompiledGrammarPtr constraint;
  if (!args.json_schema.empty() || !args.grammar.empty()) {
    PAGEDLM_CHECK(args.json_schema.empty() || args.grammar.empty(),
                  "give --json-schema or --grammar, not both");
    PAGEDLM_CHECK(tokenizer, "--json-schema and --grammar need a model with a tokenizer");
    grammar::GrammarSpec spec;
    spec.kind = args.json_schema.empty() ? grammar::GrammarSpec::Kind::kEbnf
                                         : grammar::GrammarSpec::Kind::kJsonSchema;
    spec.text = read_file(args.json_schema.empty() ? args.grammar : args.json_schema);
    spec.strict = true;
    grammar::GrammarCompiler compiler(*tokenizer,
                                      static_cast<int32_t>(model.checkpoint.config.vocab_size),
                                      model.checkpoint.config.eos_token_ids);
    try {
      constraint = compiler.compile(spec);
    } catch (const grammar::GrammarError& e) {
      fail(args.json_schema.empty() ? "--grammar: " : "--json-schema: ", e.what());
    }
  }
  if (ran_as_worker_rank(model.checkpoint, options)) return;
  Engine engine(model.checkpoint, options);
  model.checkpoint.release_weights();
  engine.set_abandon_check([] { return stop_signal() != 0; });
  starting.reset();
  std::vector<int64_t> ids;
  std::map<int64_t, TextOutput> texts;
  for (const auto& prompt : prompts) {
    Request r;
    r.prompt = prompt;
    r.sampling = args.sampling;
    if (args.seed != 0 || args.sampling.temperature > 0) r.sampling.seed = args.seed;
    const int64_t id = engine.add_request(std::move(r));
    if (constraint) engine.set_grammar(id, constraint);
    ids.push_back(id);
    if (tokenizer)
      texts.emplace(std::piecewise_construct, std::forward_as_tuple(id),
                    std::forward_as_tuple(*tokenizer, args.stop));
  }
  const bool stream = ids.size() == 1 && tokenizer != nullptr;
  std::map<int64_t, bool> stopped_by_string;
  const auto start = std::chrono::steady_clock::now();
  int64_t generated = 0;
  bool cache_shown = false;
  while (engine.has_unfinished() && stop_signal() == 0) {
    for (const RequestEvent& e : engine.step()) {
      if (e.token < 0) continue;
      ++generated;
      auto it = texts.find(e.request_id);
      if (it == texts.end()) continue;
      const std::string piece = it->second.push(e.token);
      if (stream) {
        std::fputs(piece.c_str(), stdout);
        std::fflush(stdout);
      }
      // A stop string ends the request at once: its pages go back to the pool.
      if (it->second.matcher.stopped() && !e.finished && engine.cancel(e.request_id)) {
        stopped_by_string[e.request_id] = true;
      }
    }
    // Once every prompt is in the cache, the page tables show what is shared.
    if (args.show_cache && !cache_shown && engine.stats().num_waiting == 0) {
      if (stream) std::printf("\n");
      print_cache(engine, /*page_tables=*/true);
      cache_shown = true;
    }
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  // Interrupted: the unfinished requests end here, with what they have (those of a step left
  // midway have ended already).
  const bool interrupted = stop_signal() != 0;
  if (interrupted) {
    for (const int64_t id : ids) engine.cancel(id);
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    RequestOutput out = engine.take_output(ids[i]);
    auto text = texts.find(ids[i]);
    if (text != texts.end()) {
      const std::string tail = text->second.finish();
      if (stream) std::printf("%s\n", tail.c_str());
    }
    if (!stream) {
      std::printf(
          "=== [%zu] %s\n%s\n", i + 1, labels[i].c_str(),
          text != texts.end() ? text->second.text.c_str() : token_ids_text(out.tokens).c_str());
    }
    const bool by_string = stopped_by_string.count(ids[i]) != 0;
    const bool cut_short = interrupted && out.reason == FinishReason::kCancelled;
    std::printf("(finish: %s; %zu prompt tokens, %d from the prefix cache; %zu generated)\n",
                by_string   ? "stop string"
                : cut_short ? "interrupted"
                            : reason_name(out.reason),
                out.prompt.size(), out.num_cached_tokens, out.tokens.size());
  }
  std::fflush(stdout);  // keep the summary after the text when both go to one terminal
  std::fprintf(stderr, "%zu sequences, %lld tokens generated in %.2f s (%.1f tok/s), %lld steps\n",
               ids.size(), static_cast<long long>(generated), seconds,
               static_cast<double>(generated) / seconds,
               static_cast<long long>(engine.num_steps()));
  if (args.show_cache) print_cache(engine, /*page_tables=*/false);
  if (stop_signal() != 0) {
    std::fprintf(stderr, "pagedlm: interrupted\n");
    std::exit(stop_exit_status());  // the stdio buffers are flushed on the way out
  }
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate text for one or more prompts");
  auto args = std::make_shared<Args>();
  args->sampling.max_tokens = 128;
  cmd->add_option("--model", args->model, "HF folder or .gguf file (default: SmolLM2 GGUF)");
  cmd->add_option("--prompt", args->prompts, "a text prompt (repeatable)");
  cmd->add_option("--prompts-file", args->prompts_file, "a file of prompts, one per line");
  cmd->add_option("--tokens", args->token_prompts, "a prompt as token ids, e.g. \"1 2 3\"");
  cmd->add_flag("--chat", args->chat, "wrap each prompt in the model's chat template");
  cmd->add_option("--system", args->system, "system message for --chat");
  cmd->add_option("--chat-template", args->chat_template,
                  "Jinja file for --chat instead of the model's template")
      ->check(CLI::ExistingFile);
  cmd->add_option("--max-tokens", args->sampling.max_tokens, "tokens to generate at most")
      ->capture_default_str();
  cmd->add_option("--temperature", args->sampling.temperature, "0 means greedy")
      ->capture_default_str();
  cmd->add_option("--top-k", args->sampling.top_k, "keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", args->sampling.top_p, "nucleus sampling mass (1: off)");
  cmd->add_option("--min-p", args->sampling.min_p, "drop tokens below min_p * max prob");
  cmd->add_option("--presence-penalty", args->sampling.presence_penalty,
                  "OpenAI presence penalty over generated tokens, [-2, 2]");
  cmd->add_option("--frequency-penalty", args->sampling.frequency_penalty,
                  "OpenAI frequency penalty over generated tokens, [-2, 2]");
  cmd->add_option("--repetition-penalty", args->sampling.repetition_penalty,
                  "divide seen tokens' positive logits by this, multiply negative ones (1: off)");
  cmd->add_option("--seed", args->seed, "seed for reproducible sampling");
  cmd->add_option("--stop", args->stop, "stop at this text, which is not printed (repeatable)");
  cmd->add_flag("--show-cache", args->show_cache, "print page tables and prefix-cache counters");
  cmd->add_option("--json-schema", args->json_schema,
                  "hold every output to the JSON schema in this file (strict)");
  cmd->add_option("--grammar", args->grammar,
                  "hold every output to the EBNF/GBNF grammar in this file (root rule 'root')");
  add_engine_flags(*cmd, args->flags);
  cmd->callback([args] { run_generate(*args); });
}

}  // namespace pagedlm::cli
