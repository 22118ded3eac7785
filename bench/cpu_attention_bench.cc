// CPU paged attention alone, at SmolLM2-135M's shape (9 q heads over 3 kv heads of 64 dims,
// pages of 16): one prompt's prefill in a single chunk at 125 to 4000 tokens, a decode step of
// 32 sequences at 1000 tokens of context, and one sequence's decode step at 124 and 1000 (and at
// 124 out of cache), over an f32 cache and (the decode rows) over a bf16 one.
// Counter `pairs`: (query, visible key) pairs a second, the work a causal step does whatever
// the kernel.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/ops/paged_attention.h"

namespace pagedlm {
namespace {

constexpr int64_t kQHeads = 9, kKvHeads = 3, kHeadDim = 64;
constexpr int32_t kPageSize = 16;

// Sequences of n_new tokens after n_ctx cached ones, on shuffled pages of random keys and values.
struct Step {
  std::vector<int32_t> q_indptr{0}, kv_indptr{0}, pages, last_len;
  std::vector<float> q, k_cache, v_cache, out;
  std::vector<uint16_t> k_bf16, v_bf16;  // the caches rounded to bf16, when the step reads them
  bool bf16 = false;
  ops::PagedAttentionDims dims{};
  int64_t pairs = 0;

  Step(int32_t num_seqs, int32_t n_new, int32_t n_ctx, bool bf16_cache = false) : bf16(bf16_cache) {
    for (int32_t s = 0; s < num_seqs; ++s) {
      const int32_t n_kv = n_ctx + n_new;
      const int32_t num_pages = (n_kv + kPageSize - 1) / kPageSize;
      for (int32_t i = 0; i < num_pages; ++i) pages.push_back(static_cast<int32_t>(pages.size()));
      kv_indptr.push_back(static_cast<int32_t>(pages.size()));
      last_len.push_back(n_kv - (num_pages - 1) * kPageSize);
      q_indptr.push_back(q_indptr.back() + n_new);
      for (int32_t t = 0; t < n_new; ++t) pairs += n_ctx + t + 1;
    }
    std::mt19937 rng(5);
    std::shuffle(pages.begin(), pages.end(), rng);
    const auto num_pages = static_cast<int64_t>(pages.size());
    dims = {num_seqs, q_indptr.back(), kQHeads,   kKvHeads,
            kHeadDim, num_pages,       kPageSize, num_pages};
    std::uniform_real_distribution<float> uniform(-2.f, 2.f);
    q.resize(dims.n_tokens * kQHeads * kHeadDim);
    k_cache.resize(num_pages * kPageSize * kKvHeads * kHeadDim);
    v_cache.resize(k_cache.size());
    out.resize(q.size());
    for (auto* values : {&q, &k_cache, &v_cache}) {
      for (float& x : *values) x = uniform(rng);
    }
    if (bf16) {
      for (float x : k_cache) k_bf16.push_back(f32_to_bf16(x));
      for (float x : v_cache) v_bf16.push_back(f32_to_bf16(x));
      k_cache = {};
      v_cache = {};
    }
  }

  void run() {
    auto attend = [&](const auto* k, const auto* v) {
      ops::cpu::paged_attention(q.data(), k, v, q_indptr.data(), kv_indptr.data(), pages.data(),
                                last_len.data(), AttentionVariant{0.125f, 0, 0.f}, out.data(),
                                dims);
    };
    if (bf16) {
      attend(k_bf16.data(), v_bf16.data());
    } else {
      attend(k_cache.data(), v_cache.data());
    }
  }
};

void run_step(benchmark::State& state, Step& step) {
  set_num_threads(static_cast<int>(state.range(0)));
  for (auto _ : state) {
    step.run();
    benchmark::DoNotOptimize(step.out.data());
  }
  state.counters["pairs"] = benchmark::Counter(static_cast<double>(step.pairs) * kQHeads,
                                               benchmark::Counter::kIsIterationInvariantRate);
}

void BM_Prefill(benchmark::State& state) {
  Step step(1, static_cast<int32_t>(state.range(1)), 0);
  run_step(state, step);
}
BENCHMARK(BM_Prefill)
    ->ArgNames({"threads", "tokens"})
    ->ArgsProduct({{1, 2}, {125, 1000, 4000}})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

void BM_Decode(benchmark::State& state) {
  Step step(32, 1, 1000, state.range(1) != 0);
  run_step(state, step);
}
BENCHMARK(BM_Decode)
    ->ArgNames({"threads", "bf16"})
    ->ArgsProduct({{1, 2}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// One stream's decode step (one layer's attention) at a short and a longer context.
void BM_DecodeOne(benchmark::State& state) {
  Step step(1, 1, static_cast<int32_t>(state.range(1)), state.range(2) != 0);
  run_step(state, step);
}
BENCHMARK(BM_DecodeOne)
    ->ArgNames({"threads", "context", "bf16"})
    ->ArgsProduct({{1}, {124, 1000}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

// The same step as a decode meets it, its keys and values out of cache: 78 MB of caches at 124
// keys (400 sequences' in f32, 800 in bf16), one sequence a step in turn.
void BM_DecodeOneCold(benchmark::State& state) {
  const bool bf16 = state.range(2) != 0;
  std::vector<Step> steps;
  for (int i = 0; i < (bf16 ? 800 : 400); ++i)
    steps.emplace_back(1, 1, static_cast<int32_t>(state.range(1)), bf16);
  set_num_threads(static_cast<int>(state.range(0)));
  size_t next = 0;
  for (auto _ : state) {
    steps[next].run();
    benchmark::DoNotOptimize(steps[next].out.data());
    next = (next + 1) % steps.size();
  }
}
BENCHMARK(BM_DecodeOneCold)
    ->ArgNames({"threads", "context", "bf16"})
    ->ArgsProduct({{1}, {124}, {0, 1}})
    ->Unit(benchmark::kMicrosecond)
    ->UseRealTime();

}  // namespace
}  // namespace pagedlm

BENCHMARK_MAIN();
