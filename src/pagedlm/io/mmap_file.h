// MappedFile: a whole file mapped read-only into memory. Tensors that view the mapping hold
// the shared_ptr as their owner, so the mapping lives as long as any view of it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>

namespace pagedlm {

class MappedFile {
 public:
  // Throws pagedlm::Error naming the path if it cannot be opened, is not a regular file or
  // cannot be mapped. An empty file maps to data() == nullptr, size() == 0.
  static std::shared_ptr<MappedFile> open(const std::string& path);

  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  // Read-only: the pages are mapped PROT_READ, so writing through a view faults.
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  const std::string& path() const { return path_; }

 private:
  MappedFile(std::string path, const uint8_t* data, size_t size)
      : path_(std::move(path)), data_(data), size_(size) {}

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace pagedlm
