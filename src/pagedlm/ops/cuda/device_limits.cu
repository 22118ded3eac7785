// The device's limits that the kernels size themselves by (kernels.h), asked once per device.

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <mutex>
#include <string>
#include <vector>

#include "pagedlm/ops/cuda/common.cuh"
#include "pagedlm/ops/cuda/kernels.h"

namespace pagedlm::cuda {
namespace {

// The cap's bounds: 99 KB is the least shared memory per block of any GPU from sm_80 on (RTX
// 30xx / 40xx / 50xx); above 1024 KB a cap caps nothing.
constexpr int kMinSmemCapKb = 99;
constexpr int kMaxSmemCapKb = 1024;

std::string& cap_error() {
  static std::string error;
  return error;
}

// PAGEDLM_CUDA_SMEM_CAP_KB: 0 when unset; cudaErrorInvalidValue (and cap_error()) when it is not
// a whole number within the bounds.
cudaError_t read_smem_cap(int* kb) {
  *kb = 0;
  const char* text = std::getenv("PAGEDLM_CUDA_SMEM_CAP_KB");
  if (text == nullptr || *text == '\0') return cudaSuccess;
  errno = 0;
  char* end = nullptr;
  const long value = std::strtol(text, &end, 10);
  if (errno != 0 || *end != '\0' || value < kMinSmemCapKb || value > kMaxSmemCapKb) {
    cap_error() = std::string("PAGEDLM_CUDA_SMEM_CAP_KB=") + text +
                  ": expected a whole number of KB from " + std::to_string(kMinSmemCapKb) + " to " +
                  std::to_string(kMaxSmemCapKb);
    return cudaErrorInvalidValue;
  }
  *kb = static_cast<int>(value);
  return cudaSuccess;
}

}  // namespace

cudaError_t device_limits(int device, const DeviceLimits** limits) {
  static std::mutex mu;
  static std::deque<DeviceLimits> known;  // a deque: the pointers handed out stay valid
  std::lock_guard<std::mutex> lock(mu);
  for (const DeviceLimits& d : known) {
    if (d.device == device) {
      *limits = &d;
      return cudaSuccess;
    }
  }
  int cap_kb = 0;
  if (cudaError_t err = read_smem_cap(&cap_kb); err != cudaSuccess) return err;
  cudaDeviceProp prop{};
  if (cudaError_t err = cudaGetDeviceProperties(&prop, device); err != cudaSuccess) return err;
  DeviceLimits d{};
  d.device = device;
  std::snprintf(d.name, sizeof(d.name), "%s", prop.name);
  d.cc_major = prop.major;
  d.cc_minor = prop.minor;
  d.num_sms = prop.multiProcessorCount > 0 ? prop.multiProcessorCount : 1;
  d.smem_per_block = prop.sharedMemPerBlockOptin;
  d.smem_per_sm = prop.sharedMemPerMultiprocessor;
  d.smem_reserved_per_block = prop.reservedSharedMemPerBlock;
  d.smem_cap_kb = cap_kb;
  if (cap_kb > 0) {
    const size_t cap = static_cast<size_t>(cap_kb) * 1024;
    d.smem_per_block = std::min(d.smem_per_block, cap);
    d.smem_per_sm = std::min(d.smem_per_sm, cap + d.smem_reserved_per_block);
  }
  known.push_back(d);
  *limits = &known.back();
  return cudaSuccess;
}

cudaError_t current_device_limits(const DeviceLimits** limits) {
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  return device_limits(device, limits);
}

const char* smem_cap_error() { return cap_error().c_str(); }

bool overlapped_launches() {
  static const bool allowed = detail::env_switch_on("PAGEDLM_PDL");
  if (!allowed) return false;
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return false;
  // Asked at every launch: each thread keeps the answer for the device it asked about last, so
  // that a launch takes device_limits' lock only when its thread changes device.
  thread_local int last_device = -1;
  thread_local bool last_answer = false;
  if (device != last_device) {
    const DeviceLimits* limits = nullptr;
    last_answer = device_limits(device, &limits) == cudaSuccess && limits->cc_major >= 9;
    last_device = device;
  }
  return last_answer;
}

cudaError_t allow_dynamic_smem(const void* fn, size_t bytes) {
  struct Allowed {
    int device;
    const void* fn;
    size_t bytes;
  };
  static std::mutex mu;
  static std::vector<Allowed> allowed;
  int device = 0;
  if (cudaError_t err = cudaGetDevice(&device); err != cudaSuccess) return err;
  std::lock_guard<std::mutex> lock(mu);
  const auto it = std::find_if(allowed.begin(), allowed.end(),
                               [&](const Allowed& a) { return a.device == device && a.fn == fn; });
  if (it != allowed.end() && it->bytes >= bytes) return cudaSuccess;
  if (cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             static_cast<int>(bytes));
      err != cudaSuccess) {
    return err;
  }
  if (it != allowed.end()) {
    it->bytes = bytes;
  } else {
    allowed.push_back({device, fn, bytes});
  }
  return cudaSuccess;
}

}  // namespace pagedlm::cuda
