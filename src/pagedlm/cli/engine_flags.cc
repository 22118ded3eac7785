#include "pagedlm/cli/commands.h"
#include "pagedlm/core/error.h"

namespace pagedlm::cli {

void add_engine_flags(CLI::App& app, EngineFlags& flags) {
  EngineOptions& o = flags.options;
  app.add_option("--page-size", o.page_size, "tokens per KV page (a power of two)")
      ->capture_default_str();
  app.add_option("--num-pages", o.num_pages, "KV pages (default: sized from memory)");
  app.add_option("--max-num-batched-tokens", o.max_num_batched_tokens, "token budget per step")
      ->capture_default_str();
  app.add_option("--max-num-seqs", o.max_num_seqs, "most sequences running at once")
      ->capture_default_str();
  app.add_flag("--no-prefix-cache", flags.no_prefix_cache, "never share KV pages between requests");
  app.add_option("--threads", o.threads, "CPU threads (default: all)");
  app.add_option("--device", flags.device, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
}

EngineOptions EngineFlags::resolve() const {
  EngineOptions o = options;
  o.enable_prefix_cache = !no_prefix_cache;
  if (device == "cuda") fail("this build of pagedlm has no CUDA model path yet");
  o.device = Device::kCpu;
  return o;
}

}  // namespace pagedlm::cli
