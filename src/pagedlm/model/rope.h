// A layer's rotary frequencies, computed as HF transformers does (modeling_rope_utils.py).
#pragma once

#include <cstdint>
#include <vector>

#include "pagedlm/model/model_config.h"

namespace pagedlm {

// The head_dim/2 rotation frequencies, computed in float32 exactly as HF transformers does:
// inv_freq[i] = 1 / theta^(2i/head_dim), then rescaled per spec.type (linear: divided by the
// factor; llama3: `_compute_llama3_parameters`; yarn: `_compute_yarn_parameters`, whose
// attention factor is not applied here, see RopeSpec::attention_factor).
std::vector<float> rope_inv_freq(const RopeSpec& spec, int64_t head_dim);

// YaRN's default attention factor for a context extension of `factor` (HF `get_mscale`).
float yarn_attention_factor(float factor);

}  // namespace pagedlm
