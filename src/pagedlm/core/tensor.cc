#include "pagedlm/core/tensor.h"

#include <cstdlib>
#include <cstring>
#include <sstream>

#include "pagedlm/core/device_memory.h"

namespace pagedlm {

std::string shape_str(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

namespace {

int64_t count(const Shape& shape) {
  int64_t n = 1;
  for (int64_t d : shape) {
    PAGEDLM_CHECK(d >= 0, "negative dimension in shape ", shape_str(shape));
    n *= d;
  }
  return n;
}

std::shared_ptr<void> allocate(size_t bytes, Device device) {
  if (device == Device::kCpu) {
    const size_t rounded = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, rounded == 0 ? 64 : rounded);
    PAGEDLM_CHECK(p != nullptr, "out of host memory allocating ", bytes, " bytes");
    return std::shared_ptr<void>(p, std::free);
  }
  return std::shared_ptr<void>(device_memory::allocate(bytes), device_memory::release);
}

}  // namespace

int64_t Tensor::numel() const { return count(shape_); }

Tensor Tensor::empty(DType dtype, Shape shape, Device device) {
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.shape_ = std::move(shape);
  t.owner_ = allocate(t.nbytes(), device);
  t.data_ = t.owner_.get();
  return t;
}

Tensor Tensor::zeros(DType dtype, Shape shape, Device device) {
  Tensor t = empty(dtype, std::move(shape), device);
  if (device == Device::kCpu) {
    std::memset(t.data_, 0, t.nbytes());
  } else {
    device_memory::zero(t.data_, t.nbytes());
  }
  return t;
}

Tensor Tensor::wrap(void* data, DType dtype, Shape shape, Device device,
                    std::shared_ptr<void> owner) {
  Tensor t;
  t.dtype_ = dtype;
  t.device_ = device;
  t.shape_ = std::move(shape);
  t.owner_ = std::move(owner);
  t.data_ = data;
  return t;
}

Tensor Tensor::from_f32(const std::vector<float>& values, Shape shape) {
  Tensor t = empty(DType::kF32, std::move(shape));
  PAGEDLM_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_f32: ", values.size(),
                " values for shape ", shape_str(t.shape_));
  std::memcpy(t.data_, values.data(), t.nbytes());
  return t;
}

Tensor Tensor::from_i32(const std::vector<int32_t>& values, Shape shape) {
  Tensor t = empty(DType::kI32, std::move(shape));
  PAGEDLM_CHECK(static_cast<int64_t>(values.size()) == t.numel(), "from_i32: ", values.size(),
                " values for shape ", shape_str(t.shape_));
  std::memcpy(t.data_, values.data(), t.nbytes());
  return t;
}

Tensor Tensor::reshape(Shape shape) const {
  PAGEDLM_CHECK(count(shape) == numel(), "cannot reshape ", shape_str(shape_), " to ",
                shape_str(shape));
  Tensor t = *this;
  t.shape_ = std::move(shape);
  return t;
}

Tensor Tensor::rows(int64_t begin, int64_t end) const {
  PAGEDLM_CHECK(ndim() >= 1 && 0 <= begin && begin <= end && end <= shape_[0], "rows [", begin,
                ", ", end, ") out of range for shape ", shape_str(shape_));
  const int64_t row_elems = shape_[0] == 0 ? 0 : numel() / shape_[0];
  Tensor t = *this;
  t.shape_[0] = end - begin;
  t.data_ =
      static_cast<char*>(data_) + begin * row_elems * static_cast<int64_t>(dtype_size(dtype_));
  return t;
}

Tensor Tensor::to(Device device) const {
  Tensor out = empty(dtype_, shape_, device);
  if (device_ == Device::kCpu && device == Device::kCpu) {
    std::memcpy(out.data_, data_, nbytes());
    return out;
  }
  device_memory::copy(out.data_, data_, nbytes());
  return out;
}

Tensor Tensor::to_f32() const {
  PAGEDLM_CHECK(device_ == Device::kCpu, "to_f32 needs a CPU tensor");
  Tensor out = empty(DType::kF32, shape_);
  const int64_t n = numel();
  float* dst = out.data<float>();
  switch (dtype_) {
    case DType::kF32:
      std::memcpy(dst, data_, nbytes());
      break;
    case DType::kBF16: {
      const uint16_t* src = data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_f32(src[i]);
      break;
    }
    case DType::kF16: {
      const uint16_t* src = data<uint16_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_f32(src[i]);
      break;
    }
    case DType::kF8E4M3: {
      const uint8_t* src = data<uint8_t>();
      for (int64_t i = 0; i < n; ++i) dst[i] = f8e4m3_to_f32(src[i]);
      break;
    }
    default:
      fail("to_f32: cannot convert dtype ", dtype_name(dtype_));
  }
  return out;
}

void check_tensor(const Tensor& t, DType dtype, const Shape& shape, const std::string& what) {
  PAGEDLM_CHECK(t.dtype() == dtype && t.shape() == shape, what, ": expected ", dtype_name(dtype),
                " ", shape_str(shape), ", got ", dtype_name(t.dtype()), " ", shape_str(t.shape()));
}

uint16_t f32_to_f16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000;
  const int32_t exp = static_cast<int32_t>((x >> 23) & 0xff) - 127 + 15;
  uint32_t mant = x & 0x7fffff;
  if (((x >> 23) & 0xff) == 0xff) return static_cast<uint16_t>(sign | 0x7c00 | (mant ? 0x200 : 0));
  if (exp >= 31) return static_cast<uint16_t>(sign | 0x7c00);
  if (exp <= 0) {
    if (exp < -10) return static_cast<uint16_t>(sign);
    mant |= 0x800000;
    const int shift = 14 - exp;
    uint32_t half = mant >> shift;
    const uint32_t rem = mant & ((1u << shift) - 1);
    const uint32_t mid = 1u << (shift - 1);
    if (rem > mid || (rem == mid && (half & 1))) ++half;
    return static_cast<uint16_t>(sign | half);
  }
  uint32_t half = sign | static_cast<uint32_t>(exp) << 10 | mant >> 13;
  const uint32_t rem = mant & 0x1fff;
  if (rem > 0x1000 || (rem == 0x1000 && (half & 1))) ++half;
  return static_cast<uint16_t>(half);
}

}  // namespace pagedlm
