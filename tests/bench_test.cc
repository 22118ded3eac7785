// The offline benchmark's counters on a tiny model: what it reports must add up.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/engine/benchmark.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/dummy_checkpoint.h"

namespace pagedlm {
namespace {

const std::string kFixture = std::string(PAGEDLM_TESTDATA) + "/fixtures/llama-gqa";

// Runs a shell command; its stdout, and its wait status in *status.
std::string run(const std::string& command, int* status) {
  std::string out;
  FILE* pipe = popen(command.c_str(), "r");
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) out.append(buf.data(), n);
  *status = pclose(pipe);
  return out;
}

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
  // The launch (here the whole forward and sampling) lies inside the steps' wall time. (Not
  // inside "prepare": the CPU worker stamps the end of that span just before its launch returns.)
  EXPECT_GT(by_bytes.decode_launch_s, 0);
  EXPECT_LE(by_bytes.decode_launch_s, by_bytes.decode_s);
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
  int status = 0;
  const auto j = nlohmann::json::parse(run(cmd, &status));
  EXPECT_EQ(status, 0);
  EXPECT_EQ(j["requests"], 4);
  EXPECT_EQ(j["generated_tokens"], 8);
  for (const char* phase : {"schedule_s", "prepare_s", "wait_s", "finish_s"}) {
    EXPECT_GE(j["decode_host"][phase].get<double>(), 0) << phase;
  }
  EXPECT_GT(j["decode_launch_s"].get<double>(), 0);
  EXPECT_LE(j["decode_launch_s"].get<double>(), j["decode_s"].get<double>());
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

// Random blocks for --dummy --quantization: every ggml format by its quantizer's name, each
// block's largest weight (by the format's reference dequantization) at the asked amplitude, and
// a bench run of them whose step reads those bytes.
TEST(Benchmark, DummyBlocks) {
  EXPECT_EQ(ggml_quant_type_named("Q4_K"), QuantType::kQ4_K);
  EXPECT_EQ(ggml_quant_type_named("q8_0"), QuantType::kQ8_0);
  EXPECT_FALSE(ggml_quant_type_named("q4_k_m").has_value());
  EXPECT_FALSE(ggml_quant_type_named("Q4_1 (f32 scales)").has_value());
  EXPECT_FALSE(ggml_quant_type_named("fp8").has_value());
  const float amplitude = 0.05f;
  for (const char* name : {"q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k", "q4_k", "q5_k",
                           "q6_k", "iq4_nl", "iq4_xs"}) {
    const QuantType type = ggml_quant_type_named(name).value();
    const QuantizedMatrix m = random_quantized_matrix(type, 3, 512, amplitude, 7);
    const int64_t block = quant_format(type).block_elems;
    std::vector<float> row(512);
    int nonzero_blocks = 0;
    for (int64_t r = 0; r < 3; ++r) {
      dequantize_row(m, r, row.data());
      for (int64_t b = 0; b < 512 / block; ++b) {
        float largest = 0;
        for (int64_t i = b * block; i < (b + 1) * block; ++i) {
          ASSERT_TRUE(std::isfinite(row[i])) << name;
          largest = std::max(largest, std::fabs(row[i]));
        }
        if (largest == 0) continue;  // a block whose random scales are all 0
        ++nonzero_blocks;
        // The f16 scale rounds amplitude / largest to 11 bits, or to 2^-24 where it is subnormal
        // (Q6_K's: largest is up to 127 x 32 at scale 1, as in llama.cpp's own files).
        EXPECT_NEAR(largest, amplitude, amplitude / 200) << name << " row " << r << " block " << b;
      }
    }
    EXPECT_GT(nonzero_blocks, 0) << name;
  }
  EXPECT_THROW(random_quantized_matrix(QuantType::kQ4_K, 1, 96, amplitude, 1), Error);

  const Checkpoint dummy =
      make_dummy_checkpoint(kFixture + "/config.json", 1, {}, QuantType::kQ4_K);
  EXPECT_EQ(dummy.quantized.at("model.layers.0.self_attn.q_proj.weight").type, QuantType::kQ4_K);
  EXPECT_EQ(dummy.quantized.at("model.layers.1.mlp.down_proj.weight").cols, 512);
  EXPECT_EQ(dummy.tensors.count("model.embed_tokens.weight"), 1u);  // looked up, not multiplied
  EXPECT_THROW(make_dummy_checkpoint(kFixture + "/config.json", 1, {0, 2}, QuantType::kQ4_K),
               Error);

  int status = 0;
  const auto j =
      nlohmann::json::parse(run(std::string(PAGEDLM_BINARY) + " bench --dummy " + kFixture +
                                    "/config.json --device cpu --quantization q4_k "
                                    "--num-requests 2 --prompt-min 4 --prompt-max 8 "
                                    "--output-min 2 --output-max 2 --json",
                                &status));
  EXPECT_EQ(status, 0);
  EXPECT_EQ(j["generated_tokens"], 4);
  // 2 layers x (q, k, v, o, gate, up, down) of Q4_K blocks, in the CPU's repacking of them.
  const int64_t q4k_blocks = 2 * (256 * 256 + 2 * 128 * 256 + 256 * 256 + 3 * 512 * 256) / 256;
  const QuantFormat& cpu_form = quant_format(quant_format(QuantType::kQ4_K).cpu_form);
  ASSERT_TRUE(j["step_weight_bytes_by_format"].contains(cpu_form.name))
      << j["step_weight_bytes_by_format"].dump();
  EXPECT_EQ(j["step_weight_bytes_by_format"][cpu_form.name].get<int64_t>(),
            q4k_blocks * cpu_form.block_bytes);
  const std::string err =
      run(std::string(PAGEDLM_BINARY) + " generate --model " + kFixture +
              " --quantization q4_k --device cpu --prompt hi --max-tokens 1 2>&1",
          &status);
  EXPECT_NE(status, 0);
  EXPECT_NE(err.find("block formats make --dummy weights"), std::string::npos) << err;
}

}  // namespace
}  // namespace pagedlm
