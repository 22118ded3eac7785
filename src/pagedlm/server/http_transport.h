// The event-driven HTTP/1.1 front end (Boost.Beast on Asio): one thread runs every socket, so
// thousands of idle or slow connections cost memory, not threads; CPU work (JSON, templates,
// tokenizing) runs on a small worker pool. What one connection may take is bounded: the request
// head must arrive within --header-timeout and the body within --body-timeout, sizes are held
// by the parser (http_parse.h), and a client that stops reading a response is dropped after
// kWriteTimeout. Generation requests pass an admission check before any parsing work, and an
// answer the engine is still producing (a PendingReply) is written as it arrives, without
// holding a thread.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace pagedlm::server {

struct HttpRequest {
  std::string method;  // as sent: GET, POST, ...
  std::string path;    // the target up to '?'
  std::string query;   // after '?', as sent
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
  // Up once the server drains (the transport sets it): a handler parsing the body stops at it
  // (parse_json's `abandon`), as its request has not reached the engine yet.
  const std::atomic<bool>* shutting_down = nullptr;

  // The first header of that name (case-insensitive); empty when absent.
  std::string header(std::string_view name) const;
  // The raw value of a query parameter; nullopt when absent.
  std::optional<std::string> query_param(std::string_view name) const;
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;  // beyond the framing ones
  bool close = false;                                        // the connection closes after it
};

// An answer the engine is still producing. Every method but the callback given to set_notify
// runs on the front end's thread.
class PendingReply {
 public:
  virtual ~PendingReply() = default;
  // `notify` may be called from any thread whenever new output may be ready.
  virtual void set_notify(std::function<void()> notify) = 0;
  // A stream: the bytes to send now (possibly none), and whether the stream is complete.
  virtual std::string take_stream(bool* ended) = 0;
  // Not a stream: the response once the answer is complete.
  virtual std::optional<HttpResponse> take_response() = 0;
  // The client left: stop the work.
  virtual void cancel() = 0;
  // The server is stopping: finish now (a stream with a finish_reason, a reply with 503).
  virtual void abort() = 0;
};

struct HttpReply {
  HttpResponse response;  // for a stream: the status and headers sent before its data
  std::shared_ptr<PendingReply> pending;
  bool stream = false;  // pending's output is sent as it arrives (chunked)
};

enum class RouteWork {
  kInline,      // cheap: answered on the front end's thread
  kWorker,      // parses or waits: runs on a worker
  kGeneration,  // a worker, after the admission check
};

struct TransportOptions {
  std::string host = "127.0.0.1";
  int port = 8000;
  size_t max_body_bytes = size_t{8} << 20;
  std::chrono::milliseconds header_timeout{10000};  // the whole request head
  std::chrono::milliseconds body_timeout{60000};    // the whole body
  int worker_threads = 4;
  int max_connections = 10000;  // past it, new connections are closed at once
  // Connections one client address may hold; past it, its new ones are closed at once.
  int max_connections_per_client = 1000;
};

struct TransportHooks {
  // Before the body is read: a response refuses the request (the connection then closes).
  std::function<std::optional<HttpResponse>(const HttpRequest& head)> pre_route;
  // Generation routes: a token held while the request is parsed and queued; null answers 503.
  std::function<std::shared_ptr<void>()> admit;
  // A refused generation's Retry-After, in seconds.
  std::function<int32_t()> retry_after_seconds;
  // The body of an error response; `type` is OpenAI's error type.
  std::function<std::string(int status, const std::string& message, const std::string& type)>
      error_body;
};

class HttpTransport {
 public:
  HttpTransport(TransportOptions options, TransportHooks hooks);
  ~HttpTransport();

  // Handlers may throw; what escapes becomes a 500.
  void route(const std::string& method, const std::string& path, RouteWork work,
             std::function<HttpReply(HttpRequest&)> handler);

  // Binds; returns the port. Throws pagedlm::Error when it cannot.
  int bind();
  // Serves on the calling thread until shutdown() has finished.
  void run();
  // From another thread: stops accepting; on open connections, answers cheap routes (/health
  // says draining) and refuses others with 503, closing each after its answer; lets running
  // answers finish for up to `drain`, then aborts the rest, and returns once they were written
  // (or a second later) and every connection closed.
  // Requests still on a worker then are not waited for: their connections close and queued
  // tasks are dropped. A body being parsed is abandoned from the drain's start
  // (HttpRequest::shutting_down), so the drain does not wait for that.
  void shutdown(std::chrono::milliseconds drain);
  bool draining() const;

  struct Impl;  // named by the connections in the .cc

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace pagedlm::server
