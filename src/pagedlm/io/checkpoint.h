// A checkpoint as the model sees it: a ModelConfig plus CPU tensors under Hugging Face names
// with HF shapes ([out, in] for projections), whatever the file format.
#pragma once

#include <functional>
#include <map>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/io/model_config.h"

namespace pagedlm {

// Called as loading advances: bytes (or tensors) done out of total.
using LoadProgress = std::function<void(size_t done, size_t total)>;

struct Checkpoint {
  ModelConfig config;
  // F32, F16 or BF16. Safetensors tensors are views of the mapped files; GGUF tensors are
  // dequantized to F32 (and attn_q/attn_k un-permuted back to HF's rope layout), except:
  std::map<std::string, Tensor> tensors;
  // GGUF Q4_1 and Q8_0 matrices, kept in their blocks (rows in HF order): backends that compute
  // from blocks read them here, get() dequantizes them for the others.
  std::map<std::string, QuantizedMatrix> quantized;

  bool has(const std::string& name) const {
    return tensors.count(name) != 0 || quantized.count(name) != 0;
  }
  // The tensor (a quantized matrix dequantized to F32, a new tensor each call). Throws
  // pagedlm::Error naming the tensor if it is missing or its shape differs.
  Tensor get(const std::string& name, const Shape& expected_shape) const;
  // The matrix's blocks, or null when it has none; throws if its shape differs.
  const QuantizedMatrix* blocks(const std::string& name, const Shape& expected_shape) const;
  // Every tensor's name and shape, quantized ones included, in name order.
  std::map<std::string, Shape> shapes() const;
};

// Every tensor the model reads, under its HF name with its HF shape, in load order:
// embeddings, each layer's attention then MLP, the final norm, and lm_head unless tied.
// The one list both the loader's checks and the model code's lookups are made from.
std::vector<std::pair<std::string, Shape>> expected_tensor_shapes(const ModelConfig& config);

// Parses an HF config.json (both the Hub's top-level rope_theta/rope_scaling style and
// transformers 5's rope_parameters). Throws for unsupported architectures, naming them.
ModelConfig parse_hf_config(const nlohmann::json& config);

// `path` is an HF folder (config.json + model.safetensors or a sharded index) or a .gguf file.
Checkpoint load_checkpoint(const std::string& path, const LoadProgress& progress = {});
Checkpoint load_hf_checkpoint(const std::string& dir, const LoadProgress& progress = {});
Checkpoint load_gguf_checkpoint(const std::string& path, const LoadProgress& progress = {});

}  // namespace pagedlm
