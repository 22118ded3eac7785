#include "pagedlm/server/http_server.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string_view>

#include "pagedlm/core/error.h"
#include "pagedlm/core/json.h"
#include "pagedlm/engine/stop_strings.h"
#include "pagedlm/server/chat_page.h"
#include "pagedlm/server/http_transport.h"
#include "pagedlm/server/openai_api.h"
#include "pagedlm/serving/engine_loop.h"
#include "pagedlm/serving/generation.h"
#include "pagedlm/serving/reasoning.h"
#include "pagedlm/serving/tool_calls.h"

namespace pagedlm::server {

using json = nlohmann::ordered_json;

namespace {

std::string dump(const json& j) {
  // Token strings in logprobs may be partial UTF-8; replace rather than throw.
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

std::string random_id(const char* prefix) {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%s%016llx%08llx", prefix, static_cast<unsigned long long>(rng()),
                static_cast<unsigned long long>(rng() & 0xffffffffULL));
  return buf;
}

const char* error_type(int status) {
  return status >= 500 ? "server_error" : "invalid_request_error";
}

// What a request the server ends on its way out is told (503).
constexpr const char* kShuttingDown = "the server is shutting down";

int64_t unix_time() { return static_cast<int64_t>(std::time(nullptr)); }

HttpResponse json_response(int status, const json& body) {
  HttpResponse r;
  r.status = status;
  r.body = dump(body);
  return r;
}

HttpResponse error_response(int status, const std::string& message,
                            const std::string& type = "invalid_request_error",
                            const std::string& param = "") {
  return json_response(status, error_body(message, type, param, status));
}

HttpReply reply(HttpResponse response) { return HttpReply{std::move(response), nullptr, false}; }

// A body still being parsed when the drain starts is answered as one arriving then (503): a
// large one takes seconds to parse (8 MB of `{}`: 1-2 s and hundreds of MB on a loaded 2-core
// Xeon), which would hold the drain for a request that has not reached the engine yet and could
// rarely be answered before the deadline.
json parse_body(const HttpRequest& req) {
  return parse_json<json>(req.body, kMaxJsonDepth, req.shutting_down);
}

std::string bearer_token(const HttpRequest& req) {
  const std::string auth = req.header("Authorization");
  const std::string prefix = "Bearer ";
  return auth.rfind(prefix, 0) == 0 ? auth.substr(prefix.size()) : std::string();
}

// Whether a Content-Type names JSON: "application/json", any case, parameters (charset) allowed.
// Every POST route takes JSON; refusing other types also keeps a web page from posting here
// cross-origin without a CORS preflight (forms may only send urlencoded, multipart or text).
bool is_json_content_type(std::string_view value) {
  const size_t end = value.find(';');
  std::string_view type = value.substr(0, end);
  while (!type.empty() && (type.front() == ' ' || type.front() == '\t')) type.remove_prefix(1);
  while (!type.empty() && (type.back() == ' ' || type.back() == '\t')) type.remove_suffix(1);
  constexpr std::string_view kJson = "application/json";
  return type.size() == kJson.size() &&
         std::equal(type.begin(), type.end(), kJson.begin(), [](char a, char b) {
           return std::tolower(static_cast<unsigned char>(a)) == b;
         });
}

// One /v1/completions or /v1/chat/completions request in flight: its output stream
// (serving/generation.h) and how that output is rendered in OpenAI's shapes.
class Generation {
 public:
  Generation(CompletionRequest request, const ModelInfo& model, std::string model_name,
             serving::EngineLoop& loop)
      : chat_(request.chat),
        include_usage_(request.include_usage),
        model_(model),
        model_name_(std::move(model_name)),
        id_(random_id(chat_ ? "chatcmpl-" : "cmpl-")),
        created_(unix_time()),
        stream_(std::move(static_cast<serving::GenerationSpec&>(request)), model.tokenizer, loop) {}

  // Queues every choice; false when the server is overloaded.
  bool submit() { return stream_.submit(); }

  // Takes in the output that arrived; false if none had.
  bool poll() { return stream_.poll(std::chrono::milliseconds(0)); }

  // `listener` runs on the engine's thread after each of its events.
  void set_listener(std::function<void()> listener) { stream_.set_listener(std::move(listener)); }

  // Every choice finished and the stream's closing events were rendered.
  bool ended() const { return ended_; }

  bool done() const { return stream_.done(); }

  // The client is gone: every unfinished choice stops at the next step.
  void cancel() { stream_.cancel(); }

  // The server stops: every unfinished choice ends now, as the engine would end it on its way
  // out (which a long step may delay).
  void abort() { stream_.abort(kShuttingDown, 503, "abort"); }

  // The first error a choice met, as (status, message); status 0 when none.
  std::pair<int, std::string> error() const { return stream_.error(); }

  json response() {
    const serving::GenerationSpec& spec = stream_.spec();
    json choices = json::array();
    for (size_t i = 0; i < stream_.choices().size(); ++i) {
      ChoiceOutput& c = stream_.choices()[i];
      json choice = {{"index", i}};
      if (chat_ && !c.calls.empty()) {
        choice["message"] = {{"role", "assistant"},
                             {"content", trimmed_or_null(c.content)},
                             {"tool_calls", tool_calls_json(c.calls, false)}};
      } else if (chat_) {
        // A reply that was all reasoning has no content (null, as with only tool calls).
        const bool no_content = spec.reasoning && c.text.empty();
        choice["message"] = {{"role", "assistant"},
                             {"content", no_content ? json(nullptr) : json(c.text)}};
      } else {
        choice["text"] = c.text;
      }
      if (spec.reasoning) {
        choice["message"]["reasoning_content"] =
            c.reasoning.empty() ? json(nullptr) : json(c.reasoning);
      }
      if (!c.decoder) choice["token_ids"] = c.token_ids;
      choice["logprobs"] = take_logprobs(c, 0);
      choice["finish_reason"] = *c.finish_reason;
      choices.push_back(std::move(choice));
    }
    return {{"id", id_},
            {"object", chat_ ? "chat.completion" : "text_completion"},
            {"created", created_},
            {"model", model_name_},
            {"choices", std::move(choices)},
            {"usage", usage()}};
  }

  // SSE events for what arrived since the last call; `first` adds the chat role deltas.
  std::string stream_chunks(bool first) {
    std::string out;
    for (size_t i = 0; i < stream_.choices().size(); ++i) {
      ChoiceOutput& c = stream_.choices()[i];
      if (first && chat_) {
        out += sse(chunk(i, {{"role", "assistant"}, {"content", ""}}, json(nullptr), nullptr));
      }
      if (!c.reasoning_delta.empty()) {
        out += sse(chunk(i, {{"reasoning_content", c.reasoning_delta}}, json(nullptr), nullptr));
        c.reasoning_delta.clear();
      }
      if (!c.delta.empty() || !c.logprobs.empty() || !c.token_ids.empty()) {
        const int32_t offset = static_cast<int32_t>(c.text.size() - c.delta.size());
        json lp = take_logprobs(c, offset);
        json delta = chat_ ? json{{"content", c.delta}} : json(c.delta);
        json event = chunk(i, std::move(delta), std::move(lp), nullptr);
        if (!c.decoder) event["choices"][0]["token_ids"] = std::move(c.token_ids);
        out += sse(event);
        c.delta.clear();
        c.token_ids.clear();
      }
      const bool finish_sent = finish_sent_.count(i) != 0;
      if (!c.error.empty() && !finish_sent) {
        if (c.error_status == 503) {
          // Shutting down: the stream ends as vLLM ends an aborted one, with a finish_reason.
          c.finish_reason = "abort";
        } else {
          out += sse(error_body(c.error, error_type(c.error_status), "", c.error_status));
          finish_sent_.insert(i);  // the error event ends this choice
        }
      }
      if (!c.calls.empty() && calls_sent_.insert(i).second) {
        out +=
            sse(chunk(i, {{"tool_calls", tool_calls_json(c.calls, true)}}, json(nullptr), nullptr));
      }
      if (c.finish_reason && finish_sent_.insert(i).second) {
        out += sse(
            chunk(i, chat_ ? json::object() : json(""), json(nullptr), c.finish_reason->c_str()));
      }
    }
    if (done() && !ended_) {
      ended_ = true;
      if (include_usage_) {
        out += sse({{"id", id_},
                    {"object", chunk_object()},
                    {"created", created_},
                    {"model", model_name_},
                    {"choices", json::array()},
                    {"usage", usage()}});
      }
      out += "data: [DONE]\n\n";
    }
    return out;
  }

 private:
  using ChoiceOutput = serving::ChoiceOutput;

  // OpenAI's tool_calls list; `streamed` adds each call's index (the delta form).
  static json tool_calls_json(const std::vector<ToolCall>& calls, bool streamed) {
    json out = json::array();
    for (size_t i = 0; i < calls.size(); ++i) {
      json call = {{"id", random_id("call_")},
                   {"type", "function"},
                   {"function", {{"name", calls[i].name}, {"arguments", calls[i].arguments}}}};
      if (streamed) call["index"] = i;
      out.push_back(std::move(call));
    }
    return out;
  }

  // A message's content: the text without surrounding whitespace, null when nothing is left.
  static json trimmed_or_null(const std::string& text) {
    const size_t begin = text.find_first_not_of(" \t\r\n");
    if (begin == std::string::npos) return json(nullptr);
    const size_t end = text.find_last_not_of(" \t\r\n");
    return text.substr(begin, end - begin + 1);
  }

  // The pending logprobs of a choice in the API's shape (null when not asked for).
  json take_logprobs(ChoiceOutput& c, int32_t text_offset) {
    if (!c.keep_logprobs) return json(nullptr);
    const Tokenizer& tok = *model_.tokenizer;
    auto piece = [&](int32_t id) { return tok.decode(std::vector<int32_t>{id}); };
    json out;
    if (chat_) {
      auto bytes = [&](int32_t id) {
        json b = json::array();
        for (unsigned char ch : tok.token_to_bytes(id)) b.push_back(ch);
        return b;
      };
      json content = json::array();
      for (const serving::LogprobEntry& e : c.logprobs) {
        json top = json::array();
        for (const auto& [id, lp] : e.top) {
          top.push_back({{"token", piece(id)}, {"logprob", lp}, {"bytes", bytes(id)}});
        }
        content.push_back({{"token", piece(e.token)},
                           {"logprob", e.logprob},
                           {"bytes", bytes(e.token)},
                           {"top_logprobs", std::move(top)}});
      }
      out = {{"content", std::move(content)}};
    } else {
      json tokens = json::array(), token_logprobs = json::array(), tops = json::array(),
           offsets = json::array();
      for (const serving::LogprobEntry& e : c.logprobs) {
        const std::string text = piece(e.token);
        tokens.push_back(text);
        token_logprobs.push_back(e.logprob);
        json top = json::object();
        for (const auto& [id, lp] : e.top) top[piece(id)] = lp;
        tops.push_back(std::move(top));
        offsets.push_back(text_offset);
        text_offset += static_cast<int32_t>(text.size());
      }
      out = {{"tokens", std::move(tokens)},
             {"token_logprobs", std::move(token_logprobs)},
             {"top_logprobs", std::move(tops)},
             {"text_offset", std::move(offsets)}};
    }
    c.logprobs.clear();
    return out;
  }

  json usage() const {
    const serving::GenerationSpec& spec = stream_.spec();
    const std::vector<ChoiceOutput>& choices = stream_.choices();
    int64_t prompt_tokens = 0, completion_tokens = 0, cached_tokens = 0;
    for (size_t p = 0; p < spec.prompts.size(); ++p) {
      prompt_tokens += static_cast<int64_t>(spec.prompts[p].size());
      int32_t cached = 0;
      for (int32_t j = 0; j < spec.n; ++j) {
        cached = std::max(cached, choices[p * spec.n + j].num_cached_tokens);
      }
      cached_tokens += cached;
    }
    for (const ChoiceOutput& c : choices) completion_tokens += c.completion_tokens;
    return {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens},
            {"prompt_tokens_details", {{"cached_tokens", cached_tokens}}}};
  }

  const char* chunk_object() const { return chat_ ? "chat.completion.chunk" : "text_completion"; }

  json chunk(size_t index, json delta, json logprobs, const char* finish_reason) const {
    json choice = {{"index", index}};
    choice[chat_ ? "delta" : "text"] = std::move(delta);
    choice["logprobs"] = std::move(logprobs);
    choice["finish_reason"] = finish_reason ? json(finish_reason) : json(nullptr);
    return {{"id", id_},
            {"object", chunk_object()},
            {"created", created_},
            {"model", model_name_},
            {"choices", json::array({std::move(choice)})}};
  }

  static std::string sse(const json& payload) { return "data: " + dump(payload) + "\n\n"; }

  const bool chat_;
  const bool include_usage_;
  const ModelInfo& model_;
  std::string model_name_;
  std::string id_;
  int64_t created_;
  serving::GenerationStream stream_;
  std::set<size_t> finish_sent_;  // choices whose closing event was rendered
  std::set<size_t> calls_sent_;   // choices whose tool calls were rendered
  bool ended_ = false;
};

// A generation as the front end sees it: output drained on its thread when the engine's
// events arrive, rendered as SSE (a stream) or one response once done.
class GenerationReply final : public PendingReply {
 public:
  explicit GenerationReply(std::shared_ptr<Generation> gen) : gen_(std::move(gen)) {}
  ~GenerationReply() override { gen_->set_listener(nullptr); }

  void set_notify(std::function<void()> notify) override { gen_->set_listener(std::move(notify)); }

  std::string take_stream(bool* ended) override {
    gen_->poll();
    std::string out = gen_->stream_chunks(first_);
    first_ = false;
    *ended = gen_->ended();
    return out;
  }

  std::optional<HttpResponse> take_response() override {
    gen_->poll();
    if (!gen_->done()) return std::nullopt;
    if (auto [status, message] = gen_->error(); status != 0) {
      HttpResponse r = error_response(status, message, error_type(status));
      if (status == 503) r.close = true;
      return r;
    }
    return json_response(200, gen_->response());
  }

  void cancel() override { gen_->cancel(); }
  void abort() override { gen_->abort(); }

 private:
  std::shared_ptr<Generation> gen_;
  bool first_ = true;
};

}  // namespace

struct HttpServer::Impl {
  Impl(const TextModel& model, Engine& engine, ServerOptions options)
      : options(std::move(options)),
        loop(engine, this->options.max_waiting, this->options.max_queue_wait),
        http(transport_options(this->options), hooks()) {
    info.name = this->options.served_model_name;
    info.tokenizer = model.tokenizer.get();
    info.chat_template = model.chat_template ? &*model.chat_template : nullptr;
    info.parse_reasoning = !this->options.reasoning_parser.empty();
    info.vocab_size = engine.config().vocab_size;
    info.max_model_len = engine.config().max_position_embeddings;
    info.max_prompt_tokens =
        static_cast<int64_t>(engine.options().num_pages) * engine.options().page_size;
    if (model.tokenizer) {
      grammar_compiler = std::make_unique<grammar::GrammarCompiler>(
          *model.tokenizer, static_cast<int32_t>(engine.config().vocab_size),
          engine.config().eos_token_ids);
      info.grammar = grammar_compiler.get();
    }
    setup_routes();
  }

  static TransportOptions transport_options(const ServerOptions& o) {
    TransportOptions t;
    t.host = o.host;
    t.port = o.port;
    t.max_body_bytes = o.max_body_bytes;
    t.header_timeout = o.header_timeout;
    t.body_timeout = o.body_timeout;
    t.worker_threads = o.http_threads;
    t.max_connections = o.max_connections;
    t.max_connections_per_client = o.max_connections_per_client;
    return t;
  }

  TransportHooks hooks() {
    TransportHooks h;
    h.pre_route = [this](const HttpRequest& req) -> std::optional<HttpResponse> {
      const bool open = req.path == "/" || req.path == "/health" ||
                        (req.path == "/metrics" && !options.metrics_auth);
      if (!open && !authorized(req)) {
        return error_response(401, "missing or invalid API key (Authorization: Bearer <key>)",
                              "authentication_error");
      }
      if (req.method == "POST" && !is_json_content_type(req.header("Content-Type"))) {
        const std::string given = req.header("Content-Type");
        return error_response(
            415, "the request body must be JSON (Content-Type: application/json)" +
                     (given.empty() ? std::string(", got none") : ", got '" + given + "'"));
      }
      return std::nullopt;
    };
    h.admit = [this] { return loop.admit(); };
    h.retry_after_seconds = [this] { return loop.retry_after_seconds(); };
    h.error_body = [](int status, const std::string& message, const std::string& type) {
      return dump(error_body(message, type, "", status));
    };
    return h;
  }

  void setup_routes();
  HttpReply completions(const HttpRequest& req, bool chat);
  // Runs `handler` with OpenAI-shaped errors for everything it throws.
  template <typename F>
  static HttpReply guarded(F&& handler);
  bool authorized(const HttpRequest& req) const {
    if (options.api_keys.empty()) return true;
    const std::string token = bearer_token(req);
    return std::find(options.api_keys.begin(), options.api_keys.end(), token) !=
           options.api_keys.end();
  }
  HttpReply cache_map(const HttpRequest& req);

  ServerOptions options;
  std::unique_ptr<grammar::GrammarCompiler> grammar_compiler;  // structured output
  ModelInfo info;
  serving::EngineLoop loop;
  HttpTransport http;
};

template <typename F>
HttpReply HttpServer::Impl::guarded(F&& handler) {
  try {
    return handler();
  } catch (const ApiError& e) {
    return reply(error_response(e.status(), e.what(), e.type(), e.param()));
  } catch (const JsonParseAbandoned&) {
    // As a request that arrives during the drain is answered.
    return reply(error_response(503, kShuttingDown, "server_error"));
  } catch (const json::exception& e) {
    return reply(error_response(400, std::string("malformed JSON: ") + e.what()));
  } catch (const Error& e) {
    return reply(error_response(400, e.what()));
  } catch (const std::exception& e) {
    return reply(error_response(500, e.what(), "server_error"));
  }
}

HttpReply HttpServer::Impl::completions(const HttpRequest& req, bool chat) {
  CompletionRequest request = parse_completion_request(parse_body(req), chat, info);
  const bool stream = request.stream;
  // The api key salts the cache too, so tenants with different keys never share pages.
  if (!options.api_keys.empty()) {
    request.cache_salt = bearer_token(req) + '\x1f' + request.cache_salt;
  }
  auto gen = std::make_shared<Generation>(std::move(request), info, info.name, loop);
  if (!gen->submit()) {
    HttpResponse r =
        error_response(503, "the server is overloaded; retry later", "server_overloaded");
    r.headers.emplace_back("Retry-After", std::to_string(loop.retry_after_seconds()));
    return reply(std::move(r));
  }
  HttpReply out;
  out.pending = std::make_shared<GenerationReply>(gen);
  out.stream = stream;
  if (stream) {
    out.response.content_type = "text/event-stream";
    out.response.headers = {{"Cache-Control", "no-cache"}, {"X-Accel-Buffering", "no"}};
  }
  return out;
}

// The KV cache map, behind the API key: each running sequence's page table (shared pages, the
// partial-page copy of its admission, entries released behind the window) and the free pages
// the prefix cache can still serve, next reused first.
HttpReply HttpServer::Impl::cache_map(const HttpRequest& req) {
  int32_t max_free_pages = 256;
  if (const std::optional<std::string> value = req.query_param("max_free_pages")) {
    char* end = nullptr;
    const long parsed = std::strtol(value->c_str(), &end, 10);
    if (value->empty() || *end != '\0' || parsed < 0 || parsed > (1 << 20)) {
      return reply(error_response(400, "max_free_pages must be an integer in [0, 1048576]"));
    }
    max_free_pages = static_cast<int32_t>(parsed);
  }
  serving::CacheSnapshot snap;
  if (!loop.cache_snapshot(max_free_pages, std::chrono::seconds(10), &snap)) {
    return reply(error_response(503, "the engine did not answer in time", "server_error"));
  }
  json sequences = json::array();
  for (const SequenceView& s : snap.sequences) {
    json pages = json::array();
    for (size_t i = 0; i < s.pages.size(); ++i) {
      if (s.pages[i] == SequenceView::kReleasedPage) {
        pages.push_back(json{{"released", true}});
      } else {
        pages.push_back(json{{"page", s.pages[i]},
                             {"ref_count", s.page_ref_counts[i]},
                             {"shared", s.page_shared[i] != 0}});
      }
    }
    json copy = nullptr;
    if (s.copy_page_index >= 0) {
      copy = json{{"page_index", s.copy_page_index},
                  {"page", s.pages[s.copy_page_index]},
                  {"src_page", s.copy_src_page},
                  {"num_tokens", s.num_copied_tokens}};
    }
    sequences.push_back(json{{"request_id", s.request_id},
                             {"num_tokens", s.num_tokens},
                             {"num_computed", s.num_computed},
                             {"num_cached_tokens", s.num_cached_tokens},
                             {"pages", std::move(pages)},
                             {"partial_copy", std::move(copy)}});
  }
  json free_pages = json::array();
  for (const CachedPageView& p : snap.free_pages) {
    free_pages.push_back(
        json{{"page", p.page}, {"ref_count", 0}, {"num_tokens", p.num_tokens}, {"full", p.full}});
  }
  const SchedulerStats& st = snap.stats;
  return reply(json_response(200, json{{"page_size", snap.page_size},
                                       {"pages",
                                        {{"total", st.pages_total},
                                         {"reserved", st.pages_reserved},
                                         {"used", st.pages_used},
                                         {"free", st.pages_free},
                                         {"cached", st.pages_cached}}},
                                       {"prefix_cache",
                                        {{"query_tokens", st.prefix_query_tokens},
                                         {"hit_tokens", st.prefix_hit_tokens},
                                         {"partial_hits", st.prefix_partial_hits},
                                         {"partial_hit_tokens", st.prefix_partial_hit_tokens}}},
                                       {"sequences", std::move(sequences)},
                                       {"free_pages", std::move(free_pages)}}));
}

void HttpServer::Impl::setup_routes() {
  http.route("GET", "/", RouteWork::kInline, [](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/html; charset=utf-8";
    r.body = kChatPageHtml;
    return reply(std::move(r));
  });
  // A load balancer stops sending here once the drain starts.
  http.route("GET", "/health", RouteWork::kInline, [this](HttpRequest&) {
    return reply(http.draining() ? json_response(503, json{{"status", "draining"}})
                                 : json_response(200, json{{"status", "ok"}}));
  });
  http.route("GET", "/metrics", RouteWork::kInline, [this](HttpRequest&) {
    HttpResponse r;
    r.content_type = "text/plain; version=0.0.4";
    r.body = loop.prometheus_text();
    return reply(std::move(r));
  });
  // Waits for the engine thread: on a worker.
  http.route("GET", "/v1/cache", RouteWork::kWorker,
             [this](HttpRequest& req) { return guarded([&] { return cache_map(req); }); });
  http.route("GET", "/v1/models", RouteWork::kInline, [this](HttpRequest&) {
    return reply(
        json_response(200, json{{"object", "list"},
                                {"data", json::array({{{"id", info.name},
                                                       {"object", "model"},
                                                       {"created", unix_time()},
                                                       {"owned_by", "pagedlm"},
                                                       {"max_model_len", info.max_model_len}}})}}));
  });
  http.route("POST", "/v1/completions", RouteWork::kGeneration, [this](HttpRequest& req) {
    return guarded([&] { return completions(req, /*chat=*/false); });
  });
  http.route("POST", "/v1/chat/completions", RouteWork::kGeneration, [this](HttpRequest& req) {
    return guarded([&] { return completions(req, /*chat=*/true); });
  });
  http.route("POST", "/tokenize", RouteWork::kWorker, [this](HttpRequest& req) {
    return guarded([&] {
      const std::vector<int32_t> ids = parse_tokenize_request(parse_body(req), info);
      return reply(json_response(
          200,
          json{{"count", ids.size()}, {"max_model_len", info.max_model_len}, {"tokens", ids}}));
    });
  });
  http.route("POST", "/detokenize", RouteWork::kWorker, [this](HttpRequest& req) {
    return guarded([&] {
      const std::vector<int32_t> ids = parse_detokenize_request(parse_body(req), info);
      return reply(json_response(200, json{{"prompt", info.tokenizer->decode(ids)}}));
    });
  });
}

HttpServer::HttpServer(const TextModel& model, Engine& engine, ServerOptions options)
    : impl_(std::make_unique<Impl>(model, engine, std::move(options))) {}

HttpServer::~HttpServer() { impl_->loop.stop(); }

int HttpServer::bind() { return impl_->http.bind(); }

void HttpServer::listen() { impl_->http.run(); }

bool HttpServer::stop() {
  // The front end first: running answers get --shutdown-timeout to finish, then end without
  // the engine (whose current step may be long), and only then does the engine stop. Its steps
  // are held short from the start of the drain, so it is between two of them by then unless
  // the step in progress at the signal was a long one.
  impl_->loop.drain();
  impl_->http.shutdown(impl_->options.shutdown_timeout);
  const bool engine_stopped = impl_->loop.stop_within(std::chrono::milliseconds(500));
  return engine_stopped;
}

}  // namespace pagedlm::server
