// safetensors: memory-mapped reading (validated against the format's rules) and writing.
#pragma once

#include <map>
#include <memory>
#include <string>

#include "pagedlm/core/tensor.h"

namespace pagedlm {

class SafetensorsFile {
 public:
  // Throws pagedlm::Error naming the file and the problem (truncated, bad header JSON,
  // offsets that do not tile the buffer, unsupported dtype, size/shape mismatch).
  static SafetensorsFile open(const std::string& path);

  // Views into the mapping; they keep it alive. The mapping is read-only: copy a tensor before
  // writing to it.
  const std::map<std::string, Tensor>& tensors() const { return tensors_; }
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::map<std::string, Tensor> tensors_;
  std::map<std::string, std::string> metadata_;
};

// Writes CPU tensors (F32, F16, BF16, I32, U8, F8_E4M3) with HF's layout (8-byte aligned header).
void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors);

}  // namespace pagedlm
