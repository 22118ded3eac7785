// The TCP rendezvous of a tensor-parallel group whose ranks live in separate processes (on one
// machine or several): rank 0 listens, every other rank connects and says who it is (its rank,
// the world size, a fingerprint of the model it loaded); rank 0 checks them all and answers each
// with the same payload (the NCCL unique id and the settings every rank must share) or with the
// reason it refuses. The connections then stay open as rank 0's channel to the others: a rank
// whose process dies closes its end, which the other side sees as an error, never a hang.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include "pagedlm/model/model_config.h"

namespace pagedlm {

// A hash of what must be the same model on every rank: family, dimensions, vocabulary, layers.
uint64_t model_fingerprint(const ModelConfig& config);

// "host:port" -> (host, port); throws naming the text when it is not one.
std::pair<std::string, int> parse_endpoint(const std::string& endpoint);

// A thread that calls `on_gone` (once, from that thread) when the peer of one of the sockets
// closes its end or the connection breaks: another rank's process is gone. stop() ends it.
class HangupWatch {
 public:
  HangupWatch() = default;
  ~HangupWatch() { stop(); }
  HangupWatch(const HangupWatch&) = delete;
  HangupWatch& operator=(const HangupWatch&) = delete;
  // names[i] says whose socket fds[i] is ("rank 2"), for the message.
  void start(std::vector<int> fds, std::vector<std::string> names,
             std::function<void(const std::string&)> on_gone);
  void stop();

 private:
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

class RendezvousServer {
 public:
  // Listens on host:port (port 0: any free port, see port()).
  RendezvousServer(const std::string& host, int port, int32_t world_size, uint64_t fingerprint);
  ~RendezvousServer();
  RendezvousServer(const RendezvousServer&) = delete;
  RendezvousServer& operator=(const RendezvousServer&) = delete;

  int port() const { return port_; }

  // Waits for ranks 1..world-1, at most `timeout` in all, and sends each `payload`. Throws (and
  // tells every connected rank why) on a rank outside the group, a rank twice, another world
  // size, another model, or a rank that has not come by the deadline.
  void accept_all(const std::string& payload, std::chrono::milliseconds timeout);

  // Sends `message` to every rank; throws naming the first rank whose process is gone.
  void broadcast(const std::string& message);
  // The next message of every rank, in rank order (rank r's at [r - 1]); throws naming the first
  // rank whose process is gone or that sent nothing within `timeout`.
  std::vector<std::string> gather(std::chrono::milliseconds timeout);

  // Calls on_gone when a rank's process is gone (see HangupWatch), until stop_watching().
  void watch(std::function<void(const std::string&)> on_gone);
  void stop_watching() { watch_.stop(); }
  // Waits up to `timeout` for every rank to close its end (after a last message telling them to).
  void wait_closed(std::chrono::milliseconds timeout);

 private:
  HangupWatch watch_;
  int listen_fd_ = -1;
  int port_ = 0;
  int32_t world_size_;
  uint64_t fingerprint_;
  std::vector<int> peers_;  // rank r's socket at [r - 1]
};

class RendezvousClient {
 public:
  // Connects to rank 0 (retrying until `timeout`: it may start later), introduces itself and
  // waits for the payload; throws rank 0's reason when it refuses, or on the timeout.
  RendezvousClient(const std::string& host, int port, int32_t rank, int32_t world_size,
                   uint64_t fingerprint, std::chrono::milliseconds timeout);
  ~RendezvousClient();
  RendezvousClient(const RendezvousClient&) = delete;
  RendezvousClient& operator=(const RendezvousClient&) = delete;

  const std::string& payload() const { return payload_; }

  // The next message rank 0 broadcasts; throws when rank 0's process is gone or after `timeout`.
  std::string receive(std::chrono::milliseconds timeout);
  // Sends `message` to rank 0 (its gather()); throws when rank 0's process is gone.
  void send(const std::string& message);

  // Calls on_gone when rank 0's process is gone (see HangupWatch), until stop_watching().
  void watch(std::function<void(const std::string&)> on_gone);
  void stop_watching() { watch_.stop(); }

 private:
  HangupWatch watch_;
  int fd_ = -1;
  int32_t rank_;
  std::string payload_;
};

}  // namespace pagedlm
