#include "pagedlm/serving/generation.h"

#include <algorithm>

namespace pagedlm::serving {

ChoiceOutput::ChoiceOutput(const Tokenizer* tokenizer, const GenerationSpec& spec)
    : stop(spec.stop), keep_logprobs(spec.top_logprobs >= 0) {
  if (tokenizer != nullptr) decoder.emplace(*tokenizer, /*skip_special_tokens=*/true);
  if (spec.tool_calls != ToolCallFormat::kNone) {
    tool_stream.emplace(spec.tool_calls);
    if (tokenizer != nullptr) call_marker = dropped_call_marker(*tokenizer, spec.tool_calls);
  }
  if (spec.reasoning) reasoning_splitter.emplace(spec.reasoning_opened);
}

bool ChoiceOutput::accept(const TokenEvent& e) {
  if (finish_reason) return false;  // tokens the engine made before it saw a stop-string cancel
  if (!e.error.empty()) {
    error = e.error;
    error_status = e.error_status;
    finish_reason = "error";
    return false;
  }
  if (e.token >= 0) {
    ++completion_tokens;
    all_token_ids.push_back(e.token);
    if (!decoder) {
      // Without a tokenizer the request could not ask for stop strings or logprobs.
      token_ids.push_back(e.token);
    } else {
      std::string piece = decoder->push(e.token);
      if (e.token == call_marker) piece += kMistralMarker;  // decoding drops special tokens
      emit(stop.push(piece));
      if (keep_logprobs) logprobs.push_back({e.token, e.logprob, e.top_logprobs});
      if (stop.stopped()) {
        end_reply("stop");
        return true;
      }
    }
  }
  if (e.finished) {
    num_cached_tokens = e.num_cached_tokens;
    prompt_logits = e.prompt_logits;
    if (decoder) emit(stop.push(decoder->finish()));
    emit(stop.finish());
    end_reply(e.reason == FinishReason::kLength ? "length" : "stop");
  }
  return false;
}

void ChoiceOutput::fail(std::string message, int status, const char* reason) {
  if (finish_reason) return;
  error = std::move(message);
  error_status = status;
  finish_reason = reason;
}

// The reply's next text: its reasoning split off (when asked for), the rest to the content.
void ChoiceOutput::emit(const std::string& piece) {
  if (!reasoning_splitter) {
    emit_content(piece);
    return;
  }
  add(reasoning_splitter->push(piece));
}

void ChoiceOutput::add(const ReasoningSplitter::Split& split) {
  reasoning += split.reasoning;
  reasoning_delta += split.reasoning;
  emit_content(split.content);
}

void ChoiceOutput::emit_content(const std::string& piece) {
  text += piece;
  delta += tool_stream ? tool_stream->push(piece) : piece;
}

// The reply is complete: its calls (if it was parsed for them) and its finish reason, which is
// "tool_calls" when a stopped reply called tools.
void ChoiceOutput::end_reply(const char* reason) {
  if (reasoning_splitter) add(reasoning_splitter->finish());
  finish_reason = reason;
  if (!tool_stream) return;
  std::string unsent;
  ParsedReply reply = tool_stream->finish(text, &unsent);
  delta += unsent;
  content = std::move(reply.content);
  calls = std::move(reply.calls);
  if (!calls.empty() && *finish_reason == "stop") finish_reason = "tool_calls";
}

GenerationStream::GenerationStream(GenerationSpec spec, const Tokenizer* tokenizer,
                                   EngineLoop& loop, std::shared_ptr<OutputWaker> waker)
    : spec_(std::move(spec)),
      loop_(loop),
      channel_(std::make_shared<OutputChannel>(std::move(waker))) {
  const size_t num_choices = spec_.prompts.size() * static_cast<size_t>(spec_.n);
  choices_.reserve(num_choices);
  for (size_t i = 0; i < num_choices; ++i) choices_.emplace_back(tokenizer, spec_);
}

bool GenerationStream::submit() {
  return submit([](Request&) {});
}

bool GenerationStream::submit(const std::function<void(Request&)>& edit) {
  std::vector<GenerationJob> jobs;
  for (size_t p = 0; p < spec_.prompts.size(); ++p) {
    for (int32_t j = 0; j < spec_.n; ++j) {
      GenerationJob job;
      job.request.prompt = spec_.prompts[p];
      job.request.sampling = spec_.sampling;
      job.request.sampling.max_tokens = spec_.max_tokens.at(p);
      // n samples of one seeded request must differ, and still be reproducible.
      if (job.request.sampling.seed) *job.request.sampling.seed += static_cast<uint64_t>(j);
      job.request.cache_salt = spec_.cache_salt;
      edit(job.request);
      job.choice = static_cast<int32_t>(p * spec_.n + j);
      job.top_logprobs = spec_.top_logprobs;
      job.grammar = spec_.grammar;
      jobs.push_back(std::move(job));
    }
  }
  return loop_.submit(std::move(jobs), channel_);
}

bool GenerationStream::poll(std::chrono::milliseconds timeout) {
  std::vector<TokenEvent> events;
  if (!channel_->wait_pop(&events, timeout)) return false;
  for (const TokenEvent& e : events) {
    if (choices_.at(e.choice).accept(e)) {
      channel_->cancel(e.choice);
      loop_.wake();
    }
  }
  return true;
}

void GenerationStream::set_listener(std::function<void()> listener) {
  channel_->set_listener(std::move(listener));
}

bool GenerationStream::done() const {
  return std::all_of(choices_.begin(), choices_.end(),
                     [](const ChoiceOutput& c) { return c.finish_reason.has_value(); });
}

void GenerationStream::cancel() {
  channel_->cancel_all();
  loop_.wake();
}

void GenerationStream::abort(const std::string& message, int status, const char* reason) {
  for (ChoiceOutput& c : choices_) c.fail(message, status, reason);
  cancel();
}

std::pair<int, std::string> GenerationStream::error() const {
  for (const ChoiceOutput& c : choices_) {
    if (!c.error.empty()) return {c.error_status, c.error};
  }
  return {0, {}};
}

}  // namespace pagedlm::serving
