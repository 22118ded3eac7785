// The experts of a mixture-of-experts layer alone (ops::moe_experts: plan, grouped GEMMs,
// combine) at decode-sized token counts, as a CUDA graph of `layers` calls over two weight sets
// used in turn (each far larger than the L2), routed by moe_route over uniform random logits.
// Prints the time a graph and the activated experts' weight bytes over it.
// Usage: cuda_moe_bench [experts hidden expert_ffn top_k layers [tokens ...]]
// (default Qwen3-30B-A3B's 128 2048 768 8 48 at 64 128 256 320 tokens; Mixtral-8x7B: 8 4096
// 14336 2 32 16 32 64).
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "cuda_timing.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/moe.h"

using namespace pagedlm;

int main(int argc, char** argv) {
  const bool shape_given = argc >= 6;
  const int E = shape_given ? std::atoi(argv[1]) : 128, D = shape_given ? std::atoi(argv[2]) : 2048;
  const int F = shape_given ? std::atoi(argv[3]) : 768, k = shape_given ? std::atoi(argv[4]) : 8;
  const int layers = shape_given ? std::atoi(argv[5]) : 48;
  std::vector<int> token_counts;
  for (int i = 6; i < argc; ++i) token_counts.push_back(std::atoi(argv[i]));
  if (token_counts.empty()) token_counts = {64, 128, 256, 320};
  if (E <= 0 || D <= 0 || F <= 0 || k <= 0 || k > E || layers <= 0) {
    std::fprintf(stderr, "usage: %s [experts hidden expert_ffn top_k layers [tokens ...]]\n",
                 argv[0]);
    return 2;
  }
  cudaStream_t s;
  cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  // Weights uniform in [-0.05, 0.05): the values do not change the kernels' speed.
  uint32_t state = 12345;
  auto fill = [&](const Tensor& t) {
    std::vector<uint16_t> host(t.numel());
    for (uint16_t& v : host) {
      state ^= state << 13;
      state ^= state >> 17;
      state ^= state << 5;
      v = f32_to_bf16(0.05f * (static_cast<float>(state >> 8) * (2.f / 16777216.f) - 1.f));
    }
    cuda::check(cudaMemcpy(t.raw(), host.data(), host.size() * 2, cudaMemcpyHostToDevice), "copy");
  };
  ops::ExpertWeights weights[2];
  for (ops::ExpertWeights& w : weights) {
    w.num_experts = E;
    w.hidden = D;
    w.ffn = F;
    w.gate_up = Tensor::empty(DType::kBF16, {E, 2 * F, D}, Device::kCuda);
    w.down = Tensor::empty(DType::kBF16, {E, D, F}, Device::kCuda);
    fill(w.gate_up);
    fill(w.down);
  }
  std::printf("experts %d, hidden %d, expert ffn %d, top %d, %d layers a graph\n", E, D, F, k,
              layers);
  for (const int T : token_counts) {
    std::mt19937 rng(T);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    std::vector<float> logits_host(static_cast<size_t>(T) * E);
    for (float& v : logits_host) v = uni(rng);
    Tensor x_host = Tensor::empty(DType::kBF16, {T, D});
    for (int64_t i = 0; i < x_host.numel(); ++i) x_host.data<uint16_t>()[i] = f32_to_bf16(uni(rng));
    const Tensor logits = Tensor::from_f32(logits_host, {T, E}).to(Device::kCuda);
    const Tensor x = x_host.to(Device::kCuda);
    const Tensor ids = Tensor::empty(DType::kI32, {T, k}, Device::kCuda);
    const Tensor expert_weights = Tensor::empty(DType::kF32, {T, k}, Device::kCuda);
    ops::moe_route(logits, true, ids, expert_weights, s);
    const Tensor host_ids = ids.to(Device::kCpu);
    std::vector<bool> used(E, false);
    for (int64_t i = 0; i < host_ids.numel(); ++i) used[host_ids.data<int32_t>()[i]] = true;
    int activated = 0;
    for (const bool u : used) activated += u ? 1 : 0;
    const int64_t rows = int64_t{T} * k;
    ops::MoeWorkspace ws;
    ws.plan = Tensor::empty(DType::kI32, {ops::moe_plan_size(rows, E)}, Device::kCuda);
    ws.act = Tensor::empty(DType::kBF16, {rows, F}, Device::kCuda);
    ws.expert_out = Tensor::empty(DType::kBF16, {rows, D}, Device::kCuda);
    const Tensor out = Tensor::empty(DType::kBF16, {T, D}, Device::kCuda);
    auto all_layers = [&] {
      for (int l = 0; l < layers; ++l) {
        ops::moe_experts(x, ids, expert_weights, weights[l % 2], ops::GatedActivation::kSilu, ws,
                         out, s);
      }
    };
    // The best of three graphs of 10 replays each.
    double ms = 1e30;
    for (int round = 0; round < 3; ++round)
      ms = std::min(ms, bench::graph_mean_ms(s, all_layers, 10));
    const double bytes = 2.0 * layers * activated * 3 * D * F;
    std::printf("tokens %5d (%5.1f rows an expert): %8.3f ms, %3d experts activated, %6.0f GB/s\n",
                T, static_cast<double>(rows) / E, ms, activated, bytes / ms / 1e6);
  }
  return 0;
}
