// A checkpoint as the model sees it: a ModelConfig plus CPU tensors under Hugging Face names
// with HF shapes ([out, in] for projections), whatever the file format. The file readers are in
// io/; what the names and keys mean comes from the model's family.
#pragma once

#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/io/hf_folder.h"
#include "pagedlm/io/quant_config.h"
#include "pagedlm/model/family.h"
#include "pagedlm/model/fp8_weights.h"
#include "pagedlm/model/model_config.h"

namespace pagedlm {

struct Checkpoint {
  ModelConfig config;
  // F32, F16 or BF16. Safetensors tensors are views of the mapped files; GGUF tensors are
  // dequantized to F32 (and attn_q/attn_k un-permuted back to HF's rope layout), except:
  std::map<std::string, Tensor> tensors;
  // GGUF matrices of the block formats the CPU computes with (io/gguf.h: cpu_block_format), kept in
  // their blocks (rows in HF order): backends that compute from blocks read them here, get()
  // dequantizes them for the others.
  std::map<std::string, QuantizedMatrix> quantized;
  // FP8 checkpoints (config.json's quantization_config): the projection weights in e4m3 with
  // their scales; get() dequantizes them. The attention layers' k_scale / v_scale, where the
  // checkpoint has them, are in kv_scales for an e4m3 KV cache (PagedKvCache::checkpoint_scales).
  QuantConfig quantization;
  std::map<std::string, Fp8Matrix> fp8;
  std::map<std::string, Tensor> kv_scales;

  bool has(const std::string& name) const {
    return tensors.count(name) != 0 || quantized.count(name) != 0 || fp8.count(name) != 0;
  }
  // The tensor (a quantized or FP8 matrix dequantized to F32, a new tensor each call). Throws
  // pagedlm::Error naming the tensor if it is missing or its shape differs.
  Tensor get(const std::string& name, const Shape& expected_shape) const;
  // The matrix's blocks, or null when it has none; throws if its shape differs.
  const QuantizedMatrix* blocks(const std::string& name, const Shape& expected_shape) const;
  // Every tensor's name and shape, quantized ones included, in name order.
  std::map<std::string, Shape> shapes() const;
  // Drops the weights, keeping the config: once an Engine is built, the model holds what it
  // computes with (a GGUF's blocks copied and repacked for the CPU), and the checkpoint's own
  // copy would stay resident for the life of the process (SmolLM2 Q4_0: 92 MB).
  void release_weights();
};

class GgufFile;

// Parses an HF config.json through its family (model/family.h), in both the Hub's older key
// style and transformers 5's. Throws for unsupported architectures, naming them.
ModelConfig parse_hf_config(const nlohmann::json& config);

// Maps a GGUF file's metadata to a ModelConfig through its family; throws naming any other
// architecture or a missing key. tie_word_embeddings is true when output.weight is absent.
// Llama 3.1 rope scaling is not expressed in the metadata: such files carry rope_freqs.weight,
// which load_gguf_checkpoint stores as the tensor "rope_freqs" (F32 [head_dim/2]); the model
// divides inv_freq[i] by rope_freqs[i].
ModelConfig config_from_gguf(const GgufFile& file);

// `path` is an HF folder (config.json + model.safetensors or a sharded index) or a .gguf file.
Checkpoint load_checkpoint(const std::string& path, const LoadProgress& progress = {});
Checkpoint load_hf_checkpoint(const std::string& dir, const LoadProgress& progress = {});
Checkpoint load_gguf_checkpoint(const std::string& path, const LoadProgress& progress = {});

}  // namespace pagedlm
