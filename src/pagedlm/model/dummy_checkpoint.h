// Random weights for a config (like vLLM's dummy load format), so large configs can be
// benchmarked without their checkpoints.
#pragma once

#include <cstdint>
#include <string>

#include "pagedlm/model/checkpoint.h"

namespace pagedlm {

// Every tensor the model needs, float32, seeded: norms near 1, projections small and random.
Checkpoint make_dummy_checkpoint(const ModelConfig& config, uint64_t seed = 0);
// Reads an HF config.json file and makes its dummy checkpoint.
Checkpoint make_dummy_checkpoint(const std::string& config_json_path, uint64_t seed = 0);

}  // namespace pagedlm
