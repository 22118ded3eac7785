// ops::Communicator over NCCL: one GPU per rank, collectives enqueued on the engine's stream (so
// a decode step's all-reduces are captured in its CUDA graph with the kernels around them).
// Built when CMake finds NCCL (the nvidia-nccl-cu13 wheel, scripts/fetch_nccl.sh); otherwise
// making one fails with that reason.
#include <cuda_runtime.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <thread>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/communicator.h"

#ifdef PAGEDLM_HAS_NCCL
#include <nccl.h>
#endif

namespace pagedlm::ops {

#ifdef PAGEDLM_HAS_NCCL
namespace {

// How long joining the group may take before the rank gives up (a peer that never starts).
constexpr std::chrono::seconds kInitTimeout{300};

void check_cuda(cudaError_t e, const char* what) {
  PAGEDLM_CHECK(e == cudaSuccess, "NCCL communicator: ", what, ": ", cudaGetErrorString(e));
}

class NcclCommunicator final : public Communicator {
 public:
  NcclCommunicator(const NcclUniqueId& id, int32_t rank, int32_t size) : rank_(rank), size_(size) {
    PAGEDLM_CHECK(size >= 1 && rank >= 0 && rank < size, "NCCL rank ", rank,
                  " is outside a group of ", size);
    // NVLink multicast (NVLS) stays off: it reserves device memory per communicator and is not
    // available on every host; a user's own setting wins.
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    ncclUniqueId uid;
    static_assert(sizeof(uid.internal) == std::tuple_size<NcclUniqueId>::value);
    std::memcpy(uid.internal, id.data(), id.size());
    // Non-blocking, so that joining (and every call) can be waited for with a deadline and
    // aborted: a peer that never comes must not hang this rank.
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&comm_, size, uid, rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      fail("NCCL: rank ", rank, " of ", size, " could not join the group: ", ncclGetErrorString(r));
    }
    wait_ready("joining the group", kInitTimeout);
  }

  ~NcclCommunicator() override {
    if (comm_ == nullptr) return;
    if (aborted_) return;  // ncclCommAbort freed it
    ncclCommDestroy(comm_);
  }

  int32_t rank() const override { return rank_; }
  int32_t size() const override { return size_; }

  void all_reduce_sum(const Tensor& x, void* stream) override {
    PAGEDLM_CHECK(x.device() == Device::kCuda, "NCCL all_reduce_sum takes a CUDA tensor");
    PAGEDLM_CHECK(x.dtype() == DType::kF32 || x.dtype() == DType::kBF16,
                  "NCCL all_reduce_sum takes f32 or bf16, got ", dtype_name(x.dtype()));
    check_alive();
    const ncclDataType_t type = x.dtype() == DType::kF32 ? ncclFloat32 : ncclBfloat16;
    enqueued(ncclAllReduce(x.raw(), x.raw(), static_cast<size_t>(x.numel()), type, ncclSum, comm_,
                           static_cast<cudaStream_t>(stream)),
             "all_reduce_sum");
  }

  void all_gather_cols(const Tensor& local, const Tensor& out, void* stream) override {
    PAGEDLM_CHECK(local.device() == Device::kCuda && out.device() == Device::kCuda &&
                      local.dtype() == DType::kF32 && out.dtype() == DType::kF32,
                  "NCCL all_gather_cols takes f32 CUDA tensors");
    PAGEDLM_CHECK(local.ndim() == 2 && out.ndim() == 2 && out.dim(0) == local.dim(0) &&
                      out.dim(1) == local.dim(1) * size_,
                  "all_gather_cols: local ", shape_str(local.shape()), " and out ",
                  shape_str(out.shape()), " do not fit ", size_, " ranks");
    check_alive();
    const int64_t rows = local.dim(0), cols = local.dim(1);
    reserve(rows, cols);  // a no-op in a captured step: the model reserved it beforehand
    const auto s = static_cast<cudaStream_t>(stream);
    // NCCL gathers rank-major ([size, rows, cols]); the logits want the ranks' columns side by
    // side in each row: one strided copy per rank.
    enqueued(ncclAllGather(local.raw(), gathered_, static_cast<size_t>(rows * cols), ncclFloat32,
                           comm_, s),
             "all_gather_cols");
    for (int32_t r = 0; r < size_; ++r) {
      check_cuda(cudaMemcpy2DAsync(out.data<float>() + r * cols, size_ * cols * sizeof(float),
                                   gathered_ + r * rows * cols, cols * sizeof(float),
                                   cols * sizeof(float), rows, cudaMemcpyDeviceToDevice, s),
                 "cudaMemcpy2DAsync");
    }
  }

  void reserve(int64_t rows, int64_t cols) override {
    const int64_t need = rows * cols * size_;
    if (need <= gathered_capacity_) return;
    if (gathered_ != nullptr) check_cuda(cudaFree(gathered_), "cudaFree");
    gathered_ = nullptr;
    check_cuda(cudaMalloc(&gathered_, need * sizeof(float)), "cudaMalloc of the gather buffer");
    gathered_capacity_ = need;
  }

  void abort(const std::string& why) override {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_) return;
    why_ = why;
    aborted_ = true;
    // Ends this rank's pending collectives, so a stream waiting on a dead peer is released.
    ncclCommAbort(comm_);
  }

 private:
  void check_alive() {
    if (!aborted_) return;
    std::lock_guard<std::mutex> lock(mutex_);
    fail("tensor-parallel group aborted: ", why_);
  }

  // A call of a non-blocking communicator may still be enqueueing: it is done (or failed) once
  // the communicator's state leaves ncclInProgress.
  void enqueued(ncclResult_t r, const char* op) {
    if (r == ncclInProgress) {
      wait_ready(op, std::chrono::seconds(60));
      return;
    }
    if (r != ncclSuccess) {
      const std::string why = cat("NCCL ", op, " on rank ", rank_, ": ", ncclGetErrorString(r),
                                  " (", ncclGetLastError(comm_), ")");
      abort(why);
      fail(why);
    }
  }

  void wait_ready(const char* what, std::chrono::seconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      ncclResult_t state = ncclSuccess;
      ncclCommGetAsyncError(comm_, &state);
      if (state == ncclSuccess) return;
      std::string why;
      if (state != ncclInProgress) {
        why = cat("NCCL ", what, " on rank ", rank_, " of ", size_, ": ", ncclGetErrorString(state),
                  " (", ncclGetLastError(comm_), ")");
      } else if (std::chrono::steady_clock::now() > deadline) {
        why = cat("NCCL ", what, " on rank ", rank_, " of ", size_, " did not finish within ",
                  timeout.count(), " s (a rank that never joined or died)");
      }
      if (!why.empty()) {
        abort(why);
        fail(why);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }

  int32_t rank_, size_;
  ncclComm_t comm_ = nullptr;
  float* gathered_ = nullptr;  // [size, rows, cols] of all_gather_cols
  int64_t gathered_capacity_ = 0;
  std::mutex mutex_;
  std::atomic<bool> aborted_{false};
  std::string why_;
};

}  // namespace

NcclUniqueId nccl_unique_id() {
  ncclUniqueId uid;
  const ncclResult_t r = ncclGetUniqueId(&uid);
  PAGEDLM_CHECK(r == ncclSuccess, "ncclGetUniqueId: ", ncclGetErrorString(r));
  NcclUniqueId id;
  std::memcpy(id.data(), uid.internal, id.size());
  return id;
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int32_t rank,
                                                     int32_t size) {
  return std::make_unique<NcclCommunicator>(id, rank, size);
}

#else  // !PAGEDLM_HAS_NCCL

NcclUniqueId nccl_unique_id() {
  fail("this build of pagedlm has no NCCL (configure with -DPAGEDLM_NCCL_ROOT, ",
       "see scripts/fetch_nccl.sh)");
}

std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId&, int32_t, int32_t) {
  nccl_unique_id();  // fails, saying why
  return nullptr;
}

#endif

}  // namespace pagedlm::ops
