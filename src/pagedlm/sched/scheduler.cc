#include "pagedlm/sched/scheduler.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "pagedlm/core/error.h"

namespace pagedlm {

enum class SeqStatus : uint8_t { kWaiting, kRunning, kFinished };

struct Sequence {
  Request request;
  std::vector<int32_t> tokens;  // prompt, then the outputs
  int32_t num_prompt = 0;
  int32_t num_computed = 0;  // tokens whose K/V are written or in the plan being run
  int32_t num_cached_tokens = 0;
  // The admission's partial-page hit: pages[copy_page_index] got its first num_copied_tokens
  // slots from copy_src_page (-1: none). For inspection only.
  int32_t copy_page_index = -1;
  int32_t copy_src_page = -1;
  int32_t num_copied_tokens = 0;
  std::vector<int32_t> pages;
  // Leading entries of `pages` released behind the window: they point to the null page.
  int32_t num_released_pages = 0;
  // Hashes of the sequence's first full pages. Tokens never change once a page is full, so they
  // survive preemption and serve both lookups and registration.
  std::vector<BlockHash> page_hashes;
  BlockHash extra_key;
  SeqStatus status = SeqStatus::kWaiting;
  FinishReason finish_reason = FinishReason::kNone;
  bool in_flight = false;  // in the plan that update() has not seen yet

  int32_t num_tokens() const { return static_cast<int32_t>(tokens.size()); }
  int32_t num_outputs() const { return num_tokens() - num_prompt; }
  int32_t num_pending() const { return num_tokens() - num_computed; }
};

namespace {

struct ScheduledSeq {
  Sequence* seq;
  int32_t num_new_tokens;
};

int32_t ceil_div(int32_t a, int32_t b) { return (a + b - 1) / b; }

bool contains(const std::vector<int32_t>& values, int32_t value) {
  return std::find(values.begin(), values.end(), value) != values.end();
}

}  // namespace

struct Scheduler::State {
  explicit State(const SchedulerConfig& config)
      : config(config),
        pool(config.num_pages, /*reserve_null_page=*/config.window > 0),
        cache(&pool, config.page_size) {}

  const SchedulerConfig& config;
  BlockPool pool;
  PrefixCache cache;
  std::unordered_map<int64_t, std::unique_ptr<Sequence>> sequences;
  std::deque<Sequence*> waiting;
  std::vector<Sequence*> running;       // in admission order: preemption takes the back
  std::vector<ScheduledSeq> scheduled;  // the last plan's sequences, in plan order
  std::vector<int32_t> hit_pages;       // scratch of admission
  std::vector<Sequence*> finished;      // scratch of update
  // The plan's partial-page copies, (src, dst, tokens) triples. Each source page is held (one
  // more reference) until update() has seen the step, so that no allocation of the same
  // schedule() reuses it before the step has copied from it.
  std::vector<int32_t> kv_copies;
  std::vector<int32_t> copy_holds;
  std::vector<int32_t> copy_dsts;  // written by this step's copies: no source for another one
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;
  int64_t prefix_partial_hits = 0;
  int64_t prefix_partial_hit_tokens = 0;
  int64_t preemptions = 0;
  // This step's prefill under its StepTimeLimit: the time its prefill chunks may still take
  // (infinite: no limit), the cost model, and whether a prefill chunk is in the step yet.
  double prefill_ms_left = std::numeric_limits<double>::infinity();
  StepCost step_cost;
  bool prefilled = false;
  bool prefill_waits = false;  // a running sequence's prefill got no time in this step

  const BlockHash& page_hash(Sequence& seq, int32_t page_index) {
    const int32_t page_size = config.page_size;
    while (static_cast<int32_t>(seq.page_hashes.size()) <= page_index) {
      const int32_t index = static_cast<int32_t>(seq.page_hashes.size());
      const BlockHash& parent = index == 0 ? PrefixCache::kRootHash : seq.page_hashes.back();
      seq.page_hashes.push_back(
          PrefixCache::page_hash(parent, seq.tokens.data() + static_cast<size_t>(index) * page_size,
                                 page_size, seq.extra_key));
    }
    return seq.page_hashes[page_index];
  }

  const BlockHash& parent_hash(const Sequence& seq, int32_t page_index) const {
    return page_index == 0 ? PrefixCache::kRootHash : seq.page_hashes[page_index - 1];
  }

  // Pages the sequence still needs to hold `num_tokens` tokens.
  int32_t num_missing_pages(const Sequence& seq, int32_t num_tokens) const {
    return std::max(
        0, ceil_div(num_tokens, config.page_size) - static_cast<int32_t>(seq.pages.size()));
  }

  void allocate_pages(Sequence& seq, int32_t num_tokens) {
    for (int32_t i = num_missing_pages(seq, num_tokens); i > 0; --i) {
      seq.pages.push_back(pool.allocate());
    }
  }

  // Tail first, so the LRU free list evicts a sequence's tail before the prefix others share.
  // Entries released behind the window were given back already.
  void free_pages(Sequence& seq) {
    for (auto it = seq.pages.rbegin(); it != seq.pages.rend() - seq.num_released_pages; ++it) {
      pool.release(*it);
    }
    seq.pages.clear();
    seq.num_released_pages = 0;
  }

  // Releases the pages whose keys no later query of the sequence can see. Its next query is at
  // num_computed (the first pending token: a prefill chunk's first query, or the sampled token)
  // and sees keys from num_computed - window + 1 on; every later query sees fewer. Oldest
  // first, so the LRU free list reuses them in that order; a full page keeps its hash (and
  // stays findable, as a finished sequence's pages do) and a shared one just loses a holder.
  void release_pages_behind_window(Sequence& seq) {
    if (config.window == 0) return;
    const int32_t lowest_visible = seq.num_computed - config.window + 1;
    const int32_t num_behind = std::max(0, lowest_visible) / config.page_size;
    for (; seq.num_released_pages < num_behind; ++seq.num_released_pages) {
      int32_t& page = seq.pages[seq.num_released_pages];
      pool.release(page);
      page = pool.null_page();
    }
  }

  // Makes the pages among tokens [begin, end) findable: full ones by hash, and the last one,
  // if the range ends inside it, for partial hits on its leading tokens. Called once those
  // tokens are in the plan, because every layer writes its new K/V before any attention (or
  // partial-hit copy) reads them.
  void register_pages(Sequence& seq, int32_t begin, int32_t end) {
    if (!config.enable_prefix_cache || end <= begin) return;
    const int32_t page_size = config.page_size;
    for (int32_t index = begin / page_size; index < end / page_size; ++index) {
      const int32_t page = seq.pages[index];
      if (pool.has_hash(page)) continue;  // served by the cache: already indexed
      const BlockHash& hash = page_hash(seq, index);
      cache.insert(page, hash, parent_hash(seq, index),
                   seq.tokens.data() + static_cast<size_t>(index) * page_size, seq.extra_key);
    }
    if (end % page_size == 0) return;
    const int32_t index = end / page_size;
    if (index > 0) page_hash(seq, index - 1);  // the parent of the partly filled page
    cache.record(seq.pages[index], parent_hash(seq, index),
                 seq.tokens.data() + static_cast<size_t>(index) * page_size,
                 end - index * page_size, seq.extra_key);
  }

  // Gives back the holds on the last plan's copy sources.
  void release_copy_holds() {
    for (const int32_t page : copy_holds) pool.release(page);
    copy_holds.clear();
    copy_dsts.clear();
    kv_copies.clear();
  }

  // Frees the victim's pages and queues it first for recompute. Returns the tokens it had in
  // this step's plan, now given back to the budget.
  int32_t preempt(Sequence* victim) {
    running.pop_back();
    free_pages(*victim);
    victim->num_computed = 0;
    victim->copy_page_index = victim->copy_src_page = -1;
    victim->num_copied_tokens = 0;
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
      while (!pool.can_allocate(num_missing_pages(*seq, num_tokens))) {
        Sequence* victim = running.back();
        budget += preempt(victim);
        preempted = true;
        if (victim == seq) {
          was_preempted = true;
          break;
        }
      }
      if (was_preempted) break;  // it was the last running sequence
      allocate_pages(*seq, num_tokens);
      if (!decodes) charge_prefill(seq->num_computed, num_new_tokens);
      scheduled.push_back({seq, num_new_tokens});
      budget -= num_new_tokens;
    }
    return preempted;
  }

  // Admits the first waiting sequence if its next chunk fits; it never preempts anyone.
  bool try_admit(Sequence& seq, int32_t& budget) {
    const int32_t page_size = config.page_size;
    hit_pages.clear();
    const bool can_lookup = config.enable_prefix_cache && seq.request.use_prefix_cache;
    if (can_lookup) {
      // At least one token stays to compute: its logits extend the sequence.
      const int32_t max_hit_pages = (seq.num_tokens() - 1) / page_size;
      for (int32_t index = 0; index < max_hit_pages; ++index) {
        // page_hash() may grow page_hashes, so it runs before parent_hash() takes a reference.
        const BlockHash& hash = page_hash(seq, index);
        const int32_t page =
            cache.find(hash, parent_hash(seq, index),
                       seq.tokens.data() + static_cast<size_t>(index) * page_size, seq.extra_key);
        if (page < 0) break;
        hit_pages.push_back(page);
      }
    }
    const auto num_full_hits = static_cast<int32_t>(hit_pages.size());
    // Where the whole-page hits end, the request's next tokens may still equal the leading
    // tokens of a page someone else filled: those are copied into the request's own fresh page
    // rather than computed. The last token stays to compute, as above.
    PartialMatch partial;
    if (can_lookup) {
      const int32_t begin = num_full_hits * page_size;
      const int32_t max_tokens = std::min(page_size - 1, seq.num_tokens() - 1 - begin);
      if (num_full_hits > 0) page_hash(seq, num_full_hits - 1);  // the parent (already hashed)
      partial = cache.find_partial(parent_hash(seq, num_full_hits), seq.tokens.data() + begin,
                                   max_tokens, seq.extra_key, copy_dsts);
    }
    // Hits on free pages revive them, so they no longer count as allocatable; so does holding a
    // free copy source through the step.
    const auto num_free_hits = static_cast<int32_t>(
        std::count_if(hit_pages.begin(), hit_pages.end(),
                      [this](int32_t page) { return pool.ref_count(page) == 0; }));
    // The chunk this step computes after `num_hit_tokens` served by the cache.
    const auto chunk = [&](int32_t num_hit_tokens) {
      return std::min({seq.num_tokens() - num_hit_tokens, budget, prefill_cap(num_hit_tokens)});
    };
    const auto pages_needed = [&](const PartialMatch& hit) {
      const int32_t num_hit_tokens = num_full_hits * page_size + hit.num_tokens;
      const int32_t num_tokens = num_hit_tokens + chunk(num_hit_tokens);
      const bool holds_free_page = hit.num_tokens > 0 && pool.ref_count(hit.page) == 0;
      return ceil_div(num_tokens, page_size) - num_full_hits + num_free_hits +
             (holds_free_page ? 1 : 0);
    };
    // The held source is one page more than the request keeps: a request that fits the pool
    // only without it computes those tokens instead, or it would wait for good.
    if (partial.num_tokens > 0 && !pool.can_allocate(pages_needed(partial))) partial = {};
    if (!pool.can_allocate(pages_needed(partial))) return false;
    const int32_t num_hit_tokens = num_full_hits * page_size + partial.num_tokens;
    const int32_t num_new_tokens = chunk(num_hit_tokens);
    if (num_new_tokens <= 0) return false;  // the step's time is spent: it waits, unchanged
    const int32_t num_tokens = num_hit_tokens + num_new_tokens;

    for (const int32_t page : hit_pages) {
      pool.acquire(page);
      seq.pages.push_back(page);
    }
    if (partial.num_tokens > 0) {
      pool.acquire(partial.page);  // before allocate_pages, which must not hand it out
      copy_holds.push_back(partial.page);
    }
    allocate_pages(seq, num_tokens);
    if (partial.num_tokens > 0) {
      const int32_t dst = seq.pages[num_full_hits];
      kv_copies.insert(kv_copies.end(), {partial.page, dst, partial.num_tokens});
      copy_dsts.push_back(dst);
      seq.copy_page_index = num_full_hits;
      seq.copy_src_page = partial.page;
      seq.num_copied_tokens = partial.num_tokens;
      ++prefix_partial_hits;
      prefix_partial_hit_tokens += partial.num_tokens;
    }
    if (can_lookup) {
      prefix_query_tokens += seq.num_tokens();
      prefix_hit_tokens += num_hit_tokens;
    }
    seq.num_computed = num_hit_tokens;
    seq.num_cached_tokens = num_hit_tokens;
    seq.status = SeqStatus::kRunning;
    running.push_back(&seq);
    // Admission never preempts, so this chunk is final and its pages can be shared at once.
    register_pages(seq, num_hit_tokens, num_tokens);
    charge_prefill(num_hit_tokens, num_new_tokens);
    scheduled.push_back({&seq, num_new_tokens});
    budget -= num_new_tokens;
    return true;
  }

  void finish(Sequence& seq, FinishReason reason) {
    seq.status = SeqStatus::kFinished;
    seq.finish_reason = reason;
    free_pages(seq);
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
  // Throws unless `plan` is the last schedule()'s (its sequences, in order).
  void check_last_plan(const StepPlan& plan, const char* caller) const;
};

void Scheduler::State::emit(StepPlan& plan) const {
  const int32_t page_size = config.page_size;
  size_t num_tokens = 0;
  size_t num_kv_pages = 0;
  size_t num_logits = 0;
  for (const auto& [seq, num_new_tokens] : scheduled) {
    num_tokens += num_new_tokens;
    num_kv_pages += seq->pages.size();
    num_logits += seq->request.want_prompt_logits ? num_new_tokens : 1;
  }
  const size_t num_seqs = scheduled.size();
  plan.page_size = page_size;
  plan.null_page = pool.null_page();
  plan.kv_copies = kv_copies;
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
    for (int32_t position = begin; position < end; ++position) {
      plan.token_ids.push_back(seq->tokens[position]);
      plan.positions.push_back(position);
      plan.slot_mapping.push_back(seq->pages[position / page_size] * page_size +
                                  position % page_size);
    }
    const int32_t end_row = plan.num_tokens();
    plan.q_indptr.push_back(end_row);

    plan.kv_page_indices.insert(plan.kv_page_indices.end(), seq->pages.begin(), seq->pages.end());
    plan.kv_indptr.push_back(static_cast<int32_t>(plan.kv_page_indices.size()));
    plan.kv_last_page_len.push_back(end -
                                    (static_cast<int32_t>(seq->pages.size()) - 1) * page_size);

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
  const int32_t page_size = config_.page_size;
  PAGEDLM_CHECK(page_size > 0 && (page_size & (page_size - 1)) == 0,
                "SchedulerConfig.page_size must be a power of two, got ", page_size);
  PAGEDLM_CHECK(config_.window >= 0, "SchedulerConfig.window must be >= 0, got ", config_.window);
  // With a window the last page is the null page; at least one other must be left to use.
  const int32_t min_pages = config_.window > 0 ? 2 : 1;
  PAGEDLM_CHECK(config_.num_pages >= min_pages, "SchedulerConfig.num_pages must be at least ",
                min_pages, config_.window > 0 ? " (one is the null page)" : "", ", got ",
                config_.num_pages);
  // Slots are int32 in the plan.
  PAGEDLM_CHECK(
      static_cast<int64_t>(config_.num_pages) * page_size <= std::numeric_limits<int32_t>::max(),
      "SchedulerConfig: ", config_.num_pages, " pages of ", page_size,
      " tokens overflow int32 slot indices");
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

void Scheduler::add(Request request) {
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
  const int32_t num_usable_pages = config_.num_pages - state.pool.num_reserved();
  const int64_t pool_tokens = static_cast<int64_t>(num_usable_pages) * config_.page_size;
  PAGEDLM_CHECK(max_len <= pool_tokens, "request ", id, " may reach ", max_len,
                " tokens, more than the whole KV pool holds (", num_usable_pages, " pages of ",
                config_.page_size, " = ", pool_tokens, " tokens)");

  auto seq = std::make_unique<Sequence>();
  seq->tokens = request.prompt;
  seq->tokens.reserve(max_len);
  seq->num_prompt = static_cast<int32_t>(prompt_len);
  if (config_.enable_prefix_cache) seq->extra_key = PrefixCache::extra_key(request.cache_salt);
  seq->request = std::move(request);
  state.waiting.push_back(seq.get());
  state.sequences.emplace(id, std::move(seq));
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
  // A sequence in the pending plan lives on until update() reports it.
  if (!seq->in_flight) state.sequences.erase(it);
  return true;
}

bool Scheduler::has_unfinished() const {
  return !state_->running.empty() || !state_->waiting.empty();
}

StepPlan Scheduler::schedule(const StepTimeLimit& limit) {
  State& state = *state_;
  state.scheduled.clear();
  state.release_copy_holds();  // none unless the last plan never reached update()
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
  for (const auto& [seq, num_new_tokens] : state.scheduled) {
    state.register_pages(*seq, seq->num_computed, seq->num_computed + num_new_tokens);
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
    seq->in_flight = true;
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

std::vector<SeqUpdate> Scheduler::update(const StepPlan& plan,
                                         const std::vector<int32_t>& sampled) {
  State& state = *state_;
  const size_t num_seqs = state.scheduled.size();
  PAGEDLM_CHECK(sampled.size() >= num_seqs, "update() got ", sampled.size(),
                " sampled tokens for a plan of ", num_seqs, " sequences");
  // Checked up front so that a wrong plan changes nothing.
  state.check_last_plan(plan, "update");
  std::vector<SeqUpdate> updates;
  updates.reserve(num_seqs);
  state.finished.clear();
  for (size_t b = 0; b < num_seqs; ++b) {
    Sequence& seq = *state.scheduled[b].seq;
    seq.in_flight = false;
    SeqUpdate& update = updates.emplace_back();
    update.request_id = seq.request.id;
    if (seq.status == SeqStatus::kFinished) {  // cancelled while the step ran
      state.finished.push_back(&seq);
    } else if (seq.num_pending() == 0) {
      FinishReason reason = FinishReason::kLength;  // max_tokens == 0: the prompt was all
      if (seq.request.sampling.max_tokens > 0) {
        update.token = sampled[b];
        seq.tokens.push_back(update.token);
        reason = state.finish_reason_after(seq, update.token);
      }
      if (reason != FinishReason::kNone) {
        state.finish(seq, reason);
        state.finished.push_back(&seq);
      }
    }
    // After the step ran: its queries were the last to read what is released here.
    if (seq.status == SeqStatus::kRunning) state.release_pages_behind_window(seq);
    update.finished = seq.status == SeqStatus::kFinished;
    update.reason = seq.finish_reason;
  }
  if (!state.finished.empty()) {
    std::erase_if(state.running,
                  [](const Sequence* seq) { return seq->status == SeqStatus::kFinished; });
    for (const Sequence* seq : state.finished) state.sequences.erase(seq->request.id);
  }
  state.scheduled.clear();
  // The step has run its copies: their sources may be reused now.
  state.release_copy_holds();
  return updates;
}

std::vector<SeqUpdate> Scheduler::abandon(const StepPlan& plan) {
  State& state = *state_;
  state.check_last_plan(plan, "abandon");
  std::vector<SeqUpdate> updates;
  updates.reserve(state.scheduled.size());
  for (const auto& [seq, num_new_tokens] : state.scheduled) {
    seq->in_flight = false;
    if (seq->status != SeqStatus::kFinished) {  // else cancelled while the step ran
      state.running.erase(std::find(state.running.begin(), state.running.end(), seq));
      state.finish(*seq, FinishReason::kCancelled);
    }
    updates.push_back({seq->request.id, -1, true, seq->finish_reason});
    state.sequences.erase(seq->request.id);
  }
  // Every slot the step was to write (its copies' destinations among them) lies in a page of
  // the plan's sequences, all of which have just given their pages back.
  for (const int32_t slot : plan.slot_mapping) state.pool.forget(slot / config_.page_size);
  for (size_t i = 1; i < plan.kv_copies.size(); i += 3) state.pool.forget(plan.kv_copies[i]);
  state.scheduled.clear();
  state.release_copy_holds();
  return updates;
}

SchedulerStats Scheduler::stats() const {
  const State& state = *state_;
  SchedulerStats stats;
  stats.num_running = static_cast<int32_t>(state.running.size());
  stats.num_waiting = static_cast<int32_t>(state.waiting.size());
  stats.pages_total = state.pool.num_pages();
  stats.pages_reserved = state.pool.num_reserved();
  stats.pages_used = state.pool.num_used();
  stats.pages_free = state.pool.num_free();
  stats.pages_cached = state.pool.num_cached();
  stats.prefix_query_tokens = state.prefix_query_tokens;
  stats.prefix_hit_tokens = state.prefix_hit_tokens;
  stats.prefix_partial_hits = state.prefix_partial_hits;
  stats.prefix_partial_hit_tokens = state.prefix_partial_hit_tokens;
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
    view.pages = seq->pages;
    std::fill_n(view.pages.begin(), seq->num_released_pages, SequenceView::kReleasedPage);
    view.page_shared.reserve(seq->pages.size());
    view.page_ref_counts.reserve(seq->pages.size());
    for (const int32_t page : view.pages) {
      // A copy source held through the step is no sequence's: it does not count as a holder.
      const int32_t refs = page == SequenceView::kReleasedPage
                               ? 0
                               : state.pool.ref_count(page) -
                                     static_cast<int32_t>(std::count(state.copy_holds.begin(),
                                                                     state.copy_holds.end(), page));
      view.page_shared.push_back(refs > 1 ? 1 : 0);
      view.page_ref_counts.push_back(refs);
    }
    view.copy_page_index = seq->copy_page_index;
    view.copy_src_page = seq->copy_src_page;
    view.num_copied_tokens = seq->num_copied_tokens;
  }
  return views;
}

std::vector<CachedPageView> Scheduler::cached_pages(int32_t max_pages) const {
  const State& state = *state_;
  std::vector<CachedPageView> views;
  for (const int32_t page : state.pool.free_pages_in_eviction_order()) {
    if (static_cast<int32_t>(views.size()) >= max_pages) break;
    const bool full = state.pool.has_hash(page);
    const int32_t num_tokens = full ? config_.page_size : state.cache.num_recorded(page);
    if (num_tokens > 0) views.push_back({page, num_tokens, full});
  }
  return views;
}

std::vector<int32_t> Scheduler::output_tokens(int64_t request_id) const {
  const auto it = state_->sequences.find(request_id);
  if (it == state_->sequences.end()) return {};
  const Sequence& seq = *it->second;
  return {seq.tokens.begin() + seq.num_prompt, seq.tokens.end()};
}

int32_t Scheduler::num_cached_tokens(int64_t request_id) const {
  const auto it = state_->sequences.find(request_id);
  return it == state_->sequences.end() ? 0 : it->second->num_cached_tokens;
}

}  // namespace pagedlm
