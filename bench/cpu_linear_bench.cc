// CPU linear over ggml blocks alone, at SmolLM2-135M's projection shapes (576 -> 1536 gate/up,
// 1536 -> 576 down) and its tied output head (576 -> 49152, Q8_0 in the Q4_1 GGUF): a decode step
// (1 row: counter `bytes`, the blocks streamed a second) and a prefill step (512 rows: counter
// `flops`, 2 x rows x weights a second). `type` is the QuantType: 0 Q4_1, 1 Q8_0, 2 Q4_1 repacked
// with f32 scales as the CPU backend loads it (24 bytes a block where Q4_1 has 20, so its `bytes`
// counter runs 1.2x ahead of the weights it covers), 3 Q4_0 (BM_DecodeStepQ8 only); BM_ProjectionQ8
// takes every block type the 8-bit kernels pack, by its QuantType.
#include <benchmark/benchmark.h>

#include <cstring>
#include <random>
#include <vector>

#include "pagedlm/core/parallel.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/ops/linear.h"

namespace pagedlm {
namespace {

// Random nibbles or int8s (Q8_0's in -127..127, as ggml's quantizer writes them); scales and
// minima random normal float16s in [1/1024, 1/8).
QuantizedMatrix random_matrix(QuantType type, int64_t rows, int64_t cols) {
  QuantizedMatrix q;
  q.type = type;
  q.rows = rows;
  q.cols = cols;
  q.blocks.resize(rows * q.row_bytes());
  std::mt19937 rng(3);
  std::uniform_int_distribution<int> byte(0, 255), exponent(5, 11);
  const int64_t block_bytes = quant_block_bytes(type);
  for (size_t at = 0; at < q.blocks.size(); at += block_bytes) {
    for (int64_t i = 0; i < block_bytes; ++i) {
      q.blocks[at + i] = static_cast<uint8_t>(byte(rng));
      if (type == QuantType::kQ8_0 && q.blocks[at + i] == 0x80) q.blocks[at + i] = 0x81;
    }
    for (int s = 0; s < (type == QuantType::kQ4_1 ? 2 : 1); ++s) {
      // sign, a biased exponent of 5-11 (2^-10 .. 2^-4), random mantissa bits
      const auto h = static_cast<uint16_t>((byte(rng) & 1) << 15 | exponent(rng) << 10 |
                                           (byte(rng) << 2 & 0x3FF));
      std::memcpy(&q.blocks[at + 2 * s], &h, sizeof(h));
    }
  }
  return q;
}

// n activations uniform in [-1, 1).
std::vector<float> random_x(int64_t n) {
  std::vector<float> x(n);
  std::mt19937 rng(4);
  std::uniform_real_distribution<float> uniform(-1.f, 1.f);
  for (float& v : x) v = uniform(rng);
  return x;
}

void BM_Linear(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const int64_t rows = state.range(1), out_features = state.range(2), in_features = state.range(3);
  const auto type = static_cast<QuantType>(state.range(4));
  set_num_threads(threads);
  // Q4_1 with f32 scales: the repacking of random Q4_1 blocks, as the CPU backend loads them.
  const QuantizedMatrix w =
      type == QuantType::kQ4_1F32
          ? ops::repack_for_cpu(random_matrix(QuantType::kQ4_1, out_features, in_features))
          : random_matrix(type, out_features, in_features);
  const std::vector<float> x = random_x(rows * in_features);
  std::vector<float> out(rows * out_features);
  for (auto _ : state) {
    ops::cpu::linear(x.data(), w, nullptr, out.data(), rows);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters[rows == 1 ? "bytes" : "flops"] = benchmark::Counter(
      rows == 1 ? static_cast<double>(w.blocks.size()) : 2.0 * rows * out_features * in_features,
      benchmark::Counter::kIsIterationInvariantRate);
}

// One decode step's projections with 8-bit activations (--cpu-q8-activations), 1 row:
// SmolLM2-135M's 30 layers (q, k, v, o, gate, up, down) and its output head, every matrix of format
// `type`, each packed as pagedlm::ops::pack_for_q8 packs it. Its 143 MB (Q8_0) stream from memory
// as a decode step's do, where one matrix alone would sit in the caches. Counter `bytes`: packed
// bytes a second.
void BM_DecodeStepQ8(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const auto type = static_cast<QuantType>(state.range(1));
  set_num_threads(threads);
  constexpr int64_t kLayers = 30, kHidden = 576, kKv = 192, kFfn = 1536, kVocab = 49152;
  const int64_t shapes[][2] = {{kHidden, kHidden}, {kKv, kHidden},  {kKv, kHidden},
                               {kHidden, kHidden}, {kFfn, kHidden}, {kFfn, kHidden},
                               {kHidden, kFfn}};
  std::vector<ops::Q8PackedMatrix> step;
  int64_t bytes = 0;
  for (int64_t l = 0; l < kLayers; ++l) {
    for (const auto& shape : shapes) {
      step.push_back(ops::pack_for_q8(random_matrix(type, shape[0], shape[1])));
    }
  }
  step.push_back(ops::pack_for_q8(random_matrix(type, kVocab, kHidden)));
  for (const auto& m : step) bytes += static_cast<int64_t>(m.data.size());
  const std::vector<float> x = random_x(kFfn);
  std::vector<float> out(kVocab);
  const ops::cpu::Q8Kernel kernel = ops::cpu::q8_kernels().front();
  for (auto _ : state) {
    for (const auto& m : step) ops::cpu::linear_q8(x.data(), m, nullptr, out.data(), 1, kernel);
    benchmark::DoNotOptimize(out.data());
  }
  state.counters["bytes"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
}

// One projection of SmolLM2's shape with 8-bit activations, one row, of format `type`, packed
// by pagedlm::ops::pack_for_q8: the same matrix every iteration, so that it sits in the caches
// and the kernel's own arithmetic is measured apart from memory. Counter `bytes`: packed bytes
// a second.
void BM_ProjectionQ8(benchmark::State& state) {
  const int64_t out_features = state.range(0), in_features = state.range(1);
  const auto type = static_cast<QuantType>(state.range(2));
  set_num_threads(1);
  const ops::Q8PackedMatrix w = ops::pack_for_q8(random_matrix(type, out_features, in_features));
  const std::vector<float> x = random_x(in_features);
  std::vector<float> out(out_features);
  const ops::cpu::Q8Kernel kernel = ops::cpu::q8_kernels().front();
  for (auto _ : state) {
    ops::cpu::linear_q8(x.data(), w, nullptr, out.data(), 1, kernel);
    benchmark::DoNotOptimize(out.data());
  }
  state.SetLabel(quant_format(type).name);
  state.counters["bytes"] = benchmark::Counter(static_cast<double>(w.data.size()),
                                               benchmark::Counter::kIsIterationInvariantRate);
}

// SmolLM2's output head (49152 x 576, of format `type`) in a decode step of `rows` rows, as the
// exact mode computes it: `fixed32` 0, the exact kernels on the blocks repacked as the CPU keeps
// them; 1, the integer kernels on the blocks packed by pack_for_q8, with 32-bit fixed-point
// activations, the lm_head's form (model/weights.h). `kernel` indexes q8_kernels() (0: the
// default; the AVX2 one is built beside the AVX-512 ones). Four copies (64-120 MB) are taken in
// turn, so that the head streams from memory as in a decode step rather than from the caches.
// Counter `bytes`: the form's bytes a second.
void BM_OutputHead(benchmark::State& state) {
  const int threads = static_cast<int>(state.range(0));
  const auto type = static_cast<QuantType>(state.range(1));
  const bool fixed32 = state.range(2) != 0;
  const ops::cpu::Q8Kernel kernel = ops::cpu::q8_kernels().at(state.range(3));
  const int64_t rows = state.range(4);
  set_num_threads(threads);
  constexpr int64_t kHidden = 576, kVocab = 49152, kCopies = 4;
  std::vector<QuantizedMatrix> repacked;
  std::vector<ops::Q8PackedMatrix> packed;
  for (int64_t i = 0; i < kCopies; ++i) {
    const QuantizedMatrix blocks = random_matrix(type, kVocab, kHidden);
    if (fixed32) {
      packed.push_back(ops::pack_for_q8(blocks));
    } else {
      repacked.push_back(ops::repack_for_cpu(blocks));
    }
  }
  const std::vector<float> x = random_x(rows * kHidden);
  std::vector<float> out(rows * kVocab);
  int64_t turn = 0;
  for (auto _ : state) {
    const int64_t i = turn++ % kCopies;
    if (fixed32) {
      ops::cpu::linear_q8(x.data(), packed[i], nullptr, out.data(), rows, kernel, -1,
                          ops::IntActivations::kFixed32);
    } else {
      ops::cpu::linear(x.data(), repacked[i], nullptr, out.data(), rows);
    }
    benchmark::DoNotOptimize(out.data());
  }
  const size_t bytes = fixed32 ? packed[0].data.size() : repacked[0].blocks.size();
  state.SetLabel(ops::cpu::q8_kernel_name(kernel));
  state.counters["bytes"] =
      benchmark::Counter(static_cast<double>(bytes), benchmark::Counter::kIsIterationInvariantRate);
}

constexpr int64_t kQ4 = static_cast<int64_t>(QuantType::kQ4_1);
constexpr int64_t kQ8 = static_cast<int64_t>(QuantType::kQ8_0);
constexpr int64_t kQ4F32 = static_cast<int64_t>(QuantType::kQ4_1F32);

BENCHMARK(BM_Linear)
    ->ArgNames({"threads", "rows", "out", "in", "type"})
    ->Args({1, 1, 1536, 576, kQ4})
    ->Args({1, 1, 1536, 576, kQ4F32})
    ->Args({1, 1, 576, 1536, kQ4})
    ->Args({1, 1, 576, 1536, kQ4F32})
    ->Args({1, 1, 49152, 576, kQ8})
    ->Args({2, 1, 1536, 576, kQ4})
    ->Args({2, 1, 1536, 576, kQ4F32})
    ->Args({2, 1, 49152, 576, kQ8})
    ->Args({1, 512, 1536, 576, kQ4})
    ->Args({2, 512, 1536, 576, kQ4})
    ->UseRealTime();

constexpr int64_t kQ4_0 = static_cast<int64_t>(QuantType::kQ4_0);
BENCHMARK(BM_DecodeStepQ8)
    ->ArgNames({"threads", "type"})
    ->Args({1, kQ4})
    ->Args({1, kQ8})
    ->Args({1, kQ4_0})
    ->UseRealTime();

// gate/up's shape for the 32-weight formats, down's for the 256-weight K-quants (576 inputs are
// not whole super-blocks), as llama.cpp's quantizer lays SmolLM2 out.
BENCHMARK(BM_ProjectionQ8)
    ->ArgNames({"out", "in", "type"})
    ->Args({1536, 576, static_cast<int64_t>(QuantType::kQ4_0)})
    ->Args({1536, 576, static_cast<int64_t>(QuantType::kQ5_0)})
    ->Args({1536, 576, static_cast<int64_t>(QuantType::kQ5_1)})
    ->Args({1536, 576, static_cast<int64_t>(QuantType::kIQ4_NL)})
    ->Args({1536, 576, kQ8})
    ->Args({576, 1536, static_cast<int64_t>(QuantType::kQ2_K)})
    ->Args({576, 1536, static_cast<int64_t>(QuantType::kQ3_K)})
    ->Args({576, 1536, static_cast<int64_t>(QuantType::kQ4_K)})
    ->Args({576, 1536, static_cast<int64_t>(QuantType::kQ5_K)})
    ->Args({576, 1536, static_cast<int64_t>(QuantType::kQ6_K)})
    ->Args({576, 1536, static_cast<int64_t>(QuantType::kIQ4_XS)})
    ->UseRealTime();

BENCHMARK(BM_OutputHead)
    ->ArgNames({"threads", "type", "fixed32", "kernel", "rows"})
    ->ArgsProduct({{1, 2}, {kQ8, kQ4_0}, {0, 1}, {0}, {1, 32}})
    ->UseRealTime();

}  // namespace
}  // namespace pagedlm

BENCHMARK_MAIN();
