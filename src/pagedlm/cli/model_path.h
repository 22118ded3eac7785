// Where models come from: an explicit path, or the default model in the model cache.
#pragma once

#include <string>

#include "pagedlm/io/model_cache.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm::cli {

// `path`, or the default model when empty; throws with the command to run when it is missing.
std::string resolve_model_path(const std::string& path);
// A loading progress bar on stderr.
LoadProgress progress_bar();
// Loads with a progress bar on stderr.
Checkpoint load_with_progress(const std::string& path);

}  // namespace pagedlm::cli
