#include "pagedlm/io/model_cache.h"

#include <cstdlib>

namespace pagedlm {

std::string model_cache_dir() {
  if (const char* cache = std::getenv("PAGEDLM_CACHE"); cache != nullptr && *cache != '\0') {
    return cache;
  }
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/pagedlm";
}

std::string default_model_path() { return model_cache_dir() + "/SmolLM2-135M-Instruct.Q4_1.gguf"; }

}  // namespace pagedlm
