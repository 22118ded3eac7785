// The HTTP front end's request reading: server/bounded_server.h (cpp-httplib's parser behind a
// stream that bounds each request's head and body) serving on loopback. Input: the bytes a
// client sends on one connection (any number of pipelined requests), after which it closes its
// sending side. Properties: the server answers with HTTP/1.1 responses or nothing and closes
// the connection, no handler sees a body over the bound, and the server lives on.
//
// When the front end moves to another HTTP library, this target follows it: start the new
// server with the same small bounds and the same two routes on a loopback port, and keep the
// client side below, which knows nothing of the server's library.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "fuzz_util.h"
#include "pagedlm/server/bounded_server.h"

namespace {

// Small, so that inputs of a few KB reach the bound and the refusals behind it.
constexpr size_t kMaxBodyBytes = 1024;

std::atomic<size_t> largest_body{0};

int start_server() {
  // Never destroyed: its threads serve until the process exits.
  static auto& server = *new pagedlm::server::BoundedServer(
      kMaxBodyBytes, [](int status) { return "{\"error\": " + std::to_string(status) + "}"; });
  server.set_read_timeout(2, 0);
  server.set_write_timeout(2, 0);
  server.set_keep_alive_timeout(2);
  server.Post("/echo", [](const httplib::Request& req, httplib::Response& res) {
    size_t seen = largest_body.load();
    while (req.body.size() > seen && !largest_body.compare_exchange_weak(seen, req.body.size())) {
    }
    res.set_content(std::to_string(req.body.size()), "text/plain");
  });
  server.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  server.Post("/refuse", [](const httplib::Request&, httplib::Response& res) {
    res.status = 400;
    pagedlm::server::BoundedServer::close_after_response(res);
  });
  const int port = server.bind_to_any_port("127.0.0.1");
  if (port <= 0) pagedlm::fuzz::violated("cannot bind a loopback port");
  std::thread([] { server.listen_after_bind(); }).detach();
  return port;
}

int server_port() {
  static const int port = start_server();
  return port;
}

int connect_to(int port) {
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  // Thousands of connections a second can run the machine out of local ports for a moment
  // (other programs' TIME_WAIT sockets), and libFuzzer's timer signal interrupts a connect:
  // those are retried, a refusal (the server died) is not.
  for (int attempt = 0;; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) pagedlm::fuzz::violated("socket() failed");
    // A server that neither answers nor closes within this is stuck.
    const timeval timeout{10, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &timeout, sizeof(timeout));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &timeout, sizeof(timeout));
    if (connect(fd, reinterpret_cast<const sockaddr*>(&addr), sizeof(addr)) == 0) return fd;
    const int err = errno;
    close(fd);
    if ((err != EADDRNOTAVAIL && err != EAGAIN && err != EINTR) || attempt == 100) {
      const std::string why = std::string("cannot connect to the server: ") + std::strerror(err);
      pagedlm::fuzz::violated(why.c_str());
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const int fd = connect_to(server_port());
  // The server may refuse and close before it has read everything: a failed send is fine.
  for (size_t sent = 0; sent < size;) {
    const ssize_t n = send(fd, data + sent, size - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) break;
    sent += static_cast<size_t>(n);
  }
  shutdown(fd, SHUT_WR);
  std::string response;
  char buffer[4096];
  for (;;) {
    const ssize_t n = recv(fd, buffer, sizeof(buffer), 0);
    if (n > 0) {
      response.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pagedlm::fuzz::violated("the server neither answered nor closed the connection");
    }
    break;  // closed (or reset after a refusal)
  }
  close(fd);
  PAGEDLM_FUZZ_EXPECT(response.empty() || response.rfind("HTTP/1.1 ", 0) == 0);
  PAGEDLM_FUZZ_EXPECT(largest_body.load() <= kMaxBodyBytes);
  return 0;
}
