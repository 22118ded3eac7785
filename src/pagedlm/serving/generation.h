// One generation as a stream of outputs: the prompts (and n samples of each) go to the engine
// thread (EngineLoop), and each choice's tokens come back turned into text as they arrive:
// decoded incrementally, cut at stop strings, its <think> block split off and its tool calls
// parsed. What arrived since a caller last looked is each choice's delta; the HTTP server renders
// it as OpenAI JSON or SSE, the Python binding as RequestOutput objects.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/engine/stop_strings.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/sched/sampling_params.h"
#include "pagedlm/serving/engine_loop.h"
#include "pagedlm/serving/reasoning.h"
#include "pagedlm/serving/tool_calls.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace pagedlm::serving {

// What one generation asks for: every prompt is sampled n times (its choices p * n .. p * n +
// n - 1), each sample held to the same parameters.
struct GenerationSpec {
  std::vector<std::vector<int32_t>> prompts;  // token ids, one entry per prompt
  SamplingParams sampling;                    // max_tokens is taken per prompt, below
  std::vector<int32_t> max_tokens;            // per prompt
  int32_t n = 1;
  std::vector<std::string> stop;
  int32_t top_logprobs = -1;  // -1: no logprobs
  std::string cache_salt;
  // The reply's calls are parsed in this form (serving/tool_calls.h); kNone: not parsed.
  ToolCallFormat tool_calls = ToolCallFormat::kNone;
  // The reply's <think> block is split off (serving/reasoning.h); reasoning_opened: the prompt
  // left it open for the reply.
  bool reasoning = false;
  bool reasoning_opened = false;
  // The compiled grammar every choice's output is held to; null: none.
  grammar::CompiledGrammarPtr grammar;
};

// One token's logprobs as the engine reported them.
struct LogprobEntry {
  int32_t token = -1;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;
};

// The output of one choice as it arrives. A model without a tokenizer (random weights, for
// benchmarks) has no text: its token ids are the output. The *_delta fields, token_ids and
// logprobs hold what arrived since the caller last cleared them.
struct ChoiceOutput {
  ChoiceOutput(const Tokenizer* tokenizer, const GenerationSpec& spec);

  // Takes in one engine event. True when the choice just ended at a stop string: the engine
  // still generates it until told to stop (GenerationStream cancels it).
  bool accept(const TokenEvent& event);
  // Ends an unfinished choice now with an error (status as TokenEvent::error_status).
  void fail(std::string message, int status, const char* reason);

  std::optional<StreamDecoder> decoder;
  StopStringMatcher stop;
  std::string text;                    // everything emitted so far
  std::string delta;                   // emitted since the last flush
  std::vector<int32_t> all_token_ids;  // every token the choice generated
  std::vector<int32_t> token_ids;      // without a decoder: since the last flush
  bool keep_logprobs = false;
  std::vector<LogprobEntry> logprobs;  // since the last flush
  int32_t completion_tokens = 0;
  int32_t num_cached_tokens = 0;
  Tensor prompt_logits;                      // when the job asked for them, once finished
  std::optional<std::string> finish_reason;  // "stop", "length", "tool_calls", "error", "abort"
  // Chat with tools: the reply's calls are held back and become `calls`.
  std::optional<ToolCallStream> tool_stream;
  int32_t call_marker = -1;  // a special token that opens calls, written back as its text
  // The reply's <think> block, apart from its text.
  std::optional<ReasoningSplitter> reasoning_splitter;
  std::string reasoning;        // everything split off so far
  std::string reasoning_delta;  // since the last flush
  std::string content;          // with tool_stream: the reply without its calls
  std::vector<ToolCall> calls;
  std::string error;
  int error_status = 0;

 private:
  void emit(const std::string& piece);
  void add(const ReasoningSplitter::Split& split);
  void emit_content(const std::string& piece);
  void end_reply(const char* reason);
};

class GenerationStream {
 public:
  // `tokenizer` may be null (a model without one: no text, stop strings or logprobs). `waker`,
  // if any, is woken when output arrives, once per engine step (a client polling many streams
  // waits on it).
  GenerationStream(GenerationSpec spec, const Tokenizer* tokenizer, EngineLoop& loop,
                   std::shared_ptr<OutputWaker> waker = nullptr);

  // Queues every choice; false when the loop refuses them (its waiting queue is full, or it
  // stops).
  bool submit();
  // Queues every choice with the engine request's fields `edit` sets (prompt logits, no prefix
  // cache); as submit().
  bool submit(const std::function<void(Request&)>& edit);
  // Waits up to `timeout` for output and takes in all that arrived; false if none had.
  bool poll(std::chrono::milliseconds timeout);
  // `listener` runs on the engine's thread after each of its events.
  void set_listener(std::function<void()> listener);

  // Every choice finished.
  bool done() const;
  // The caller no longer wants the output: every unfinished choice stops at the next step.
  void cancel();
  // Every unfinished choice ends now with this error (the caller stops), and is cancelled.
  void abort(const std::string& message, int status, const char* reason);
  // The first error a choice met, as (status, message); status 0 when none.
  std::pair<int, std::string> error() const;

  const GenerationSpec& spec() const { return spec_; }
  std::vector<ChoiceOutput>& choices() { return choices_; }
  const std::vector<ChoiceOutput>& choices() const { return choices_; }

 private:
  GenerationSpec spec_;
  EngineLoop& loop_;
  std::shared_ptr<OutputChannel> channel_;
  std::vector<ChoiceOutput> choices_;
};

}  // namespace pagedlm::serving
