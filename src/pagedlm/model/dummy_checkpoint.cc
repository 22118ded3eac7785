#include "pagedlm/model/dummy_checkpoint.h"

#include <omp.h>

#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

namespace pagedlm {

namespace {

// A cheap counter-based generator: any element can be drawn independently, so the fill is
// parallel and the same for any thread count.
float uniform_at(uint64_t seed, uint64_t i) {
  uint64_t z = seed + (i + 1) * 0x9e3779b97f4a7c15ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) / static_cast<float>(1 << 24) * 2.f - 1.f;
}

// MemAvailable from /proc/meminfo in bytes, or -1 where it cannot be read (not Linux).
int64_t available_memory_bytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  int64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return -1;
}

// The weights a GGUF quantizer turns into blocks: the projections' matrices (not the embeddings,
// norms, router or the experts' stacks).
bool quantizable_projection(const std::string& name, const Shape& shape) {
  const auto ends_with = [&](std::string_view tail) {
    return name.size() >= tail.size() &&
           name.compare(name.size() - tail.size(), tail.size(), tail) == 0;
  };
  return shape.size() == 2 && name.find("experts") == std::string::npos &&
         (ends_with("_proj.weight") || name == "lm_head.weight");
}

}  // namespace

Checkpoint make_dummy_checkpoint(const ModelConfig& config, uint64_t seed, TensorParallel tp,
                                 std::optional<QuantType> blocks) {
  check_tensor_parallel(config, tp.size);
  PAGEDLM_CHECK(!blocks || tp.size == 1, "random ", blocks ? quant_format(*blocks).name : "",
                " blocks: one rank only (a tensor-parallel share of a block format is not cut)");
  // The weights are drawn as bf16 on the host first (the GPU's compute dtype, so they upload
  // without conversion; a Mixtral-8x7B config would not fit a host in f32): refuse a config
  // that cannot fit rather than be killed by the kernel half-way (an 8B config needs 16 GB).
  // A tensor-parallel rank writes about its share.
  double bytes = 0;  // double: an absurd config must not overflow the estimate
  for (const auto& [name, shape] : expected_tensor_shapes(config)) {
    double n = blocks && quantizable_projection(name, shape)
                   ? static_cast<double>(quant_format(*blocks).block_bytes) /
                         static_cast<double>(quant_format(*blocks).block_elems)
                   : sizeof(uint16_t);
    for (const int64_t dim : shape) n *= static_cast<double>(dim);
    bytes += n / (shard_of_tensor(config, name) == Shard::kReplicated ? 1 : tp.size);
  }
  const int64_t available = available_memory_bytes();
  PAGEDLM_CHECK(available < 0 || bytes <= static_cast<double>(available),
                "random weights of this config take ", static_cast<int64_t>(bytes / (1 << 20)),
                " MiB of host memory and only ", available >> 20, " MiB are available");
  Checkpoint ckpt;
  ckpt.config = config;
  uint64_t tensor_seed = seed;
  for (const auto& [name, shape] : expected_tensor_shapes(config)) {
    if (blocks && quantizable_projection(name, shape)) {
      // The bf16 draw's range, 1/sqrt(fan_in), as each block's largest weight.
      ckpt.quantized.emplace(name,
                             random_quantized_matrix(*blocks, shape[0], shape[1],
                                                     1.f / std::sqrt(static_cast<float>(shape[1])),
                                                     ++tensor_seed * 0x2545f4914f6cdd1dULL));
      continue;
    }
    Tensor t = Tensor::empty(DType::kBF16, shape);
    const bool is_norm = name.find("norm") != std::string::npos;
    // Projections scaled by 1/sqrt(fan_in) keep activations O(1) through the layers.
    const float scale = is_norm ? 0.1f : 1.f / std::sqrt(static_cast<float>(shape.back()));
    // Norm weights near 1 as the model multiplies them (Gemma stores w - 1).
    const float offset = is_norm ? 1.f - config.norm_weight_offset : 0.f;
    uint16_t* data = t.data<uint16_t>();
    const uint64_t s = ++tensor_seed * 0x2545f4914f6cdd1dULL;
    // Element i of the tensor (row-major) is drawn from counter i whatever the rank.
    auto draw = [&](int64_t i) { data[i] = f32_to_bf16(offset + scale * uniform_at(s, i)); };
    const int64_t row = shape[0] == 0 ? 0 : t.numel() / shape[0];
    const ShardRanges share = shard_ranges(config, tp, shard_of_tensor(config, name), shape);
    if (share.by_cols) {
      // One parallel region over the rows, not one per row: an 8B config's column shares have
      // 14k rows a layer, and ranks sharing a host's cores waited on each region's threads for
      // minutes (two ranks on one 16-core host did not finish a Qwen3-0.6B config in 100 s).
      // Plain locals: an OpenMP region may not name structured bindings (clang refuses).
      const int64_t rows = shape[0], begin = share.ranges.front().first,
                    end = share.ranges.front().second;
#pragma omp parallel for schedule(static)
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t i = r * row + begin; i < r * row + end; ++i) draw(i);
      }
    } else {
      for (const std::pair<int64_t, int64_t>& range : share.ranges) {
        const int64_t begin = range.first * row, end = range.second * row;
#pragma omp parallel for schedule(static)
        for (int64_t i = begin; i < end; ++i) draw(i);
      }
    }
    ckpt.tensors.emplace(name, std::move(t));
  }
  return ckpt;
}

Checkpoint make_dummy_checkpoint(const std::string& config_json_path, uint64_t seed,
                                 TensorParallel tp, std::optional<QuantType> blocks) {
  return make_dummy_checkpoint(parse_hf_config(read_json_file(config_json_path)), seed, tp, blocks);
}

}  // namespace pagedlm
