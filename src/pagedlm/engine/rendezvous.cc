#include "pagedlm/engine/rendezvous.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <thread>

#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x50544c50;       // "PLTP": pagedlm tensor parallel, version 1
constexpr uint32_t kMaxMessage = 256u << 20;  // a step plan is far smaller; guards bad peers

int remaining_ms(Clock::time_point deadline) {
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
  return static_cast<int>(std::max<int64_t>(0, left.count()));
}

// Waits until fd is readable; false on the deadline.
bool wait_readable(int fd, Clock::time_point deadline) {
  for (;;) {
    pollfd p{fd, POLLIN, 0};
    const int n = ::poll(&p, 1, remaining_ms(deadline));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) fail("poll: ", std::strerror(errno));
  }
}

// Sends all of `data`; false when the peer is gone (no SIGPIPE: MSG_NOSIGNAL).
bool send_all(int fd, const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::send(fd, p, n, MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

enum class Recv { kOk, kClosed, kTimeout };

Recv recv_all(int fd, void* data, size_t n, Clock::time_point deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    if (!wait_readable(fd, deadline)) return Recv::kTimeout;
    const ssize_t k = ::recv(fd, p, n, 0);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return Recv::kClosed;
    p += k;
    n -= static_cast<size_t>(k);
  }
  return Recv::kOk;
}

bool send_message(int fd, const std::string& m) {
  const uint32_t header[2] = {kMagic, static_cast<uint32_t>(m.size())};
  return send_all(fd, header, sizeof(header)) && send_all(fd, m.data(), m.size());
}

Recv recv_message(int fd, std::string& out, Clock::time_point deadline) {
  uint32_t header[2];
  if (Recv r = recv_all(fd, header, sizeof(header), deadline); r != Recv::kOk) return r;
  PAGEDLM_CHECK(header[0] == kMagic,
                "tensor-parallel rendezvous: a peer speaks another protocol (or version)");
  PAGEDLM_CHECK(header[1] <= kMaxMessage, "tensor-parallel rendezvous: a message of ", header[1],
                " bytes is too large");
  out.resize(header[1]);
  return recv_all(fd, out.data(), out.size(), deadline);
}

// The introduction a rank sends: its rank, the world size and the model's fingerprint.
struct Hello {
  int32_t rank = 0, world_size = 0;
  uint64_t fingerprint = 0;
};

std::string encode(const Hello& h) {
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

addrinfo* resolve(const std::string& host, int port, bool passive) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  if (passive) hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  const int e = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), std::to_string(port).c_str(),
                              &hints, &res);
  PAGEDLM_CHECK(e == 0, "tensor-parallel rendezvous: cannot resolve ", host, ":", port, ": ",
                gai_strerror(e));
  return res;
}

void no_delay(int fd) {
  const int one = 1;
  ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));  // small plans, sent at once
}

}  // namespace

void HangupWatch::start(std::vector<int> fds, std::vector<std::string> names,
                        std::function<void(const std::string&)> on_gone) {
  stop();
  stop_ = false;
  thread_ = std::thread(
      [this, fds = std::move(fds), names = std::move(names), on_gone = std::move(on_gone)] {
        std::vector<pollfd> polls;
        for (const int fd : fds) polls.push_back(pollfd{fd, POLLRDHUP, 0});
        while (!stop_) {
          // A short timeout, so that stop() is noticed; a hangup is reported whether or not data
          // is waiting to be read (POLLRDHUP), and reading is left to the owner.
          const int n = ::poll(polls.data(), polls.size(), 100);
          if (n <= 0) continue;
          for (size_t i = 0; i < polls.size(); ++i) {
            if (polls[i].revents & (POLLRDHUP | POLLHUP | POLLERR)) {
              if (!stop_) on_gone(cat("tensor-parallel ", names[i], "'s process is gone"));
              return;
            }
          }
        }
      });
}

void HangupWatch::stop() {
  stop_ = true;
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

uint64_t model_fingerprint(const ModelConfig& c) {
  // FNV-1a over the fields that fix every weight's shape and the model's family.
  uint64_t h = 1469598103934665603ULL;
  auto mix = [&](const void* p, size_t n) {
    for (size_t i = 0; i < n; ++i) {
      h ^= static_cast<const unsigned char*>(p)[i];
      h *= 1099511628211ULL;
    }
  };
  mix(c.model_type.data(), c.model_type.size());
  for (const int64_t v : {c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers,
                          c.num_heads, c.num_kv_heads, c.head_dim, c.max_position_embeddings}) {
    mix(&v, sizeof(v));
  }
  return h;
}

std::pair<std::string, int> parse_endpoint(const std::string& endpoint) {
  const size_t colon = endpoint.rfind(':');
  PAGEDLM_CHECK(colon != std::string::npos && colon + 1 < endpoint.size(), "\"", endpoint,
                "\" is not HOST:PORT");
  int port = -1;
  try {
    size_t used = 0;
    port = std::stoi(endpoint.substr(colon + 1), &used);
    if (used != endpoint.size() - colon - 1) port = -1;
  } catch (const std::exception&) {
    port = -1;
  }
  PAGEDLM_CHECK(port >= 0 && port <= 65535, "\"", endpoint, "\" has no valid port");
  return {endpoint.substr(0, colon), port};
}

RendezvousServer::RendezvousServer(const std::string& host, int port, int32_t world_size,
                                   uint64_t fingerprint)
    : world_size_(world_size), fingerprint_(fingerprint) {
  PAGEDLM_CHECK(world_size >= 1, "tensor-parallel world size must be >= 1");
  addrinfo* res = resolve(host, port, true);
  std::string error = "no address";
  for (addrinfo* a = res; a != nullptr && listen_fd_ < 0; a = a->ai_next) {
    const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
    if (fd < 0) continue;
    const int one = 1;
    ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(fd, a->ai_addr, a->ai_addrlen) == 0 && ::listen(fd, world_size) == 0) {
      listen_fd_ = fd;
    } else {
      error = std::strerror(errno);
      ::close(fd);
    }
  }
  ::freeaddrinfo(res);
  PAGEDLM_CHECK(listen_fd_ >= 0, "tensor-parallel rendezvous: cannot listen on ", host, ":", port,
                ": ", error);
  sockaddr_storage addr{};
  socklen_t len = sizeof(addr);
  ::getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len);
  port_ = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                           : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
}

RendezvousServer::~RendezvousServer() {
  watch_.stop();
  for (const int fd : peers_) {
    if (fd >= 0) ::close(fd);
  }
  if (listen_fd_ >= 0) ::close(listen_fd_);
}

void RendezvousServer::accept_all(const std::string& payload, std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  peers_.assign(world_size_ - 1, -1);
  // A refusal goes to every rank that has connected, so none of them waits for a group that
  // will not form.
  auto refuse = [&](int extra_fd, const std::string& why) {
    for (int& fd : peers_) {
      if (fd >= 0) send_message(fd, "E" + why);
    }
    if (extra_fd >= 0) {
      send_message(extra_fd, "E" + why);
      ::close(extra_fd);
    }
    fail(why);
  };
  for (int32_t joined = 1; joined < world_size_;) {
    if (!wait_readable(listen_fd_, deadline)) {
      std::string missing;
      for (size_t i = 0; i < peers_.size(); ++i) {
        if (peers_[i] < 0) missing += cat(missing.empty() ? "" : ", ", i + 1);
      }
      refuse(-1, cat("tensor-parallel rendezvous: rank(s) ", missing, " did not join within ",
                     timeout.count(), " ms"));
    }
    const int fd = ::accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    no_delay(fd);
    std::string hello_bytes;
    Recv r = Recv::kClosed;
    try {
      r = recv_message(fd, hello_bytes, deadline);
    } catch (const Error& e) {
      refuse(fd, e.what());
    }
    if (r != Recv::kOk || hello_bytes.size() != sizeof(Hello)) {
      ::close(fd);  // a stray connection (a port scan, a rank that died at once): not a rank
      continue;
    }
    Hello h;
    std::memcpy(&h, hello_bytes.data(), sizeof(h));
    if (h.world_size != world_size_) {
      refuse(fd, cat("tensor-parallel rendezvous: rank ", h.rank, " was started with ",
                     h.world_size, " ranks, rank 0 with ", world_size_));
    }
    if (h.rank < 1 || h.rank >= world_size_) {
      refuse(fd, cat("tensor-parallel rendezvous: rank ", h.rank, " is outside [1, ", world_size_,
                     ")"));
    }
    if (peers_[h.rank - 1] >= 0) {
      refuse(fd, cat("tensor-parallel rendezvous: rank ", h.rank, " joined twice"));
    }
    if (h.fingerprint != fingerprint_) {
      refuse(fd, cat("tensor-parallel rendezvous: rank ", h.rank,
                     " loaded another model than rank 0 (the configs differ)"));
    }
    peers_[h.rank - 1] = fd;
    ++joined;
  }
  for (size_t i = 0; i < peers_.size(); ++i) {
    PAGEDLM_CHECK(send_message(peers_[i], "O" + payload), "tensor-parallel rendezvous: rank ",
                  i + 1, "'s process is gone");
  }
}

void RendezvousServer::broadcast(const std::string& message) {
  for (size_t i = 0; i < peers_.size(); ++i) {
    PAGEDLM_CHECK(peers_[i] >= 0 && send_message(peers_[i], message), "tensor-parallel rank ",
                  i + 1, "'s process is gone");
  }
}

std::vector<std::string> RendezvousServer::gather(std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::vector<std::string> messages(peers_.size());
  for (size_t i = 0; i < peers_.size(); ++i) {
    const Recv r = peers_[i] >= 0 ? recv_message(peers_[i], messages[i], deadline) : Recv::kClosed;
    PAGEDLM_CHECK(r != Recv::kTimeout, "tensor-parallel rank ", i + 1, ": nothing within ",
                  timeout.count(), " ms");
    PAGEDLM_CHECK(r == Recv::kOk, "tensor-parallel rank ", i + 1, "'s process is gone");
  }
  return messages;
}

void RendezvousServer::watch(std::function<void(const std::string&)> on_gone) {
  std::vector<std::string> names;
  for (size_t i = 0; i < peers_.size(); ++i) names.push_back(cat("rank ", i + 1));
  watch_.start(peers_, std::move(names), std::move(on_gone));
}

void RendezvousServer::wait_closed(std::chrono::milliseconds timeout) {
  const Clock::time_point deadline = Clock::now() + timeout;
  for (const int fd : peers_) {
    char byte;
    while (fd >= 0 && wait_readable(fd, deadline) && ::recv(fd, &byte, 1, 0) > 0) {
    }
  }
}

RendezvousClient::RendezvousClient(const std::string& host, int port, int32_t rank,
                                   int32_t world_size, uint64_t fingerprint,
                                   std::chrono::milliseconds timeout)
    : rank_(rank) {
  const Clock::time_point deadline = Clock::now() + timeout;
  std::string error;
  while (fd_ < 0) {
    addrinfo* res = resolve(host, port, false);
    for (addrinfo* a = res; a != nullptr && fd_ < 0; a = a->ai_next) {
      const int fd = ::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC, a->ai_protocol);
      if (fd < 0) continue;
      if (::connect(fd, a->ai_addr, a->ai_addrlen) == 0) {
        fd_ = fd;
      } else {
        error = std::strerror(errno);
        ::close(fd);
      }
    }
    ::freeaddrinfo(res);
    if (fd_ >= 0) break;
    PAGEDLM_CHECK(Clock::now() < deadline, "tensor-parallel rank ", rank,
                  ": cannot reach rank 0 at ", host, ":", port, " within ", timeout.count(),
                  " ms: ", error);
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // rank 0 may start later
  }
  no_delay(fd_);
  Hello h;
  h.rank = rank;
  h.world_size = world_size;
  h.fingerprint = fingerprint;
  PAGEDLM_CHECK(send_message(fd_, encode(h)), "tensor-parallel rank ", rank,
                ": rank 0 closed the connection");
  std::string reply;
  const Recv r = recv_message(fd_, reply, deadline);
  PAGEDLM_CHECK(r != Recv::kTimeout, "tensor-parallel rank ", rank,
                ": rank 0 did not answer within ", timeout.count(), " ms");
  PAGEDLM_CHECK(r == Recv::kOk && !reply.empty(), "tensor-parallel rank ", rank,
                ": rank 0 closed the connection");
  PAGEDLM_CHECK(reply[0] == 'O', reply.substr(1));
  payload_ = reply.substr(1);
}

void RendezvousClient::watch(std::function<void(const std::string&)> on_gone) {
  watch_.start({fd_}, {"rank 0"}, std::move(on_gone));
}

RendezvousClient::~RendezvousClient() {
  watch_.stop();
  if (fd_ >= 0) ::close(fd_);
}

std::string RendezvousClient::receive(std::chrono::milliseconds timeout) {
  std::string m;
  const Recv r = recv_message(fd_, m, Clock::now() + timeout);
  PAGEDLM_CHECK(r != Recv::kTimeout, "tensor-parallel rank ", rank_, ": nothing from rank 0 for ",
                timeout.count(), " ms");
  PAGEDLM_CHECK(r == Recv::kOk, "tensor-parallel rank ", rank_,
                ": rank 0's process is gone (connection closed)");
  return m;
}

void RendezvousClient::send(const std::string& message) {
  PAGEDLM_CHECK(send_message(fd_, message), "tensor-parallel rank ", rank_,
                ": rank 0's process is gone (connection closed)");
}

}  // namespace pagedlm
