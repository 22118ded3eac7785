#include <CLI/CLI.hpp>
#include <cstdio>
#include <exception>

#include "pagedlm/cli/commands.h"
#include "pagedlm/core/error.h"

int main(int argc, char** argv) {
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
