// Server metrics in the Prometheus text format: engine gauges and counters plus latency
// histograms that the engine thread records and HTTP workers read.
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "pagedlm/sched/scheduler.h"

namespace pagedlm::serving {

// A cumulative histogram with fixed upper bounds (seconds); thread-safe.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds);
  void observe(double value);
  // Appends the _bucket, _sum and _count lines of `name`.
  void render(const std::string& name, const std::string& help, std::string* out) const;

 private:
  mutable std::mutex mu_;
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // one per bound, plus +Inf
  double sum_ = 0.0;
  uint64_t count_ = 0;
};

// Counters the engine thread keeps beyond the scheduler's own.
struct ServingCounters {
  int64_t prompt_tokens = 0;
  int64_t generation_tokens = 0;
  int64_t requests_finished = 0;
  int64_t requests_cancelled = 0;
  int64_t requests_rejected = 0;  // refused with 503 because the waiting queue was full
  // Structured output: steps with token masks, the engine thread's time getting them (filling
  // them, or waiting for and copying prefetched ones), the steps (GPU) whose forward pass was
  // still running when the masks were done, the prefetch worker's time filling them, and the
  // masks it filled that steps used.
  int64_t masked_steps = 0;
  double mask_seconds = 0;
  int64_t mask_hidden_steps = 0;
  double mask_prefetch_seconds = 0;
  int64_t prefetched_masks = 0;
  // GPU, masked steps: device time of the forward pass, and of the masks' upload and the sampler.
  double masked_forward_gpu_seconds = 0, masked_sampler_gpu_seconds = 0;
  // Engine steps that produced events, the host time of each part of them (Engine::StepShape:
  // scheduling, until the device is waited for, the wait, after it), their device time (GPU),
  // and the engine thread's time handing their events to the requests.
  int64_t steps = 0;
  double step_schedule_seconds = 0, step_prepare_seconds = 0, step_wait_seconds = 0;
  double step_finish_seconds = 0, step_gpu_seconds = 0, event_seconds = 0;
};

struct ServingMetrics {
  Histogram time_to_first_token{{0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                                 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0}};
  Histogram inter_token_latency{{0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05,
                                 0.075, 0.1,    0.15,  0.2,  0.3,   0.4,  0.5,   0.75, 1.0,  2.5}};
};

std::string render_prometheus(const SchedulerStats& stats, int32_t num_queued,
                              const ServingCounters& counters, const ServingMetrics& metrics);

}  // namespace pagedlm::serving
