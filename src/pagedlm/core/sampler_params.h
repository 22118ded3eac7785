// What the token sampler reads of a request: its temperature and filters. A plain value type of
// its own, so the sampling ops depend on no scheduler header; the scheduler's per-request
// SamplingParams (sched/sampling_params.h) extends it with penalties, seeds and stop rules.
#pragma once

#include <cstdint>

namespace pagedlm {

struct SamplerParams {
  float temperature = 0.f;  // 0 means greedy
  int32_t top_k = 0;        // 0 means off
  float top_p = 1.f;        // 1 means off
  float min_p = 0.f;        // 0 means off
};

}  // namespace pagedlm
