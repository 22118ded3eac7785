// A generation request as the scheduler sees it: token ids in, token ids out.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "pagedlm/sched/sampling_params.h"

namespace pagedlm {

enum class FinishReason : uint8_t { kNone, kStop, kLength, kCancelled };

// An output token a step is still computing: a step planned while its predecessor runs
// (Scheduler::run_ahead) feeds it, and the worker takes its value on the device from the
// predecessor's sampled ids. Never a valid token id.
inline constexpr int32_t kPendingToken = -1;

struct Request {
  int64_t id = 0;
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  std::string cache_salt;           // tenants with different salts never share cached pages
  bool use_prefix_cache = true;     // look up cached pages for this prompt
  bool want_prompt_logits = false;  // logits at every computed prompt position
};

// A request's tokens, prompt then outputs: its one copy, made by Scheduler::add from the prompt.
// The scheduler appends outputs (and, on a rollback, removes them); the engine reads it, and keeps
// it for the request's output once the scheduler is done with the request.
struct RequestTokens {
  std::vector<int32_t> all;
  int32_t num_prompt = 0;

  int32_t size() const { return static_cast<int32_t>(all.size()); }
  int32_t num_outputs() const { return size() - num_prompt; }
  std::span<const int32_t> prompt() const { return {all.data(), static_cast<size_t>(num_prompt)}; }
  std::span<const int32_t> outputs() const {
    return {all.data() + num_prompt, static_cast<size_t>(num_outputs())};
  }
};

}  // namespace pagedlm
