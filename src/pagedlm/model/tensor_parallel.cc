#include "pagedlm/model/tensor_parallel.h"

#include <algorithm>

#include "pagedlm/core/error.h"

namespace pagedlm {

void check_tensor_parallel(const ModelConfig& c, int32_t size) {
  PAGEDLM_CHECK(size >= 1, "tensor parallel size must be >= 1, got ", size);
  if (size == 1) return;
  const int64_t Hq = c.num_heads, Hk = c.num_kv_heads;
  PAGEDLM_CHECK(Hq % size == 0, "tensor parallel size ", size, " does not divide the ", Hq,
                " attention heads of this model");
  PAGEDLM_CHECK(Hk % size == 0 || size % Hk == 0, "tensor parallel size ", size,
                " neither divides the ", Hk, " kv heads of this model nor is a multiple of them");
  PAGEDLM_CHECK(c.intermediate_size % size == 0, "tensor parallel size ", size,
                " does not divide the MLP's intermediate size ", c.intermediate_size);
  for (const LayerSpec& layer : c.layers) {
    PAGEDLM_CHECK(!layer.sparse_mlp, "tensor parallelism does not split mixture-of-experts ",
                  "layers yet; run this model with tensor parallel size 1");
  }
  PAGEDLM_CHECK(c.vocab_size % size == 0, "tensor parallel size ", size,
                " does not divide the vocabulary of ", c.vocab_size,
                " tokens (the embedding and the lm_head are split by vocabulary)");
}

RankDims rank_dims(const ModelConfig& c, TensorParallel tp) {
  PAGEDLM_CHECK(tp.rank >= 0 && tp.rank < tp.size, "tensor-parallel rank ", tp.rank,
                " is outside [0, ", tp.size, ")");
  check_tensor_parallel(c, tp.size);
  RankDims d;
  d.q_heads = c.num_heads / tp.size;
  d.kv_heads = std::max<int64_t>(1, c.num_kv_heads / tp.size);
  // With fewer kv heads than ranks, ranks r * Hk / size share a kv head: the one their q heads
  // read (size / Hk consecutive ranks hold the q heads of one kv head's group).
  d.kv_head_begin = tp.rank * c.num_kv_heads / tp.size;
  d.ffn = c.intermediate_size / tp.size;
  d.vocab = c.vocab_size / tp.size;
  d.vocab_begin = tp.rank * d.vocab;
  return d;
}

Shard shard_of_tensor(const ModelConfig& config, const std::string& name) {
  if (name == "model.embed_tokens.weight" || name == "lm_head.weight") return Shard::kRows;
  const Family& family = family_of(config);
  for (const LayerWeightName& w : family.layer_weights) {
    const std::string suffix = std::string(".") + w.hf;
    if (name.rfind("model.layers.", 0) == 0 && name.size() > suffix.size() &&
        name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0) {
      return w.shard;
    }
  }
  return Shard::kReplicated;
}

ShardRanges shard_ranges(const ModelConfig& c, TensorParallel tp, Shard rule, const Shape& shape) {
  PAGEDLM_CHECK(!shape.empty(), "a sharded tensor needs at least one dimension");
  ShardRanges out;
  const int64_t rows = shape[0];
  if (tp.size == 1 || rule == Shard::kReplicated) {
    out.ranges.emplace_back(0, rows);
    return out;
  }
  const RankDims d = rank_dims(c, tp);
  // Rows [begin, end) of an evenly split block of n rows starting at `at`.
  auto even = [&](int64_t at, int64_t n) {
    PAGEDLM_CHECK(n % tp.size == 0, "tensor parallel size ", tp.size, " does not divide ", n,
                  " rows of a weight of shape ", shape_str(shape));
    out.ranges.emplace_back(at + tp.rank * (n / tp.size), at + (tp.rank + 1) * (n / tp.size));
  };
  const int64_t per_kv_head = c.num_kv_heads > 0 ? shape[0] / c.num_kv_heads : 0;
  auto kv_heads = [&](int64_t at, int64_t row_per_head) {
    out.ranges.emplace_back(at + d.kv_head_begin * row_per_head,
                            at + (d.kv_head_begin + d.kv_heads) * row_per_head);
  };
  switch (rule) {
    case Shard::kReplicated:
      break;
    case Shard::kNotSplit:
      fail("a weight of shape ", shape_str(shape), " has no tensor-parallel split yet");
    case Shard::kRows:
      even(0, rows);
      break;
    case Shard::kKvHeadRows:
      PAGEDLM_CHECK(rows % c.num_kv_heads == 0, "a weight of shape ", shape_str(shape),
                    " does not hold whole rows for ", c.num_kv_heads, " kv heads");
      kv_heads(0, per_kv_head);
      break;
    case Shard::kQkvHeadRows: {
      const int64_t dh = c.head_dim, q_rows = c.num_heads * dh, kv_rows = c.num_kv_heads * dh;
      PAGEDLM_CHECK(rows == q_rows + 2 * kv_rows, "a fused q/k/v weight of shape ",
                    shape_str(shape), " does not have ", q_rows + 2 * kv_rows, " rows");
      even(0, q_rows);
      kv_heads(q_rows, dh);
      kv_heads(q_rows + kv_rows, dh);
      break;
    }
    case Shard::kHalvesRows:
      PAGEDLM_CHECK(rows % 2 == 0, "a fused gate/up weight of shape ", shape_str(shape),
                    " has an odd number of rows");
      even(0, rows / 2);
      even(rows / 2, rows / 2);
      break;
    case Shard::kCols: {
      PAGEDLM_CHECK(shape.size() == 2, "a weight split by input columns must be a matrix, got ",
                    shape_str(shape));
      const int64_t cols = shape[1];
      PAGEDLM_CHECK(cols % tp.size == 0, "tensor parallel size ", tp.size, " does not divide ",
                    cols, " input columns of a weight of shape ", shape_str(shape));
      out.by_cols = true;
      out.ranges.emplace_back(tp.rank * (cols / tp.size), (tp.rank + 1) * (cols / tp.size));
      break;
    }
  }
  return out;
}

}  // namespace pagedlm
