// One layer's attention variant, as FlashInfer's variant policies name them: how a query row
// scores keys. Every backend's attention (CPU and CUDA, prefill, decode and cascade) takes it.
// A plain value type with no dependencies, so the raw CUDA launchers can take it too.
#pragma once

#include <cstdint>

namespace pagedlm {

struct AttentionVariant {
  // score = scale * q . k (HF: head_dim^-0.5, or query_pre_attn_scalar^-0.5 for Gemma; YaRN's
  // attention factor, which HF multiplies into cos and sin of both q and k, is folded in here
  // squared).
  float scale = 1.f;
  // 0: every earlier key. Else a query at position p sees keys at positions p - window + 1 .. p
  // (HF's sliding_window: kv_idx > q_idx - sliding_window).
  int32_t window = 0;
  // 0: none. Else score = softcap * tanh(score / softcap), after the scale, before the mask.
  float softcap = 0.f;

  // Spelled out: the CUDA sources that include this compile as C++17.
  bool operator==(const AttentionVariant& o) const {
    return scale == o.scale && window == o.window && softcap == o.softcap;
  }
};

}  // namespace pagedlm
