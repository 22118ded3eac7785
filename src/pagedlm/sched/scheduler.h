// Continuous-batching scheduler: FCFS admission under a token budget and a sequence limit,
// chunked prefill mixed with decode, preemption by recompute when pages run out. When every
// layer of the model slides, pages whose keys no later query can see go back to the pool.
// Host only: it never touches device memory; its output is a StepPlan. It holds policy (token
// budget, admission order, preemption, the step time limit) and reaches KV pages only through
// the KvCacheManager.
#pragma once

#include <cstdint>
#include <deque>
#include <memory>
#include <unordered_map>
#include <vector>

#include "pagedlm/kv/kv_cache_manager.h"
#include "pagedlm/sched/request.h"
#include "pagedlm/sched/step_cost.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

struct SchedulerConfig {
  int32_t page_size = 16;
  int32_t num_pages = 4096;  // pages of the KV cache, the null page included when there is one
  // The sliding window of every layer (ModelConfig::window_of_all_layers; 0: some layer sees all
  // keys). A query at position p sees keys p - window + 1 .. p, so once a sequence's next query
  // is at q, its pages wholly below q - window + 1 are never read again: after each step they
  // are released, their page-table entries pointing to the pool's null page (its last page,
  // reserved whenever window > 0).
  int32_t window = 0;
  int32_t max_num_batched_tokens = 8192;
  int32_t max_num_seqs = 256;
  int32_t max_model_len = 8192;  // prompt + output tokens of one sequence
  bool enable_prefix_cache = true;
  std::vector<int32_t> eos_token_ids;
  // Under a StepTimeLimit, the first prefill chunk of a step gets at least this many tokens
  // whatever the model predicts, so that a prompt always progresses.
  int32_t min_prefill_chunk = 32;
};

// Holds one step's prefill to a wall-time target. While any sequence decodes, each step is one
// token of its output, so a step that also prefills a long prompt whole delays every running
// stream by the prompt's whole prefill time. Under a limit, the step's prefill tokens are cut
// to what the cost model predicts fits max_ms beside the step's decodes (the first prefill
// chunk of the step keeps SchedulerConfig::min_prefill_chunk tokens). Outputs do not change:
// only how a prompt is split into chunks.
struct StepTimeLimit {
  double max_ms = 0;  // 0: no limit
  StepCost cost;
  // Also when no sequence decodes: every step stays short (a server stopping between steps).
  bool without_decodes = false;
};

// What a step produced, per sequence b of its plan (CSR, as the plan): the tokens to append,
// tokens[token_indptr[b] .. token_indptr[b+1]) (0..n of them: a step that ran ahead or
// speculated commits what it got), after discarding the last num_rolled_back[b] tokens the step
// computed (their K/V are forgotten; those that were outputs leave the sequence, prompt tokens are
// computed again). num_rolled_back may be empty: none.
struct StepTokens {
  std::vector<int32_t> tokens;
  std::vector<int32_t> token_indptr;  // [B+1]
  std::vector<int32_t> num_rolled_back;
};

// What one step did to one sequence.
struct SeqUpdate {
  int64_t request_id = 0;
  int32_t token = -1;        // the last token appended this step, -1 if none (mid-prefill)
  int32_t num_appended = 0;  // tokens appended this step (a stop token ends them early)
  bool finished = false;
  FinishReason reason = FinishReason::kNone;
  // Finished in an earlier update (resolve() of the step before, which ran ahead): this one
  // brings nothing new about it, and the token the step computed for it is discarded.
  bool reported = false;
};

struct SchedulerStats {
  int32_t num_running = 0;
  int32_t num_waiting = 0;
  int32_t pages_total = 0;
  int32_t pages_reserved = 0;  // the null page when the config has a window: never used or free
  int32_t pages_used = 0;      // ref count > 0
  int32_t pages_free = 0;      // ref count == 0 (cached or empty)
  int32_t pages_cached = 0;    // ref count == 0 and still findable by hash
  int64_t prefix_query_tokens = 0;
  int64_t prefix_hit_tokens = 0;  // whole pages and partial-page hits together
  // Admissions whose hit ended inside a page, and the tokens those partial pages served (copied
  // from a cached page instead of computed); both are part of prefix_hit_tokens too.
  int64_t prefix_partial_hits = 0;
  int64_t prefix_partial_hit_tokens = 0;
  int64_t preemptions = 0;
};

// A running sequence's page table, for inspection (Scheduler::sequence_map, `generate
// --show-cache`): its token counts and the pages it holds, in order.
struct SequenceView {
  // The entry of a page released because no later query's window reaches it.
  static constexpr int32_t kReleasedPage = -1;

  int64_t request_id = 0;
  int32_t num_tokens = 0;                // prompt + generated so far
  int32_t num_computed = 0;              // tokens whose K/V are in the cache
  int32_t num_cached_tokens = 0;         // prompt tokens served by the prefix cache at admission
  std::vector<int32_t> pages;            // the page table; released entries are kReleasedPage
  std::vector<uint8_t> page_shared;      // per page: 1 if another sequence holds it too
  std::vector<int32_t> page_ref_counts;  // per page: its holders (0 for released entries)
  // The partial-page hit of the admission, if any: page table entry copy_page_index received
  // the first num_copied_tokens slots of copy_src_page (-1: no partial hit).
  int32_t copy_page_index = -1;
  int32_t copy_src_page = -1;
  int32_t num_copied_tokens = 0;
};

struct Sequence;  // defined in scheduler.cc

class Scheduler {
 public:
  explicit Scheduler(SchedulerConfig config);
  ~Scheduler();

  // Throws pagedlm::Error for an empty prompt, a duplicate id, a prompt that cannot fit
  // max_model_len or the whole page pool (its null page aside). The request's prompt moves into
  // the returned record, the one copy of its tokens: the scheduler appends the outputs, readers
  // (the engine) keep it as long as they need.
  std::shared_ptr<const RequestTokens> add(Request request);
  // Frees the request's pages at once. False if unknown or already finished.
  bool cancel(int64_t request_id);
  bool has_unfinished() const;

  StepPlan schedule(const StepTimeLimit& limit = {});
  // sampled[b] is sequence b's new token where plan.samples[b]; other entries are ignored.
  std::vector<SeqUpdate> update(const StepPlan& plan, const std::vector<int32_t>& sampled);
  // The same for 0..n tokens per sequence, and rollbacks. A sequence that got no token stays
  // pending at its last computed token only if that was rolled back (a sequence whose step
  // sampled and that gets nothing else waits for a token it can never get: an error).
  std::vector<SeqUpdate> update(const StepPlan& plan, const StepTokens& step);
  // Running ahead (asynchronous scheduling): in place of update() while the last plan's step
  // still runs, so that the next step can be planned before its tokens are known. Every
  // sequence that the step samples gets kPendingToken as its next token, which makes it a decode
  // in the next schedule() (its row's token id is kPendingToken: the worker takes the value
  // from this step's sampled ids). A sequence whose token ends it by length whatever its value
  // (max_tokens, max_model_len) gets none and is not scheduled again. Stops that depend on the
  // token (EOS, stop ids) are checked by resolve(), one step late: a sequence that stopped is
  // finished there, and the token the next step computes for it is discarded (its update
  // reports it as `reported`, with no token); its pages, that step's slot included, go back to
  // the pool. The pending position is not committed to the prefix cache until its token is
  // known. At most one plan runs ahead at a time.
  void run_ahead(const StepPlan& plan);
  // The tokens of the plan run_ahead() was given (sampled[b] as update()'s): each replaces its
  // sequence's kPendingToken, then stops are checked as update() does.
  std::vector<SeqUpdate> resolve(const StepPlan& plan, const std::vector<int32_t>& sampled);
  // In place of update() for a plan whose step was left midway, its K/V partly written: every
  // sequence of the plan ends as cancelled (its pages go back to the pool), and every page the
  // step was to write is forgotten by the prefix cache (BlockPool::forget), so that no later
  // request is served what the step left there. Sequences admitted in the same plan may hold
  // such pages through a hit; being in the plan, they end too.
  std::vector<SeqUpdate> abandon(const StepPlan& plan);

  SchedulerStats stats() const;
  std::vector<SequenceView> sequence_map() const;
  // Free pages still holding servable content, the next one to be reused first, at most
  // max_pages of them.
  std::vector<CachedPageView> cached_pages(int32_t max_pages) const;
  const SchedulerConfig& config() const { return config_; }
  // The KV pages behind every sequence.
  const KvCacheManager& kv_cache() const;
  // Tokens generated so far by a live request (empty if unknown).
  std::vector<int32_t> output_tokens(int64_t request_id) const;
  // Prompt tokens served from the prefix cache at the request's (last) admission.
  int32_t num_cached_tokens(int64_t request_id) const;

 private:
  SchedulerConfig config_;
  // Sequences, queues and the KV cache manager live in State (scheduler.cc), so this header
  // does not expose the Sequence layout.
  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace pagedlm
