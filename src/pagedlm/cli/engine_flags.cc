#include <signal.h>
#include <sys/prctl.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include "pagedlm/cli/commands.h"
#include "pagedlm/core/error.h"
#include "pagedlm/engine/executor.h"
#include "pagedlm/engine/rendezvous.h"

namespace pagedlm::cli {

#ifdef PAGEDLM_HAS_CUDA
namespace {

// This process's command line, as it was started.
std::vector<std::string> own_arguments() {
  std::ifstream in("/proc/self/cmdline", std::ios::binary);
  const std::string all((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::string> args;
  for (size_t at = 0; at < all.size();) {
    const size_t end = all.find('\0', at);
    args.push_back(all.substr(at, end - at));
    at = end == std::string::npos ? all.size() : end + 1;
  }
  PAGEDLM_CHECK(!args.empty(), "cannot read this process's command line");
  return args;
}

// The default launch of tensor parallelism on GPUs: this process is rank 0, and ranks 1..N-1 are
// this same command line started again with their rank and rank 0's loopback endpoint. They end
// with this process (PR_SET_PDEATHSIG), whatever way it ends.
std::string launch_local_ranks(int32_t size) {
  int port = 0;
  {
    RendezvousServer probe("127.0.0.1", 0, size, 0);  // a free port, released for rank 0
    port = probe.port();
  }
  std::string endpoint = cat("127.0.0.1:", port);
  const std::vector<std::string> base = own_arguments();
  const pid_t parent = getpid();
  for (int32_t r = 1; r < size; ++r) {
    std::vector<std::string> args = base;
    for (const std::string& a : {std::string("--tensor-parallel-rank"), std::to_string(r),
                                 std::string("--tensor-parallel-endpoint"), endpoint}) {
      args.push_back(a);
    }
    std::vector<char*> argv;
    argv.reserve(args.size() + 1);
    for (std::string& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    const pid_t pid = fork();
    PAGEDLM_CHECK(pid >= 0, "cannot start tensor-parallel rank ", r);
    if (pid == 0) {
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      // A Ctrl-C in the terminal reaches the whole process group: rank 0 stops cleanly and tells
      // this rank to stop, which a SIGINT of its own would pre-empt.
      signal(SIGINT, SIG_IGN);
      if (getppid() != parent) _exit(1);  // rank 0 already gone
      execv("/proc/self/exe", argv.data());
      std::fprintf(stderr, "pagedlm: cannot start tensor-parallel rank %d\n", r);
      _exit(127);
    }
  }
  return endpoint;
}

}  // namespace
#endif

namespace {

// A rank of this process's group of GPU processes is gone: a collective waiting for it never
// returns, so this process ends, saying why.
[[noreturn]] void end_process(const std::string& why) {
  std::fprintf(stderr, "pagedlm: %s; ending this rank\n", why.c_str());
  std::fflush(stderr);
  std::_Exit(1);
}

}  // namespace

void add_engine_flags(CLI::App& app, EngineFlags& flags) {
  EngineOptions& o = flags.options;
  app.add_option("--page-size", o.page_size, "tokens per KV page (a power of two)")
      ->capture_default_str();
  app.add_option("--num-pages", o.num_pages, "KV pages (default: sized from memory)");
  app.add_option("--kv-cache-dtype", flags.kv_cache_dtype,
                 "KV cache elements: auto (the compute dtype), bf16 (CPU: half the bytes of its "
                 "f32 cache), or fp8 (GPU: e4m3 with the checkpoint's per-layer k_scale / "
                 "v_scale, else 1.0; twice the pages of bf16)")
      // Its value is parsed by resolve() (before any load), whose message names the flag once.
      ->capture_default_str();
  app.add_option("--dtype", flags.dtype,
                 "activations and dense weights: auto (the device's: float32 on the CPU, "
                 "bfloat16 on the GPU, the only ones their kernels take), float32, bfloat16 or "
                 "float16")
      // Parsed by resolve(), checked against the device before any load.
      ->capture_default_str();
  app.add_option("--max-num-batched-tokens", o.max_num_batched_tokens,
                 "token budget per step (default: 2048 on the CPU, 16384 on the GPU)");
  app.add_option("--max-num-seqs", o.max_num_seqs, "most sequences running at once")
      ->capture_default_str();
  app.add_option("--target-itl-ms", o.target_itl_ms,
                 "while sequences decode, cut each step's prefill to what is expected to fit in "
                 "this many ms, the inter-token latency running streams see (0: off; default: "
                 "200 on the CPU, off on the GPU)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-prefix-cache", flags.no_prefix_cache, "never share KV pages between requests");
  app.add_option("--threads", o.threads, "CPU threads (default: all)");
  app.add_flag("--cpu-q8-activations", o.cpu_q8_activations,
               "CPU, GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K to Q6_K, IQ4_NL, IQ4_XS): "
               "quantize the projections' inputs to 8 bits and multiply in integers (faster, not "
               "exact; like llama.cpp)");
  app.add_flag("--cpu-fixed32-activations", o.cpu_fixed32_activations,
               "CPU, GGUF blocks as for --cpu-q8-activations: take the projections' inputs as "
               "32-bit fixed point (four 8-bit digits) through the same integer kernels: as exact "
               "as the default, faster single-stream decode, slower prefill");
  app.add_option("--quantization", flags.quantization,
                 "GPU: fp8 quantizes every projection's weight to FP8 (e4m3, one scale per output "
                 "feature) at load and runs W8A8 GEMMs (GPUs with FP8 tensor cores); auto keeps an "
                 "FP8 checkpoint's weights in FP8 where the GPU can, dequantizing them to bf16 "
                 "elsewhere; none dequantizes every FP8 weight to bf16. With --dummy: a GGUF block "
                 "format (q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k, q6_k) makes the "
                 "projections random blocks of it")
      // Parsed by resolve() (before any load), which also checks a block format against --dummy.
      ->capture_default_str();
  app.add_option("--tensor-parallel-size", o.tensor_parallel_size,
                 "ranks that split the model (a divisor of its attention heads)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--tensor-parallel-endpoint", o.tensor_parallel_endpoint,
                 "GPUs: rank 0's HOST:PORT, where it listens and the other ranks connect "
                 "(default: rank 0 starts ranks 1..N-1 on this machine itself)");
  app.add_option("--tensor-parallel-rank", o.tensor_parallel_rank,
                 "GPUs: this process's rank (with --tensor-parallel-endpoint)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--tensor-parallel-device", o.tensor_parallel_device,
                 "GPUs: this rank's GPU (default: its rank modulo the GPUs it sees)");
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
  CLI::Option* no_async = app.add_flag(
      "--no-async-scheduling", flags.no_async_scheduling,
      "plan each step only after the one before has returned its tokens (A/B runs; the GPU's "
      "default plans step N + 1 while the device runs step N)");
  app.add_flag("--async-scheduling", flags.async_scheduling,
               "plan step N + 1 while step N runs, on the CPU too (the GPU's default)")
      ->excludes(no_async);
  app.add_flag(
      "--gguf-blocks", flags.gguf_blocks,
      "CUDA: keep a GGUF's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q5_K / Q6_K projections in "
      "their blocks (a third to a quarter of bf16's memory; faster single-stream decode "
      "for Q8_0 and Q4_x, slower for K-quants and batches) instead of expanding them to "
      "bf16 at load");
  app.add_flag("--no-gemm-tuning", flags.no_gemm_tuning,
               "CUDA: take cuBLASLt's first algorithm for each GEMM shape untimed (A/B runs)");
}

std::optional<QuantType> EngineFlags::dummy_blocks() const {
  return ggml_quant_type_named(quantization);
}

EngineOptions EngineFlags::resolve() const {
  EngineOptions o = options;
  o.enable_prefix_cache = !no_prefix_cache;
  o.use_cuda_graphs = !no_cuda_graphs;
  o.use_cascade_attention = !no_cascade_attention;
  o.tune_gemms = !no_gemm_tuning;
  o.async_scheduling = no_async_scheduling ? 0 : async_scheduling ? 1 : -1;
  o.gguf_blocks_on_gpu = gguf_blocks;
  o.on_lost_rank = end_process;
  o.fp8_weights = quantization_named(quantization, dummy_weights).fp8_weights;
  o.kv_cache_dtype = kv_cache_dtype_named(kv_cache_dtype);
  o.compute_dtype = compute_dtype_named(dtype);
  o.device = Device::kCpu;
  if (device == "cpu") return o;
#ifdef PAGEDLM_HAS_CUDA
  if (cuda_device_available()) {
    require_supported_cuda_devices();  // an older GPU is refused, not left to fail in a kernel
    o.device = Device::kCuda;
    if (o.tensor_parallel_size > 1 && o.tensor_parallel_endpoint.empty()) {
      // Two ranks on one GPU would fail only later, inside NCCL ("duplicate GPU").
      const int gpus = cuda_device_count();
      PAGEDLM_CHECK(gpus >= o.tensor_parallel_size, "--tensor-parallel-size ",
                    o.tensor_parallel_size, " starts one process per GPU on this machine, but ",
                    gpus, " GPU(s) are visible; ranks on other machines are started by hand ",
                    "with --tensor-parallel-rank and --tensor-parallel-endpoint ",
                    "(docs/TENSOR_PARALLEL.md)");
      o.tensor_parallel_endpoint = launch_local_ranks(o.tensor_parallel_size);
    }
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

bool ran_as_worker_rank(const Checkpoint& checkpoint, const EngineOptions& options) {
  if (options.tensor_parallel_rank == 0) return false;
  run_worker_rank(checkpoint, options);
  return true;
}

}  // namespace pagedlm::cli
