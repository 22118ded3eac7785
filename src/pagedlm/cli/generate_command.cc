// pagedlm generate: runs prompts through one continuous batch and prints what each produced.
#include <sstream>

#include "pagedlm/cli/commands.h"
#include "pagedlm/cli/model_path.h"

namespace pagedlm::cli {

namespace {

std::vector<int32_t> parse_token_list(const std::string& text) {
  std::istringstream in(text);
  std::vector<int32_t> ids;
  std::string word;
  while (in >> word) {
    try {
      size_t used = 0;
      const long long v = std::stoll(word, &used);
      PAGEDLM_CHECK(used == word.size() && v >= 0 && v <= INT32_MAX, "bad token id '", word, "'");
      ids.push_back(static_cast<int32_t>(v));
    } catch (const std::logic_error&) {
      fail("bad token id '", word, "' in --tokens");
    }
  }
  PAGEDLM_CHECK(!ids.empty(), "--tokens holds no token ids");
  return ids;
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

void print_cache(const Engine& engine) {
  for (const SequenceView& s : engine.sequence_map()) {
    std::printf("seq %lld: %d tokens, pages [", static_cast<long long>(s.request_id), s.num_tokens);
    for (size_t i = 0; i < s.pages.size(); ++i) {
      std::printf("%s%d%s", i ? " " : "", s.pages[i], s.page_shared[i] ? "*" : "");
    }
    std::printf("]\n");
  }
  const SchedulerStats st = engine.stats();
  std::printf(
      "cache: %d pages (%d used, %d free, %d cached); prefix cache: %lld of %lld prompt tokens "
      "hit; %lld preemptions\n",
      st.pages_total, st.pages_used, st.pages_free, st.pages_cached,
      static_cast<long long>(st.prefix_hit_tokens), static_cast<long long>(st.prefix_query_tokens),
      static_cast<long long>(st.preemptions));
}

}  // namespace

void register_generate(CLI::App& app) {
  auto* cmd = app.add_subcommand("generate", "generate text or tokens for one or more prompts");
  struct Args {
    std::string model;
    std::vector<std::string> token_prompts;
    SamplingParams sampling;
    uint64_t seed = 0;
    bool show_cache = false;
    EngineFlags flags;
  };
  auto args = std::make_shared<Args>();
  args->sampling.max_tokens = 64;
  cmd->add_option("--model", args->model, "HF folder or .gguf file (default: SmolLM2 GGUF)");
  cmd->add_option("--tokens", args->token_prompts, "a prompt as token ids, e.g. \"1 2 3\"")
      ->required();
  cmd->add_option("--max-tokens", args->sampling.max_tokens, "tokens to generate at most")
      ->capture_default_str();
  cmd->add_option("--temperature", args->sampling.temperature, "0 means greedy");
  cmd->add_option("--top-k", args->sampling.top_k, "keep the k most likely tokens (0: off)");
  cmd->add_option("--top-p", args->sampling.top_p, "nucleus sampling mass (1: off)");
  cmd->add_option("--min-p", args->sampling.min_p, "drop tokens below min_p * max prob");
  auto* seed_opt = cmd->add_option("--seed", args->seed, "seed for reproducible sampling");
  cmd->add_flag("--show-cache", args->show_cache, "print page tables and prefix-cache counters");
  add_engine_flags(*cmd, args->flags);
  cmd->callback([args, seed_opt] {
    std::vector<Request> requests;
    for (const std::string& text : args->token_prompts) {
      Request r;
      r.prompt = parse_token_list(text);
      r.sampling = args->sampling;
      if (seed_opt->count() > 0) r.sampling.seed = args->seed;
      requests.push_back(std::move(r));
    }
    Checkpoint ckpt = load_with_progress(resolve_model_path(args->model));
    Engine engine(ckpt, args->flags.resolve());
    std::vector<int64_t> ids;
    for (Request& r : requests) ids.push_back(engine.add_request(std::move(r)));
    while (engine.has_unfinished()) {
      engine.step();
      if (args->show_cache && engine.num_steps() == 1) print_cache(engine);
    }
    for (int64_t id : ids) {
      RequestOutput out = engine.take_output(id);
      std::printf("[%lld] finish=%s cached=%d tokens:", static_cast<long long>(id),
                  reason_name(out.reason), out.num_cached_tokens);
      for (int32_t t : out.tokens) std::printf(" %d", t);
      std::printf("\n");
    }
    if (args->show_cache) print_cache(engine);
  });
}

}  // namespace pagedlm::cli
