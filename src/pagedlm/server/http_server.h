// The OpenAI-compatible HTTP server: routes, auth, streaming, errors. HTTP worker threads parse,
// template and tokenize; the EngineLoop's thread runs the model.
#pragma once

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
  int32_t max_waiting = 256;  // past it, 503 with Retry-After
  size_t max_body_bytes = size_t{8} << 20;
  int32_t http_threads = 128;     // each streaming client holds one while it streams
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
  // Ends open requests with an error and stops listening; callable from any thread.
  void stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace pagedlm::server
