// Offline throughput benchmark through the real engine: seeded, reproducible workloads and
// the latency / cache counters a serving engine is judged by.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "pagedlm/engine/engine.h"

namespace pagedlm {

struct WorkloadSpec {
  std::string kind = "random";  // random | shared-prefix | chat
  int32_t num_requests = 256;   // chat: number of conversations
  uint64_t seed = 0;
  // random: prompt length uniform in [prompt_min, prompt_max], output in [output_min, output_max]
  int32_t prompt_min = 100, prompt_max = 1024;
  int32_t output_min = 256, output_max = 256;
  // shared-prefix: prefix_len shared tokens + unique_len unique tokens, output_min..output_max
  int32_t prefix_len = 2000, unique_len = 32;
  // chat: turns per conversation, each adding unique_len user tokens to the whole history
  int32_t turns = 4;
};

struct BenchmarkResult {
  int64_t num_requests = 0;
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double wall_s = 0;
  double output_tok_s = 0;
  double total_tok_s = 0;
  double ttft_p50_ms = 0, ttft_p99_ms = 0;
  double itl_p50_ms = 0, itl_p99_ms = 0;
  double prefix_hit_rate = 0;  // prefix-cache hit tokens / query tokens
  int32_t peak_pages_used = 0;
  int64_t preemptions = 0;
  int64_t steps = 0;
};

// Runs the workload to completion; `progress(done, total)` is called after each step.
BenchmarkResult run_benchmark(Engine& engine, const WorkloadSpec& spec,
                              const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace pagedlm
