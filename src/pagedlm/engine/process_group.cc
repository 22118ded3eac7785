#include "pagedlm/engine/process_group.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/rendezvous.h"

#ifdef PAGEDLM_HAS_CUDA
#include <cuda_runtime.h>
#endif

namespace pagedlm {
namespace {

// Messages of rank 0's channel after the rendezvous.
constexpr char kFits = 'F', kPages = 'P', kStep = 'S', kDone = 'D';
// A rank waits this long for rank 0's next message: a server may idle for days.
constexpr std::chrono::hours kIdle{24 * 365};

// The KV cache page counts: a rank's fit (kFits) and the agreed count (kPages).
std::string pages_message(char kind, int32_t n) {
  std::string m(1, kind);
  m.append(reinterpret_cast<const char*>(&n), sizeof(n));
  return m;
}

int32_t pages_of(const std::string& m, char kind, const std::string& whose) {
  PAGEDLM_CHECK(m.size() == 1 + sizeof(int32_t) && m[0] == kind, "tensor-parallel ", whose,
                ": expected a KV cache page count");
  int32_t n = 0;
  std::memcpy(&n, m.data() + 1, sizeof(n));
  return n;
}

}  // namespace

ProcessGroup::ProcessGroup(const EngineOptions& options, const ModelConfig& config)
    : rank_(options.tensor_parallel_rank) {
  const int32_t size = options.tensor_parallel_size;
  PAGEDLM_CHECK(rank_ >= 0 && rank_ < size, "tensor-parallel rank ", rank_, " is outside [0, ",
                size, ")");
  PAGEDLM_CHECK(!options.tensor_parallel_endpoint.empty(),
                "a tensor-parallel group of processes needs rank 0's HOST:PORT");
  PAGEDLM_CHECK(options.on_lost_rank != nullptr,
                "a tensor-parallel group of processes needs EngineOptions::on_lost_rank (a rank ",
                "whose peer is gone would wait in a collective forever)");
#ifdef PAGEDLM_HAS_CUDA
  int devices = 0;
  PAGEDLM_CHECK(cudaGetDeviceCount(&devices) == cudaSuccess && devices > 0, "tensor-parallel rank ",
                rank_, " sees no GPU");
  const int device =
      options.tensor_parallel_device >= 0 ? options.tensor_parallel_device : rank_ % devices;
  PAGEDLM_CHECK(device < devices, "tensor-parallel rank ", rank_, ": GPU ", device,
                " does not exist (", devices, " visible)");
  PAGEDLM_CHECK(cudaSetDevice(device) == cudaSuccess, "cudaSetDevice(", device, ") failed");
  const auto [host, port] = parse_endpoint(options.tensor_parallel_endpoint);
  const auto timeout = std::chrono::milliseconds(options.collective_timeout_ms);
  const uint64_t fingerprint = model_fingerprint(config);
  ops::NcclUniqueId id{};
  if (rank_ == 0) {
    id = ops::nccl_unique_id();
    server_ = std::make_unique<RendezvousServer>(host, port, size, fingerprint);
    server_->accept_all(std::string(id.data(), id.size()), timeout);
  } else {
    client_ = std::make_unique<RendezvousClient>(host, port, rank_, size, fingerprint, timeout);
    PAGEDLM_CHECK(client_->payload().size() == id.size(), "tensor-parallel rank ", rank_,
                  ": rank 0 sent an NCCL id of ", client_->payload().size(), " bytes");
    std::memcpy(id.data(), client_->payload().data(), id.size());
  }
  comm_ = ops::make_nccl_communicator(id, rank_, size);
  // From here a dead rank would leave the others inside a collective forever.
  if (server_) server_->watch(options.on_lost_rank);
  if (client_) client_->watch(options.on_lost_rank);
#else
  (void)config;
  fail("tensor parallelism over processes needs the CUDA build (NCCL)");
#endif
}

ProcessGroup::~ProcessGroup() {
  if (!server_) return;
  server_->stop_watching();
  try {
    server_->broadcast(std::string(1, kDone));
    server_->wait_closed(std::chrono::seconds(30));
  } catch (const Error&) {
    // A rank already gone needs no telling.
  }
}

int32_t ProcessGroup::agree_num_pages(int32_t fits) {
  if (client_) {
    client_->send(pages_message(kFits, fits));
    return pages_of(client_->receive(kIdle), kPages, cat("rank ", rank_));
  }
  // The other ranks may still be loading their weights: a dead one ends this process (watch).
  const std::vector<std::string> fits_of_ranks = server_->gather(kIdle);
  int32_t pages = fits;
  for (size_t i = 0; i < fits_of_ranks.size(); ++i) {
    pages = std::min(pages, pages_of(fits_of_ranks[i], kFits, cat("rank ", i + 1)));
  }
  server_->broadcast(pages_message(kPages, pages));
  return pages;
}

void ProcessGroup::send_step(const StepPlan& plan, bool want_logits) {
  server_->broadcast(kStep + encode_step(plan, want_logits));
}

std::optional<WireStep> ProcessGroup::receive_step() {
  const std::string m = client_->receive(kIdle);
  PAGEDLM_CHECK(!m.empty() && (m[0] == kStep || m[0] == kDone), "tensor-parallel rank ", rank_,
                ": unexpected message from rank 0");
  if (m[0] == kDone) {
    client_->stop_watching();  // rank 0 closes next: that is no failure
    return std::nullopt;
  }
  return decode_step(m.substr(1));
}

}  // namespace pagedlm
