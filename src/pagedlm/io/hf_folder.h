// Reading a Hugging Face checkpoint folder's files: its JSON files and its safetensors tensors
// (model.safetensors, or the shards model.safetensors.index.json lists). What the tensors mean
// is the model families' business (model/).
#pragma once

#include <cstddef>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <string>

#include "pagedlm/core/tensor.h"

namespace pagedlm {

// Called as loading advances: bytes (or tensors) done out of total.
using LoadProgress = std::function<void(size_t done, size_t total)>;

// The parsed file; throws pagedlm::Error naming the file when it is unreadable or not JSON.
nlohmann::json read_json_file(const std::string& path);

// True when the file starts with the GGUF magic.
bool has_gguf_magic(const std::string& path);

// Every tensor of the folder's safetensors files, as views of the mapped files; throws naming
// a missing shard, an index entry that is not a plain file name or a tensor missing from its
// shard.
std::map<std::string, Tensor> read_safetensors_folder(const std::string& dir,
                                                      const LoadProgress& progress = {});

}  // namespace pagedlm
