// Random weights for a config (like vLLM's dummy load format), so large configs can be
// benchmarked without their checkpoints.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "pagedlm/core/quantized.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/tensor_parallel.h"

namespace pagedlm {

// Every tensor the model needs, bf16, seeded: norms near 1, projections small and random. Each
// element is drawn on its own, so for a tensor-parallel rank only the elements its share reads
// are written (the rest of each tensor is allocated, never touched, so the OS never backs it):
// a 70B config at 2 ranks fits a host that could not hold it twice, and every rank's share
// holds the values a single rank would.
// With `blocks`, the projections' weights (attention, dense MLP, an untied lm_head) are random
// blocks of that ggml format instead (core/quantized.h: random_quantized_matrix), as a GGUF
// quantized by llama.cpp would hold them: a quantized model's step, measured without its file.
// One rank only.
Checkpoint make_dummy_checkpoint(const ModelConfig& config, uint64_t seed = 0,
                                 TensorParallel tp = {},
                                 std::optional<QuantType> blocks = std::nullopt);
// Reads an HF config.json file and makes its dummy checkpoint.
Checkpoint make_dummy_checkpoint(const std::string& config_json_path, uint64_t seed = 0,
                                 TensorParallel tp = {},
                                 std::optional<QuantType> blocks = std::nullopt);

}  // namespace pagedlm
