#include "pagedlm/server/http_transport.h"

#include <malloc.h>
#include <sys/resource.h>
#include <sys/socket.h>

#include <array>
#include <atomic>
#include <boost/asio/executor_work_guard.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/post.hpp>
#include <boost/asio/steady_timer.hpp>
#include <boost/asio/thread_pool.hpp>
#include <boost/asio/write.hpp>
#include <boost/beast/core/flat_buffer.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/core/tcp_stream.hpp>
#include <boost/beast/http/read.hpp>
#include <boost/beast/http/status.hpp>
#include <cerrno>
#include <cstdio>
#include <map>
#include <set>
#include <thread>
#include <unordered_set>

#include "pagedlm/core/error.h"
#include "pagedlm/server/http_parse.h"

namespace pagedlm::server {

namespace net = boost::asio;
namespace beast = boost::beast;
namespace http = beast::http;
using tcp = net::ip::tcp;
using Clock = std::chrono::steady_clock;

namespace {

// A client that takes longer than this to accept part of a response is gone or hostile.
constexpr std::chrono::seconds kWriteTimeout{30};
// A stream with nothing to say sends an SSE comment this often, so proxies and clients with idle
// timeouts see it alive.
constexpr std::chrono::milliseconds kHeartbeat{1000};
// After a refusal, the connection's unread input is drained this long before it closes, so the
// client reads the refusal instead of a reset.
constexpr std::chrono::seconds kLinger{2};
// After a body this large is freed, malloc_trim hands the memory back: glibc keeps freed memory
// in its arenas otherwise, where what a burst of large bodies took stays resident.
constexpr size_t kTrimAfterBytes = size_t{1} << 20;

std::string status_line(int status) {
  return "HTTP/1.1 " + std::to_string(status) + " " +
         std::string(http::obsolete_reason(static_cast<http::status>(status))) + "\r\n";
}

// A response's head (and body unless `head_only`), framed by Content-Length, or chunked for a
// stream to an HTTP/1.1 client.
std::string serialize(const HttpResponse& r, bool keep_alive, unsigned version, bool head_only,
                      bool stream) {
  std::string out = status_line(r.status);
  if (!r.content_type.empty()) out.append("Content-Type: ").append(r.content_type).append("\r\n");
  for (const auto& [name, value] : r.headers)
    out.append(name).append(": ").append(value).append("\r\n");
  if (!stream) {
    out.append("Content-Length: ").append(std::to_string(r.body.size())).append("\r\n");
  } else if (version >= 11) {
    out += "Transfer-Encoding: chunked\r\n";
  }
  if (!keep_alive) {
    out += "Connection: close\r\n";
  } else if (version < 11) {
    out += "Connection: keep-alive\r\n";
  }
  out += "\r\n";
  if (!stream && !head_only) out += r.body;
  return out;
}

// A connection's read buffer, which also looks at the bytes Beast takes from it as a request
// head: Beast parses a head in one piece once all of it has arrived, and joins folded lines
// without saying so (http_parse.h, has_folded_line).
class HeadBuffer : public beast::flat_buffer {
 public:
  void watch_head() {
    watching_ = true;
    folded_ = false;
  }
  // Whether the head taken since watch_head() held a folded line; stops watching.
  bool head_was_folded() {
    watching_ = false;
    return folded_;
  }
  // Hides flat_buffer's: Beast's read operations call it through this type.
  void consume(std::size_t n) {
    if (watching_ && n > 0) {
      const auto bytes = data();
      folded_ = folded_ || has_folded_line(std::string_view(static_cast<const char*>(bytes.data()),
                                                            std::min(n, bytes.size())));
    }
    beast::flat_buffer::consume(n);
  }

 private:
  bool watching_ = false;
  bool folded_ = false;
};

bool disconnected(const beast::error_code& ec) {
  return ec == http::error::end_of_stream || ec == net::error::eof ||
         ec == net::error::connection_reset || ec == net::error::operation_aborted ||
         ec == net::error::broken_pipe || ec == beast::error::timeout;
}

}  // namespace

std::string HttpRequest::header(std::string_view name) const {
  for (const auto& [k, v] : headers) {
    if (beast::iequals(k, beast::string_view(name.data(), name.size()))) return v;
  }
  return {};
}

std::optional<std::string> HttpRequest::query_param(std::string_view name) const {
  std::string_view rest = query;
  while (!rest.empty()) {
    const size_t amp = rest.find('&');
    const std::string_view pair = rest.substr(0, amp);
    rest = amp == std::string_view::npos ? std::string_view() : rest.substr(amp + 1);
    const size_t eq = pair.find('=');
    if (pair.substr(0, eq) == name) {
      return std::string(eq == std::string_view::npos ? std::string_view() : pair.substr(eq + 1));
    }
  }
  return std::nullopt;
}

class Connection;

struct HttpTransport::Impl {
  struct Route {
    RouteWork work;
    std::function<HttpReply(HttpRequest&)> handler;
  };

  Impl(TransportOptions o, TransportHooks h)
      : options(std::move(o)), hooks(std::move(h)), workers(std::max(1, options.worker_threads)) {}

  void accept();
  HttpResponse error(int status, const std::string& message, const std::string& type) const {
    HttpResponse r;
    r.status = status;
    r.body = hooks.error_body(status, message, type);
    return r;
  }
  // The Allow header's value for a path; empty when no route has it.
  std::string allowed(const std::string& path) const {
    const auto it = routes.find(path);
    if (it == routes.end()) return {};
    std::string out;
    for (const auto& [method, route] : it->second) {
      out += (out.empty() ? "" : ", ") + method + (method == "GET" ? ", HEAD" : "");
    }
    return out;
  }

  TransportOptions options;
  TransportHooks hooks;
  std::map<std::string, std::map<std::string, Route>> routes;  // path -> method -> route
  net::io_context ioc{1};
  net::executor_work_guard<net::io_context::executor_type> guard{ioc.get_executor()};
  tcp::acceptor acceptor{ioc};
  net::steady_timer accept_retry{ioc};
  net::thread_pool workers;
  std::unordered_set<std::shared_ptr<Connection>> connections;  // the front end's thread only
  std::map<net::ip::address, int> connections_per_client;       // the front end's thread only
  std::atomic<bool> draining{false};
  std::atomic<int> answering{0};  // connections whose answer is being made or written
};

// One client connection. Everything here runs on the front end's thread, except the notify
// callback handed to a PendingReply, which only posts to it.
class Connection : public std::enable_shared_from_this<Connection> {
 public:
  Connection(HttpTransport::Impl& server, tcp::socket socket, net::ip::address client)
      : server_(server),
        stream_(std::move(socket)),
        heartbeat_(stream_.get_executor()),
        client_(std::move(client)) {}

  void start() { read_head(); }

  // Shutdown: an answer still in progress ends now. One still on a worker (its body being
  // parsed, its template rendered) is not waited for: the connection closes, and what the
  // worker hands back is cancelled.
  void abort() {
    if (!pending_) {
      if (answering_) close();
      return;
    }
    pending_->abort();
    on_notify();
  }

  void close() {
    if (closed_) return;
    closed_ = true;
    if (pending_) {
      pending_->cancel();
      end_answer();
    }
    set_answering(false);
    heartbeat_.cancel();
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_both, ec);
    stream_.close();
    const auto count = server_.connections_per_client.find(client_);
    if (count != server_.connections_per_client.end() && --count->second <= 0) {
      server_.connections_per_client.erase(count);
    }
    // The last reference may be this one; the caller's handler still holds its own.
    server_.connections.erase(shared_from_this());
  }

 private:
  enum class Then { kNothing, kNextRequest, kClose, kLinger };

  void read_head() {
    if (closed_) return;
    if (server_.draining) {
      close();
      return;
    }
    parser_.emplace();
    bound_parser(*parser_, server_.options.max_body_bytes);
    // What a long request left behind is not kept for the connection's life.
    if (buffer_.size() == 0 && buffer_.capacity() > kMaxHeadBytes) buffer_ = HeadBuffer();
    buffer_.watch_head();
    stream_.expires_after(server_.options.header_timeout);
    http::async_read_header(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->on_head(ec); });
  }

  void on_head(beast::error_code ec) {
    if (closed_) return;
    const bool folded = buffer_.head_was_folded();
    if (ec) {
      // A client that left, or whose head did not arrive in time, gets no answer.
      if (disconnected(ec)) return close();
      return refuse(refusal_for(ec));
    }
    if (folded) return refuse(Refusal{400, kFoldedLineMessage});
    const auto& head = parser_->get();
    if (const Refusal r = check_head(head.base()); r.status != 0) return refuse(r);
    request_ = HttpRequest{};
    request_.shutting_down = &server_.draining;
    request_.method = std::string(head.method_string());
    const std::string_view target(head.target().data(), head.target().size());
    const size_t q = target.find('?');
    request_.path = std::string(target.substr(0, q));
    if (q != std::string_view::npos) request_.query = std::string(target.substr(q + 1));
    for (const auto& field : head) {
      request_.headers.emplace_back(std::string(field.name_string()), std::string(field.value()));
    }
    keep_alive_ = head.keep_alive();
    version_ = head.version();
    head_only_ = head.method() == http::verb::head;

    const auto path = server_.routes.find(request_.path);
    if (path == server_.routes.end()) {
      return refuse(server_.error(404, "no route for " + request_.method + " " + request_.path,
                                  "not_found_error"));
    }
    const auto method = path->second.find(head_only_ ? "GET" : request_.method);
    if (method == path->second.end()) {
      const std::string allow = server_.allowed(request_.path);
      HttpResponse r = server_.error(
          405, request_.method + " is not allowed on " + request_.path + "; use " + allow,
          "invalid_request_error");
      r.headers.emplace_back("Allow", allow);
      return refuse(std::move(r));
    }
    route_ = &method->second;
    // Cheap routes (/health among them, which reports the drain) still answer while draining.
    if (server_.draining && route_->work != RouteWork::kInline) {
      return refuse(server_.error(503, "the server is shutting down", "server_error"));
    }
    if (server_.hooks.pre_route) {
      if (std::optional<HttpResponse> r = server_.hooks.pre_route(request_)) {
        return refuse(std::move(*r));
      }
    }
    // A client that asks first (curl does for large and chunked bodies) sends the body only
    // once told to; one past the limit by its Content-Length was refused above, by the parser.
    if (beast::iequals(request_.header("Expect"), "100-continue")) {
      continue_ = "HTTP/1.1 100 Continue\r\n\r\n";
      stream_.expires_after(kWriteTimeout);
      net::async_write(stream_, net::buffer(continue_),
                       [self = shared_from_this()](beast::error_code ec, size_t) {
                         if (ec) return self->close();
                         self->read_body();
                       });
      return;
    }
    read_body();
  }

  void read_body() {
    if (parser_->is_done()) return on_body({});
    stream_.expires_after(server_.options.body_timeout);
    http::async_read(
        stream_, buffer_, *parser_,
        [self = shared_from_this()](beast::error_code ec, size_t) { self->on_body(ec); });
  }

  void on_body(beast::error_code ec) {
    if (closed_) return;
    if (ec) {
      if (disconnected(ec)) return close();
      return refuse(refusal_for(ec));
    }
    stream_.expires_never();
    request_.body = std::move(parser_->get().body());
    parser_.reset();
    dispatch();
  }

  void dispatch() {
    const HttpTransport::Impl::Route& route = *route_;
    if (route.work == RouteWork::kInline) return send(run(route, request_));
    std::shared_ptr<void> admission;
    if (route.work == RouteWork::kGeneration) {
      // Before any parsing: an overloaded server refuses at once instead of queueing unseen.
      admission = server_.hooks.admit();
      if (!admission) {
        request_ = HttpRequest{};
        HttpResponse r =
            server_.error(503, "the server is overloaded; retry later", "server_overloaded");
        const int32_t retry =
            server_.hooks.retry_after_seconds ? server_.hooks.retry_after_seconds() : 1;
        r.headers.emplace_back("Retry-After", std::to_string(retry));
        return send(HttpReply{std::move(r), nullptr, false});
      }
    }
    set_answering(true);
    net::post(server_.workers, [self = shared_from_this(), &route, admission = std::move(admission),
                                request = std::move(request_)]() mutable {
      HttpReply reply = self->run(route, request);
      const bool large = request.body.capacity() >= kTrimAfterBytes;
      request = HttpRequest{};
      admission.reset();
      if (large) malloc_trim(0);
      net::post(self->stream_.get_executor(),
                [self, reply = std::move(reply)]() mutable { self->send(std::move(reply)); });
    });
  }

  HttpReply run(const HttpTransport::Impl::Route& route, HttpRequest& request) const {
    try {
      return route.handler(request);
    } catch (const std::exception& e) {
      return HttpReply{server_.error(500, e.what(), "server_error"), nullptr, false};
    }
  }

  void send(HttpReply reply) {
    if (closed_) {
      if (reply.pending) reply.pending->cancel();
      return;
    }
    if (!reply.pending) {
      set_answering(false);
      return respond(reply.response);
    }
    set_answering(true);
    pending_ = std::move(reply.pending);
    streaming_ = reply.stream;
    std::weak_ptr<Connection> weak = shared_from_this();
    pending_->set_notify([weak, executor = stream_.get_executor()] {
      const std::shared_ptr<Connection> self = weak.lock();
      if (self && !self->notified_.exchange(true)) {
        net::post(executor, [self] { self->on_notify(); });
      }
    });
    if (streaming_) {
      if (version_ < 11) keep_alive_ = false;  // no chunked framing: the close ends the stream
      after_flush_ = Then::kNothing;
      queue(serialize(reply.response, keep_alive_ && !server_.draining, version_, head_only_,
                      /*stream=*/true));
      arm_heartbeat();
    }
    watch_client();
    on_notify();
  }

  void on_notify() {
    notified_ = false;
    if (closed_ || !pending_) return;
    if (streaming_) {
      bool ended = false;
      const std::string data = pending_->take_stream(&ended);
      if (!data.empty() && !head_only_) queue(frame(data));
      if (!ended) return;
      end_answer();
      after_flush_ = keep_alive_ && !server_.draining ? Then::kNextRequest : Then::kClose;
      queue(version_ >= 11 && !head_only_ ? "0\r\n\r\n" : "");
    } else if (std::optional<HttpResponse> r = pending_->take_response()) {
      end_answer();
      respond(*r);
    }
  }

  std::string frame(const std::string& data) const {
    if (version_ < 11) return data;
    char size[24];
    std::snprintf(size, sizeof(size), "%zx\r\n", data.size());
    return size + data + "\r\n";
  }

  // The answer is complete (or abandoned): no more output, heartbeats or client watching.
  void end_answer() {
    pending_.reset();
    ++watch_id_;
    heartbeat_.cancel();
    set_answering(false);
  }

  void set_answering(bool on) {
    if (on != answering_) server_.answering += on ? 1 : -1;
    answering_ = on;
  }

  // A client that closes its end while its answer is made has left: its work is cancelled at
  // once (its KV pages freed) rather than at the next failed write.
  void watch_client() {
    const uint64_t id = ++watch_id_;
    stream_.socket().async_wait(
        tcp::socket::wait_read, [self = shared_from_this(), id](beast::error_code ec) {
          if (ec || id != self->watch_id_ || !self->pending_) return;
          char byte;
          const ssize_t n =
              ::recv(self->stream_.socket().native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
          if (n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
            return self->close();
          }
          // Bytes of a pipelined request wait for their turn; a failed write still notices a
          // client that leaves after sending them.
          if (n < 0) self->watch_client();
        });
  }

  void arm_heartbeat() {
    heartbeat_.expires_after(kHeartbeat);
    heartbeat_.async_wait([self = shared_from_this()](beast::error_code ec) {
      if (ec || !self->pending_) return;
      if (!self->writing_ && Clock::now() - self->last_write_ >= kHeartbeat && !self->head_only_) {
        self->queue(self->frame(": keep-alive\n\n"));
      }
      self->arm_heartbeat();
    });
  }

  void respond(const HttpResponse& r) {
    const bool keep = keep_alive_ && !r.close && !server_.draining;
    after_flush_ = keep ? Then::kNextRequest : Then::kClose;
    queue(serialize(r, keep, version_, head_only_, /*stream=*/false));
  }

  // Answers before the body was read (or when the request could not be read): the connection
  // closes, since what follows on it cannot be trusted to start a request.
  void refuse(const Refusal& r) {
    refuse(server_.error(r.status, r.message, "invalid_request_error"));
  }
  void refuse(HttpResponse r) {
    parser_.reset();
    r.close = true;
    respond(r);
    after_flush_ = Then::kLinger;
  }

  void queue(const std::string& data) {
    outbox_ += data;
    if (!writing_) flush();
  }

  void flush() {
    if (closed_) return;
    if (outbox_.empty()) return flushed();
    writing_buf_ = std::move(outbox_);
    outbox_.clear();
    writing_ = true;
    stream_.expires_after(kWriteTimeout);
    net::async_write(stream_, net::buffer(writing_buf_),
                     [self = shared_from_this()](beast::error_code ec, size_t) {
                       self->writing_ = false;
                       if (ec) return self->close();  // cancels what the client was owed
                       self->last_write_ = Clock::now();
                       self->flush();
                     });
  }

  void flushed() {
    stream_.expires_never();
    const Then then = after_flush_;
    after_flush_ = Then::kNothing;
    if (writing_buf_.capacity() > kMaxHeadBytes) std::string().swap(writing_buf_);
    if (then == Then::kNextRequest) read_head();
    if (then == Then::kClose) close();
    if (then == Then::kLinger) linger();
  }

  void linger() {
    beast::error_code ec;
    stream_.socket().shutdown(tcp::socket::shutdown_send, ec);
    if (ec) return close();
    stream_.expires_after(kLinger);
    drain_next();
  }
  void drain_next() {
    stream_.async_read_some(net::buffer(drain_),
                            [self = shared_from_this()](beast::error_code ec, size_t) {
                              if (ec || self->closed_) return self->close();
                              self->drain_next();
                            });
  }

  HttpTransport::Impl& server_;
  beast::tcp_stream stream_;
  net::steady_timer heartbeat_;
  const net::ip::address client_;  // the peer's address, for --max-connections-per-client
  HeadBuffer buffer_;
  std::optional<RequestParser> parser_;
  HttpRequest request_;
  const HttpTransport::Impl::Route* route_ = nullptr;
  bool keep_alive_ = false;
  unsigned version_ = 11;
  bool head_only_ = false;  // a HEAD request: the head of the GET answer
  bool closed_ = false;
  bool answering_ = false;
  std::shared_ptr<PendingReply> pending_;
  bool streaming_ = false;
  std::atomic<bool> notified_{false};
  uint64_t watch_id_ = 0;
  std::string continue_;
  std::string outbox_, writing_buf_;
  bool writing_ = false;
  Then after_flush_ = Then::kNothing;
  Clock::time_point last_write_ = Clock::now();
  std::array<char, 16384> drain_{};
};

void HttpTransport::Impl::accept() {
  acceptor.async_accept([this](beast::error_code ec, tcp::socket socket) {
    if (!acceptor.is_open()) return;
    if (ec) {
      // Out of file descriptors (or another transient failure): the pending connection waits
      // in the backlog while closing ones free descriptors.
      accept_retry.expires_after(std::chrono::milliseconds(50));
      accept_retry.async_wait([this](beast::error_code e) {
        if (!e) accept();
      });
      return;
    }
    const tcp::endpoint peer = socket.remote_endpoint(ec);
    // One client may hold a share of the connections only, so another (a load balancer's
    // /health probe among them) still gets in while it floods (2026-12-02, 2-core Intel Xeon,
    // b8c1423: 10,050 idle sockets from one address in 1.1 s held every slot, and /health was
    // reset for 14 s).
    int& held = connections_per_client[ec ? net::ip::address() : peer.address()];
    if (ec || static_cast<int>(connections.size()) >= options.max_connections ||
        held >= options.max_connections_per_client || draining) {
      if (held == 0) connections_per_client.erase(ec ? net::ip::address() : peer.address());
      beast::error_code ignored;
      socket.close(ignored);
    } else {
      ++held;
      socket.set_option(tcp::no_delay(true), ec);  // SSE events are small and must not wait
      auto connection = std::make_shared<Connection>(*this, std::move(socket), peer.address());
      connections.insert(connection);
      connection->start();
    }
    accept();
  });
}

HttpTransport::HttpTransport(TransportOptions options, TransportHooks hooks)
    : impl_(std::make_shared<Impl>(std::move(options), std::move(hooks))) {}

HttpTransport::~HttpTransport() {
  impl_->draining = true;  // a body still being parsed is abandoned, not waited for
  impl_->ioc.stop();
  impl_->workers.join();
}

void HttpTransport::route(const std::string& method, const std::string& path, RouteWork work,
                          std::function<HttpReply(HttpRequest&)> handler) {
  impl_->routes[path][method] = Impl::Route{work, std::move(handler)};
}

int HttpTransport::bind() {
  // Each connection holds a descriptor; the soft limit (often 1024) would cap them far below
  // what a hostile client opens.
  rlimit limit{};
  if (getrlimit(RLIMIT_NOFILE, &limit) == 0 && limit.rlim_cur < limit.rlim_max) {
    limit.rlim_cur = limit.rlim_max;
    setrlimit(RLIMIT_NOFILE, &limit);
  }
  const TransportOptions& o = impl_->options;
  beast::error_code ec;
  const auto address = net::ip::make_address(o.host, ec);
  PAGEDLM_CHECK(!ec, "cannot listen on ", o.host, ": not an IP address");
  const tcp::endpoint endpoint(address, static_cast<unsigned short>(o.port));
  tcp::acceptor& a = impl_->acceptor;
  a.open(endpoint.protocol(), ec);
  if (!ec) a.set_option(net::socket_base::reuse_address(true), ec);
  if (!ec) a.bind(endpoint, ec);
  if (!ec) a.listen(net::socket_base::max_listen_connections, ec);
  PAGEDLM_CHECK(!ec, "cannot listen on ", o.host, ":", o.port, ": ", ec.message());
  return a.local_endpoint().port();
}

void HttpTransport::run() {
  net::post(impl_->ioc, [impl = impl_.get()] { impl->accept(); });
  impl_->ioc.run();
}

bool HttpTransport::draining() const { return impl_->draining; }

void HttpTransport::shutdown(std::chrono::milliseconds drain) {
  Impl& s = *impl_;
  if (s.ioc.stopped()) return;
  const auto wait_answers = [&s](Clock::duration limit) {
    const auto deadline = Clock::now() + limit;
    while (s.answering > 0 && Clock::now() < deadline) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  };
  s.draining = true;
  const auto each = [&s](void (Connection::*f)()) {
    net::post(s.ioc, [&s, f] {
      for (const auto& c : std::vector(s.connections.begin(), s.connections.end())) (*c.*f)();
    });
  };
  net::post(s.ioc, [&s] {
    beast::error_code ec;
    s.acceptor.close(ec);
    s.accept_retry.cancel();
  });
  wait_answers(drain);
  each(&Connection::abort);
  wait_answers(std::chrono::seconds(1));
  // What was written reaches the clients before the close.
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  each(&Connection::close);
  s.guard.reset();
  net::post(s.ioc, [&s] { s.ioc.stop(); });
  // Tasks still queued are dropped; the ones running end on their own.
  s.workers.stop();
}

}  // namespace pagedlm::server
