// Collectives between the ranks of a tensor-parallel group: each rank holds a share of every
// sharded weight and joins its partial results to the others' here. Two implementations: threads
// of one process over shared memory (CPU tensors; what CI tests the sharding with) and NCCL
// (ops/cuda/nccl_communicator.cu, one GPU per rank, on the engine's stream, capturable in CUDA
// graphs).
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pagedlm/core/tensor.h"

namespace pagedlm::ops {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int32_t rank() const = 0;
  virtual int32_t size() const = 0;
  // Sums x over the ranks, in place; every rank passes a tensor of the same dtype and element
  // count on its own device. CPU: f32; CUDA: f32 or bf16, issued on `stream` (cudaStream_t).
  virtual void all_reduce_sum(const Tensor& x, void* stream) = 0;
  // local: [rows, cols] f32 -> out: [rows, size() * cols] f32, rank r's local at columns
  // [r * cols, (r + 1) * cols) (the vocabulary-split lm_head's logits).
  virtual void all_gather_cols(const Tensor& local, const Tensor& out, void* stream) = 0;
  // Allocates what all_gather_cols needs for local tensors of up to [rows, cols], so that a
  // step captured as a CUDA graph allocates nothing (the thread communicator needs nothing).
  virtual void reserve(int64_t rows, int64_t cols) {}
  // Ends the group for every rank: their collectives in progress and later ones throw an Error
  // that carries `why` (a rank that failed). Safe to call from any thread, more than once.
  virtual void abort(const std::string& why) = 0;
};

// `size` communicators over threads of one process, rank r at index r, each used by one thread.
// A collective waits at most `timeout` for the other ranks; then it aborts the group, naming the
// rank that waited.
std::vector<std::unique_ptr<Communicator>> make_thread_communicators(
    int32_t size, std::chrono::milliseconds timeout);

#ifdef PAGEDLM_HAS_CUDA
// NCCL's opaque rendezvous token: rank 0 makes it and hands it to every rank (engine/ does so
// over TCP), which then joins the group with it.
using NcclUniqueId = std::array<char, 128>;
NcclUniqueId nccl_unique_id();
// Joins the NCCL group `id` as `rank` of `size` on the current CUDA device. NVLink multicast
// (NVLS) is turned off (NCCL_NVLS_ENABLE=0) unless the environment already sets it.
// Collectives are enqueued on the given stream and never block the host, so they can be
// captured in a CUDA graph; abort() ends the communicator (ncclCommAbort) so that a failed or
// missing peer makes the others fail instead of hanging.
std::unique_ptr<Communicator> make_nccl_communicator(const NcclUniqueId& id, int32_t rank,
                                                     int32_t size);
#endif

}  // namespace pagedlm::ops
