// The OpenAI-compatible HTTP server: routes, auth, streaming, errors, on the event-driven front
// end of http_transport.h. Its workers parse, template and tokenize; the EngineLoop's thread
// runs the model.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/text_model.h"

namespace pagedlm::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8000;  // 0: any free port (bind() returns it)
  // Bearer tokens that may call the API; empty: no auth. Each key also salts the prefix cache,
  // so clients with different keys never share cached pages.
  std::vector<std::string> api_keys;
  // Requests admitted but not yet running (being parsed, queued, waiting in the engine); past
  // it, 503 with Retry-After before any parsing.
  int32_t max_waiting = 64;
  // The expected wait for a first token (requests ahead over the rate they have been starting)
  // beyond which new requests get 503, with that estimate in Retry-After; 0: no bound.
  std::chrono::milliseconds max_queue_wait{30000};
  size_t max_body_bytes = size_t{8} << 20;
  int32_t http_threads = 4;  // workers that parse, template and tokenize (streams hold none)
  int32_t max_connections = 10000;
  // Of those, what one client address may hold, so one client cannot take them all.
  int32_t max_connections_per_client = 1000;
  std::chrono::milliseconds header_timeout{10000};  // for a whole request head
  std::chrono::milliseconds body_timeout{60000};    // for a whole body
  // On stop(): how long running requests may still finish before they are ended.
  std::chrono::milliseconds shutdown_timeout{5000};
  bool metrics_auth = false;      // /metrics (all tenants' counters) needs an API key too
  std::string served_model_name;  // the model id clients send and see
  // "deepseek_r1" or "qwen3" (one parser serves both): a chat reply's <think> block becomes
  // the message's reasoning_content (server/reasoning.h). Empty: replies are returned whole.
  std::string reasoning_parser;
};

class HttpServer {
 public:
  // A model without a tokenizer (random weights) serves token-id prompts only.
  HttpServer(const TextModel& model, Engine& engine, ServerOptions options);
  ~HttpServer();

  // Binds the socket; returns the port. Throws pagedlm::Error when it cannot.
  int bind();
  // Serves until stop(); call bind() first.
  void listen();
  // Graceful shutdown, from another thread: stops accepting, lets running requests finish for
  // up to shutdown_timeout, then ends streams with finish_reason "abort" and other requests
  // with 503; listen() then returns. From the start of the drain every engine step is held to
  // target_itl_ms (EngineLoop::drain), so the engine thread leaves between two short steps.
  // False when it is still inside a step half a second after the drain (one that was already
  // long when the drain began, such as a prompt prefilled alone with the whole step budget on
  // the CPU, or any step with target_itl_ms off): the Engine is then still in use, and the
  // caller should end the process rather than destroy it. A body still being parsed at the
  // drain is abandoned (503); a worker may still be busy with other work of a client whose
  // connection is closed (a long prompt tokenizing), which destroying the server waits for.
  bool stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedlm::server
