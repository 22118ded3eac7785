// Offline throughput benchmark through the real engine: seeded, reproducible workloads and
// the latency / cache counters a serving engine is judged by.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
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
  // Untimed requests first, as the peer's script does: the same prompt lengths, other tokens
  // (nothing the timed run asks for is cached by them), a few output tokens each.
  int32_t warmup_requests = 8;
  // 0: the seed's token ids. k > 0: every id the workload draws goes through the k-th bijection
  // of the id range instead, so lengths, outputs and which prompts share what stay the seed's,
  // while no page of another variant's prompts can be served from the prefix cache (repeats of
  // a run on one engine: `pagedlm bench --repeat`).
  uint64_t token_variant = 0;
  // Every timed request's sampling (max_tokens and ignore_eos are the workload's): temperature,
  // filters, penalties; and logprobs with that many top tokens (-1: none).
  SamplingParams sampling;
  int32_t logprobs = -1;
};

// The device's measured peaks, for the workload's lower bound (0: no bound reported).
struct DevicePeaks {
  double bytes_per_s = 0;
  double flops_per_s = 0;
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
  int32_t kv_pages = 0;  // the KV cache's pages (with --kv-cache-dtype fp8 twice bf16's)
  int64_t preemptions = 0;
  int64_t steps = 0;
  int64_t logits_downloads = 0;  // GPU steps that brought logits to the host
  // Pure decode steps (one new token per sequence): their count, wall time, and the bytes they
  // must read (every weight once per step, every sequence's K/V once).
  int64_t decode_steps = 0;
  double decode_s = 0;
  double decode_gpu_s = 0;  // CUDA: the device time of those steps (decode_s - it: host work)
  // CUDA: the device's idle time between consecutive decode steps, summed, and how many gaps.
  double decode_gap_gpu_s = 0;
  int64_t decode_gaps = 0;
  // Host clock of those steps (StepShape): scheduling, preparing, waiting for the device, the
  // bookkeeping after it; decode_s less all four is the benchmark loop's own share. With
  // asynchronous scheduling a step is planned and launched while the one before runs, so its
  // "prepare" spans that step's wait and bookkeeping too (the four then add up to more than
  // decode_s); decode_launch_s is the executor's launch alone (StepShape::launch_ms; on the CPU
  // the forward, which "prepare" holds as well).
  double decode_schedule_s = 0, decode_prepare_s = 0, decode_wait_s = 0, decode_finish_s = 0;
  double decode_launch_s = 0;
  // The other steps (prefill and mixed): how many, the host time their launches took and the
  // host's wait for them (StepShape::launch_ms, wait_ms), and their device time.
  int64_t prefill_steps = 0;
  double prefill_launch_s = 0, prefill_wait_s = 0, prefill_gpu_s = 0;
  double decode_bytes = 0;
  double decode_bytes_per_s = 0;
  // The weights a step reads, by the format they are kept in (Engine::step_weight_bytes_by_format).
  std::map<std::string, int64_t> step_weight_bytes_by_format;
  double gpu_s = 0;  // CUDA: the device time of all steps (gpu_s - decode_gpu_s: the prefill's)
  // The workload's lower bound as the run scheduled it: all steps' bytes at the peak bandwidth
  // or all their FLOPs (2 x params per token, lm_head per sequence, attention) at the peak
  // rate, whichever is longer (perfect overlap). Zero without DevicePeaks.
  double bytes = 0, flops = 0;
  double bound_s = 0;
  double bound_output_tok_s = 0;
  double bound_fraction = 0;  // output_tok_s / bound_output_tok_s
  // The run stopped early (`interrupted` said so); every other field is then left at zero, as a
  // part of a run's numbers would misstate the whole.
  bool interrupted = false;
};

// The requests of a workload fixed in advance (random, shared-prefix) for a model of `vocab`
// tokens, in submission order: what run_benchmark submits, so that another front end (the Python
// package's LLM.generate) can run the very same workload. Each ignores EOS.
std::vector<Request> workload_requests(const WorkloadSpec& spec, int64_t vocab);
// Its untimed warm-up requests (spec.warmup_requests of them, 4 output tokens each).
std::vector<Request> warmup_requests(const WorkloadSpec& spec, int64_t vocab);

// Runs the workload to completion; `progress(done, total)` is called after each step. Before
// each step (warm-up included) `interrupted()`, when given, may stop the run: the result then
// says only that (BenchmarkResult::interrupted), and requests of the run stay in the engine.
BenchmarkResult run_benchmark(Engine& engine, const WorkloadSpec& spec,
                              const std::function<void(int64_t, int64_t)>& progress = {},
                              const DevicePeaks& peaks = {},
                              const std::function<bool()>& interrupted = {});

}  // namespace pagedlm
