// The offline benchmark's counters on a tiny model: what it reports must add up.
#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <nlohmann/json.hpp>

#include "pagedlm/engine/benchmark.h"
#include "pagedlm/io/checkpoint.h"
#include "pagedlm/io/dummy_checkpoint.h"

namespace pagedlm {
namespace {

const std::string kFixture = std::string(PAGEDLM_TESTDATA) + "/fixtures/llama-gqa";

TEST(Benchmark, RandomWorkloadCountsAddUp) {
  Engine engine(load_checkpoint(kFixture), EngineOptions{});
  WorkloadSpec spec;
  spec.num_requests = 12;
  spec.prompt_min = 5;
  spec.prompt_max = 40;
  spec.output_min = 3;
  spec.output_max = 9;
  spec.seed = 7;
  const BenchmarkResult a = run_benchmark(engine, spec);
  EXPECT_EQ(a.num_requests, 12);
  EXPECT_GE(a.prompt_tokens, 12 * 5);
  EXPECT_LE(a.prompt_tokens, 12 * 40);
  EXPECT_GE(a.generated_tokens, 12 * 3);
  EXPECT_LE(a.generated_tokens, 12 * 9);
  EXPECT_GT(a.output_tok_s, 0);
  EXPECT_NEAR(a.total_tok_s / a.output_tok_s,
              static_cast<double>(a.prompt_tokens + a.generated_tokens) / a.generated_tokens, 1e-6);
  EXPECT_LE(a.ttft_p50_ms, a.ttft_p99_ms);
  EXPECT_LE(a.itl_p50_ms, a.itl_p99_ms);
  EXPECT_GT(a.peak_pages_used, 0);
  EXPECT_EQ(engine.stats().pages_used, 0);

  // Same seed, same workload: the same token counts on a fresh engine.
  Engine again(load_checkpoint(kFixture), EngineOptions{});
  const BenchmarkResult b = run_benchmark(again, spec);
  EXPECT_EQ(b.prompt_tokens, a.prompt_tokens);
  EXPECT_EQ(b.generated_tokens, a.generated_tokens);
}

TEST(Benchmark, SharedPrefixHitsTheCacheAndPreemptionIsCounted) {
  EngineOptions opts;
  opts.num_pages = 14;  // 8 sequences of 80+ tokens cannot all fit: preemption
  Engine engine(load_checkpoint(kFixture), opts);
  WorkloadSpec spec;
  spec.kind = "shared-prefix";
  spec.num_requests = 8;
  spec.prefix_len = 64;
  spec.unique_len = 16;
  spec.output_min = spec.output_max = 40;
  const BenchmarkResult r = run_benchmark(engine, spec);
  EXPECT_EQ(r.prompt_tokens, 8 * 80);
  EXPECT_EQ(r.generated_tokens, 8 * 40);
  // Every request but the first finds the 4 full prefix pages (64 tokens) of 80.
  EXPECT_GT(r.prefix_hit_rate, 0.5);
  EXPECT_LE(r.prefix_hit_rate, 64.0 / 80.0);
  EXPECT_LE(r.peak_pages_used, 14);
  EXPECT_GT(r.preemptions, 0);
}

TEST(Benchmark, ChatResendsHistory) {
  EngineOptions opts;
  opts.num_pages = 128;
  Engine engine(load_checkpoint(kFixture), opts);
  WorkloadSpec spec;
  spec.kind = "chat";
  spec.num_requests = 3;
  spec.turns = 3;
  spec.prompt_min = spec.prompt_max = 20;
  spec.unique_len = 10;
  spec.output_min = spec.output_max = 6;
  const BenchmarkResult r = run_benchmark(engine, spec);
  EXPECT_EQ(r.num_requests, 9);
  EXPECT_EQ(r.generated_tokens, 9 * 6);
  // Turn t's prompt is 20 + 10t + 6(t-1) tokens: 30, 46, 62 per conversation.
  EXPECT_EQ(r.prompt_tokens, 3 * (30 + 46 + 62));
  EXPECT_GT(r.prefix_hit_rate, 0.3);
}

TEST(Benchmark, DummyWeightsAndCliGuard) {
  const Checkpoint dummy = make_dummy_checkpoint(kFixture + "/config.json", 1);
  EXPECT_EQ(dummy.config.hidden_size, 256);
  for (const auto& [name, shape] : expected_tensor_shapes(dummy.config)) {
    ASSERT_TRUE(dummy.has(name)) << name;
    EXPECT_EQ(dummy.tensors.at(name).shape(), shape) << name;
  }
  const std::string cmd = std::string(PAGEDLM_BINARY) + " bench --dummy " + kFixture +
                          "/config.json --num-requests 4 --prompt-min 4 --prompt-max 8 " +
                          "--output-min 2 --output-max 2 --json";
  auto run = [](const std::string& c, int* status) {
    std::string out;
    FILE* pipe = popen(c.c_str(), "r");
    std::array<char, 4096> buf;
    while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
    *status = pclose(pipe);
    return out;
  };
  int status = 0;
  const auto j = nlohmann::json::parse(run(cmd, &status));
  EXPECT_EQ(status, 0);
  EXPECT_EQ(j["requests"], 4);
  EXPECT_EQ(j["generated_tokens"], 8);
  run(cmd + " --min-tok-s 1e12 2>/dev/null", &status);
  EXPECT_NE(status, 0) << "--min-tok-s must fail a run below it";
}

}  // namespace
}  // namespace pagedlm
