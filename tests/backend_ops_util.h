// The backend side of tests/backend_ops_test.cc: one op case is written once against a Backend,
// which makes its input tensors on the backend's device in the backend's compute dtype, reads its
// outputs back, and picks the case's tolerance for that backend. Outputs are compared with the
// normalized mean squared error (NMSE = sum (got - want)^2 / sum want^2), as llama.cpp's
// test-backend-ops does.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/ops/device_state.h"

namespace pagedlm::testing {

// One tolerance per backend, as an NMSE bound.
struct Nmse {
  double cpu;
  double cuda;
};

class Backend {
 public:
  explicit Backend(Device device) : device_(device) {
#ifdef PAGEDLM_HAS_CUDA
    if (device == Device::kCuda) state_ = std::make_shared<ops::DeviceState>();
#endif
  }

  Device device() const { return device_; }
  bool cpu() const { return device_ == Device::kCpu; }
  bool cuda() const { return device_ == Device::kCuda; }
  const char* name() const { return cpu() ? "cpu" : "cuda"; }
  // The dtype activations and weights are computed in: f32 on the CPU, bf16 on the GPU.
  DType compute() const { return cpu() ? DType::kF32 : DType::kBF16; }
  double tol(const Nmse& t) const { return cpu() ? t.cpu : t.cuda; }
  // The GPU state the GEMMs run with, the Backend's own as an engine has its own (null on the
  // CPU).
  ops::DeviceState* state() const { return state_.get(); }

  // Rounds host values in place to what the compute dtype holds, so that the reference takes the
  // same inputs as the op and measures the kernel, not the rounding of its inputs.
  void round(std::vector<float>& v) const {
    if (compute() != DType::kBF16) return;
    for (float& x : v) x = bf16_to_f32(f32_to_bf16(x));
  }

  // A tensor on the backend's device holding `v` (already rounded) in the compute dtype.
  Tensor tensor(const std::vector<float>& v, const Shape& shape) const {
    return as(v, shape, compute());
  }
  // The same in f32 whatever the backend (the residual stream, logits, inv_freq).
  Tensor f32(const std::vector<float>& v, const Shape& shape) const {
    return as(v, shape, DType::kF32);
  }
  Tensor i32(const std::vector<int32_t>& v, const Shape& shape) const {
    return Tensor::from_i32(v, shape).to(device_);
  }
  // An output full of NaN: any element the op forgets to write fails the comparison.
  Tensor poisoned(const Shape& shape, DType dtype) const {
    Tensor t = Tensor::empty(dtype, shape);
    if (dtype == DType::kF32) {
      for (int64_t i = 0; i < t.numel(); ++i) {
        t.data<float>()[i] = std::numeric_limits<float>::quiet_NaN();
      }
    } else {
      for (int64_t i = 0; i < t.numel(); ++i) t.data<uint16_t>()[i] = 0x7fc0;  // bf16 NaN
    }
    return t.to(device_);
  }
  Tensor poisoned(const Shape& shape) const { return poisoned(shape, compute()); }

 private:
  Tensor as(const std::vector<float>& v, const Shape& shape, DType dtype) const {
    Tensor host = Tensor::from_f32(v, shape);
    if (dtype == DType::kBF16) {
      Tensor bf = Tensor::empty(DType::kBF16, shape);
      for (int64_t i = 0; i < host.numel(); ++i) {
        bf.data<uint16_t>()[i] = f32_to_bf16(host.data<float>()[i]);
      }
      host = bf;
    }
    return host.to(device_);
  }

  Device device_;
  std::shared_ptr<ops::DeviceState> state_;
};

// The parameterized fixture of every op case: the CUDA instance skips without a GPU.
class BackendOps : public ::testing::TestWithParam<Device> {
 protected:
  void SetUp() override {
    if (GetParam() != Device::kCuda) return;
#ifndef PAGEDLM_HAS_CUDA
    GTEST_SKIP() << "this build of pagedlm has no CUDA support";
#else
    if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
#endif
  }
  Backend backend() const { return Backend(GetParam()); }
};

// A tensor's elements as float on the host (bf16 widened exactly).
inline std::vector<float> host_f32(const Tensor& t) {
  const Tensor cpu = t.device() == Device::kCpu ? t : t.to(Device::kCpu);
  const Tensor f = cpu.dtype() == DType::kF32 ? cpu : cpu.to_f32();
  return {f.data<float>(), f.data<float>() + f.numel()};
}

// Uniform in [lo, hi) with |x| >= 1e-3, so no element is (near) zero and a missed write or a
// dropped term cannot hide behind a zero.
inline std::vector<float> uniform(size_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (float& x : v) {
    do {
      x = dist(rng);
    } while (std::abs(x) < 1e-3f);
  }
  return v;
}

// Expects every element of `got` to be finite and NMSE(got, want) <= max_nmse.
inline void expect_nmse(const std::vector<float>& got, const std::vector<double>& want,
                        double max_nmse, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  double diff = 0.0, norm = 0.0;
  int64_t not_finite = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (!std::isfinite(got[i])) {
      ++not_finite;
      continue;
    }
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  EXPECT_EQ(not_finite, 0) << what << ": elements not written or not finite";
  ASSERT_GT(norm, 0.0) << what;
  EXPECT_LE(diff / norm, max_nmse) << what;
}

}  // namespace pagedlm::testing
