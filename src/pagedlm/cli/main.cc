#include <malloc.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "pagedlm/cli/commands.h"
#include "pagedlm/core/error.h"

// Allocations of this size or more get their own mapping, handed back to the system when freed.
// glibc's threshold otherwise rises to the size of any mapped block freed (up to 32 MB): once
// the CLI releases a checkpoint's weights (SmolLM2 Q4_1's 17.7 MB embedding blocks), 8 MB
// request bodies were carved from the heap arenas instead, and a burst of 64 of them left
// 75 MB resident for good (idle 190 MB, 265 MB after, on a 2-core Xeon). 1 MB costs nothing
// measurable: a CPU step's temporaries above it are few (1,000-token prefills at the same
// speed either way).
constexpr int kOwnMappingBytes = 1 << 20;

int main(int argc, char** argv) {
  mallopt(M_MMAP_THRESHOLD, kOwnMappingBytes);
  CLI::App app{"pagedlm: paged-attention LLM inference engine"};
  app.require_subcommand(1);
  pagedlm::cli::register_generate(app);
  pagedlm::cli::register_logits(app);
  pagedlm::cli::register_bench(app);
  pagedlm::cli::register_inspect(app);
  pagedlm::cli::register_serve(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
  return 0;
}
