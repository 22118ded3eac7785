// config.json's quantization_config (io/quant_config.h): parsing, then which scheme each of a
// model's projections takes. Input: a config.json's text. A bad config may only throw
// pagedlm::Error; a config that parses names a scheme or none for every module, and describes
// itself.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>

#include "fuzz_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/core/json.h"
#include "pagedlm/io/quant_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const nlohmann::json config = pagedlm::try_parse_json(pagedlm::fuzz::as_text(data, size));
  if (config.is_discarded()) return 0;
  try {
    const pagedlm::QuantConfig q = pagedlm::parse_quant_config(config);
    PAGEDLM_FUZZ_EXPECT(q.quantized() == (q.method != pagedlm::QuantMethod::kNone));
    PAGEDLM_FUZZ_EXPECT(!q.describe().empty());
    for (const char* module :
         {"model.layers.0.self_attn.q_proj", "model.layers.17.mlp.experts.3.down_proj",
          "model.layers.1.mlp.gate", "lm_head", ""}) {
      if (const pagedlm::QuantScheme* s = q.scheme_for(module)) {
        PAGEDLM_FUZZ_EXPECT(s->weights.layout != pagedlm::WeightScaleLayout::kBlock ||
                            (s->weights.block_rows > 0 && s->weights.block_cols > 0));
        PAGEDLM_FUZZ_EXPECT(!s->weights.scale_suffix.empty());
      }
    }
  } catch (const pagedlm::Error&) {
  }
  return 0;
}
