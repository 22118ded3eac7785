// The model's GEMMs as the engine runs them at a decode batch and at a full prefill budget, with
// cuBLASLt's first choice of algorithm and with start-up tuning (gemm_set_tuning: the fastest
// of its first eight candidates), on random bf16 data (all-zero operands draw less power and
// run faster than real ones). Mean of 20 runs after the plan is built, CUDA events.
// Usage: cuda_gemm_bench config.json [m ...]   (default m: 256 16384)
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/kernels.h"

using namespace pagedlm;

namespace {

// n bf16 values in [-0.05, 0.05): a 16M-value random block, copied over the whole buffer.
void* random_bf16(size_t n, uint32_t seed) {
  static std::vector<uint16_t> block = [] {
    std::vector<uint16_t> v(size_t{1} << 24);
    std::mt19937 rng(7);
    std::uniform_real_distribution<float> u(-0.05f, 0.05f);
    for (uint16_t& x : v) {
      const float f = u(rng);
      uint32_t bits = 0;
      std::memcpy(&bits, &f, 4);
      x = static_cast<uint16_t>(bits >> 16);
    }
    return v;
  }();
  void* p = nullptr;
  cuda::check(cudaMalloc(&p, n * 2), "malloc");
  const size_t offset = seed % 1024;  // different operands start at different values
  for (size_t done = 0; done < n;) {
    const size_t count = std::min(n - done, block.size() - offset);
    cuda::check(cudaMemcpy(static_cast<uint16_t*>(p) + done, block.data() + offset, count * 2,
                           cudaMemcpyHostToDevice),
                "fill");
    done += count;
  }
  return p;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s config.json [m ...]\n", argv[0]);
    return 2;
  }
  std::ifstream in(argv[1]);
  const ModelConfig c = parse_hf_config(nlohmann::json::parse(in));
  std::vector<int> ms;
  for (int i = 2; i < argc; ++i) ms.push_back(std::atoi(argv[i]));
  if (ms.empty()) ms = {256, 16384};
  const int D = static_cast<int>(c.hidden_size), F = static_cast<int>(c.intermediate_size);
  const int d = static_cast<int>(c.head_dim), Hq = static_cast<int>(c.num_heads);
  const int Hk = static_cast<int>(c.num_kv_heads), V = static_cast<int>(c.vocab_size);
  struct Shape {
    const char* name;
    int n, k;
    bool f32;
  };
  const std::vector<Shape> shapes = {{"qkv", (Hq + 2 * Hk) * d, D, false},
                                     {"o", D, Hq * d, false},
                                     {"gate_up", 2 * F, D, false},
                                     {"down", D, F, false},
                                     {"lm_head", V, D, true}};
  cuda::GemmHandle *first = nullptr, *tuned = nullptr;
  cuda::check(cuda::gemm_create(&first, size_t{32} << 20), "gemm");
  cuda::check(cuda::gemm_create(&tuned, size_t{32} << 20), "gemm");
  cuda::gemm_set_tuning(tuned, true);
  std::printf("%-8s %6s %6s %6s | %9s %8s | %9s %8s\n", "gemm", "m", "n", "k", "first ms",
              "TFLOP/s", "tuned ms", "TFLOP/s");
  for (const int m : ms) {
    double layers_ms[2] = {0, 0}, head_ms[2] = {0, 0}, flops_layer = 0;
    for (const Shape& s : shapes) {
      // The lm_head runs only on the sampled rows: at a prefill budget, far fewer than m.
      const int rows = s.f32 && m > 256 ? 256 : m;
      void* x = random_bf16(size_t{1} * rows * s.k, 1);
      void* w = random_bf16(size_t{1} * s.n * s.k, 2);
      void* y = nullptr;
      cuda::check(cudaMalloc(&y, size_t{4} * rows * s.n), "malloc");
      double t[2];
      for (int tuning = 0; tuning < 2; ++tuning) {
        cuda::GemmHandle* gemm = tuning ? tuned : first;
        auto run = [&] {
          cuda::check(
              cuda::launch_gemm_bf16(gemm, x, w, nullptr, y, s.f32, rows, s.n, s.k, nullptr),
              "gemm");
        };
        t[tuning] = bench::mean_ms(nullptr, run, 20);  // its untimed first call tunes
        (s.f32 ? head_ms : layers_ms)[tuning] += s.f32 ? t[tuning] : c.num_layers * t[tuning];
      }
      const double flops = 2.0 * rows * s.n * s.k;
      std::printf("%-8s %6d %6d %6d | %9.4f %8.1f | %9.4f %8.1f\n", s.name, rows, s.n, s.k, t[0],
                  flops / t[0] / 1e9, t[1], flops / t[1] / 1e9);
      if (!s.f32) flops_layer += flops;
      for (void* p : {x, w, y}) cudaFree(p);
    }
    for (int tuning = 0; tuning < 2; ++tuning) {
      std::printf("m %d, %s: %d layers %.3f ms (%.0f TFLOP/s), lm_head %.3f ms\n", m,
                  tuning ? "tuned" : "first", c.num_layers, layers_ms[tuning],
                  flops_layer * c.num_layers / 1e9 / layers_ms[tuning], head_ms[tuning]);
    }
    std::printf("\n");
  }
  return 0;
}
