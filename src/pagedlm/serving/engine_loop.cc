#include "pagedlm/serving/engine_loop.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>

#include "pagedlm/core/error.h"

namespace pagedlm::serving {

void OutputWaker::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    ++wakes_;
  }
  cv_.notify_all();
}

uint64_t OutputWaker::wakes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return wakes_;
}

bool OutputWaker::wait_past(uint64_t seen, std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, timeout, [&] { return wakes_ != seen; });
}

OutputChannel::OutputChannel(std::shared_ptr<OutputWaker> waker) : waker_(std::move(waker)) {}

void OutputChannel::push(TokenEvent event) {
  if (const std::shared_ptr<OutputWaker>& waker = push_in_step(std::move(event))) waker->wake();
}

const std::shared_ptr<OutputWaker>& OutputChannel::push_in_step(TokenEvent event) {
  std::function<void()> listener;
  {
    std::lock_guard<std::mutex> lock(mu_);
    events_.push_back(std::move(event));
    listener = listener_;
  }
  cv_.notify_one();
  if (listener) listener();
  return waker_;
}

void OutputChannel::set_listener(std::function<void()> listener) {
  std::lock_guard<std::mutex> lock(mu_);
  listener_ = std::move(listener);
}

bool OutputChannel::wait_pop(std::vector<TokenEvent>* out, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> lock(mu_);
  // A look without waiting makes no system call (a wait for no time would: a client polling
  // hundreds of channels after each step paid one per channel that had nothing new).
  if (events_.empty() &&
      (timeout.count() <= 0 || !cv_.wait_for(lock, timeout, [&] { return !events_.empty(); }))) {
    return false;
  }
  for (TokenEvent& e : events_) out->push_back(std::move(e));
  events_.clear();
  return true;
}

void OutputChannel::cancel(int32_t choice) {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_.insert(choice);
  any_cancelled_ = true;
}

void OutputChannel::cancel_all() {
  std::lock_guard<std::mutex> lock(mu_);
  all_cancelled_ = true;
  any_cancelled_ = true;
}

bool OutputChannel::is_cancelled(int32_t choice) const {
  if (!any_cancelled_.load(std::memory_order_acquire)) return false;
  std::lock_guard<std::mutex> lock(mu_);
  return all_cancelled_ || cancelled_.count(choice) != 0;
}

EngineLoop::EngineLoop(Engine& engine, int32_t max_waiting,
                       std::chrono::milliseconds max_queue_wait)
    : engine_(engine),
      max_waiting_(max_waiting),
      max_queue_wait_(max_queue_wait),
      stats_(engine.stats()) {
  engine_.set_abandon_check(
      [this] { return stopping_.load(std::memory_order_relaxed) || all_cancelled(); });
  thread_ = std::thread([this] { run(); });
}

EngineLoop::~EngineLoop() {
  stop();
  engine_.set_abandon_check({});
}

void EngineLoop::stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    stopping_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool EngineLoop::stop_within(std::chrono::milliseconds wait) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    stop_ = true;
    stopping_ = true;
    cv_.notify_all();
    if (!cv_.wait_for(lock, wait, [&] { return exited_; })) return false;
  }
  if (thread_.joinable()) thread_.join();
  return true;
}

int64_t EngineLoop::queued_locked() const {
  return admitted_ + static_cast<int64_t>(inbox_.size()) + stats_.num_waiting;
}

double EngineLoop::start_rate_locked(Clock::time_point now) const {
  if (starts_.size() < kMinStarts) return 0;
  // Up to now, not to the last start: a queue that stopped moving shows a falling rate.
  const double seconds = std::chrono::duration<double>(now - starts_.front()).count();
  return seconds > 0 ? static_cast<double>(starts_.size() - 1) / seconds : 0;
}

std::shared_ptr<void> EngineLoop::admit() {
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t waiting = queued_locked();
  // The wait a new request would see: the requests ahead of it, started at the measured rate
  // (2-core Intel Xeon, 2026-12-02, b8c1423: with only the count bounded, admitted requests
  // waited up to 212 s while refusals said Retry-After: 1).
  bool too_long = false;
  if (max_queue_wait_.count() > 0 && waiting > 0) {
    const double rate = start_rate_locked(Clock::now());
    too_long = rate > 0 && static_cast<double>(waiting) / rate * 1000.0 >
                               static_cast<double>(max_queue_wait_.count());
  }
  if (stop_ || waiting >= max_waiting_ || too_long) {
    ++counters_.requests_rejected;
    return nullptr;
  }
  ++admitted_;
  return std::shared_ptr<void>(static_cast<void*>(this), [this](void*) {
    std::lock_guard<std::mutex> lock(mu_);
    --admitted_;
  });
}

int32_t EngineLoop::retry_after_seconds() const {
  std::lock_guard<std::mutex> lock(mu_);
  const double rate = start_rate_locked(Clock::now());
  if (rate <= 0) return 1;
  // Admitted again once fewer than max_waiting wait and their wait is within the bound.
  double allowed = static_cast<double>(max_waiting_) - 1;
  if (max_queue_wait_.count() > 0) {
    allowed = std::min(allowed, rate * static_cast<double>(max_queue_wait_.count()) / 1000.0);
  }
  const double excess = static_cast<double>(queued_locked()) - std::max(0.0, allowed);
  const double seconds = std::ceil(std::max(1.0, excess / rate));
  return static_cast<int32_t>(std::min(seconds, 3600.0));
}

bool EngineLoop::submit(std::vector<GenerationJob> jobs,
                        const std::shared_ptr<OutputChannel>& channel) {
  const Clock::time_point now = Clock::now();
  bool held = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const int64_t waiting = static_cast<int64_t>(inbox_.size()) + stats_.num_waiting;
    if (stop_ || waiting + static_cast<int64_t>(jobs.size()) > max_waiting_) {
      ++counters_.requests_rejected;
      return false;
    }
    for (GenerationJob& job : jobs) inbox_.push_back({std::move(job), channel, now});
    held = admission_holds_ > 0;
  }
  // Held, the engine thread could not admit the jobs: release_admissions() wakes it (a batch
  // submitted under a hold would otherwise wake an idle engine thread once per request, for
  // nothing, while the engine waits for the batch).
  if (!held) cv_.notify_all();
  return true;
}

void EngineLoop::drain() {
  std::lock_guard<std::mutex> lock(mu_);
  draining_ = true;
}

void EngineLoop::hold_admissions() {
  std::lock_guard<std::mutex> lock(mu_);
  ++admission_holds_;
}

void EngineLoop::release_admissions() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    PAGEDLM_CHECK(admission_holds_ > 0, "release_admissions without a hold");
    --admission_holds_;
  }
  cv_.notify_all();
}

void EngineLoop::wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  cv_.notify_all();
}

std::string EngineLoop::prometheus_text() const {
  std::lock_guard<std::mutex> lock(mu_);
  return render_prometheus(stats_, static_cast<int32_t>(inbox_.size()), counters_, metrics_);
}

SchedulerStats EngineLoop::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return stats_;
}

bool EngineLoop::cache_snapshot(int32_t max_free_pages, std::chrono::milliseconds timeout,
                                CacheSnapshot* out) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stop_) return false;
  const int64_t ticket = ++cache_requests_;
  cache_max_free_pages_ = std::max(cache_max_free_pages_, max_free_pages);
  cv_.notify_all();
  if (!cv_.wait_for(lock, timeout, [&] { return cache_served_ >= ticket || stop_; })) return false;
  if (cache_served_ < ticket) return false;
  *out = cache_;
  if (static_cast<int32_t>(out->free_pages.size()) > max_free_pages) {
    out->free_pages.resize(max_free_pages);
  }
  return true;
}

// The engine's state is read here only, on its own thread, between steps.
void EngineLoop::serve_cache_request() {
  int64_t requested = 0;
  int32_t max_free_pages = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (cache_requests_ == cache_served_) return;
    requested = cache_requests_;
    max_free_pages = cache_max_free_pages_;
    cache_max_free_pages_ = 0;
  }
  CacheSnapshot snapshot;
  snapshot.page_size = engine_.options().page_size;
  snapshot.stats = engine_.stats();
  snapshot.sequences = engine_.sequence_map();
  snapshot.free_pages = engine_.cached_pages(max_free_pages);
  {
    std::lock_guard<std::mutex> lock(mu_);
    cache_ = std::move(snapshot);
    cache_served_ = requested;
  }
  cv_.notify_all();
}

void EngineLoop::run() {
  // The engine's GPU and OpenMP thread count: those set by its constructor on the thread that
  // built it would not reach this one, whose steps would then use every hardware thread
  // whatever `threads` says; two engines in one process, each on its loop's thread, keep their
  // own counts.
  engine_.use_on_this_thread();
  // A short request never waits out a long prompt's prefill (Engine::set_prefill_always_bounded).
  engine_.set_prefill_always_bounded(true);
  while (true) {
    std::vector<Pending> incoming;
    bool draining = false;
    {
      std::unique_lock<std::mutex> lock(mu_);
      const auto admitting = [&] { return !inbox_.empty() && admission_holds_ == 0; };
      cv_.wait(lock, [&] {
        return stop_ || woken_ || admitting() || !active_.empty() ||
               cache_requests_ != cache_served_;
      });
      if (stop_) break;
      woken_ = false;
      draining = draining_;
      if (admitting()) incoming.swap(inbox_);
    }
    engine_.set_draining(draining);
    admit(std::move(incoming));
    drop_cancelled();
    std::vector<RequestEvent> events;
    if (engine_.has_unfinished()) {
      try {
        events = engine_.step();
      } catch (const std::exception& e) {
        // The step's state is unknown: end every request rather than serve wrong tokens.
        std::fprintf(stderr, "engine step failed: %s\n", e.what());
        fail_all(std::string("engine step failed: ") + e.what(), 500);
      }
    }
    const Clock::time_point processing = Clock::now();
    process(events);
    if (!events.empty()) {
      const StepShape& s = engine_.last_step();
      std::lock_guard<std::mutex> lock(mu_);
      ++counters_.steps;
      counters_.step_schedule_seconds += s.schedule_ms / 1e3;
      counters_.step_prepare_seconds += s.prepare_ms / 1e3;
      counters_.step_wait_seconds += s.wait_ms / 1e3;
      counters_.step_finish_seconds += s.finish_ms / 1e3;
      counters_.step_gpu_seconds += s.gpu_ms / 1e3;
      counters_.event_seconds += std::chrono::duration<double>(Clock::now() - processing).count();
    }
    const SchedulerStats stats = engine_.stats();
    {
      std::lock_guard<std::mutex> lock(mu_);
      stats_ = stats;
      // The rate is measured over the current busy spell only: starts from before an idle
      // time would make a fresh burst look slow.
      if (queued_locked() == 0) starts_.clear();
    }
    serve_cache_request();
  }
  fail_all("the server is shutting down", 503);
  std::vector<Pending> left;
  {
    std::lock_guard<std::mutex> lock(mu_);
    left.swap(inbox_);
  }
  for (Pending& p : left) {
    TokenEvent event;
    event.choice = p.job.choice;
    event.finished = true;
    event.error = "the server is shutting down";
    event.error_status = 503;
    p.channel->push(std::move(event));
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    exited_ = true;
  }
  cv_.notify_all();
}

void EngineLoop::admit(std::vector<Pending> incoming) {
  for (Pending& p : incoming) {
    const int32_t choice = p.job.choice;
    if (p.channel->is_cancelled(choice)) continue;
    const int64_t prompt_tokens = static_cast<int64_t>(p.job.request.prompt.size());
    int64_t id = -1;
    try {
      id = engine_.add_request(std::move(p.job.request));
      if (p.job.top_logprobs >= 0) engine_.enable_logprobs(id, p.job.top_logprobs);
      if (p.job.grammar) engine_.set_grammar(id, p.job.grammar);
      active_[id] = Active{p.channel, choice, p.arrival, p.arrival, false};
      std::lock_guard<std::mutex> lock(mu_);
      counters_.prompt_tokens += prompt_tokens;
    } catch (const std::exception& e) {
      // Queued, then refused: it must not run unseen.
      if (id >= 0 && engine_.cancel(id)) engine_.take_output(id);
      TokenEvent event;
      event.choice = choice;
      event.finished = true;
      event.error = e.what();
      event.error_status = 400;
      p.channel->push(std::move(event));
    }
  }
}

void EngineLoop::drop_cancelled() {
  int64_t cancelled = 0;
  for (auto it = active_.begin(); it != active_.end();) {
    if (!it->second.channel->is_cancelled(it->second.choice)) {
      ++it;
      continue;
    }
    // Cancelling frees the pages at once; taking the output drops the engine's record of it.
    if (engine_.cancel(it->first)) engine_.take_output(it->first);
    it = active_.erase(it);
    ++cancelled;
  }
  if (cancelled == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  counters_.requests_cancelled += cancelled;
}

void EngineLoop::process(const std::vector<RequestEvent>& events) {
  const Clock::time_point now = Clock::now();
  int64_t generated = 0, finished = 0, cancelled = 0, started = 0;
  // Woken once each, after the step's last push (held: a channel may go with its request).
  std::vector<std::shared_ptr<OutputWaker>> wakers;
  for (const RequestEvent& e : events) {
    auto it = active_.find(e.request_id);
    if (it == active_.end()) continue;
    Active& a = it->second;
    TokenEvent out;
    out.choice = a.choice;
    out.token = e.token;
    out.logprob = e.logprob;
    out.top_logprobs = e.top_logprobs;
    out.finished = e.finished;
    out.reason = e.reason;
    if (e.token >= 0) {
      if (!a.has_token) ++started;
      ++generated;
      const double seconds =
          std::chrono::duration<double>(now - (a.has_token ? a.last_token : a.arrival)).count();
      (a.has_token ? metrics_.inter_token_latency : metrics_.time_to_first_token).observe(seconds);
      a.has_token = true;
      a.last_token = now;
    }
    if (e.finished) {
      RequestOutput output = engine_.take_output(e.request_id);
      out.num_cached_tokens = output.num_cached_tokens;
      out.prompt_logits = std::move(output.prompt_logits);
      // Ended as cancelled: a step left midway (every client had gone, or the loop stops).
      ++(e.reason == FinishReason::kCancelled ? cancelled : finished);
    }
    const std::shared_ptr<OutputWaker>& waker = a.channel->push_in_step(std::move(out));
    if (waker && std::find(wakers.begin(), wakers.end(), waker) == wakers.end()) {
      wakers.push_back(waker);
    }
    if (e.finished) active_.erase(it);
  }
  for (const std::shared_ptr<OutputWaker>& waker : wakers) waker->wake();
  std::lock_guard<std::mutex> lock(mu_);
  counters_.generation_tokens += generated;
  counters_.requests_finished += finished;
  counters_.requests_cancelled += cancelled;
  for (int64_t i = 0; i < started; ++i) {
    starts_.push_back(now);
    if (starts_.size() > kStartWindow) starts_.pop_front();
  }
  if (engine_.last_mask_ms() > 0) {
    ++counters_.masked_steps;
    counters_.mask_seconds += engine_.last_mask_ms() / 1000.0;
    counters_.mask_hidden_steps += engine_.last_mask_hidden() ? 1 : 0;
    counters_.mask_prefetch_seconds += engine_.last_mask_prefetch_ms() / 1000.0;
    counters_.prefetched_masks += engine_.last_prefetched_masks();
    counters_.masked_forward_gpu_seconds += engine_.last_step().masked_forward_gpu_ms / 1e3;
    counters_.masked_sampler_gpu_seconds += engine_.last_step().masked_sampler_gpu_ms / 1e3;
  }
}

bool EngineLoop::all_cancelled() const {
  if (active_.empty()) return false;
  return std::all_of(active_.begin(), active_.end(), [](const auto& entry) {
    return entry.second.channel->is_cancelled(entry.second.choice);
  });
}

void EngineLoop::fail_all(const std::string& message, int status) {
  for (auto& [id, a] : active_) {
    try {
      if (engine_.cancel(id)) engine_.take_output(id);
    } catch (const std::exception&) {
      // The request is being failed anyway; its record goes with the engine.
    }
    TokenEvent event;
    event.choice = a.choice;
    event.finished = true;
    event.error = message;
    event.error_status = status;
    a.channel->push(std::move(event));
  }
  active_.clear();
}

}  // namespace pagedlm::serving
