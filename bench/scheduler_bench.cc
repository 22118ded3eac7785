// Host cost of one engine step for a full decode batch: schedule() + update() with 256 running
// sequences, each appending one token. Prompts are distinct, so nothing is shared.
#include <benchmark/benchmark.h>

#include <memory>
#include <numeric>
#include <vector>

#include "pagedlm/sched/scheduler.h"

namespace pagedlm {
namespace {

constexpr int32_t kNumSeqs = 256;
constexpr int32_t kMaxTokens = 256;
constexpr int32_t kSampledToken = 1;

SchedulerConfig decode_config(int32_t prompt_len) {
  SchedulerConfig config;
  config.page_size = 16;
  config.num_pages = kNumSeqs * ((prompt_len + kMaxTokens) / config.page_size + 1);
  config.max_num_seqs = kNumSeqs;
  config.max_model_len = prompt_len + kMaxTokens;
  config.eos_token_ids = {2};
  return config;
}

class DecodeBatch {
 public:
  explicit DecodeBatch(int32_t prompt_len) : scheduler_(decode_config(prompt_len)) {
    for (int32_t i = 0; i < kNumSeqs; ++i) {
      Request request;
      request.id = i;
      request.prompt.resize(prompt_len);
      std::iota(request.prompt.begin(), request.prompt.end(), 100 + i * prompt_len);
      request.sampling.max_tokens = kMaxTokens;
      scheduler_.add(std::move(request));
    }
    // Prefill until a step decodes every sequence.
    while (step() < kNumSeqs) {
    }
  }

  // One engine step; returns how many sequences it decoded.
  int32_t step() {
    const StepPlan plan = scheduler_.schedule();
    sampled_.assign(plan.num_seqs(), kSampledToken);
    benchmark::DoNotOptimize(scheduler_.update(plan, sampled_));
    return plan.num_tokens() == plan.num_seqs() ? plan.num_seqs() : 0;
  }

 private:
  Scheduler scheduler_;
  std::vector<int32_t> sampled_;
};

void BM_ScheduleUpdate256Decodes(benchmark::State& state) {
  const auto prompt_len = static_cast<int32_t>(state.range(0));
  std::unique_ptr<DecodeBatch> batch;
  int32_t num_decode_steps_left = 0;
  for (auto _ : state) {
    if (num_decode_steps_left == 0) {
      // Sequences end at max_tokens; start a fresh batch outside the timed region.
      state.PauseTiming();
      batch.reset();
      batch = std::make_unique<DecodeBatch>(prompt_len);
      num_decode_steps_left = kMaxTokens - 2;
      state.ResumeTiming();
    }
    batch->step();
    --num_decode_steps_left;
  }
  state.SetItemsProcessed(state.iterations() * kNumSeqs);
}
BENCHMARK(BM_ScheduleUpdate256Decodes)->Arg(64)->Arg(1024)->Unit(benchmark::kMicrosecond);

}  // namespace
}  // namespace pagedlm

BENCHMARK_MAIN();
