// pagedlm bench: offline throughput through the real engine, as a table or JSON.
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <nlohmann/json.hpp>
#include <numeric>
#include <optional>
#include <vector>

#include "pagedlm/cli/commands.h"
#include "pagedlm/cli/interrupt.h"
#include "pagedlm/cli/model_path.h"
#include "pagedlm/engine/benchmark.h"
#include "pagedlm/model/dummy_checkpoint.h"

namespace pagedlm::cli {

namespace {

nlohmann::json to_json(const BenchmarkResult& r, const WorkloadSpec& w) {
  return {{"workload", w.kind},
          {"requests", r.num_requests},
          {"prompt_tokens", r.prompt_tokens},
          {"generated_tokens", r.generated_tokens},
          {"wall_s", r.wall_s},
          {"output_tok_s", r.output_tok_s},
          {"total_tok_s", r.total_tok_s},
          {"ttft_p50_ms", r.ttft_p50_ms},
          {"ttft_p99_ms", r.ttft_p99_ms},
          {"itl_p50_ms", r.itl_p50_ms},
          {"itl_p99_ms", r.itl_p99_ms},
          {"prefix_hit_rate", r.prefix_hit_rate},
          {"peak_pages_used", r.peak_pages_used},
          {"kv_pages", r.kv_pages},
          {"preemptions", r.preemptions},
          {"logits_downloads", r.logits_downloads},
          {"steps", r.steps},
          {"decode_steps", r.decode_steps},
          {"decode_s", r.decode_s},
          {"decode_gpu_s", r.decode_gpu_s},
          {"decode_gap_gpu_s", r.decode_gap_gpu_s},
          {"decode_gaps", r.decode_gaps},
          {"decode_host",
           {{"schedule_s", r.decode_schedule_s},
            {"prepare_s", r.decode_prepare_s},
            {"wait_s", r.decode_wait_s},
            {"finish_s", r.decode_finish_s}}},
          {"decode_launch_s", r.decode_launch_s},
          {"prefill_steps", r.prefill_steps},
          {"prefill_host", {{"launch_s", r.prefill_launch_s}, {"wait_s", r.prefill_wait_s}}},
          {"prefill_gpu_s", r.prefill_gpu_s},
          {"decode_bytes_per_s", r.decode_bytes_per_s},
          {"step_weight_bytes_by_format", r.step_weight_bytes_by_format},
          {"gpu_s", r.gpu_s},
          {"bound_output_tok_s", r.bound_output_tok_s},
          {"bound_fraction", r.bound_fraction}};
}

void print_table(const BenchmarkResult& r, const WorkloadSpec& w) {
  std::printf("%-22s %s\n", "workload", w.kind.c_str());
  std::printf("%-22s %lld\n", "requests", static_cast<long long>(r.num_requests));
  std::printf("%-22s %lld\n", "prompt tokens", static_cast<long long>(r.prompt_tokens));
  std::printf("%-22s %lld\n", "generated tokens", static_cast<long long>(r.generated_tokens));
  std::printf("%-22s %.3f\n", "wall time (s)", r.wall_s);
  std::printf("%-22s %.1f\n", "output tok/s", r.output_tok_s);
  std::printf("%-22s %.1f\n", "total tok/s", r.total_tok_s);
  std::printf("%-22s %.2f / %.2f\n", "TTFT p50/p99 (ms)", r.ttft_p50_ms, r.ttft_p99_ms);
  std::printf("%-22s %.2f / %.2f\n", "ITL p50/p99 (ms)", r.itl_p50_ms, r.itl_p99_ms);
  std::printf("%-22s %.1f%%\n", "prefix-cache hit rate", 100 * r.prefix_hit_rate);
  std::printf("%-22s %d of %d\n", "peak pages used", r.peak_pages_used, r.kv_pages);
  std::printf("%-22s %lld\n", "preemptions", static_cast<long long>(r.preemptions));
  std::printf("%-22s %lld\n", "steps", static_cast<long long>(r.steps));
  std::printf("%-22s %lld\n", "logits downloads", static_cast<long long>(r.logits_downloads));
  std::printf("%-22s %lld steps, %.3f s (device %.3f s), %.1f GB/s\n", "decode",
              static_cast<long long>(r.decode_steps), r.decode_s, r.decode_gpu_s,
              r.decode_bytes_per_s / 1e9);
  std::string formats;
  for (const auto& [format, bytes] : r.step_weight_bytes_by_format) {
    char part[160];
    std::snprintf(part, sizeof(part), "%s%s %.1f MB", formats.empty() ? "" : ", ", format.c_str(),
                  static_cast<double>(bytes) / 1e6);
    formats += part;
  }
  std::printf("%-22s %s\n", "weights read a step", formats.c_str());
  if (r.decode_steps > 0) {
    const double per_step = 1e3 / static_cast<double>(r.decode_steps);
    std::printf("%-22s schedule %.3f, prepare %.3f (launch %.3f), wait %.3f, finish %.3f\n",
                "decode host ms/step", r.decode_schedule_s * per_step,
                r.decode_prepare_s * per_step, r.decode_launch_s * per_step,
                r.decode_wait_s * per_step, r.decode_finish_s * per_step);
  }
  if (r.prefill_steps > 0) {
    const double per_step = 1e3 / static_cast<double>(r.prefill_steps);
    std::printf("%-22s launch %.3f, wait %.3f, device %.3f (%lld steps)\n", "prefill host ms/step",
                r.prefill_launch_s * per_step, r.prefill_wait_s * per_step,
                r.prefill_gpu_s * per_step, static_cast<long long>(r.prefill_steps));
  }
  if (r.decode_gaps > 0) {
    std::printf("%-22s %.3f s over %lld gaps (%.1f%% of the decode steps' device time)\n",
                "device idle, decode", r.decode_gap_gpu_s, static_cast<long long>(r.decode_gaps),
                r.decode_gpu_s > 0 ? 100 * r.decode_gap_gpu_s / r.decode_gpu_s : 0.0);
  }
  if (r.gpu_s > 0) std::printf("%-22s %.3f s\n", "device time, all steps", r.gpu_s);
  if (r.bound_output_tok_s > 0) {
    std::printf("%-22s %.1f output tok/s (this run: %.1f%% of it)\n", "lower-bound time gives",
                r.bound_output_tok_s, 100 * r.bound_fraction);
  }
}

}  // namespace

void register_bench(CLI::App& app) {
  auto* cmd = app.add_subcommand("bench", "offline throughput benchmark through the engine");
  struct Args {
    std::string model, dummy;
    WorkloadSpec spec;
    std::string output_range;
    bool json = false;
    double min_tok_s = 0;
    int repeat = 1;
    DevicePeaks peaks;
    EngineFlags flags;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "HF folder or .gguf file (default: SmolLM2 GGUF)");
  cmd->add_option("--dummy", args->dummy, "config.json: benchmark random weights of that shape");
  cmd->add_option("--workload", args->spec.kind, "random | shared-prefix | chat")
      ->check(CLI::IsMember({"random", "shared-prefix", "chat"}))
      ->capture_default_str();
  cmd->add_option("--num-requests", args->spec.num_requests, "requests (chat: conversations)")
      ->capture_default_str();
  cmd->add_option("--seed", args->spec.seed, "workload seed")->capture_default_str();
  cmd->add_option("--prompt-min", args->spec.prompt_min, "shortest prompt")->capture_default_str();
  cmd->add_option("--prompt-max", args->spec.prompt_max, "longest prompt")->capture_default_str();
  cmd->add_option("--output-min", args->spec.output_min, "fewest output tokens")
      ->capture_default_str();
  cmd->add_option("--output-max", args->spec.output_max, "most output tokens")
      ->capture_default_str();
  cmd->add_option("--prefix-len", args->spec.prefix_len, "shared-prefix: shared tokens")
      ->capture_default_str();
  cmd->add_option("--unique-len", args->spec.unique_len,
                  "shared-prefix: unique tokens per request; chat: user tokens per turn")
      ->capture_default_str();
  cmd->add_option("--turns", args->spec.turns, "chat: turns per conversation")
      ->capture_default_str();
  cmd->add_option("--warmup", args->spec.warmup_requests, "untimed warm-up requests first")
      ->capture_default_str();
  cmd->add_option("--temperature", args->spec.sampling.temperature,
                  "every timed request's temperature (0: greedy)")
      ->capture_default_str();
  cmd->add_option("--presence-penalty", args->spec.sampling.presence_penalty,
                  "every timed request's presence penalty, [-2, 2]")
      ->capture_default_str();
  cmd->add_option("--frequency-penalty", args->spec.sampling.frequency_penalty,
                  "every timed request's frequency penalty, [-2, 2]")
      ->capture_default_str();
  cmd->add_option("--repetition-penalty", args->spec.sampling.repetition_penalty,
                  "every timed request's repetition penalty, > 0")
      ->capture_default_str();
  cmd->add_option("--logprobs", args->spec.logprobs,
                  "every timed request's logprobs with that many top tokens (-1: none)")
      ->capture_default_str();
  cmd->add_option("--peak-gb-s", args->peaks.bytes_per_s,
                  "device bandwidth for the lower bound, GB/s (CUDA default: the H200's measured "
                  "4280)");
  cmd->add_option("--peak-tflops", args->peaks.flops_per_s,
                  "device bf16 matrix rate for the lower bound, TFLOP/s (CUDA default: 790)");
  cmd->add_option("--repeat", args->repeat,
                  "timed runs on one engine (the warm-up once; each repeat the same lengths "
                  "with other tokens); reports the run with the median output tok/s")
      ->check(CLI::Range(1, 100))
      ->capture_default_str();
  cmd->add_flag("--json", args->json, "print the result as JSON");
  cmd->add_option("--min-tok-s", args->min_tok_s,
                  "fail (exit 2) when output tok/s falls below this");
  add_engine_flags(*cmd, args->flags);
  cmd->callback([args] {
    // Ctrl-C ends the load, the random weights and the engine's start-up at once; from the
    // warm-up on it stops the run within a step, between two layers of a long CPU step.
    catch_stop_signals();
    std::optional<StopSignalsEndAtOnce> starting(std::in_place);
    args->flags.dummy_weights = !args->dummy.empty();
    const EngineOptions options = args->flags.resolve();  // a bad --device fails before the load
    // On GPUs each tensor-parallel rank is a process drawing its share of the random weights
    // only (model/dummy_checkpoint.h); the CPU's ranks are threads sharing one checkpoint.
    const bool on_gpu = options.device == Device::kCuda;
    const TensorParallel tp =
        on_gpu ? TensorParallel{options.tensor_parallel_rank, options.tensor_parallel_size}
               : TensorParallel{};
    Checkpoint ckpt = args->dummy.empty() ? load_with_progress(resolve_model_path(args->model))
                                          : make_dummy_checkpoint(args->dummy, args->spec.seed, tp,
                                                                  args->flags.dummy_blocks());
    if (ran_as_worker_rank(ckpt, options)) return;
    Engine engine(ckpt, options);
    ckpt.release_weights();
    engine.set_abandon_check([] { return stop_signal() != 0; });
    starting.reset();
    DevicePeaks peaks{args->peaks.bytes_per_s * 1e9, args->peaks.flops_per_s * 1e12};
    if (engine.options().device == Device::kCuda) {
      if (peaks.bytes_per_s <= 0) peaks.bytes_per_s = 4280e9;
      if (peaks.flops_per_s <= 0) peaks.flops_per_s = 790e12;
      // The peaks are one GPU's; tensor-parallel ranks read their shares side by side.
      peaks.bytes_per_s *= options.tensor_parallel_size;
      peaks.flops_per_s *= options.tensor_parallel_size;
    }
    const bool tty = isatty(fileno(stderr));
    auto progress = [tty](int64_t done, int64_t total) {
      if (!tty && done != total) return;
      std::fprintf(stderr, "\rbench: %lld/%lld requests done", static_cast<long long>(done),
                   static_cast<long long>(total));
      if (done == total) std::fprintf(stderr, "\n");
    };
    std::vector<BenchmarkResult> runs;
    for (int i = 0; i < args->repeat; ++i) {
      WorkloadSpec spec = args->spec;
      spec.token_variant = static_cast<uint64_t>(i);
      if (i > 0) spec.warmup_requests = 0;
      runs.push_back(
          run_benchmark(engine, spec, progress, peaks, [] { return stop_signal() != 0; }));
      if (runs.back().interrupted) {
        std::fprintf(stderr, "%sbench: interrupted before run %d of %d finished; no results\n",
                     tty ? "\n" : "", i + 1, args->repeat);
        std::exit(stop_exit_status());
      }
    }
    std::vector<size_t> order(runs.size());
    std::iota(order.begin(), order.end(), 0);
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return runs[a].output_tok_s < runs[b].output_tok_s; });
    const BenchmarkResult& r = runs[order[(runs.size() - 1) / 2]];  // the (lower) median
    std::vector<double> each;
    each.reserve(runs.size());
    for (const BenchmarkResult& run : runs) each.push_back(run.output_tok_s);
    if (args->json) {
      nlohmann::json j = to_json(r, args->spec);
      if (runs.size() > 1) j["repeat_output_tok_s"] = each;
      std::printf("%s\n", j.dump(2).c_str());
    } else {
      print_table(r, args->spec);
      if (runs.size() > 1) {
        std::printf("%-22s", "repeats, output tok/s");
        for (const double v : each) std::printf(" %.1f", v);
        std::printf(" (the table: the median run)\n");
      }
    }
    if (r.output_tok_s < args->min_tok_s) {
      std::fprintf(stderr, "error: %.1f output tok/s is below --min-tok-s %.1f\n", r.output_tok_s,
                   args->min_tok_s);
      std::exit(2);
    }
  });
}

}  // namespace pagedlm::cli
