// A generation request as the scheduler sees it: token ids in, token ids out.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pagedlm/sched/sampling_params.h"

namespace pagedlm {

enum class FinishReason : uint8_t { kNone, kStop, kLength, kCancelled };

struct Request {
  int64_t id = 0;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string cache_salt;           // tenants with different salts never share cached pages
  bool use_prefix_cache = true;     // look up cached pages for this prompt
  bool want_prompt_logits = false;  // logits at every computed prompt position
};

}  // namespace pagedlm
