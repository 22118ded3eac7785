#include <cstdio>

#include "pagedlm/cli/commands.h"
#include "pagedlm/core/error.h"

namespace pagedlm::cli {

void add_engine_flags(CLI::App& app, EngineFlags& flags) {
  EngineOptions& o = flags.options;
  app.add_option("--page-size", o.page_size, "tokens per KV page (a power of two)")
      ->capture_default_str();
  app.add_option("--num-pages", o.num_pages, "KV pages (default: sized from memory)");
  app.add_option("--max-num-batched-tokens", o.max_num_batched_tokens,
                 "token budget per step (default: 2048 on the CPU, 16384 on the GPU)");
  app.add_option("--max-num-seqs", o.max_num_seqs, "most sequences running at once")
      ->capture_default_str();
  app.add_flag("--no-prefix-cache", flags.no_prefix_cache, "never share KV pages between requests");
  app.add_option("--threads", o.threads, "CPU threads (default: all)");
  app.add_option("--tensor-parallel-size", o.tensor_parallel_size,
                 "ranks that split the model (a divisor of its attention heads)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--device", flags.device, "cpu, cuda or auto (cuda when a GPU is present)")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  app.add_option("--gpu-memory-fraction", o.gpu_memory_fraction,
                 "CUDA: share of the free device memory the KV cache takes (without --num-pages)")
      ->check(CLI::Range(0.01f, 1.f))
      ->capture_default_str();
  app.add_flag("--no-cuda-graphs", flags.no_cuda_graphs,
               "CUDA: run decode steps eagerly instead of replaying graphs (debugging)");
  app.add_flag("--no-cascade-attention", flags.no_cascade_attention,
               "CUDA: every sequence reads its shared prefix pages itself (A/B runs)");
  app.add_flag("--no-gemm-tuning", flags.no_gemm_tuning,
               "CUDA: take cuBLASLt's first algorithm for each GEMM shape untimed (A/B runs)");
}

EngineOptions EngineFlags::resolve() const {
  EngineOptions o = options;
  o.enable_prefix_cache = !no_prefix_cache;
  o.use_cuda_graphs = !no_cuda_graphs;
  o.use_cascade_attention = !no_cascade_attention;
  o.tune_gemms = !no_gemm_tuning;
  o.device = Device::kCpu;
  if (device == "cpu") return o;
#ifdef PAGEDLM_HAS_CUDA
  if (cuda_device_available()) {
    o.device = Device::kCuda;
  } else if (device == "cuda") {
    fail("--device cuda: no CUDA device found");
  } else {
    std::fprintf(stderr, "pagedlm: no CUDA device found; running on the CPU\n");
  }
#else
  if (device == "cuda") fail("--device cuda: this build of pagedlm has no CUDA support");
#endif
  return o;
}

}  // namespace pagedlm::cli
