#include "pagedlm/cli/model_path.h"

#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>

#include "pagedlm/core/error.h"

namespace pagedlm::cli {

std::string resolve_model_path(const std::string& path) {
  if (!path.empty()) {
    PAGEDLM_CHECK(std::filesystem::exists(path), "model not found: ", path);
    return path;
  }
  std::string def = default_model_path();
  PAGEDLM_CHECK(std::filesystem::exists(def), "the default model is not downloaded yet (", def,
                "); run: scripts/fetch_model.sh");
  return def;
}

LoadProgress progress_bar() {
  const bool tty = isatty(fileno(stderr));
  auto last_percent = std::make_shared<int>(-1);
  return [tty, last_percent](size_t done, size_t total) {
    if (total == 0) return;
    const int percent = static_cast<int>(100 * done / total);
    if (percent == *last_percent) return;
    *last_percent = percent;
    if (!tty && percent != 100) return;
    const int width = 30, filled = percent * width / 100;
    std::fprintf(stderr, "\rloading [%.*s%*s] %3d%%", filled, "##############################",
                 width - filled, "", percent);
    if (percent == 100) std::fprintf(stderr, "\n");
    std::fflush(stderr);
  };
}

Checkpoint load_with_progress(const std::string& path) {
  return load_checkpoint(path, progress_bar());
}

}  // namespace pagedlm::cli
