// pagedlm._pagedlm: the native half of the Python package. It holds one model, its Engine and the
// engine thread (serving::EngineLoop), and hands out GenerationStreams; python/pagedlm/ builds
// vLLM's API on top. Every call that waits releases the GIL, and waits in slices short enough
// (the caller's timeout) for Python to see Ctrl-C between them.
#include <fcntl.h>
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/unique_ptr.h>
#include <nanobind/stl/vector.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/engine/benchmark.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/model/dummy_checkpoint.h"
#include "pagedlm/serving/engine_loop.h"
#include "pagedlm/serving/generation.h"
#include "pagedlm/serving/reasoning.h"
#include "pagedlm/serving/tool_calls.h"

namespace nb = nanobind;
using namespace nb::literals;

namespace pagedlm::python {

namespace {

using json = nlohmann::ordered_json;

// Raised as Python's FileNotFoundError.
class ModelNotFound : public std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Raised as Python's ValueError: the caller's input was refused.
class BadInput : public std::runtime_error {
  using std::runtime_error::runtime_error;
};

serving::ToolCallFormat parse_format(const std::string& name) {
  if (name == "none") return serving::ToolCallFormat::kNone;
  if (name == "tags") return serving::ToolCallFormat::kTags;
  if (name == "json_reply") return serving::ToolCallFormat::kJsonReply;
  if (name == "marker_list") return serving::ToolCallFormat::kMarkerList;
  throw BadInput("unknown tool call format '" + name + "'");
}

const char* format_name(serving::ToolCallFormat format) {
  switch (format) {
    case serving::ToolCallFormat::kTags:
      return "tags";
    case serving::ToolCallFormat::kJsonReply:
      return "json_reply";
    case serving::ToolCallFormat::kMarkerList:
      return "marker_list";
    case serving::ToolCallFormat::kNone:
      break;
  }
  return "none";
}

// A compiled grammar, opaque to Python.
struct Grammar {
  grammar::CompiledGrammarPtr compiled;
};

// Woken once per engine step in which any stream of any model got output: what Stream.poll_all
// waits on. One for the process (poll_all takes streams of any models); a wake that brought a
// caller nothing costs it one more look at its streams.
const std::shared_ptr<serving::OutputWaker>& output_waker() {
  static const auto waker = std::make_shared<serving::OutputWaker>();
  return waker;
}

// One submitted generation: a serving::GenerationStream that Python polls.
class Stream {
 public:
  Stream(serving::GenerationSpec spec, const Tokenizer* tokenizer, serving::EngineLoop& loop,
         std::shared_ptr<void> keep_alive)
      : keep_alive_(std::move(keep_alive)),
        stream_(std::move(spec), tokenizer, loop, output_waker()) {}
  ~Stream() {
    stream_.set_listener(nullptr);
    // Nobody reads the rest: the engine stops generating it at its next step.
    if (!stream_.done()) stream_.cancel();
  }

  // A file descriptor that turns readable when output arrives (for asyncio's add_reader); the
  // reader drains it. The engine thread writes a byte to it after each of its events.
  int notify_fd() {
    if (!pipe_) {
      auto pipe = std::make_shared<Pipe>();
      if (pipe2(pipe->fds, O_NONBLOCK | O_CLOEXEC) != 0) {
        throw std::runtime_error(std::string("pipe2: ") + std::strerror(errno));
      }
      // The listener holds the pipe: a push that copied it before set_listener(nullptr) still
      // writes to an open descriptor.
      stream_.set_listener([pipe] {
        const char byte = 1;
        // A full pipe already wakes the reader: the byte is not needed.
        [[maybe_unused]] const ssize_t written = write(pipe->fds[1], &byte, 1);
      });
      pipe_ = std::move(pipe);
    }
    return pipe_->fds[0];
  }

  serving::GenerationStream& stream() { return stream_; }
  bool stream_done() const { return stream_.done(); }

  // Waits up to `timeout` seconds (GIL released) for output; true if any arrived.
  bool poll(double timeout) {
    nb::gil_scoped_release release;
    return stream_.poll(std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
  }

  // Polls every stream in one call, the GIL released once (an offline batch of hundreds of
  // requests would otherwise cross into Python and back once per stream after every step):
  // first without waiting; when none had output and one is unfinished, waits up to `timeout`
  // seconds for the end of an engine step that brought any stream output (output_waker), then
  // looks at them all again. Per stream: bit 0 output arrived, bit 1 done (every choice
  // finished, as of this poll).
  static std::vector<int32_t> poll_all(const std::vector<Stream*>& streams, double timeout) {
    nb::gil_scoped_release release;
    std::vector<int32_t> state(streams.size(), 0);
    const auto look = [&] {
      bool any = false;
      for (size_t i = 0; i < streams.size(); ++i) {
        if (streams[i]->stream_.poll(std::chrono::milliseconds(0))) state[i] |= 1;
        any = any || (state[i] & 1) != 0;
      }
      return any;
    };
    // Read before looking: output pushed after the look wakes the wait below.
    const uint64_t seen = output_waker()->wakes();
    const bool unfinished =
        std::any_of(streams.begin(), streams.end(), [](Stream* s) { return !s->stream_.done(); });
    if (!look() && unfinished) {
      output_waker()->wait_past(seen,
                                std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000)));
      look();
    }
    for (size_t i = 0; i < streams.size(); ++i) {
      if (streams[i]->stream_.done()) state[i] |= 2;
    }
    return state;
  }

  // Choice i's output since the last take: (text, reasoning, token ids, logprobs, finish_reason),
  // logprobs as (token, logprob, [(token, logprob)...]) per token.
  nb::tuple take(size_t i) {
    serving::ChoiceOutput& c = choice(i);
    std::vector<int32_t> ids(c.all_token_ids.begin() + static_cast<std::ptrdiff_t>(taken_[i]),
                             c.all_token_ids.end());
    taken_[i] = c.all_token_ids.size();
    nb::list logprobs;
    for (const serving::LogprobEntry& e : c.logprobs) {
      logprobs.append(nb::make_tuple(e.token, e.logprob, e.top));
    }
    nb::tuple out = nb::make_tuple(std::move(c.delta), std::move(c.reasoning_delta), ids, logprobs,
                                   c.finish_reason);
    c.delta.clear();
    c.reasoning_delta.clear();
    c.token_ids.clear();
    c.logprobs.clear();
    return out;
  }

  // Choice i's whole output: a dict of text, token_ids, finish_reason, num_cached_tokens,
  // reasoning, content (the text without its tool calls) and tool_calls [(name, arguments)].
  nb::dict result(size_t i) {
    const serving::ChoiceOutput& c = choice(i);
    nb::dict d;
    d["text"] = c.text;
    d["token_ids"] = c.all_token_ids;
    d["finish_reason"] = c.finish_reason;
    d["num_cached_tokens"] = c.num_cached_tokens;
    d["reasoning"] = c.reasoning;
    d["content"] = c.content;
    nb::list calls;
    for (const serving::ToolCall& call : c.calls)
      calls.append(nb::make_tuple(call.name, call.arguments));
    d["tool_calls"] = calls;
    return d;
  }

  // Choice i's prompt logits [prompt_len, vocab] (float32), for a stream that asked for them.
  nb::ndarray<nb::numpy, float, nb::ndim<2>> prompt_logits(size_t i) {
    const Tensor& logits = choice(i).prompt_logits;
    if (logits.ndim() != 2) throw BadInput("this generation has no prompt logits");
    auto* owner = new Tensor(logits);
    nb::capsule free_owner(owner, [](void* p) noexcept { delete static_cast<Tensor*>(p); });
    return nb::ndarray<nb::numpy, float, nb::ndim<2>>(
        owner->data<float>(),
        {static_cast<size_t>(logits.dim(0)), static_cast<size_t>(logits.dim(1))}, free_owner);
  }

  // Raises the first error a choice met: ValueError for a refused request, RuntimeError else.
  void raise_error() const {
    const auto [status, message] = stream_.error();
    if (status == 400) throw BadInput(message);
    if (status != 0) throw std::runtime_error(message);
  }

 private:
  serving::ChoiceOutput& choice(size_t i) {
    if (i >= stream_.choices().size()) throw std::out_of_range("no such choice");
    if (taken_.size() != stream_.choices().size()) taken_.assign(stream_.choices().size(), 0);
    return stream_.choices()[i];
  }
  const serving::ChoiceOutput& choice(size_t i) const {
    if (i >= stream_.choices().size()) throw std::out_of_range("no such choice");
    return stream_.choices()[i];
  }

  struct Pipe {
    int fds[2] = {-1, -1};
    ~Pipe() {
      for (const int fd : fds) {
        if (fd >= 0) close(fd);
      }
    }
  };

  std::shared_ptr<void> keep_alive_;  // the model the stream reads (tokenizer, loop)
  std::shared_ptr<Pipe> pipe_;
  serving::GenerationStream stream_;
  std::vector<size_t> taken_;  // per choice: token ids already taken
};

// A loaded model with its engine and engine thread.
class Model {
 public:
  struct State {
    TextModel text;
    std::unique_ptr<Engine> engine;
    std::unique_ptr<serving::EngineLoop> loop;
    std::unique_ptr<grammar::GrammarCompiler> compiler;
    ~State() {
      if (loop) loop->stop();  // before the engine it steps goes
    }
  };

  Model(const std::string& model, const std::string& device, int32_t page_size, int32_t num_pages,
        int64_t kv_cache_bytes, int32_t max_num_batched_tokens, int32_t max_num_seqs,
        double target_itl_ms, bool enable_prefix_cache, int32_t threads, bool cpu_q8_activations,
        bool cpu_fixed32_activations, float gpu_memory_fraction, bool use_cuda_graphs,
        int32_t max_waiting, const std::string& chat_template, const std::string& load_format,
        const std::string& dtype, const std::string& kv_cache_dtype,
        const std::string& quantization, int32_t async_scheduling, bool gguf_blocks,
        bool use_cascade_attention, bool tune_gemms, int32_t tensor_parallel_size,
        nb::handle load_progress) {
    if (load_format != "auto" && load_format != "dummy") {
      throw BadInput("load_format must be 'auto' or 'dummy', got '" + load_format + "'");
    }
    const bool dummy = load_format == "dummy";
    if (async_scheduling < -1 || async_scheduling > 1) {
      throw BadInput("async_scheduling must be -1 (the device's default), 0 (off) or 1 (on), got " +
                     std::to_string(async_scheduling));
    }
    EngineOptions o;
    Quantization quant;
    try {
      o.kv_cache_dtype = kv_cache_dtype_named(kv_cache_dtype);
      o.compute_dtype = compute_dtype_named(dtype);
      quant = quantization_named(quantization, dummy);
    } catch (const Error& e) {
      throw BadInput(e.what());
    }
    o.fp8_weights = quant.fp8_weights;
    o.async_scheduling = async_scheduling;
    o.gguf_blocks_on_gpu = gguf_blocks;
    o.use_cascade_attention = use_cascade_attention;
    o.tune_gemms = tune_gemms;
    if (tensor_parallel_size < 1) {
      throw BadInput("tensor_parallel_size must be at least 1, got " +
                     std::to_string(tensor_parallel_size));
    }
    o.tensor_parallel_size = tensor_parallel_size;
    o.page_size = page_size;
    o.num_pages = num_pages;
    o.kv_cache_bytes = kv_cache_bytes;
    o.max_num_batched_tokens = max_num_batched_tokens;
    o.max_num_seqs = max_num_seqs;
    o.target_itl_ms = target_itl_ms;
    o.enable_prefix_cache = enable_prefix_cache;
    o.threads = threads;
    o.cpu_q8_activations = cpu_q8_activations;
    o.cpu_fixed32_activations = cpu_fixed32_activations;
    o.gpu_memory_fraction = gpu_memory_fraction;
    o.use_cuda_graphs = use_cuda_graphs;
    if (device == "cuda" || (device == "auto" && cuda_device_available())) {
      if (!cuda_device_available()) {
        throw BadInput(cuda_device_count() == 0 && device == "cuda"
                           ? "device='cuda': no CUDA device found (or this build has no CUDA)"
                           : "device='cuda': no CUDA device found");
      }
      o.device = Device::kCuda;
      // The CPU's ranks are threads of this process; a GPU's are processes, one per GPU, which
      // the command line starts (it runs itself again as each rank).
      if (tensor_parallel_size > 1) {
        throw BadInput("tensor_parallel_size " + std::to_string(tensor_parallel_size) +
                       " on the GPU: its ranks are processes, which `pagedlm serve "
                       "--tensor-parallel-size N` starts; in Python tensor parallelism runs on "
                       "the CPU (device='cpu')");
      }
    } else if (device != "cpu" && device != "auto") {
      throw BadInput("device must be 'cpu', 'cuda' or 'auto', got '" + device + "'");
    }
    if (dummy && model.empty()) {
      throw BadInput("load_format='dummy' needs model=: a config.json, or a folder holding one");
    }
    std::string path = model.empty() ? default_model_path() : model;
    // Random weights of a config's shape (as `pagedlm bench --dummy`), with no tokenizer.
    if (dummy && std::filesystem::is_directory(path)) path += "/config.json";
    if (!std::filesystem::exists(path)) {
      throw ModelNotFound(
          path + (model.empty() ? " is missing: run scripts/fetch_model.sh to fetch the default "
                                  "model, or pass model="
                                : " does not exist"));
    }
    // load_progress(done, total) as the weights load (tensors of a GGUF, bytes of safetensors
    // shards), called with the GIL taken back; the caller keeps it alive for the call, so a
    // handle (no reference counting while the GIL is released) is enough.
    LoadProgress progress;
    if (!load_progress.is_none()) {
      progress = [load_progress](size_t done, size_t total) {
        nb::gil_scoped_acquire gil;
        load_progress(done, total);
      };
    }
    auto state = std::make_shared<State>();
    {
      nb::gil_scoped_release release;
      state->text = dummy ? TextModel{make_dummy_checkpoint(path, 0, {}, quant.dummy_blocks),
                                      nullptr, std::nullopt}
                          : load_text_model(path, progress);
      if (!chat_template.empty()) replace_chat_template(state->text, chat_template);
      try {
        state->engine = std::make_unique<Engine>(state->text.checkpoint, o);
      } catch (const Error& e) {
        throw BadInput(e.what());  // the options are checked as the engine is built
      }
      if (state->text.tokenizer) {
        state->compiler = std::make_unique<grammar::GrammarCompiler>(
            *state->text.tokenizer, static_cast<int32_t>(state->engine->config().vocab_size),
            state->engine->config().eos_token_ids);
      }
      state->loop = std::make_unique<serving::EngineLoop>(*state->engine, max_waiting);
    }
    state_ = std::move(state);
  }

  const Tokenizer& tokenizer() const {
    if (!state_->text.tokenizer) throw BadInput("this model has no tokenizer: give token ids");
    return *state_->text.tokenizer;
  }
  bool has_tokenizer() const { return state_->text.tokenizer != nullptr; }

  std::vector<int32_t> encode(const std::string& text, bool add_special_tokens) const {
    return tokenizer().encode(text, add_special_tokens);
  }
  std::string decode(const std::vector<int32_t>& ids, bool skip_special_tokens) const {
    return tokenizer().decode(ids, skip_special_tokens);
  }
  std::string token_to_bytes(int32_t id) const { return tokenizer().token_to_bytes(id); }

  // messages and extra (tools, ...) as JSON text, keys in the caller's order; template_source:
  // a Jinja template to render with instead of the model's (empty: the model's).
  std::string apply_chat_template(const std::string& messages, bool add_generation_prompt,
                                  const std::string& extra,
                                  const std::string& template_source) const {
    const ChatTemplate* model_template =
        state_->text.chat_template ? &*state_->text.chat_template : nullptr;
    std::optional<ChatTemplate> given;
    if (!template_source.empty()) {
      // BOS and EOS as the model's template has them, else the tokenizer's.
      std::string bos, eos;
      if (model_template != nullptr) {
        bos = model_template->bos_token();
        eos = model_template->eos_token();
      } else if (const Tokenizer* t = state_->text.tokenizer.get()) {
        if (t->bos_id() >= 0) bos = t->token_to_bytes(t->bos_id());
        if (t->eos_id() >= 0) eos = t->token_to_bytes(t->eos_id());
      }
      try {
        given.emplace(template_source, bos, eos);
      } catch (const Error& e) {
        throw BadInput(e.what());
      }
    }
    const ChatTemplate* chat_template = given ? &*given : model_template;
    if (chat_template == nullptr) throw BadInput("this model has no chat template");
    json parsed_messages, parsed_extra;
    try {
      parsed_messages = json::parse(messages);
      parsed_extra = json::parse(extra);
    } catch (const json::exception& e) {
      throw BadInput(e.what());
    }
    try {
      return chat_template->render(parsed_messages, add_generation_prompt, parsed_extra);
    } catch (const Error& e) {
      throw BadInput(e.what());
    }
  }

  std::optional<std::string> chat_template_source() const {
    if (!state_->text.chat_template) return std::nullopt;
    return state_->text.chat_template->source();
  }
  // The form calls are written in by a chat template's source.
  static std::string tool_call_format(const std::string& template_source) {
    return format_name(serving::tool_call_format(template_source));
  }

  // kind: json_object, json_schema, regex, choice or grammar (EBNF).
  Grammar compile_grammar(const std::string& kind, const std::string& text,
                          const std::vector<std::string>& choices, bool strict) {
    if (!state_->compiler) throw BadInput("structured output needs a model with a tokenizer");
    grammar::GrammarSpec spec;
    if (kind == "json_object") {
      spec.kind = grammar::GrammarSpec::Kind::kJsonObject;
    } else if (kind == "json_schema") {
      spec.kind = grammar::GrammarSpec::Kind::kJsonSchema;
    } else if (kind == "regex") {
      spec.kind = grammar::GrammarSpec::Kind::kRegex;
    } else if (kind == "choice") {
      spec.kind = grammar::GrammarSpec::Kind::kChoice;
    } else if (kind == "grammar") {
      spec.kind = grammar::GrammarSpec::Kind::kEbnf;
    } else {
      throw BadInput("unknown grammar kind '" + kind + "'");
    }
    spec.text = text;
    spec.choices = choices;
    spec.strict = strict;
    return compile(spec);
  }

  // tool_choice (its JSON) over tools (a JSON list, or "null") for a chat template whose call
  // form is template_format: the grammar of the one call it forces and the form that call is
  // written in, or nothing ("auto", "none"). As the server reads tool_choice.
  std::optional<std::pair<Grammar, std::string>> compile_tool_choice(
      const std::string& tools, const std::string& tool_choice,
      const std::string& template_format) {
    const json tools_json = json::parse(tools, nullptr, /*allow_exceptions=*/false);
    const json choice_json = json::parse(tool_choice, nullptr, /*allow_exceptions=*/false);
    if (tools_json.is_discarded() || choice_json.is_discarded()) {
      throw BadInput("tools and tool_choice must be JSON");
    }
    std::optional<serving::ForcedToolCall> forced;
    try {
      forced = serving::forced_tool_call(tools_json.is_null() ? nullptr : &tools_json, choice_json,
                                         parse_format(template_format));
    } catch (const serving::ToolChoiceError& e) {
      throw BadInput(e.what());
    }
    if (!forced) return std::nullopt;
    if (!state_->compiler) throw BadInput("tool_choice needs a model with a tokenizer");
    return std::pair{compile(forced->spec), std::string(format_name(forced->format))};
  }

  std::unique_ptr<Stream> submit(std::vector<std::vector<int32_t>> prompts,
                                 const nb::dict& sampling, std::vector<int32_t> max_tokens,
                                 int32_t n, std::vector<std::string> stop, int32_t top_logprobs,
                                 const std::string& tool_calls, bool reasoning,
                                 bool reasoning_opened, const Grammar* grammar,
                                 bool prompt_logits) {
    if (prompts.empty()) throw BadInput("no prompts given");
    if (max_tokens.size() != prompts.size()) throw BadInput("one max_tokens per prompt");
    if (n < 1) throw BadInput("n must be at least 1, got " + std::to_string(n));
    if (!has_tokenizer() && (!stop.empty() || top_logprobs >= 0)) {
      throw BadInput("stop strings and logprobs need a model with a tokenizer");
    }
    serving::GenerationSpec spec;
    spec.prompts = std::move(prompts);
    spec.max_tokens = std::move(max_tokens);
    spec.n = n;
    spec.stop = std::move(stop);
    spec.top_logprobs = top_logprobs;
    spec.tool_calls = parse_format(tool_calls);
    spec.reasoning = reasoning;
    spec.reasoning_opened = reasoning_opened;
    if (grammar != nullptr) spec.grammar = grammar->compiled;
    SamplingParams& s = spec.sampling;
    for (auto [key, value] : sampling) {
      const std::string name = nb::cast<std::string>(key);
      if (name == "temperature") {
        s.temperature = nb::cast<float>(value);
      } else if (name == "top_p") {
        s.top_p = nb::cast<float>(value);
      } else if (name == "top_k") {
        s.top_k = nb::cast<int32_t>(value);
      } else if (name == "min_p") {
        s.min_p = nb::cast<float>(value);
      } else if (name == "presence_penalty") {
        s.presence_penalty = nb::cast<float>(value);
      } else if (name == "frequency_penalty") {
        s.frequency_penalty = nb::cast<float>(value);
      } else if (name == "repetition_penalty") {
        s.repetition_penalty = nb::cast<float>(value);
      } else if (name == "seed") {
        if (!value.is_none()) s.seed = nb::cast<uint64_t>(value);
      } else if (name == "ignore_eos") {
        s.ignore_eos = nb::cast<bool>(value);
      } else if (name == "stop_token_ids") {
        s.stop_token_ids = nb::cast<std::vector<int32_t>>(value);
      } else if (name == "logit_bias") {
        s.logit_bias = nb::cast<std::vector<std::pair<int32_t, float>>>(value);
      } else {
        throw BadInput("unknown sampling parameter '" + name + "'");
      }
    }
    auto stream = std::make_unique<Stream>(std::move(spec), state_->text.tokenizer.get(),
                                           *state_->loop, state_);
    const bool queued = stream->stream().submit([&](Request& r) {
      if (!prompt_logits) return;
      r.want_prompt_logits = true;
      r.use_prefix_cache = false;  // every position's logits must be computed
    });
    if (!queued) {
      throw std::runtime_error(
          "the engine refused the request: its waiting queue is full (max_waiting), or it was "
          "closed");
    }
    return stream;
  }

  // The KV cache between two steps: page counts, prefix-cache counters, running sequences.
  nb::dict cache_info() const {
    serving::CacheSnapshot snap;
    bool answered = false;
    {
      nb::gil_scoped_release release;
      answered = state_->loop->cache_snapshot(0, std::chrono::seconds(60), &snap);
    }
    if (!answered) throw std::runtime_error("the engine did not answer in time");
    const SchedulerStats& st = snap.stats;
    nb::dict d;
    d["page_size"] = snap.page_size;
    d["pages_total"] = st.pages_total;
    d["pages_used"] = st.pages_used;
    d["pages_free"] = st.pages_free;
    d["pages_cached"] = st.pages_cached;
    d["prefix_query_tokens"] = st.prefix_query_tokens;
    d["prefix_hit_tokens"] = st.prefix_hit_tokens;
    d["num_running"] = st.num_running;
    d["num_waiting"] = st.num_waiting;
    return d;
  }

  int64_t vocab_size() const { return state_->engine->config().vocab_size; }
  int64_t max_model_len() const { return state_->engine->config().max_position_embeddings; }
  std::vector<int32_t> eos_token_ids() const { return state_->engine->config().eos_token_ids; }
  int32_t num_pages() const { return state_->engine->options().num_pages; }
  int32_t page_size() const { return state_->engine->options().page_size; }
  std::string device() const {
    return state_->engine->options().device == Device::kCuda ? "cuda" : "cpu";
  }

  // EngineLoop::hold_admissions / release_admissions: a batch submitted one call at a time is
  // admitted at one step boundary.
  void hold_admissions() { state_->loop->hold_admissions(); }
  void release_admissions() { state_->loop->release_admissions(); }

  // Stops the engine thread; later calls fail.
  void close() {
    nb::gil_scoped_release release;
    state_->loop->stop();
  }

 private:
  // Compiles on this thread with the GIL released (a schema may take a while).
  Grammar compile(const grammar::GrammarSpec& spec) {
    nb::gil_scoped_release release;
    try {
      return Grammar{state_->compiler->compile(spec)};
    } catch (const grammar::GrammarError& e) {
      throw BadInput(e.what());
    }
  }

  std::shared_ptr<State> state_;
};

}  // namespace
}  // namespace pagedlm::python

NB_MODULE(_pagedlm, m) {
  using namespace pagedlm;          // NOLINT(google-build-using-namespace)
  using namespace pagedlm::python;  // NOLINT(google-build-using-namespace)
  m.doc() = "pagedlm's native engine (use the pagedlm package's LLM)";
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const ModelNotFound& e) {
      PyErr_SetString(PyExc_FileNotFoundError, e.what());
    } catch (const BadInput& e) {
      PyErr_SetString(PyExc_ValueError, e.what());
    }
  });

  const nb::class_<Grammar> grammar_type(m, "Grammar", "A compiled structured-output grammar.");

  nb::class_<Stream>(m, "Stream", "One submitted generation's output, polled.")
      .def("poll", &Stream::poll, "timeout"_a,
           "Waits up to timeout seconds for output; True if any arrived.")
      .def_static("poll_all", &Stream::poll_all, "streams"_a, "timeout"_a,
                  "Polls every stream in one call (when none had output, waiting up to timeout "
                  "seconds for an engine step that gave any of them output): per stream, bit 0 "
                  "output arrived, bit 1 done.")
      .def(
          "done", [](const Stream& s) { return s.stream_done(); },
          "Whether every choice finished (as of the last poll).")
      .def(
          "cancel", [](Stream& s) { s.stream().cancel(); },
          "Stops every unfinished choice at the engine's next step.")
      .def("notify_fd", &Stream::notify_fd,
           "A descriptor that turns readable when output arrives; the reader drains it.")
      .def(
          "num_choices", [](Stream& s) { return s.stream().choices().size(); }, "Prompts times n.")
      .def("take", &Stream::take, "choice"_a,
           "(text, reasoning, token ids, logprobs, finish_reason) new since the last take.")
      .def("result", &Stream::result, "choice"_a, "The choice's whole output as a dict.")
      .def("prompt_logits", &Stream::prompt_logits, "choice"_a,
           "The prompt's logits [len, vocab] float32, for a stream that asked for them.")
      .def("raise_error", &Stream::raise_error,
           "Raises the first error a choice met (ValueError: the engine refused the request).");

  nb::class_<Model>(m, "Model", "A model loaded with its engine thread.")
      .def(nb::init<const std::string&, const std::string&, int32_t, int32_t, int64_t, int32_t,
                    int32_t, double, bool, int32_t, bool, bool, float, bool, int32_t,
                    const std::string&, const std::string&, const std::string&, const std::string&,
                    const std::string&, int32_t, bool, bool, bool, int32_t, nb::handle>(),
           "model"_a, "device"_a, "page_size"_a, "num_pages"_a, "kv_cache_bytes"_a,
           "max_num_batched_tokens"_a, "max_num_seqs"_a, "target_itl_ms"_a, "enable_prefix_cache"_a,
           "threads"_a, "cpu_q8_activations"_a, "cpu_fixed32_activations"_a,
           "gpu_memory_fraction"_a, "use_cuda_graphs"_a, "max_waiting"_a, "chat_template"_a,
           "load_format"_a, "dtype"_a, "kv_cache_dtype"_a, "quantization"_a, "async_scheduling"_a,
           "gguf_blocks"_a, "use_cascade_attention"_a, "tune_gemms"_a, "tensor_parallel_size"_a,
           "load_progress"_a = nb::none())
      .def("has_tokenizer", &Model::has_tokenizer)
      .def("encode", &Model::encode, "text"_a, "add_special_tokens"_a)
      .def("decode", &Model::decode, "ids"_a, "skip_special_tokens"_a)
      .def("token_to_bytes",
           [](const Model& model, int32_t id) {
             const std::string b = model.token_to_bytes(id);
             return nb::bytes(b.data(), b.size());
           })
      .def("apply_chat_template", &Model::apply_chat_template, "messages"_a,
           "add_generation_prompt"_a, "extra"_a, "template_source"_a)
      .def("chat_template_source", &Model::chat_template_source)
      .def_static("tool_call_format", &Model::tool_call_format, "template_source"_a)
      .def("compile_grammar", &Model::compile_grammar, "kind"_a, "text"_a, "choices"_a, "strict"_a)
      .def("compile_tool_choice", &Model::compile_tool_choice, "tools"_a, "tool_choice"_a,
           "template_format"_a)
      .def("submit", &Model::submit, "prompts"_a, "sampling"_a, "max_tokens"_a, "n"_a, "stop"_a,
           "top_logprobs"_a, "tool_calls"_a, "reasoning"_a, "reasoning_opened"_a,
           "grammar"_a.none(), "prompt_logits"_a)
      .def("cache_info", &Model::cache_info)
      .def_prop_ro("vocab_size", &Model::vocab_size)
      .def_prop_ro("max_model_len", &Model::max_model_len)
      .def_prop_ro("eos_token_ids", &Model::eos_token_ids)
      .def_prop_ro("num_pages", &Model::num_pages)
      .def_prop_ro("page_size", &Model::page_size)
      .def_prop_ro("device", &Model::device)
      .def("hold_admissions", &Model::hold_admissions)
      .def("release_admissions", &Model::release_admissions)
      .def("close", &Model::close);

  // `pagedlm bench`'s workload (engine/benchmark.h) as (prompt ids, max_tokens) pairs, so that a
  // script can run the very same requests through LLM.generate: (warm-up, timed). token_variant
  // k: the requests of `pagedlm bench --repeat`'s k-th run.
  m.def(
      "benchmark_workload",
      [](const std::string& kind, int32_t num_requests, uint64_t seed, int32_t prompt_min,
         int32_t prompt_max, int32_t output_min, int32_t output_max, int32_t prefix_len,
         int32_t unique_len, int32_t warmup, int64_t vocab, uint64_t token_variant) {
        WorkloadSpec spec;
        spec.kind = kind;
        spec.num_requests = num_requests;
        spec.seed = seed;
        spec.prompt_min = prompt_min;
        spec.prompt_max = prompt_max;
        spec.output_min = output_min;
        spec.output_max = output_max;
        spec.prefix_len = prefix_len;
        spec.unique_len = unique_len;
        spec.warmup_requests = warmup;
        spec.token_variant = token_variant;
        using Pairs = std::vector<std::pair<std::vector<int32_t>, int32_t>>;
        const auto pairs = [](std::vector<Request> requests) {
          Pairs out;
          for (Request& r : requests) out.emplace_back(std::move(r.prompt), r.sampling.max_tokens);
          return out;
        };
        try {
          return std::pair{pairs(warmup_requests(spec, vocab)),
                           pairs(workload_requests(spec, vocab))};
        } catch (const Error& e) {
          throw BadInput(e.what());
        }
      },
      "kind"_a, "num_requests"_a, "seed"_a, "prompt_min"_a, "prompt_max"_a, "output_min"_a,
      "output_max"_a, "prefix_len"_a, "unique_len"_a, "warmup"_a, "vocab"_a, "token_variant"_a = 0);

  m.def("prompt_opens_reasoning",
        [](const std::string& prompt) { return serving::prompt_opens_reasoning(prompt); });
}
