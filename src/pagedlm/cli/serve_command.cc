// pagedlm serve: the OpenAI-compatible HTTP server.
#include <signal.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <optional>
#include <thread>

#include "pagedlm/cli/commands.h"
#include "pagedlm/cli/interrupt.h"
#include "pagedlm/cli/model_path.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/model/dummy_checkpoint.h"
#include "pagedlm/server/http_server.h"

namespace pagedlm::cli {

namespace {

// The file or folder name, without a .gguf (or a dummy's .json) suffix: what clients call the
// model by default.
std::string model_name_from_path(const std::string& path) {
  std::filesystem::path p(path);
  if (p.filename().empty()) p = p.parent_path();  // "dir/" names the folder
  const bool strip = p.extension() == ".gguf" || p.extension() == ".json";
  return strip ? p.stem().string() : p.filename().string();
}

}  // namespace

void register_serve(CLI::App& app) {
  auto* cmd = app.add_subcommand("serve", "serve the OpenAI API (completions, chat) over HTTP");
  struct Args {
    std::string model, dummy, chat_template, tokenizer;
    server::ServerOptions server;
    EngineFlags flags;
  };
  auto args = std::make_shared<Args>();
  server::ServerOptions& s = args->server;
  cmd->add_option("--model", args->model, "HF folder or .gguf file (default: SmolLM2 GGUF)");
  cmd->add_option("--dummy", args->dummy,
                  "config.json: serve random weights of that shape, without a tokenizer (for "
                  "benchmarks: prompts must be token ids)")
      ->excludes(cmd->get_option("--model"));
  cmd->add_option("--tokenizer", args->tokenizer,
                  "with --dummy: a tokenizer.json to serve text with (benchmarks of text-only "
                  "paths such as structured output)")
      ->needs(cmd->get_option("--dummy"))
      ->check(CLI::ExistingFile);
  cmd->add_option("--host", s.host, "address to listen on")->capture_default_str();
  cmd->add_option("--port", s.port, "port to listen on (0: any free port)")->capture_default_str();
  cmd->add_option("--api-key", s.api_keys,
                  "accept only requests with this bearer token (repeatable; each key also "
                  "salts the prefix cache)");
  cmd->add_option("--max-waiting", s.max_waiting,
                  "requests admitted but not yet running (parsed, queued, waiting) beyond which "
                  "to answer 503 at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-body-bytes", s.max_body_bytes, "largest request body accepted")
      ->capture_default_str();
  cmd->add_option("--http-threads", s.http_threads,
                  "threads that parse, template and tokenize requests (connections and streams "
                  "hold none)")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-connections", s.max_connections,
                  "open connections beyond which new ones are closed at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--max-connections-per-client", s.max_connections_per_client,
                  "open connections from one client address beyond which its new ones are "
                  "closed at once")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  auto seconds = [cmd](const char* name, std::chrono::milliseconds& value, const char* help) {
    cmd->add_option_function<double>(
           name,
           [&value](double s) {
             value = std::chrono::milliseconds(static_cast<int64_t>(s * 1000));
           },
           help)
        ->default_str(std::to_string(value.count() / 1000))
        ->check(CLI::Range(0.001, 86400.0));
  };
  seconds("--header-timeout", s.header_timeout,
          "seconds a client has to send a whole request head (slow clients are dropped)");
  seconds("--body-timeout", s.body_timeout, "seconds a client has to send a whole request body");
  seconds("--shutdown-timeout", s.shutdown_timeout,
          "on SIGTERM, seconds running requests may still finish before they are ended");
  cmd->add_option_function<double>(
         "--max-queue-wait",
         [&value = s.max_queue_wait](double seconds) {
           value = std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
         },
         "seconds a new request may expect to wait for its first token (requests ahead over "
         "the rate they have been starting) beyond which it gets 503 with that estimate in "
         "Retry-After (0: no bound)")
      ->default_str(std::to_string(s.max_queue_wait.count() / 1000))
      ->check(CLI::Range(0.0, 86400.0));
  cmd->add_flag("--metrics-auth", s.metrics_auth,
                "/metrics needs an --api-key too (it shows all tenants' counters)")
      ->needs(cmd->get_option("--api-key"));
  cmd->add_option("--served-model-name", s.served_model_name,
                  "model id clients use (default: the model file or folder name)");
  cmd->add_option("--chat-template", args->chat_template,
                  "Jinja file to render chat requests with instead of the model's template")
      ->check(CLI::ExistingFile);
  cmd->add_option("--reasoning-parser", s.reasoning_parser,
                  "return a chat reply's <think> block as reasoning_content (Qwen3, "
                  "DeepSeek-R1; one parser serves both names)")
      ->check(CLI::IsMember({"deepseek_r1", "qwen3"}));
  add_engine_flags(*cmd, args->flags);
  cmd->callback([args] {
    signal(SIGPIPE, SIG_IGN);  // a vanished client must fail a write, not kill the server
    // Until the server listens, SIGINT or SIGTERM ends the process at once (the load has
    // nothing to drain); then the first one drains (a watcher polls for it) and a second one
    // ends the process at once.
    catch_stop_signals();
    std::optional<StopSignalsEndAtOnce> starting(std::in_place);
    const bool dummy = !args->dummy.empty();
    const std::string path = dummy ? args->dummy : resolve_model_path(args->model);
    if (args->server.served_model_name.empty()) {
      args->server.served_model_name = model_name_from_path(path);
    }
    args->flags.dummy_weights = dummy;
    const EngineOptions options = args->flags.resolve();  // a bad --device fails before the load
    TextModel model =
        dummy ? TextModel{make_dummy_checkpoint(path, 0, {}, args->flags.dummy_blocks()), nullptr,
                          std::nullopt}
              : load_text_model(path, progress_bar());
    if (!args->chat_template.empty()) replace_chat_template(model, args->chat_template);
    if (!args->tokenizer.empty()) {
      model.tokenizer =
          std::make_unique<Tokenizer>(Tokenizer::from_tokenizer_json(args->tokenizer));
      PAGEDLM_CHECK(model.tokenizer->vocab_size() <= model.checkpoint.config.vocab_size,
                    "--tokenizer: ", model.tokenizer->vocab_size(),
                    " tokens, more than the model's vocabulary of ",
                    model.checkpoint.config.vocab_size);
    }
    if (ran_as_worker_rank(model.checkpoint, options)) return;
    Engine engine(model.checkpoint, options);
    model.checkpoint.release_weights();
    server::HttpServer http(model, engine, args->server);
    const int port = http.bind();
    starting.reset();
    std::fprintf(stderr, "pagedlm: serving %s on http://%s:%d\n",
                 args->server.served_model_name.c_str(), args->server.host.c_str(), port);
    std::fflush(stderr);
    std::atomic<bool> listening_done{false};
    std::thread watcher([&] {
      while (stop_signal() == 0 && !listening_done) {
        std::this_thread::sleep_for(std::chrono::milliseconds(100));
      }
      const bool engine_left = http.stop();
      if (!engine_left) {
        // Only the engine's current step is left, still running half a second after the
        // drain's deadline, past which a CPU step leaves at its next point between two
        // operations (EngineLoop: Engine::set_abandon_check): one operation that took longer
        // than that.
        std::fprintf(stderr, "pagedlm: stopped without waiting for the engine's current step\n");
      }
      // Every client has its answer or has been told the server stopped, and nothing is left
      // to write: the process ends here. Destroying the server, the engine and the model would
      // only hand their memory back piece by piece, which the kernel takes back whole at exit.
      std::fflush(nullptr);
      std::_Exit(0);
    });
    http.listen();
    listening_done = true;
    watcher.join();
  });
}

}  // namespace pagedlm::cli
