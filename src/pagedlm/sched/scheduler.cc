#include "pagedlm/sched/scheduler.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>

#include "pagedlm/core/error.h"

namespace pagedlm {

enum class SeqStatus : uint8_t { kWaiting, kRunning, kFinished };

struct Sequence {
  Request request;  // its prompt moved into `tokens`
  // The request's one copy of its tokens, here rather than apart so that a step reads them
  // without one more indirection; readers hold it through an aliasing pointer to the Sequence.
  RequestTokens tokens;
  int32_t num_computed = 0;  // tokens whose K/V are written or in the plan being run
  int32_t num_cached_tokens = 0;
  KvSeq kv;  // its pages, which only the KvCacheManager changes
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  // Plans that update() (or resolve()) has not seen yet holding it: 0, 1, or 2 while a plan
  // runs ahead of the one before it.
  int32_t in_flight = 0;
  // Index in tokens.all of the kPendingToken run_ahead() appended (-1: none).
  int32_t pending_at = -1;
  bool finish_reported = false;  // resolve() reported its finish; the next update() says so

  std::span<const int32_t> token_span() const { return tokens.all; }
  int32_t num_tokens() const { return tokens.size(); }
  int32_t num_outputs() const { return tokens.num_outputs(); }
  int32_t num_pending() const { return num_tokens() - num_computed; }
};

namespace {

struct ScheduledSeq {
  Sequence* seq;
  int32_t num_new_tokens;
};

bool contains(const std::vector<int32_t>& values, int32_t value) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

}  // namespace

struct Scheduler::State {
  explicit State(const SchedulerConfig& config)
      : config(config),
        kv(KvCacheConfig{config.page_size, config.num_pages, config.window,
                         config.enable_prefix_cache}) {}

  const SchedulerConfig& config;
  KvCacheManager kv;
  // Shared with the readers of each sequence's tokens (Scheduler::add), which may outlive it here.
  std::unordered_map<int64_t, std::shared_ptr<Sequence>> sequences;
  std::deque<Sequence*> waiting;
  std::vector<Sequence*> running;       // in admission order: preemption takes the back
  std::vector<ScheduledSeq> scheduled;  // the last plan's sequences, in plan order
  std::vector<ScheduledSeq> ahead;      // the plan run_ahead() was given, until resolve()
  std::vector<Sequence*> finished;      // scratch of update
  int64_t preemptions = 0;
  // This step's prefill under its StepTimeLimit: the time its prefill chunks may still take
  // (infinite: no limit), the cost model, and whether a prefill chunk is in the step yet.
  double prefill_ms_left = std::numeric_limits<double>::infinity();
  StepCost step_cost;
  bool prefilled = false;
  bool prefill_waits = false;  // a running sequence's prefill got no time in this step

  // Frees the victim's pages and queues it first for recompute. Returns the tokens it had in
  // this step's plan, now given back to the budget.
  int32_t preempt(Sequence* victim) {
    running.pop_back();
    kv.free(victim->kv);
    victim->num_computed = 0;
    victim->status = SeqStatus::kWaiting;
    waiting.push_front(victim);
    ++preemptions;
    const auto it = std::find_if(scheduled.begin(), scheduled.end(),
                                 [victim](const ScheduledSeq& s) { return s.seq == victim; });
    if (it == scheduled.end()) return 0;
    const int32_t refund = it->num_new_tokens;
    scheduled.erase(it);
    return refund;
  }

  // Starts this step's time limit once its decodes are scheduled (they come first): the
  // prefill gets what the decodes leave of max_ms.
  void start_prefill_limit(const StepTimeLimit& limit) {
    prefilled = false;
    prefill_waits = false;
    step_cost = limit.cost;
    prefill_ms_left = std::numeric_limits<double>::infinity();
    if (limit.max_ms <= 0 || (scheduled.empty() && !limit.without_decodes)) return;
    double decode_ms = step_cost.fixed_ms;
    for (const auto& [seq, num_new_tokens] : scheduled) {
      // A decode's one query sees the sequence's num_computed earlier keys and itself.
      decode_ms += step_cost.ms(1, int64_t{seq->num_computed} + 1) - step_cost.fixed_ms;
    }
    prefill_ms_left = limit.max_ms - decode_ms;
  }

  // The most tokens a prefill chunk from position `start` on may take under the step's limit.
  int32_t prefill_cap(int32_t start) const {
    constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
    int32_t cap = kMax;
    if (std::isfinite(prefill_ms_left)) {
      const double left = std::max(0.0, prefill_ms_left);
      const double per_token = step_cost.per_token_ms, per_pair = step_cost.per_pair_ms;
      // Nothing left: only the minimum chunk, even where the fit holds tokens free (a fixed
      // cost alone can explain a few noisy steps). Else n tokens from `start` on cost
      // per_token n + per_pair (n start + n (n + 1) / 2): the largest n within `left` is the
      // positive root of that quadratic.
      double n = std::numeric_limits<double>::infinity();
      if (left <= 0) {
        n = 0;
      } else if (per_pair > 0) {
        const double linear = per_token + per_pair * (start + 0.5);
        n = (std::sqrt(linear * linear + 2 * per_pair * left) - linear) / per_pair;
      } else if (per_token > 0) {
        n = left / per_token;
      }
      // The epsilon keeps a chunk that fits exactly from losing a token to rounding.
      if (n < kMax) cap = static_cast<int32_t>(std::floor(n + 1e-9));
    }
    return prefilled ? cap : std::max(cap, config.min_prefill_chunk);
  }

  void charge_prefill(int32_t start, int32_t num_new_tokens) {
    prefilled = true;
    if (!std::isfinite(prefill_ms_left)) return;
    const int64_t n = num_new_tokens;
    prefill_ms_left -= step_cost.ms(n, n * start + n * (n + 1) / 2) - step_cost.fixed_ms;
  }

  // Schedules running sequences whose pending length is (or is not) one token. Returns whether
  // a sequence had to be preempted.
  bool schedule_running(bool decodes, int32_t& budget) {
    bool preempted = false;
    for (size_t i = 0; i < running.size() && budget > 0; ++i) {
      Sequence* seq = running[i];
      const int32_t num_pending = seq->num_pending();
      if (num_pending <= 0 || (num_pending == 1) != decodes) continue;
      const int32_t num_new_tokens =
          std::min({num_pending, budget, decodes ? num_pending : prefill_cap(seq->num_computed)});
      if (num_new_tokens <= 0) {  // no time left for this prefill in this step
        prefill_waits = prefill_waits || !decodes;
        continue;
      }
      const int32_t num_tokens = seq->num_computed + num_new_tokens;
      bool was_preempted = false;
      while (!kv.can_allocate(kv.num_pages_needed(seq->kv, num_tokens))) {
        Sequence* victim = running.back();
        budget += preempt(victim);
        preempted = true;
        if (victim == seq) {
          was_preempted = true;
          break;
        }
      }
      if (was_preempted) break;  // it was the last running sequence
      kv.allocate_slots(seq->kv, num_tokens);
      if (!decodes) charge_prefill(seq->num_computed, num_new_tokens);
      scheduled.push_back({seq, num_new_tokens});
      budget -= num_new_tokens;
    }
    return preempted;
  }

  // Admits the first waiting sequence if its next chunk fits; it never preempts anyone.
  bool try_admit(Sequence& seq, int32_t& budget) {
    const int32_t page_size = config.page_size;
    const bool can_lookup = config.enable_prefix_cache && seq.request.use_prefix_cache;
    CachedPrefix hit = can_lookup ? kv.find_cached(seq.kv, seq.token_span()) : CachedPrefix{};
    // The chunk this step computes after `num_hit_tokens` served by the cache.
    const auto chunk = [&](int32_t num_hit_tokens) {
      return std::min({seq.num_tokens() - num_hit_tokens, budget, prefill_cap(num_hit_tokens)});
    };
    const auto pages_needed = [&](const CachedPrefix& prefix) {
      const int32_t num_hit_tokens = prefix.num_tokens(page_size);
      return kv.num_pages_needed(seq.kv, num_hit_tokens + chunk(num_hit_tokens), &prefix);
    };
    // The held copy source is one page more than the request keeps: a request that fits the pool
    // only without it computes those tokens instead, or it would wait for good.
    if (hit.partial.num_tokens > 0 && !kv.can_allocate(pages_needed(hit))) hit.partial = {};
    if (!kv.can_allocate(pages_needed(hit))) return false;
    const int32_t num_hit_tokens = hit.num_tokens(page_size);
    const int32_t num_new_tokens = chunk(num_hit_tokens);
    if (num_new_tokens <= 0) return false;  // the step's time is spent: it waits, unchanged
    const int32_t num_tokens = num_hit_tokens + num_new_tokens;

    kv.allocate_slots(seq.kv, num_tokens, /*num_lookahead=*/0, &hit);
    seq.num_computed = num_hit_tokens;
    seq.num_cached_tokens = num_hit_tokens;
    seq.status = SeqStatus::kRunning;
    running.push_back(&seq);
    // Admission never preempts, so this chunk is final and its pages can be shared at once.
    kv.commit(seq.kv, seq.token_span(), num_tokens);
    charge_prefill(num_hit_tokens, num_new_tokens);
    scheduled.push_back({&seq, num_new_tokens});
    budget -= num_new_tokens;
    return true;
  }

  void finish(Sequence& seq, FinishReason reason) {
    seq.status = SeqStatus::kFinished;
    seq.finish_reason = reason;
    kv.free(seq.kv);
  }

  FinishReason finish_reason_after(const Sequence& seq, int32_t token) const {
    const SamplingParams& sampling = seq.request.sampling;
    if (!sampling.ignore_eos && contains(config.eos_token_ids, token)) return FinishReason::kStop;
    if (contains(sampling.stop_token_ids, token)) return FinishReason::kStop;
    if (seq.num_outputs() >= sampling.max_tokens) return FinishReason::kLength;
    if (seq.num_tokens() >= config.max_model_len) return FinishReason::kLength;
    return FinishReason::kNone;
  }

  void emit(StepPlan& plan) const;
  // Forgets the last num_tokens tokens the sequence computed; those that were outputs leave it.
  void roll_back(Sequence& seq, int32_t num_tokens);
  // Applies a checked step to the last plan's sequences: rollbacks, then tokens_of(b), the
  // tokens of sequence b, appended where all its tokens are computed; finishes and window
  // releases; the step's copies end.
  template <typename TokensOf>
  std::vector<SeqUpdate> apply_step(TokensOf tokens_of,
                                    const std::vector<int32_t>& num_rolled_back);
  // Throws unless `plan` is the last schedule()'s (its sequences, in order).
  void check_last_plan(const StepPlan& plan, const char* caller) const;
};

void Scheduler::State::emit(StepPlan& plan) const {
  const int32_t page_size = config.page_size;
  const int page_shift = std::countr_zero(static_cast<uint32_t>(page_size));
  size_t num_tokens = 0;
  size_t num_kv_pages = 0;
  size_t num_logits = 0;
  for (const auto& [seq, num_new_tokens] : scheduled) {
    num_tokens += num_new_tokens;
    num_kv_pages += seq->kv.pages().size();
    num_logits += seq->request.want_prompt_logits ? num_new_tokens : 1;
  }
  const size_t num_seqs = scheduled.size();
  plan.page_size = page_size;
  plan.null_page = kv.pool().null_page();
  plan.kv_copies = kv.pending_copies();
  plan.token_ids.reserve(num_tokens);
  plan.positions.reserve(num_tokens);
  plan.slot_mapping.reserve(num_tokens);
  plan.q_indptr.reserve(num_seqs + 1);
  plan.kv_indptr.reserve(num_seqs + 1);
  plan.kv_page_indices.reserve(num_kv_pages);
  plan.kv_last_page_len.reserve(num_seqs);
  plan.logits_rows.reserve(num_logits);
  plan.logits_indptr.reserve(num_seqs + 1);
  plan.request_ids.reserve(num_seqs);
  plan.samples.reserve(num_seqs);
  plan.q_indptr.push_back(0);
  plan.kv_indptr.push_back(0);
  plan.logits_indptr.push_back(0);

  for (const auto& [seq, num_new_tokens] : scheduled) {
    const int32_t begin = seq->num_computed;
    const int32_t end = begin + num_new_tokens;
    const int32_t first_row = plan.num_tokens();
    const std::vector<int32_t>& tokens = seq->tokens.all;
    const std::vector<int32_t>& pages = seq->kv.pages();
    for (int32_t position = begin; position < end; ++position) {
      plan.token_ids.push_back(tokens[position]);
      plan.positions.push_back(position);
      // page_size is a power of two: a shift and a mask, not a division, per token.
      plan.slot_mapping.push_back((pages[position >> page_shift] << page_shift) |
                                  (position & (page_size - 1)));
    }
    const int32_t end_row = plan.num_tokens();
    plan.q_indptr.push_back(end_row);

    // The table covers the tokens after this step, not the sequence's lookahead slots.
    const int32_t num_pages = kv.num_pages_for(end);
    plan.kv_page_indices.insert(plan.kv_page_indices.end(), pages.begin(),
                                pages.begin() + num_pages);
    plan.kv_indptr.push_back(static_cast<int32_t>(plan.kv_page_indices.size()));
    plan.kv_last_page_len.push_back(end - (num_pages - 1) * page_size);

    const bool samples = end == seq->num_tokens() && seq->request.sampling.max_tokens > 0;
    if (seq->request.want_prompt_logits) {
      for (int32_t row = first_row; row < end_row; ++row) plan.logits_rows.push_back(row);
    } else if (samples) {
      plan.logits_rows.push_back(end_row - 1);
    }
    plan.logits_indptr.push_back(static_cast<int32_t>(plan.logits_rows.size()));
    plan.request_ids.push_back(seq->request.id);
    plan.samples.push_back(samples ? 1 : 0);
  }
}

Scheduler::Scheduler(SchedulerConfig config) : config_(std::move(config)) {
  // The KV cache manager (State::kv) checks the page size, the window and the page count.
  PAGEDLM_CHECK(config_.max_num_batched_tokens > 0,
                "SchedulerConfig.max_num_batched_tokens must be positive, got ",
                config_.max_num_batched_tokens);
  PAGEDLM_CHECK(config_.max_num_seqs > 0, "SchedulerConfig.max_num_seqs must be positive, got ",
                config_.max_num_seqs);
  PAGEDLM_CHECK(config_.max_model_len > 1, "SchedulerConfig.max_model_len must exceed 1, got ",
                config_.max_model_len);
  PAGEDLM_CHECK(config_.min_prefill_chunk > 0,
                "SchedulerConfig.min_prefill_chunk must be positive, got ",
                config_.min_prefill_chunk);
  state_ = std::make_unique<State>(config_);
}

Scheduler::~Scheduler() = default;

std::shared_ptr<const RequestTokens> Scheduler::add(Request request) {
  State& state = *state_;
  const int64_t id = request.id;
  const auto prompt_len = static_cast<int64_t>(request.prompt.size());
  const int32_t max_tokens = request.sampling.max_tokens;
  PAGEDLM_CHECK(prompt_len > 0, "request ", id, " has an empty prompt");
  PAGEDLM_CHECK(!state.sequences.contains(id), "request id ", id, " is already in use");
  PAGEDLM_CHECK(prompt_len < config_.max_model_len, "request ", id, " has a prompt of ", prompt_len,
                " tokens, but max_model_len is ", config_.max_model_len,
                " (prompt and output together)");
  PAGEDLM_CHECK(max_tokens >= 0, "request ", id, " has negative max_tokens ", max_tokens);
  const int64_t max_len = std::min<int64_t>(prompt_len + max_tokens, config_.max_model_len);
  const int32_t num_usable_pages = state.kv.num_usable_pages();
  const int64_t pool_tokens = static_cast<int64_t>(num_usable_pages) * config_.page_size;
  PAGEDLM_CHECK(max_len <= pool_tokens, "request ", id, " may reach ", max_len,
                " tokens, more than the whole KV pool holds (", num_usable_pages, " pages of ",
                config_.page_size, " = ", pool_tokens, " tokens)");

  auto seq = std::make_shared<Sequence>();
  seq->tokens.all = std::move(request.prompt);
  seq->tokens.all.reserve(max_len);
  seq->tokens.num_prompt = static_cast<int32_t>(prompt_len);
  request.prompt.clear();
  seq->kv = state.kv.new_seq(request.cache_salt);
  seq->request = std::move(request);
  std::shared_ptr<const RequestTokens> tokens(seq, &seq->tokens);
  state.waiting.push_back(seq.get());
  state.sequences.emplace(id, std::move(seq));
  return tokens;
}

bool Scheduler::cancel(int64_t request_id) {
  State& state = *state_;
  const auto it = state.sequences.find(request_id);
  if (it == state.sequences.end() || it->second->status == SeqStatus::kFinished) return false;
  Sequence* seq = it->second.get();
  if (seq->status == SeqStatus::kWaiting) {
    state.waiting.erase(std::find(state.waiting.begin(), state.waiting.end(), seq));
  } else {
    state.running.erase(std::find(state.running.begin(), state.running.end(), seq));
  }
  state.finish(*seq, FinishReason::kCancelled);
  // A sequence in a pending plan lives on until update() reports it.
  if (seq->in_flight == 0) state.sequences.erase(it);
  return true;
}

bool Scheduler::has_unfinished() const {
  return !state_->running.empty() || !state_->waiting.empty();
}

StepPlan Scheduler::schedule(const StepTimeLimit& limit) {
  State& state = *state_;
  state.scheduled.clear();
  state.kv.end_step();  // no copies pending unless the last plan never reached update()
  int32_t budget = config_.max_num_batched_tokens;
  bool preempted = state.schedule_running(/*decodes=*/true, budget);
  state.start_prefill_limit(limit);
  // Under a time limit, prefills already running leave half of the step's prefill time to the
  // waiting sequences, and the first of those gets its minimum chunk as the first running one
  // does, so one that arrives during a long prompt's prefill starts at the next step instead
  // of after the whole prompt (which would take all the time, step after step). Such a step
  // may run past the limit by one minimum chunk. Not while a running prefill already waits for
  // time: admitting more would only add sequences that hold pages and wait too.
  const bool share_with_waiting = !state.waiting.empty() && std::isfinite(state.prefill_ms_left);
  const double held_for_waiting =
      share_with_waiting ? std::max(0.0, state.prefill_ms_left) / 2 : 0.0;
  state.prefill_ms_left -= held_for_waiting;
  preempted |= state.schedule_running(/*decodes=*/false, budget);
  if (share_with_waiting && !state.prefill_waits) {
    state.prefill_ms_left = std::max(0.0, state.prefill_ms_left) + held_for_waiting;
    state.prefilled = false;
  }
  // Running sequences can be preempted until both passes are done; only then is their chunk
  // final, and only then may others find its pages.
  // A pending token (run_ahead) is not committed until its value is known: the next
  // schedule() commits it with the rest.
  for (const auto& [seq, num_new_tokens] : state.scheduled) {
    const int32_t end = seq->num_computed + num_new_tokens;
    state.kv.commit(seq->kv, seq->token_span(),
                    seq->pending_at >= 0 ? std::min(end, seq->pending_at) : end);
  }
  // Admitting right after a preemption would only thrash: the pool just proved too small.
  if (!preempted) {
    while (!state.waiting.empty() && budget > 0 &&
           static_cast<int32_t>(state.running.size()) < config_.max_num_seqs &&
           state.try_admit(*state.waiting.front(), budget)) {
      state.waiting.pop_front();
    }
  }

  StepPlan plan;
  state.emit(plan);
  for (const auto& [seq, num_new_tokens] : state.scheduled) {
    seq->num_computed += num_new_tokens;
    ++seq->in_flight;
  }
  return plan;
}

void Scheduler::State::check_last_plan(const StepPlan& plan, const char* caller) const {
  const size_t num_seqs = scheduled.size();
  PAGEDLM_CHECK(plan.request_ids.size() == num_seqs, caller,
                "() needs the plan of the last schedule(): it has ", plan.request_ids.size(),
                " sequences, the last plan had ", num_seqs);
  for (size_t b = 0; b < num_seqs; ++b) {
    const int64_t expected_id = scheduled[b].seq->request.id;
    PAGEDLM_CHECK(plan.request_ids[b] == expected_id, caller, "() got a plan whose sequence ", b,
                  " is request ", plan.request_ids[b], ", expected ", expected_id);
  }
}

void Scheduler::State::roll_back(Sequence& seq, int32_t num_tokens) {
  kv.rollback(seq.kv, seq.token_span().first(seq.num_computed - num_tokens), num_tokens);
  seq.num_computed -= num_tokens;
  std::vector<int32_t>& tokens = seq.tokens.all;
  tokens.resize(std::max(seq.tokens.num_prompt, seq.num_computed));
}

template <typename TokensOf>
std::vector<SeqUpdate> Scheduler::State::apply_step(TokensOf tokens_of,
                                                    const std::vector<int32_t>& num_rolled_back) {
  const size_t num_seqs = scheduled.size();
  std::vector<SeqUpdate> updates;
  updates.reserve(num_seqs);
  finished.clear();
  for (size_t b = 0; b < num_seqs; ++b) {
    Sequence& seq = *scheduled[b].seq;
    --seq.in_flight;
    SeqUpdate& update = updates.emplace_back();
    update.request_id = seq.request.id;
    if (seq.status == SeqStatus::kFinished) {  // cancelled, or stopped (resolve), as it ran
      update.reported = seq.finish_reported;
      finished.push_back(&seq);
    } else {
      if (!num_rolled_back.empty() && num_rolled_back[b] > 0) roll_back(seq, num_rolled_back[b]);
      if (seq.num_pending() == 0) {
        FinishReason reason = FinishReason::kLength;  // max_tokens == 0: the prompt was all
        if (seq.request.sampling.max_tokens > 0) {
          reason = FinishReason::kNone;
          for (const int32_t token : tokens_of(b)) {
            update.token = token;
            ++update.num_appended;
            seq.tokens.all.push_back(token);
            reason = finish_reason_after(seq, token);
            if (reason != FinishReason::kNone) break;  // what follows a stop is dropped
          }
        }
        if (reason != FinishReason::kNone) {
          finish(seq, reason);
          finished.push_back(&seq);
        }
      }
    }
    // After the step ran: its queries were the last to read what is released here.
    if (seq.status == SeqStatus::kRunning) kv.release_behind_window(seq.kv, seq.num_computed);
    update.finished = seq.status == SeqStatus::kFinished;
    update.reason = seq.finish_reason;
  }
  if (!finished.empty()) {
    std::erase_if(running, [](const Sequence* seq) { return seq->status == SeqStatus::kFinished; });
    for (const Sequence* seq : finished) {
      if (seq->in_flight == 0) sequences.erase(seq->request.id);
    }
  }
  scheduled.clear();
  // The step has run its copies: their sources may be reused now.
  kv.end_step();
  return updates;
}

std::vector<SeqUpdate> Scheduler::update(const StepPlan& plan,
                                         const std::vector<int32_t>& sampled) {
  State& state = *state_;
  const size_t num_seqs = state.scheduled.size();
  PAGEDLM_CHECK(sampled.size() >= num_seqs, "update() got ", sampled.size(),
                " sampled tokens for a plan of ", num_seqs, " sequences");
  // Checked up front so that a wrong plan changes nothing.
  state.check_last_plan(plan, "update");
  return state.apply_step([&sampled](size_t b) { return std::span<const int32_t>(&sampled[b], 1); },
                          {});
}

std::vector<SeqUpdate> Scheduler::update(const StepPlan& plan, const StepTokens& step) {
  State& state = *state_;
  const size_t num_seqs = state.scheduled.size();
  // Everything is checked up front so that wrong input changes nothing.
  state.check_last_plan(plan, "update");
  PAGEDLM_CHECK(step.token_indptr.size() == num_seqs + 1 && step.token_indptr[0] == 0,
                "update() needs token_indptr of ", num_seqs + 1, " entries from 0, got ",
                step.token_indptr.size());
  PAGEDLM_CHECK(step.num_rolled_back.empty() || step.num_rolled_back.size() == num_seqs,
                "update() got ", step.num_rolled_back.size(), " rollback counts for ", num_seqs,
                " sequences");
  for (size_t b = 0; b < num_seqs; ++b) {
    const Sequence& seq = *state.scheduled[b].seq;
    const int64_t id = seq.request.id;
    const int32_t num_new = step.token_indptr[b + 1] - step.token_indptr[b];
    PAGEDLM_CHECK(num_new >= 0 && step.token_indptr[b + 1] <= std::ssize(step.tokens),
                  "update() got token_indptr out of order or past its ", step.tokens.size(),
                  " tokens at sequence ", b);
    if (seq.status == SeqStatus::kFinished) continue;  // cancelled while the step ran
    const int32_t rolled_back = step.num_rolled_back.empty() ? 0 : step.num_rolled_back[b];
    PAGEDLM_CHECK(rolled_back >= 0 && rolled_back <= state.scheduled[b].num_new_tokens,
                  "update() rolls back ", rolled_back, " tokens of request ", id, ", whose step ",
                  "computed ", state.scheduled[b].num_new_tokens);
    PAGEDLM_CHECK(state.kv.can_rollback(seq.kv, rolled_back), "update() cannot roll back ",
                  rolled_back, " tokens of request ", id,
                  ": they share a page with another sequence");
    // The sequence's pending tokens after the rollback: outputs rolled back leave the sequence.
    const int32_t num_computed = seq.num_computed - rolled_back;
    const int32_t num_tokens =
        rolled_back > 0 ? std::max(seq.tokens.num_prompt, num_computed) : seq.num_tokens();
    const bool samples = num_tokens == num_computed && seq.request.sampling.max_tokens > 0;
    PAGEDLM_CHECK(samples || num_new == 0, "update() got ", num_new, " tokens for request ", id,
                  ", which still has ", num_tokens - num_computed, " tokens to compute");
    PAGEDLM_CHECK(!samples || num_new > 0, "update() got no token for request ", id,
                  ", whose tokens are all computed: it would wait for good");
  }
  return state.apply_step(
      [&step](size_t b) {
        return std::span<const int32_t>(step.tokens)
            .subspan(step.token_indptr[b], step.token_indptr[b + 1] - step.token_indptr[b]);
      },
      step.num_rolled_back);
}

void Scheduler::run_ahead(const StepPlan& plan) {
  State& state = *state_;
  state.check_last_plan(plan, "run_ahead");
  PAGEDLM_CHECK(state.ahead.empty(), "run_ahead() while another plan runs ahead");
  for (const auto& [seq, num_new_tokens] : state.scheduled) {
    if (seq->status != SeqStatus::kRunning || seq->num_pending() != 0 ||
        seq->request.sampling.max_tokens <= 0) {
      continue;  // cancelled, or mid-prefill: nothing to sample
    }
    // The token to come ends the sequence by length whatever it is: nothing to run ahead for.
    if (seq->num_outputs() + 1 >= seq->request.sampling.max_tokens ||
        seq->num_tokens() + 1 >= config_.max_model_len) {
      continue;
    }
    seq->pending_at = seq->num_tokens();
    seq->tokens.all.push_back(kPendingToken);
  }
  state.ahead = std::move(state.scheduled);
  state.scheduled.clear();
}

std::vector<SeqUpdate> Scheduler::resolve(const StepPlan& plan,
                                          const std::vector<int32_t>& sampled) {
  State& state = *state_;
  const size_t num_seqs = state.ahead.size();
  PAGEDLM_CHECK(
      plan.request_ids.size() == num_seqs && sampled.size() >= num_seqs,
      "resolve() needs the plan given to run_ahead() and its tokens: ", plan.request_ids.size(),
      " sequences and ", sampled.size(), " tokens for ", num_seqs);
  for (size_t b = 0; b < num_seqs; ++b) {
    PAGEDLM_CHECK(plan.request_ids[b] == state.ahead[b].seq->request.id,
                  "resolve() got a plan whose sequence ", b, " is request ", plan.request_ids[b],
                  ", expected ", state.ahead[b].seq->request.id);
  }
  std::vector<SeqUpdate> updates;
  updates.reserve(num_seqs);
  for (size_t b = 0; b < num_seqs; ++b) {
    Sequence& seq = *state.ahead[b].seq;
    --seq.in_flight;
    SeqUpdate& update = updates.emplace_back();
    update.request_id = seq.request.id;
    const int32_t pending_at = seq.pending_at;
    seq.pending_at = -1;
    FinishReason reason = FinishReason::kNone;
    if (seq.status == SeqStatus::kFinished) {  // cancelled while the step ran: no token
      if (pending_at >= 0) seq.tokens.all.resize(pending_at);
    } else if (seq.status == SeqStatus::kRunning && seq.num_pending() == 0 &&
               seq.request.sampling.max_tokens <= 0) {
      reason = FinishReason::kLength;  // max_tokens == 0: the prompt was all
    } else if (plan.samples[b]) {
      // The pending token's place (a sequence preempted since keeps it for its recompute), or
      // the end of a sequence the length stops whatever its token.
      const int32_t token = sampled[b];
      PAGEDLM_CHECK(token >= 0, "resolve() got no token for request ", seq.request.id);
      if (pending_at >= 0) {
        // Tokens after it exist only as pending rows of the next plan: the sequence reads as if
        // this token were its last until then.
        seq.tokens.all[pending_at] = token;
      } else {
        seq.tokens.all.push_back(token);
      }
      update.token = token;
      update.num_appended = 1;
      reason = state.finish_reason_after(seq, token);
    }
    if (reason != FinishReason::kNone) {
      if (seq.status == SeqStatus::kWaiting) {
        state.waiting.erase(std::find(state.waiting.begin(), state.waiting.end(), &seq));
      } else {
        state.running.erase(std::find(state.running.begin(), state.running.end(), &seq));
      }
      // Its pages go back now; the next step, still running, wrote its last slot, which no
      // one finds (that position was never committed) and which later steps overwrite only
      // after it, in stream order.
      state.finish(seq, reason);
      seq.finish_reported = true;
    }
    // The next step, planned, reads keys from one position lower than the next query after it;
    // pages released for that query go back to the pool, and a later step writes them only after
    // the next one has run (stream order).
    if (seq.status == SeqStatus::kRunning) state.kv.release_behind_window(seq.kv, seq.num_computed);
    update.finished = seq.status == SeqStatus::kFinished;
    update.reason = seq.finish_reason;
    if (update.finished && seq.in_flight == 0) state.sequences.erase(seq.request.id);
  }
  state.ahead.clear();
  return updates;
}

std::vector<SeqUpdate> Scheduler::abandon(const StepPlan& plan) {
  State& state = *state_;
  state.check_last_plan(plan, "abandon");
  std::vector<SeqUpdate> updates;
  updates.reserve(state.scheduled.size());
  for (const auto& [seq, num_new_tokens] : state.scheduled) {
    --seq->in_flight;
    if (seq->status != SeqStatus::kFinished) {  // else cancelled while the step ran
      state.running.erase(std::find(state.running.begin(), state.running.end(), seq));
      state.finish(*seq, FinishReason::kCancelled);
    }
    updates.push_back(
        {.request_id = seq->request.id, .finished = true, .reason = seq->finish_reason});
    state.sequences.erase(seq->request.id);
  }
  // Every slot the step was to write (its copies' destinations among them) lies in a page of
  // the plan's sequences, all of which have just given their pages back.
  for (const int32_t slot : plan.slot_mapping) state.kv.forget(slot / config_.page_size);
  for (size_t i = 1; i < plan.kv_copies.size(); i += 3) state.kv.forget(plan.kv_copies[i]);
  state.scheduled.clear();
  state.kv.end_step();
  return updates;
}

SchedulerStats Scheduler::stats() const {
  const State& state = *state_;
  SchedulerStats stats;
  stats.num_running = static_cast<int32_t>(state.running.size());
  stats.num_waiting = static_cast<int32_t>(state.waiting.size());
  const BlockPool& pool = state.kv.pool();
  stats.pages_total = pool.num_pages();
  stats.pages_reserved = pool.num_reserved();
  stats.pages_used = pool.num_used();
  stats.pages_free = pool.num_free();
  stats.pages_cached = pool.num_cached();
  const KvCacheStats& kv_stats = state.kv.stats();
  stats.prefix_query_tokens = kv_stats.prefix_query_tokens;
  stats.prefix_hit_tokens = kv_stats.prefix_hit_tokens;
  stats.prefix_partial_hits = kv_stats.prefix_partial_hits;
  stats.prefix_partial_hit_tokens = kv_stats.prefix_partial_hit_tokens;
  stats.preemptions = state.preemptions;
  return stats;
}

std::vector<SequenceView> Scheduler::sequence_map() const {
  const State& state = *state_;
  std::vector<SequenceView> views;
  views.reserve(state.running.size());
  for (const Sequence* seq : state.running) {
    SequenceView& view = views.emplace_back();
    view.request_id = seq->request.id;
    view.num_tokens = seq->num_tokens();
    view.num_computed = seq->num_computed;
    view.num_cached_tokens = seq->num_cached_tokens;
    view.pages = seq->kv.pages();
    std::fill_n(view.pages.begin(), seq->kv.num_released_pages(), SequenceView::kReleasedPage);
    view.page_shared.reserve(view.pages.size());
    view.page_ref_counts.reserve(view.pages.size());
    for (const int32_t page : view.pages) {
      const int32_t refs = page == SequenceView::kReleasedPage ? 0 : state.kv.num_holders(page);
      view.page_shared.push_back(refs > 1 ? 1 : 0);
      view.page_ref_counts.push_back(refs);
    }
    view.copy_page_index = seq->kv.copy_page_index();
    view.copy_src_page = seq->kv.copy_src_page();
    view.num_copied_tokens = seq->kv.num_copied_tokens();
  }
  return views;
}

std::vector<CachedPageView> Scheduler::cached_pages(int32_t max_pages) const {
  return state_->kv.cached_pages(max_pages);
}

const KvCacheManager& Scheduler::kv_cache() const { return state_->kv; }

std::vector<int32_t> Scheduler::output_tokens(int64_t request_id) const {
  const auto it = state_->sequences.find(request_id);
  if (it == state_->sequences.end()) return {};
  const std::span<const int32_t> outputs = it->second->tokens.outputs();
  return {outputs.begin(), outputs.end()};
}

int32_t Scheduler::num_cached_tokens(int64_t request_id) const {
  const auto it = state_->sequences.find(request_id);
  return it == state_->sequences.end() ? 0 : it->second->num_cached_tokens;
}

}  // namespace pagedlm
