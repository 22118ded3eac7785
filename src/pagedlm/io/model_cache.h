// Where downloaded models live: $PAGEDLM_CACHE, else ~/.cache/pagedlm (scripts/fetch_model.sh
// puts the default model there).
#pragma once

#include <string>

namespace pagedlm {

std::string model_cache_dir();
// The default model, SmolLM2-135M-Instruct Q4_1 GGUF, inside the cache (it may not exist yet).
std::string default_model_path();

}  // namespace pagedlm
