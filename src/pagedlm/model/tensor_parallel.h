// Tensor parallelism: which share of the model one rank of N holds. Attention is split by heads
// (q/k/v by output rows, o by input columns), the MLP by its intermediate size (gate/up by output
// rows, down by input columns), the embedding and the lm_head by vocabulary; o and down are each
// followed by one all-reduce, the embedding by one all-reduce and the lm_head by an all-gather.
// Which rule a layer weight follows is declared in its family's table (model/family.h Shard).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/tensor.h"
#include "pagedlm/model/family.h"
#include "pagedlm/model/model_config.h"

namespace pagedlm {

struct TensorParallel {
  int32_t rank = 0;
  int32_t size = 1;
};

// Throws an Error saying why, unless `size` ranks can split this model: size >= 1 divides the q
// heads, the kv heads divide by size or size by them (kv heads are then replicated), and size
// divides the intermediate size and the vocabulary.
void check_tensor_parallel(const ModelConfig& config, int32_t size);

// What one rank holds of the attention, the MLP and the vocabulary.
struct RankDims {
  int64_t q_heads = 0;
  int64_t kv_heads = 0;       // max(1, Hk / size)
  int64_t kv_head_begin = 0;  // its first kv head
  int64_t ffn = 0;            // intermediate_size / size
  int64_t vocab = 0;          // vocab_size / size
  int64_t vocab_begin = 0;
};
RankDims rank_dims(const ModelConfig& config, TensorParallel tp);

// One rank's share of a weight of full shape `shape` under `rule`: the row ranges [begin, end)
// to stack in order, or (by_cols) the one range of input columns of every row.
struct ShardRanges {
  bool by_cols = false;
  std::vector<std::pair<int64_t, int64_t>> ranges;
};
ShardRanges shard_ranges(const ModelConfig& config, TensorParallel tp, Shard rule,
                         const Shape& shape);

// The rule of a tensor the model reads, by its HF name (expected_tensor_shapes' names): a
// layer weight's from its family's table, the embedding's and the lm_head's by vocabulary
// (kRows), the rest (the final norm, rope_freqs) kReplicated.
Shard shard_of_tensor(const ModelConfig& config, const std::string& name);

}  // namespace pagedlm
