#include "pagedlm/server/bounded_server.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <string_view>

namespace pagedlm::server {

namespace {

const char* reason_phrase(int status) {
  if (status == 413) return "Payload Too Large";
  if (status == 431) return "Request Header Fields Too Large";
  return "Bad Request";
}

// A connection's socket as httplib::Stream, counting the bytes each request delivers to the
// parser: the head up to its blank line, then the body. Reads are buffered (httplib reads the
// head a byte at a time); counting what is delivered, not what is received, keeps pipelined
// requests apart.
class BoundedStream final : public httplib::Stream {
 public:
  BoundedStream(socket_t sock, size_t max_body_bytes, std::chrono::microseconds read_timeout,
                std::chrono::microseconds write_timeout,
                const std::function<std::string(int)>& refusal)
      : sock_(sock),
        max_body_bytes_(max_body_bytes),
        read_timeout_(read_timeout),
        write_timeout_(write_timeout),
        refusal_(refusal) {}

  using httplib::Stream::write;

  // The next request starts: its head and body are counted from zero.
  void start_request() {
    in_head_ = true;
    head_bytes_ = body_bytes_ = 0;
    blank_line_match_ = 0;
    first_line_ = true;
    line_bytes_ = 0;
    line_has_colon_ = false;
    responded_ = false;
  }

  // A bound was passed: the refusal went out and the connection must close.
  bool refused() const { return refused_; }
  // The connection closes after the current response.
  void close_after_response() { closing_ = true; }
  bool closing() const { return refused_ || closing_; }

  // Waits up to `timeout` for the next request; false when none came or `stop` turned true.
  bool wait_for_request(std::chrono::milliseconds timeout, const std::function<bool()>& stop) {
    if (begin_ < end_) return true;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // In short slices, so a stopping server does not wait out idle keep-alive connections.
    while (!stop()) {
      const auto left = deadline - std::chrono::steady_clock::now();
      if (left <= std::chrono::milliseconds(0)) return false;
      const auto slice =
          std::min<std::chrono::steady_clock::duration>(left, std::chrono::milliseconds(100));
      const int ready = wait(POLLIN, std::chrono::duration_cast<std::chrono::microseconds>(slice));
      if (ready != 0) return ready > 0;
    }
    return false;
  }

  bool is_readable() const override { return begin_ < end_ || wait(POLLIN, read_timeout_) > 0; }

  // Writable within the timeout and the client still there: a streaming handler notices a
  // client that left by a failed write.
  bool is_writable() const override {
    return !refused_ && wait(POLLOUT, write_timeout_) > 0 && peer_open();
  }

  ssize_t read(char* ptr, size_t size) override {
    if (refused_) return -1;
    if (begin_ == end_) {
      if (wait(POLLIN, read_timeout_) <= 0) return -1;
      ssize_t n;
      do {
        n = recv(sock_, buffer_, sizeof(buffer_), 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      begin_ = 0;
      end_ = static_cast<size_t>(n);
    }
    const size_t n = std::min(size, end_ - begin_);
    if (!admit(std::string_view(buffer_ + begin_, n))) return -1;
    std::copy_n(buffer_ + begin_, n, ptr);
    begin_ += n;
    return static_cast<ssize_t>(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    if (!is_writable()) return -1;
    // "100 Continue" is interim: a refusal can still follow it.
    responded_ = responded_ || std::string_view(ptr, std::min<size_t>(size, 10)) != "HTTP/1.1 1";
    return send_all(ptr, size);
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override {
    endpoint(/*peer=*/true, ip, port);
  }
  void get_local_ip_and_port(std::string& ip, int& port) const override {
    endpoint(/*peer=*/false, ip, port);
  }
  socket_t socket() const override { return sock_; }

 private:
  // Counts `bytes` against the request's bounds; false (after the refusal) past one.
  bool admit(std::string_view bytes) {
    size_t i = 0;
    for (; in_head_ && i < bytes.size(); ++i) {
      const char c = bytes[i];
      if (++head_bytes_ > kMaxHeadBytes) return refuse(431);
      // The head ends at its first blank line: "\r\n" after any line's '\n', as httplib reads
      // it. Waiting for "\r\n\r\n" instead missed the end after a line httplib skips for its
      // bare '\n', and counted the body as head, past max_body_bytes (found by fuzzing).
      const char want = "\n\r\n"[blank_line_match_];
      blank_line_match_ = c == want ? blank_line_match_ + 1 : (c == '\n' ? 1 : 0);
      if (blank_line_match_ == 3) in_head_ = false;
      // httplib skips a header line without a colon; a proxy in front may not, so the two
      // would disagree on the request.
      if (c == '\n') {
        if (!first_line_ && line_bytes_ > 0 && !line_has_colon_) return refuse(400);
        first_line_ = false;
        line_bytes_ = 0;
        line_has_colon_ = false;
      } else if (c != '\r') {
        ++line_bytes_;
        line_has_colon_ = line_has_colon_ || c == ':';
      }
    }
    body_bytes_ += bytes.size() - i;
    return body_bytes_ <= max_body_bytes_ || refuse(413);
  }

  // Answers `status` (unless a response already started) and poisons the stream: httplib's
  // own error response and every later read fail, so the connection closes.
  bool refuse(int status) {
    if (!responded_) {
      const std::string body = refusal_(status);
      const std::string response =
          "HTTP/1.1 " + std::to_string(status) + " " + reason_phrase(status) +
          "\r\nContent-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
          "\r\nConnection: close\r\n\r\n" + body;
      if (wait(POLLOUT, write_timeout_) > 0) send_all(response.data(), response.size());
    }
    refused_ = true;
    return false;
  }

  ssize_t send_all(const char* ptr, size_t size) {
    ssize_t n;
    do {
      n = send(sock_, ptr, size, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n;
  }

  // poll() for `events`: > 0 ready, 0 timed out, < 0 failed.
  int wait(short events, std::chrono::microseconds timeout) const {
    pollfd fd{sock_, events, 0};
    const int ms = static_cast<int>((timeout.count() + 999) / 1000);
    int ready;
    do {
      ready = poll(&fd, 1, ms);
    } while (ready < 0 && errno == EINTR);
    return ready;
  }

  // The peer has not closed its end (nothing to read, or something other than EOF).
  bool peer_open() const {
    if (wait(POLLIN, std::chrono::microseconds(0)) == 0) return true;
    char byte;
    return recv(sock_, &byte, 1, MSG_PEEK) > 0;
  }

  void endpoint(bool peer, std::string& ip, int& port) const {
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    auto* sa = reinterpret_cast<sockaddr*>(&addr);
    if ((peer ? getpeername(sock_, sa, &len) : getsockname(sock_, sa, &len)) != 0) return;
    char host[NI_MAXHOST], serv[NI_MAXSERV];
    if (getnameinfo(sa, len, host, sizeof(host), serv, sizeof(serv),
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
      ip = host;
      port = std::atoi(serv);
    }
  }

  socket_t sock_;
  size_t max_body_bytes_;
  std::chrono::microseconds read_timeout_, write_timeout_;
  const std::function<std::string(int)>& refusal_;
  char buffer_[4096];
  size_t begin_ = 0, end_ = 0;  // unread bytes of buffer_
  bool in_head_ = true;
  size_t head_bytes_ = 0, body_bytes_ = 0;
  int blank_line_match_ = 0;  // how much of "\n\r\n" the head ends with
  bool first_line_ = true;    // the request line, which needs no colon
  size_t line_bytes_ = 0;     // of the head's current line, without \r
  bool line_has_colon_ = false;
  bool responded_ = false;  // this request's response has started
  bool refused_ = false;
  bool closing_ = false;
};

// The stream of the connection this thread serves (httplib runs a request's handlers on the
// thread that reads it).
thread_local BoundedStream* current_stream = nullptr;

std::chrono::microseconds duration(time_t sec, time_t usec) {
  return std::chrono::seconds(sec) + std::chrono::microseconds(usec);
}

}  // namespace

void BoundedServer::close_after_response(httplib::Response& res) {
  res.set_header("Connection", "close");
  if (current_stream != nullptr) current_stream->close_after_response();
}

bool BoundedServer::process_and_close_socket(socket_t sock) {
  BoundedStream strm(sock, max_body_bytes_, duration(read_timeout_sec_, read_timeout_usec_),
                     duration(write_timeout_sec_, write_timeout_usec_), refusal_);
  current_stream = &strm;
  const auto stopping = [this] { return svr_sock_ == INVALID_SOCKET; };
  bool ok = false;
  for (size_t left = keep_alive_max_count_; left > 0; --left) {
    if (!strm.wait_for_request(std::chrono::seconds(keep_alive_timeout_sec_), stopping)) break;
    strm.start_request();
    bool connection_closed = false;
    ok = process_request(strm, /*close_connection=*/left == 1, connection_closed, nullptr);
    if (!ok || connection_closed || strm.closing()) break;
  }
  current_stream = nullptr;
  shutdown(sock, SHUT_RDWR);
  close(sock);
  return ok;
}

}  // namespace pagedlm::server
