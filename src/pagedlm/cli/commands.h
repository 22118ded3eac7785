// The pagedlm command line: one function per subcommand, sharing the engine options.
#pragma once

#include <CLI/CLI.hpp>
#include <optional>
#include <string>

#include "pagedlm/core/quantized.h"
#include "pagedlm/engine/engine.h"

namespace pagedlm::cli {

// Flags every command that runs the engine accepts.
struct EngineFlags {
  EngineOptions options;
  bool no_prefix_cache = false;
  bool no_cuda_graphs = false;
  bool no_async_scheduling = false, async_scheduling = false;
  bool no_cascade_attention = false;
  bool no_gemm_tuning = false;
  bool gguf_blocks = false;  // EngineOptions::gguf_blocks_on_gpu
  std::string device = "auto";
  // auto, fp8 or none: EngineOptions::fp8_weights; or a GGUF block format for --dummy weights
  std::string quantization = "auto";
  std::string kv_cache_dtype = "auto";  // auto, bf16 or fp8: EngineOptions::kv_cache_dtype
  std::string dtype = "auto";           // EngineOptions::compute_dtype (compute_dtype_named)
  bool dummy_weights = false;           // the command loads --dummy weights (block formats apply)
  // Applies the parsed flags (device choice, prefix cache) and returns the options.
  EngineOptions resolve() const;
  // The block format --quantization names for --dummy weights (q4_k, q8_0, ...), else nullopt.
  std::optional<QuantType> dummy_blocks() const;
};
void add_engine_flags(CLI::App& app, EngineFlags& flags);
// A command that runs the engine runs unchanged on every rank of a group of GPU processes; on a
// rank other than 0 (--tensor-parallel-rank) it calls this in place of building an engine: the
// rank runs rank 0's steps (run_worker_rank) and this returns true once rank 0 is done, when
// the command ends. False on rank 0.
bool ran_as_worker_rank(const Checkpoint& checkpoint, const EngineOptions& options);

void register_logits(CLI::App& app);
void register_generate(CLI::App& app);
void register_bench(CLI::App& app);
void register_inspect(CLI::App& app);
void register_serve(CLI::App& app);

}  // namespace pagedlm::cli
