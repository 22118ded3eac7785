// The offline benchmark's counters on a tiny model: what it reports must add up.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "pagedlm/engine/benchmark.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/dummy_checkpoint.h"

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
  EXPECT_EQ(a.kv_pages, engine.stats().pages_total);
  EXPECT_GE(a.kv_pages, a.peak_pages_used);
  EXPECT_EQ(engine.stats().pages_used, 0);

  // Same seed, same workload: the same token counts on a fresh engine.
  Engine again(load_checkpoint(kFixture), EngineOptions{});
  const BenchmarkResult b = run_benchmark(again, spec);
  EXPECT_EQ(b.prompt_tokens, a.prompt_tokens);
  EXPECT_EQ(b.generated_tokens, a.generated_tokens);
}

// Repeats on one engine: a token variant keeps the seed's lengths and sharing, and the prefix
// cache cannot serve it from the variant before (it would serve an identical repeat).
TEST(Benchmark, TokenVariantsKeepTheWorkloadButNotTheCache) {
  WorkloadSpec spec;
  spec.num_requests = 6;
  spec.prompt_min = 20;
  spec.prompt_max = 50;
  spec.output_min = spec.output_max = 4;
  spec.warmup_requests = 0;
  Engine engine(load_checkpoint(kFixture), EngineOptions{});
  const BenchmarkResult first = run_benchmark(engine, spec);
  const BenchmarkResult same = run_benchmark(engine, spec);
  EXPECT_GT(same.prefix_hit_rate, 0.2) << "an identical repeat hits the pages of the first run";
  spec.token_variant = 1;
  const BenchmarkResult other = run_benchmark(engine, spec);
  EXPECT_EQ(other.prompt_tokens, first.prompt_tokens);
  EXPECT_EQ(other.generated_tokens, first.generated_tokens);
  EXPECT_EQ(other.prefix_hit_rate, 0) << "variant 1 shares no page with variant 0";
  spec.token_variant = 2;
  EXPECT_EQ(run_benchmark(engine, spec).prefix_hit_rate, 0) << "nor with variant 1";

  // Shared-prefix: each variant's requests still share their own prefix.
  WorkloadSpec shared;
  shared.kind = "shared-prefix";
  shared.num_requests = 4;
  shared.prefix_len = 32;
  shared.unique_len = 8;
  shared.output_min = shared.output_max = 2;
  shared.warmup_requests = 0;
  const BenchmarkResult base = run_benchmark(engine, shared);
  shared.token_variant = 3;
  const BenchmarkResult varied = run_benchmark(engine, shared);
  EXPECT_EQ(varied.prefix_hit_rate, base.prefix_hit_rate);
  EXPECT_GT(varied.prefix_hit_rate, 0.5);
}

// One request, 20 prompt tokens, 6 outputs: a prefill step then 5 decode steps holding 21..25
// keys. With a bandwidth of 1 B/s the bound in seconds is the byte count, with 1 FLOP/s the
// FLOP count, so both can be checked against parameter counts taken from the checkpoint itself.
TEST(Benchmark, BytesAndFlopsFollowTheSteps) {
  const Checkpoint ckpt = load_checkpoint(kFixture);
  const ModelConfig& c = ckpt.config;
  double layer_params = 0;
  for (const auto& [name, tensor] : ckpt.tensors) {
    if (name.find(".layers.") != std::string::npos && tensor.shape().size() == 2) {
      layer_params += static_cast<double>(tensor.numel());
    }
  }
  const double head_params = static_cast<double>(c.vocab_size * c.hidden_size);  // tied lm_head
  const double weight_bytes = 4 * (layer_params + head_params);                  // f32 on the CPU
  const double kv_token_bytes = 4.0 * 2 * c.num_layers * c.num_kv_heads * c.head_dim;

  WorkloadSpec spec;
  spec.num_requests = 1;
  spec.prompt_min = spec.prompt_max = 20;
  spec.output_min = spec.output_max = 6;
  spec.warmup_requests = 2;
  auto run = [&](DevicePeaks peaks) {
    Engine engine(ckpt, EngineOptions{});
    return run_benchmark(engine, spec, {}, peaks);
  };
  const BenchmarkResult by_bytes = run({1.0, 1e30});
  EXPECT_EQ(by_bytes.steps, 6);
  EXPECT_EQ(by_bytes.decode_steps, 5);
  const double decode_keys = 21 + 22 + 23 + 24 + 25;
  EXPECT_DOUBLE_EQ(by_bytes.decode_bytes, 5 * weight_bytes + decode_keys * kv_token_bytes);
  EXPECT_DOUBLE_EQ(by_bytes.bound_s, 6 * weight_bytes + (20 + decode_keys) * kv_token_bytes);
  EXPECT_NEAR(by_bytes.decode_bytes_per_s, by_bytes.decode_bytes / by_bytes.decode_s, 1e-6);
  EXPECT_NEAR(by_bytes.bound_fraction * by_bytes.bound_output_tok_s, by_bytes.output_tok_s, 1e-6);
  // The decode steps' host phases lie inside their wall time; on the CPU nothing is waited for
  // (the forward runs inside "prepare").
  for (const double phase :
       {by_bytes.decode_schedule_s, by_bytes.decode_prepare_s, by_bytes.decode_finish_s}) {
    EXPECT_GT(phase, 0);
  }
  EXPECT_EQ(by_bytes.decode_wait_s, 0);
  EXPECT_LE(by_bytes.decode_schedule_s + by_bytes.decode_prepare_s + by_bytes.decode_finish_s,
            by_bytes.decode_s);

  const BenchmarkResult by_flops = run({1e30, 1.0});
  // Prefill: 20 queries see 1..20 keys (210 pairs); decode: one query over all keys.
  const double pairs = 210 + decode_keys;
  const double attention = 4.0 * c.num_layers * c.num_heads * c.head_dim * pairs;
  EXPECT_DOUBLE_EQ(by_flops.bound_s, 2 * layer_params * 25 + 2 * head_params * 6 + attention);
  EXPECT_EQ(run({}).bound_s, 0) << "no peaks, no bound";

  // Tensor-parallel ranks (threads on the CPU) each read their share: all of them together, the
  // same bytes (the fixture's 2 kv heads split without replication).
  EngineOptions two_ranks;
  two_ranks.tensor_parallel_size = 2;
  EXPECT_EQ(Engine(ckpt, two_ranks).step_weight_bytes(), static_cast<int64_t>(weight_bytes));
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
  for (const char* phase : {"schedule_s", "prepare_s", "wait_s", "finish_s"}) {
    EXPECT_GE(j["decode_host"][phase].get<double>(), 0) << phase;
  }
  run(cmd + " --min-tok-s 1e12 2>/dev/null", &status);
  EXPECT_NE(status, 0) << "--min-tok-s must fail a run below it";

  // --repeat: every run's throughput, and the fields of the median one.
  const auto rep = nlohmann::json::parse(run(cmd + " --repeat 3 2>/dev/null", &status));
  EXPECT_EQ(status, 0);
  ASSERT_EQ(rep["repeat_output_tok_s"].size(), 3u);
  std::vector<double> each = rep["repeat_output_tok_s"].get<std::vector<double>>();
  std::sort(each.begin(), each.end());
  EXPECT_EQ(rep["output_tok_s"].get<double>(), each[1]);
  EXPECT_EQ(rep["generated_tokens"], 8);
  run(cmd + " --repeat 0 2>/dev/null", &status);
  EXPECT_NE(status, 0) << "--repeat 0 is refused";

  // Random weights that cannot fit in host memory: a clear error before any allocation.
  nlohmann::json huge = nlohmann::json::parse(std::ifstream(kFixture + "/config.json"));
  huge["intermediate_size"] = 1000000000;
  const std::string huge_path =
      (std::filesystem::temp_directory_path() / "pagedlm_bench_huge_config.json").string();
  std::ofstream(huge_path) << huge.dump();
  const std::string err = run(std::string(PAGEDLM_BINARY) + " bench --dummy " + huge_path +
                                  " --device cpu --num-requests 1 2>&1",
                              &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(err.find("MiB of host memory"), std::string::npos) << err;
  std::filesystem::remove(huge_path);
}

}  // namespace
}  // namespace pagedlm
