// The GPU state that belongs to one owner (an engine's step runner, a test), not to the process:
// the cuBLASLt handle, its workspace and the per-shape GEMM plans with their tuned algorithms.
// Two engines in one process, on one GPU or on two, each keep their own, so neither runs a GEMM
// in a workspace the other is using at the same time, nor an algorithm chosen (or timed) for
// the other's shapes or device. What the GPU itself is (its SM count, shared memory: the
// kernels' DeviceLimits) never changes and stays one per device for the process.
// Ops that need it (the GEMMs) take it beside the stream; the others take the stream only.
#pragma once

#include <cstdint>

namespace pagedlm::cuda {
struct GemmHandle;
}

namespace pagedlm::ops {

// Not thread safe: its owner runs one step at a time (from any thread, the state's GPU current).
// Builds without CUDA declare it but cannot make one.
class DeviceState {
 public:
  // For the calling thread's current GPU.
  DeviceState();
  ~DeviceState();
  DeviceState(const DeviceState&) = delete;
  DeviceState& operator=(const DeviceState&) = delete;

  int device() const { return device_; }
  ::pagedlm::cuda::GemmHandle* gemm() const { return gemm_; }

  // While on, every prefill-sized GEMM shape this state meets for the first time is timed with
  // cuBLASLt's first few candidate algorithms and keeps the fastest (start-up only: see
  // gemm_set_tuning in ops/cuda/kernels.h).
  void set_linear_tuning(bool on);
  // Tests: FP8 shapes met from now on scale in the epilogue kernel instead of in cuBLASLt (both
  // must give the same outputs but for one bf16 rounding); and whether a shape's plan does.
  void set_fp8_epilogue_scaling(bool on);
  bool fp8_scales_in_epilogue(int64_t rows, int64_t out_features, int64_t in_features,
                              bool has_bias) const;

 private:
  int device_ = -1;
  ::pagedlm::cuda::GemmHandle* gemm_ = nullptr;
};

}  // namespace pagedlm::ops
