// Tensor: a typed, shaped, contiguous (row-major) view of memory on one device.
// Storage is shared: views (reshape, row slices) keep their owner alive.
#pragma once

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/error.h"

namespace pagedlm {

enum class Device : uint8_t { kCpu, kCuda };

using Shape = std::vector<int64_t>;

std::string shape_str(const Shape& shape);

class Tensor {
 public:
  Tensor() = default;

  // Allocates uninitialized memory (64-byte aligned on the CPU).
  static Tensor empty(DType dtype, Shape shape, Device device = Device::kCpu);
  static Tensor zeros(DType dtype, Shape shape, Device device = Device::kCpu);
  // Wraps memory owned elsewhere; `owner` (may be null) is kept alive by every view.
  static Tensor wrap(void* data, DType dtype, Shape shape, Device device,
                     std::shared_ptr<void> owner);
  // A CPU tensor holding a copy of `values`.
  static Tensor from_f32(const std::vector<float>& values, Shape shape);
  static Tensor from_i32(const std::vector<int32_t>& values, Shape shape);

  bool defined() const { return data_ != nullptr || numel() == 0; }
  DType dtype() const { return dtype_; }
  Device device() const { return device_; }
  const Shape& shape() const { return shape_; }
  int ndim() const { return static_cast<int>(shape_.size()); }
  int64_t dim(int i) const { return shape_.at(i < 0 ? i + ndim() : i); }
  int64_t numel() const;
  size_t nbytes() const { return static_cast<size_t>(numel()) * dtype_size(dtype_); }

  void* raw() const { return data_; }
  template <typename T>
  T* data() const {
    return static_cast<T*>(data_);
  }

  // Same storage, new shape with the same element count.
  Tensor reshape(Shape shape) const;
  // Rows [begin, end) of the first dimension, sharing storage.
  Tensor rows(int64_t begin, int64_t end) const;

  // Copies to another device (or a fresh CPU buffer); converts nothing.
  Tensor to(Device device) const;
  // CPU only: a float32 copy of an f32/f16/bf16 tensor.
  Tensor to_f32() const;

 private:
  std::shared_ptr<void> owner_;
  void* data_ = nullptr;
  DType dtype_ = DType::kF32;
  Device device_ = Device::kCpu;
  Shape shape_;
};

// Throws a pagedlm::Error naming `what` unless t has exactly this dtype and shape.
void check_tensor(const Tensor& t, DType dtype, const Shape& shape, const std::string& what);

}  // namespace pagedlm
