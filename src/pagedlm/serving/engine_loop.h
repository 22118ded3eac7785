// The engine thread: the only thread that touches the Engine. Its clients (the HTTP server's
// workers, the Python binding) hand it requests through a bounded queue; what each produced goes
// to a per-request OutputChannel, whose listener wakes the client. A request joins the running
// batch at the next step. serving/generation.h turns the channel's tokens into text.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pagedlm/engine/engine.h"
#include "pagedlm/grammar/grammar.h"
#include "pagedlm/serving/metrics.h"

namespace pagedlm::serving {

using Clock = std::chrono::steady_clock;

// What one engine step produced for one choice of a request.
struct TokenEvent {
  int32_t choice = 0;
  int32_t token = -1;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top_logprobs;
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  int32_t num_cached_tokens = 0;  // set when finished
  Tensor prompt_logits;           // set when finished, for a request that wanted them
  std::string error;              // the request failed; finished is true
  int error_status = 0;           // 400: the engine refused it; 500 / 503: the server failed
};

// Wakes a client that waits on many channels at once (the Python package's LLM.generate polls
// hundreds): the engine thread wakes it once per step, after pushing all of the step's events,
// rather than once per event, so that the client drains the channels while the next step runs
// instead of contending with the engine thread as it pushes. Shared by any number of channels.
class OutputWaker {
 public:
  void wake();
  // The wakes so far: read it before looking at the channels, then wait_past() it.
  uint64_t wakes() const;
  // Waits up to `timeout` for a wake after the first `seen`; false if none came.
  bool wait_past(uint64_t seen, std::chrono::milliseconds timeout) const;

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  uint64_t wakes_ = 0;
};

// The events of all choices of one request, engine thread -> client.
class OutputChannel {
 public:
  // `waker`, if any, is woken after each push (after each step, for the pushes of a step).
  explicit OutputChannel(std::shared_ptr<OutputWaker> waker = nullptr);
  void push(TokenEvent event);
  // A step's push (EngineLoop::process): as push(), but the waker is left to the caller, which
  // wakes each waker once after the step's last push. Returns the waker (null: none).
  const std::shared_ptr<OutputWaker>& push_in_step(TokenEvent event);
  // Called (on the pushing thread, outside the lock) after each push: how an event-driven
  // reader learns that events wait, without a thread blocked in wait_pop.
  void set_listener(std::function<void()> listener);
  // Waits up to `timeout` for events and moves them all into `out`; false if none came.
  bool wait_pop(std::vector<TokenEvent>* out, std::chrono::milliseconds timeout);

  // Client side: the client no longer wants this choice (or, with cancel_all, any).
  void cancel(int32_t choice);
  void cancel_all();
  bool is_cancelled(int32_t choice) const;

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<TokenEvent> events_;
  std::function<void()> listener_;
  std::set<int32_t> cancelled_;
  bool all_cancelled_ = false;
  // Set once anything was cancelled: the engine thread asks is_cancelled() of every running
  // choice before each step, and most channels never cancel, so it takes no lock for them.
  std::atomic<bool> any_cancelled_{false};
  const std::shared_ptr<OutputWaker> waker_;
};

// The KV cache as the engine thread saw it between two steps (GET /v1/cache).
struct CacheSnapshot {
  int32_t page_size = 0;
  SchedulerStats stats;
  std::vector<SequenceView> sequences;     // running sequences' page tables
  std::vector<CachedPageView> free_pages;  // free pages still serving hits, next reused first
};

struct GenerationJob {
  Request request;
  int32_t choice = 0;
  int32_t top_logprobs = -1;            // -1: no logprobs; 0: only the sampled token's
  grammar::CompiledGrammarPtr grammar;  // structured output; null: none
};

class EngineLoop {
 public:
  // `max_waiting`: requests queued for admission (here and in the engine) beyond which submit
  // refuses new ones. `max_queue_wait`: the expected wait for a first token (the requests
  // ahead over the rate at which requests have been starting lately) beyond which admit()
  // refuses new ones; 0: no bound.
  EngineLoop(Engine& engine, int32_t max_waiting,
             std::chrono::milliseconds max_queue_wait = std::chrono::milliseconds(0));
  ~EngineLoop();
  EngineLoop(const EngineLoop&) = delete;
  EngineLoop& operator=(const EngineLoop&) = delete;

  // Admission before any parsing work: a token counted as one waiting request while it is
  // held (until the request was submitted or refused); null when requests held or queued
  // (here and in the engine) already reach max_waiting, or when their expected wait exceeds
  // max_queue_wait.
  std::shared_ptr<void> admit();
  // For a refusal's Retry-After: the whole seconds (at least 1) until, at the rate requests
  // have been starting, the queue is short enough again to admit one.
  int32_t retry_after_seconds() const;
  // Queues every job of one request (all or none); their events go to `channel`.
  // False when the waiting queue is full.
  bool submit(std::vector<GenerationJob> jobs, const std::shared_ptr<OutputChannel>& channel);
  // Holds admissions while a caller submits a batch of requests one call at a time (the Python
  // package's LLM.generate): the engine thread leaves submitted requests queued, stepping those
  // it runs, until every hold is released, and then admits them all at one step boundary, as
  // an offline batch handed over at once would be (its first prefill steps full, as
  // `pagedlm bench`'s). Nestable; release_admissions() once per hold.
  void hold_admissions();
  void release_admissions();
  // Makes the engine thread look for cancelled channels now rather than after its next step.
  void wake();
  // The server is stopping: from now on every step's prefill is held to the engine's
  // target_itl_ms (Engine::set_draining), so that stop_within() finds the engine thread
  // between short steps even when a long prompt is being prefilled.
  void drain();
  void stop();
  // Stops as stop() does, but waits at most `wait` for the engine thread to leave its current
  // step; false when it has not (the thread still uses the Engine, which must then outlive it:
  // the caller exits the process instead).
  bool stop_within(std::chrono::milliseconds wait);

  std::string prometheus_text() const;
  SchedulerStats stats() const;
  // Asks the engine thread for a snapshot of the KV cache (at most max_free_pages free pages
  // listed), taken after its current step, and waits up to `timeout` for it. False on timeout
  // or shutdown.
  bool cache_snapshot(int32_t max_free_pages, std::chrono::milliseconds timeout,
                      CacheSnapshot* out);

 private:
  struct Pending {
    GenerationJob job;
    std::shared_ptr<OutputChannel> channel;
    Clock::time_point arrival;
  };
  struct Active {
    std::shared_ptr<OutputChannel> channel;
    int32_t choice = 0;
    Clock::time_point arrival;
    Clock::time_point last_token;
    bool has_token = false;
  };

  void run();
  // Requests ahead of a new one (held tokens, queued, waiting in the engine); mu_ held.
  int64_t queued_locked() const;
  // Requests starting per second lately (0: too few starts seen to tell); mu_ held.
  double start_rate_locked(Clock::time_point now) const;
  void admit(std::vector<Pending> incoming);
  void drop_cancelled();
  void process(const std::vector<RequestEvent>& events);
  void fail_all(const std::string& message, int status);
  void serve_cache_request();
  // Every request the loop runs has been cancelled by its client: the step in progress is left
  // midway (Engine::set_abandon_check), as nobody waits for its tokens. Engine thread only.
  bool all_cancelled() const;

  Engine& engine_;
  const int32_t max_waiting_;
  const std::chrono::milliseconds max_queue_wait_;
  std::map<int64_t, Active> active_;  // engine thread only

  mutable std::mutex mu_;  // guards everything below
  std::condition_variable cv_;
  std::vector<Pending> inbox_;
  bool stop_ = false;
  // stop_ as the engine's abandon check reads it, inside a step (Engine::set_abandon_check):
  // once the loop is told to stop, every request has its answer, and a long CPU step in
  // progress is left midway instead of keeping stop_within() waiting.
  std::atomic<bool> stopping_{false};
  bool exited_ = false;  // the engine thread has ended every request and returns
  bool woken_ = false;
  bool draining_ = false;
  int32_t admission_holds_ = 0;  // hold_admissions() not yet released
  int64_t admitted_ = 0;         // tokens from admit() still held
  // When the last requests got their first token, oldest first (kStartWindow at most): the
  // rate the queue drains at, measured, so that a refusal's Retry-After is an estimate.
  static constexpr size_t kStartWindow = 64;
  static constexpr size_t kMinStarts = 4;  // fewer: no rate yet, and no refusal by wait
  std::deque<Clock::time_point> starts_;
  SchedulerStats stats_;
  ServingCounters counters_;
  // Cache snapshots: requests_ counts the ones asked for, served_ the last one answered (the
  // engine thread answers every request pending when it looks, with one snapshot).
  int64_t cache_requests_ = 0;
  int64_t cache_served_ = 0;
  int32_t cache_max_free_pages_ = 0;
  CacheSnapshot cache_;

  ServingMetrics metrics_;  // thread-safe itself
  std::thread thread_;
};

}  // namespace pagedlm::serving
