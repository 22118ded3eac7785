// Property tests: random request streams through the scheduler, checked after every step, and
// a fake model that sees nothing but the StepPlan. The fake model writes each stream token's
// (token id, position) into a simulated KV store at its slot, reads every sequence's history
// back through its page table, checks it, and samples a hash of that history. A wrong page
// table, slot or shared page therefore shows up as a wrong history or a wrong output. With a
// sliding window it reads only the keys its queries see, so a page released too early shows up
// as a wrong history too, and one released too late as a broken invariant. Partial-page prefix
// hits are copies the fake model applies after the step's writes (StepPlan::kv_copies): a wrong
// source, destination or length shows up as a wrong history as well.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <optional>
#include <random>
#include <string>
#include <unordered_map>
#include <vector>

#include "pagedlm/sched/scheduler.h"

namespace pagedlm {
namespace {

using Ints = std::vector<int32_t>;

constexpr int32_t kVocab = 64;
constexpr int32_t kEos = 0;

struct RequestSpec {
  Request request;
  int32_t arrival_step = 0;
  int32_t cancel_step = -1;       // -1: never cancelled
  bool cancel_in_flight = false;  // cancel between schedule() and update()
};

struct Outcome {
  Ints outputs;
  FinishReason reason = FinishReason::kNone;
};

struct StreamResult {
  std::map<int64_t, Outcome> outcomes;
  SchedulerStats stats;
  int64_t released_entries = 0;  // page-table entries released behind the window, summed over steps
  int64_t copies = 0;            // partial-page copies the plans asked for
};

class FakeModel {
 public:
  FakeModel(int32_t num_pages, int32_t page_size, int32_t window)
      : page_size_(page_size),
        window_(window),
        slots_(static_cast<size_t>(num_pages) * page_size) {}

  // Runs the plan against the simulated KV store; `known` holds every live request's tokens
  // (prompt and outputs so far). Returns the sampled token of each sequence.
  Ints run(const StepPlan& plan, const std::unordered_map<int64_t, Ints>& known,
           const std::unordered_map<int64_t, const Request*>& requests) {
    const int32_t num_seqs = plan.num_seqs();
    const int32_t num_tokens = plan.num_tokens();
    EXPECT_EQ(plan.page_size, page_size_);
    EXPECT_EQ(static_cast<int32_t>(plan.positions.size()), num_tokens);
    EXPECT_EQ(static_cast<int32_t>(plan.slot_mapping.size()), num_tokens);
    EXPECT_EQ(static_cast<int32_t>(plan.q_indptr.size()), num_seqs + 1);
    EXPECT_EQ(static_cast<int32_t>(plan.kv_indptr.size()), num_seqs + 1);
    EXPECT_EQ(static_cast<int32_t>(plan.kv_last_page_len.size()), num_seqs);
    EXPECT_EQ(static_cast<int32_t>(plan.logits_indptr.size()), num_seqs + 1);
    EXPECT_EQ(static_cast<int32_t>(plan.samples.size()), num_seqs);
    EXPECT_EQ(plan.q_indptr.back(), num_tokens);
    EXPECT_EQ(plan.kv_indptr.back(), static_cast<int32_t>(plan.kv_page_indices.size()));
    EXPECT_EQ(plan.logits_indptr.back(), static_cast<int32_t>(plan.logits_rows.size()));

    // Every layer writes all new K/V before attention reads any, so write the whole step first.
    written_.assign(slots_.size(), 0);
    for (int32_t row = 0; row < num_tokens; ++row) {
      const int32_t slot = plan.slot_mapping[row];
      EXPECT_TRUE(slot >= 0 && slot < static_cast<int32_t>(slots_.size())) << "slot " << slot;
      EXPECT_FALSE(written_[slot]) << "two rows of one step write slot " << slot;
      EXPECT_NE(slot / page_size_, plan.null_page) << "a row writes into the null page";
      written_[slot] = 1;
      slots_[slot] = {plan.token_ids[row], plan.positions[row]};
    }
    // Then the partial-page copies, as the engine does after each layer's cache write: leading
    // slots of a page that nobody writes into those slots this step, to a page that is no
    // source of this step and whose copied slots no row writes.
    EXPECT_EQ(plan.kv_copies.size() % 3, 0u);
    for (int32_t c = 0; c < plan.num_kv_copies(); ++c) {
      const int32_t src = plan.kv_copies[3 * c], dst = plan.kv_copies[3 * c + 1];
      const int32_t count = plan.kv_copies[3 * c + 2];
      EXPECT_TRUE(count >= 1 && count < page_size_) << "copy of " << count << " tokens";
      EXPECT_NE(src, dst);
      EXPECT_NE(src, plan.null_page);
      EXPECT_NE(dst, plan.null_page);
      for (int32_t other = 0; other < plan.num_kv_copies(); ++other) {
        EXPECT_NE(plan.kv_copies[3 * other + 1], src) << "copy " << c << " reads a copied page";
      }
      for (int32_t i = 0; i < count; ++i) {
        EXPECT_FALSE(written_[dst * page_size_ + i]) << "a row writes a copied slot";
        slots_[dst * page_size_ + i] = slots_[src * page_size_ + i];
      }
    }

    Ints sampled(num_seqs, -1);
    for (int32_t b = 0; b < num_seqs; ++b) {
      const int64_t id = plan.request_ids[b];
      const Ints& tokens = known.at(id);
      const Request& request = *requests.at(id);
      const int32_t first_row = plan.q_indptr[b];
      const int32_t end_row = plan.q_indptr[b + 1];
      EXPECT_LT(first_row, end_row) << "request " << id << " has no rows";

      const int32_t num_pages = plan.kv_indptr[b + 1] - plan.kv_indptr[b];
      const int32_t last_page_len = plan.kv_last_page_len[b];
      EXPECT_TRUE(last_page_len >= 1 && last_page_len <= page_size_);
      const int32_t kv_len = (num_pages - 1) * page_size_ + last_page_len;
      EXPECT_LE(kv_len, static_cast<int32_t>(tokens.size()));
      EXPECT_EQ(plan.positions[end_row - 1], kv_len - 1) << "request " << id;

      // The step's first query sees the most: keys from its position - window + 1 on. Entries
      // below may point to the null page, and only wholly below it.
      const int32_t first_visible =
          window_ > 0 ? std::max(0, plan.positions[first_row] - window_ + 1) : 0;
      for (int32_t index = 0; index < num_pages; ++index) {
        if (plan.kv_page_indices[plan.kv_indptr[b] + index] != plan.null_page) continue;
        EXPECT_LE((index + 1) * page_size_, first_visible)
            << "request " << id << " released page " << index << " still in its window";
      }
      // The sampled row, the last, sees the last `window` keys: the output depends on those.
      const int32_t sampled_visible = window_ > 0 ? std::max(0, kv_len - window_) : 0;
      uint64_t history_hash = 1469598103934665603ull;
      for (int32_t position = first_visible; position < kv_len; ++position) {
        const int32_t page = plan.kv_page_indices[plan.kv_indptr[b] + position / page_size_];
        const auto [token, stored_position] = slots_[page * page_size_ + position % page_size_];
        if (stored_position != position || token != tokens[position]) {
          ADD_FAILURE() << "request " << id << " reads (" << token << ", " << stored_position
                        << ") from page " << page << " at position " << position
                        << ", expected token " << tokens[position];
          return {};
        }
        if (position < sampled_visible) continue;
        history_hash = (history_hash ^ static_cast<uint64_t>(token)) * 1099511628211ull;
        history_hash = (history_hash ^ static_cast<uint64_t>(position)) * 1099511628211ull;
      }
      for (int32_t row = first_row; row < end_row; ++row) {
        EXPECT_EQ(plan.positions[row], kv_len - (end_row - row));
      }

      const bool at_end = kv_len == static_cast<int32_t>(tokens.size());
      const bool samples = at_end && request.sampling.max_tokens > 0;
      EXPECT_EQ(plan.samples[b] != 0, samples) << "request " << id;
      const Ints rows(plan.logits_rows.begin() + plan.logits_indptr[b],
                      plan.logits_rows.begin() + plan.logits_indptr[b + 1]);
      Ints expected_rows;
      if (request.want_prompt_logits) {
        for (int32_t row = first_row; row < end_row; ++row) expected_rows.push_back(row);
      } else if (samples) {
        expected_rows.push_back(end_row - 1);
      }
      EXPECT_EQ(rows, expected_rows) << "request " << id;
      sampled[b] = static_cast<int32_t>((history_hash >> 17) % kVocab);
    }
    return sampled;
  }

 private:
  int32_t page_size_;
  int32_t window_;
  std::vector<std::pair<int32_t, int32_t>> slots_;  // (token id, position); (0, 0) when unwritten
  std::vector<uint8_t> written_;
};

// Returns the number of released page-table entries.
// in_flight: a plan made ahead and not yet applied (or null); its sequences' pages behind the
// window may still be held until it is.
int64_t check_invariants(const Scheduler& scheduler, const std::unordered_map<int64_t, Ints>& known,
                         const StepPlan* in_flight) {
  const SchedulerConfig& config = scheduler.config();
  const SchedulerStats stats = scheduler.stats();
  const std::vector<SequenceView> views = scheduler.sequence_map();
  const int32_t num_reserved = config.window > 0 ? 1 : 0;
  std::vector<int32_t> num_holders(config.num_pages, 0);
  int64_t num_released = 0;
  for (const SequenceView& view : views) {
    const int32_t expected_pages = (view.num_computed + config.page_size - 1) / config.page_size;
    EXPECT_EQ(static_cast<int32_t>(view.pages.size()), expected_pages) << view.request_id;
    EXPECT_EQ(view.num_tokens, static_cast<int32_t>(known.at(view.request_id).size()));
    // Every page wholly below the next query's window is released, and no other.
    const int32_t first_visible = view.num_computed - config.window + 1;
    const int32_t expected_released =
        config.window > 0 ? std::max(0, first_visible) / config.page_size : 0;
    for (size_t i = 0; i < view.pages.size(); ++i) {
      const int32_t page = view.pages[i];
      const bool released = static_cast<int32_t>(i) < expected_released;
      const bool applied = in_flight == nullptr ||
                           std::find(in_flight->request_ids.begin(), in_flight->request_ids.end(),
                                     view.request_id) == in_flight->request_ids.end();
      if (applied || page == SequenceView::kReleasedPage) {
        EXPECT_EQ(page == SequenceView::kReleasedPage, released)
            << "request " << view.request_id << " page " << i << " of " << view.num_computed
            << " computed tokens";
      }
      if (page == SequenceView::kReleasedPage) {
        EXPECT_FALSE(view.page_shared[i]);
        ++num_released;
        continue;
      }
      EXPECT_TRUE(page >= 0 && page < config.num_pages - num_reserved) << "page " << page;
      if (page < 0 || page >= config.num_pages) return num_released;
      ++num_holders[page];
    }
  }
  int32_t num_held = 0;
  for (const SequenceView& view : views) {
    for (size_t i = 0; i < view.pages.size(); ++i) {
      if (view.pages[i] == SequenceView::kReleasedPage) continue;
      const int32_t holders = num_holders[view.pages[i]];
      EXPECT_EQ(view.page_shared[i] != 0, holders > 1) << "request " << view.request_id;
      // Only full pages may be shared: a partial page is still being written.
      if (holders > 1) {
        EXPECT_LT(static_cast<int32_t>(i), view.num_computed / config.page_size);
      }
    }
  }
  // A plan in flight holds its partial-page copies' sources until the next schedule().
  if (in_flight != nullptr) {
    for (int32_t c = 0; c < in_flight->num_kv_copies(); ++c)
      ++num_holders[in_flight->kv_copies[3 * c]];
  }
  for (const int32_t holders : num_holders) num_held += holders > 0 ? 1 : 0;
  // A page with a ref count but no holder would be counted used; a page held by more sequences
  // than its ref count says is caught by page_shared above or by the KV checks once it is reused.
  EXPECT_EQ(stats.pages_used, num_held);
  EXPECT_EQ(stats.pages_reserved, num_reserved);
  EXPECT_EQ(stats.pages_used + stats.pages_free + stats.pages_reserved, config.num_pages);
  EXPECT_EQ(stats.pages_total, config.num_pages);
  EXPECT_LE(stats.pages_cached, stats.pages_free);
  EXPECT_EQ(stats.num_running, static_cast<int32_t>(views.size()));
  EXPECT_LE(stats.num_running, config.max_num_seqs);
  EXPECT_EQ(stats.num_running + stats.num_waiting, static_cast<int32_t>(known.size()));
  if (!config.enable_prefix_cache) {
    EXPECT_EQ(stats.pages_cached, 0);
  }
  return num_released;
}

// ahead: every step runs ahead (Scheduler::run_ahead): the next plan is made and run before the
// step's tokens are applied (Scheduler::resolve), its pending rows taking them as a device would.
StreamResult run_stream(const SchedulerConfig& config, const std::vector<RequestSpec>& specs,
                        bool ahead = false) {
  Scheduler scheduler(config);
  FakeModel model(config.num_pages, config.page_size, config.window);
  StreamResult result;
  std::unordered_map<int64_t, Ints> known;  // live requests only
  std::unordered_map<int64_t, const Request*> requests;
  for (const RequestSpec& spec : specs) requests[spec.request.id] = &spec.request;

  // Ahead: the plan run and not yet applied, and its sampled tokens.
  std::optional<StepPlan> in_flight;
  Ints in_flight_sampled;
  constexpr int32_t kMaxSteps = 20000;
  size_t num_added = 0;
  for (int32_t step = 0; num_added < specs.size() || scheduler.has_unfinished(); ++step) {
    if (step >= kMaxSteps) {
      ADD_FAILURE() << "no progress after " << kMaxSteps << " steps";
      break;
    }
    for (; num_added < specs.size() && specs[num_added].arrival_step <= step; ++num_added) {
      scheduler.add(specs[num_added].request);
      known[specs[num_added].request.id] = specs[num_added].request.prompt;
    }
    // A request cancelled while in the plan is reported by update(); any other is gone at once.
    const auto cancel_due = [&](bool in_flight, const StepPlan* plan) {
      for (const RequestSpec& spec : specs) {
        const int64_t id = spec.request.id;
        if (spec.cancel_step != step || spec.cancel_in_flight != in_flight) continue;
        if (!known.contains(id)) continue;
        EXPECT_TRUE(scheduler.cancel(id));
        const bool in_plan =
            plan != nullptr && std::find(plan->request_ids.begin(), plan->request_ids.end(), id) !=
                                   plan->request_ids.end();
        if (!in_plan) {
          result.outcomes[id].reason = FinishReason::kCancelled;
          known.erase(id);
        }
      }
    };
    cancel_due(false, in_flight ? &*in_flight : nullptr);

    StepPlan plan;
    Ints sampled;
    if (in_flight) {
      plan = std::move(*in_flight);
      sampled = std::move(in_flight_sampled);
      in_flight.reset();
    } else {
      plan = scheduler.schedule();
      EXPECT_LE(plan.num_tokens(), config.max_num_batched_tokens);
      if (plan.empty()) {
        // Nothing to run is only right while no request is live.
        EXPECT_TRUE(known.empty()) << "step " << step << " scheduled nothing";
        if (known.empty()) continue;
        break;
      }
      result.copies += plan.num_kv_copies();
      sampled = model.run(plan, known, requests);
      if (::testing::Test::HasFailure()) break;
    }
    cancel_due(true, &plan);

    std::vector<SeqUpdate> updates;
    if (ahead) {
      scheduler.run_ahead(plan);
      StepPlan next = scheduler.schedule();
      EXPECT_LE(next.num_tokens(), config.max_num_batched_tokens);
      if (!next.empty()) {
        // Pending rows take the tokens `plan` sampled; the model sees each such sequence with
        // its token, as the device does.
        std::unordered_map<int64_t, int32_t> token_of;
        for (int32_t b = 0; b < plan.num_seqs(); ++b) {
          if (plan.samples[b]) token_of[plan.request_ids[b]] = sampled[b];
        }
        std::unordered_map<int64_t, Ints> ahead_known = known;
        for (int32_t b = 0; b < next.num_seqs(); ++b) {
          for (int32_t row = next.q_indptr[b]; row < next.q_indptr[b + 1]; ++row) {
            if (next.token_ids[row] != kPendingToken) continue;
            const int64_t id = next.request_ids[b];
            EXPECT_EQ(row, next.q_indptr[b + 1] - 1) << "a pending token is not the last";
            if (!token_of.contains(id)) {
              ADD_FAILURE() << "request " << id << " has a pending token its step did not sample";
              return result;
            }
            next.token_ids[row] = token_of.at(id);
            ahead_known[id].push_back(token_of.at(id));
          }
        }
        result.copies += next.num_kv_copies();
        in_flight_sampled = model.run(next, ahead_known, requests);
        if (::testing::Test::HasFailure()) break;
        in_flight = std::move(next);
      }
      updates = scheduler.resolve(plan, sampled);
    } else {
      updates = scheduler.update(plan, sampled);
    }
    EXPECT_EQ(static_cast<int32_t>(updates.size()), plan.num_seqs());
    for (size_t b = 0; b < updates.size(); ++b) {
      const SeqUpdate& update = updates[b];
      EXPECT_EQ(update.request_id, plan.request_ids[b]);
      if (update.reported) {  // stopped by the step before: its token here is discarded
        EXPECT_TRUE(update.finished);
        EXPECT_EQ(update.token, -1);
        EXPECT_FALSE(known.contains(update.request_id));
        continue;
      }
      Outcome& outcome = result.outcomes[update.request_id];
      if (update.token >= 0) {
        EXPECT_TRUE(plan.samples[b]);
        EXPECT_EQ(update.token, sampled[b]);
        outcome.outputs.push_back(update.token);
        known[update.request_id].push_back(update.token);
      }
      if (update.finished) {
        outcome.reason = update.reason;
        known.erase(update.request_id);
      }
    }
    for (const auto& [id, outcome] : result.outcomes) {
      if (known.contains(id)) EXPECT_EQ(scheduler.output_tokens(id), outcome.outputs);
    }
    result.released_entries +=
        check_invariants(scheduler, known, in_flight ? &*in_flight : nullptr);
    if (::testing::Test::HasFailure()) break;
  }
  result.stats = scheduler.stats();
  EXPECT_EQ(result.stats.pages_used, 0);
  EXPECT_EQ(result.stats.pages_free, config.num_pages - result.stats.pages_reserved);
  EXPECT_EQ(result.stats.num_running + result.stats.num_waiting, 0);
  return result;
}

SchedulerConfig random_config(std::mt19937& rng, int32_t page_size) {
  SchedulerConfig config;
  config.page_size = page_size;
  config.max_model_len = 96;
  // Room for the longest request and a little more, so preemption is frequent.
  const int32_t min_pages = config.max_model_len / page_size;
  config.num_pages = min_pages + static_cast<int32_t>(rng() % (2 * min_pages));
  // A third of the streams slide, by windows from one token to past the longest sequence; the
  // null page comes on top of the room for the longest request.
  if (rng() % 3 == 0) {
    config.window = 1 + static_cast<int32_t>(rng() % 100);
    ++config.num_pages;
  }
  config.max_num_batched_tokens = rng() % 4 == 0 ? 512 : 1 + static_cast<int32_t>(rng() % 48);
  config.max_num_seqs = 1 + static_cast<int32_t>(rng() % 8);
  config.enable_prefix_cache = rng() % 5 != 0;
  config.eos_token_ids = {kEos};
  return config;
}

std::vector<RequestSpec> random_requests(std::mt19937& rng, const SchedulerConfig& config) {
  const auto random_tokens = [&rng](int32_t count) {
    Ints tokens(count);
    for (int32_t& token : tokens) token = 1 + static_cast<int32_t>(rng() % (kVocab - 1));
    return tokens;
  };
  std::vector<Ints> prefixes;
  for (int32_t i = 0; i < 3; ++i) prefixes.push_back(random_tokens(rng() % 56));
  const std::vector<std::string> salts = {"", "", "tenant-x", "tenant-y"};

  constexpr int32_t kNumRequests = 24;
  std::vector<RequestSpec> specs(kNumRequests);
  for (int32_t i = 0; i < kNumRequests; ++i) {
    RequestSpec& spec = specs[i];
    Request& request = spec.request;
    request.id = 1000 + i;
    const Ints& prefix = prefixes[rng() % prefixes.size()];
    request.prompt.assign(prefix.begin(), prefix.begin() + rng() % (prefix.size() + 1));
    const Ints suffix = random_tokens(1 + static_cast<int32_t>(rng() % 24));
    request.prompt.insert(request.prompt.end(), suffix.begin(), suffix.end());
    request.sampling.max_tokens = static_cast<int32_t>(rng() % 25);
    request.sampling.ignore_eos = rng() % 3 == 0;
    if (rng() % 5 == 0) request.sampling.stop_token_ids = {1 + static_cast<int32_t>(rng() % 8)};
    request.cache_salt = salts[rng() % salts.size()];
    request.use_prefix_cache = rng() % 7 != 0;
    request.want_prompt_logits = rng() % 10 == 0;
    spec.arrival_step = static_cast<int32_t>(rng() % 30);
    if (rng() % 6 == 0) {
      spec.cancel_step = spec.arrival_step + static_cast<int32_t>(rng() % 20);
      spec.cancel_in_flight = rng() % 2 == 0;
    }
    EXPECT_LT(static_cast<int32_t>(request.prompt.size()), config.max_model_len);
  }
  std::stable_sort(specs.begin(), specs.end(), [](const RequestSpec& a, const RequestSpec& b) {
    return a.arrival_step < b.arrival_step;
  });
  return specs;
}

bool is_prefix(const Ints& prefix, const Ints& of) {
  return prefix.size() <= of.size() && std::equal(prefix.begin(), prefix.end(), of.begin());
}

class SchedulerPropertyTest : public ::testing::TestWithParam<int32_t> {};

TEST_P(SchedulerPropertyTest, RandomStreamsMatchRunningEachRequestAlone) {
  const int32_t page_size = GetParam();
  constexpr int32_t kNumStreams = 100;
  int64_t total_preemptions = 0;
  int64_t total_hit_tokens = 0;
  int64_t total_released = 0;
  int64_t total_copies = 0, total_partial_hits = 0, total_partial_tokens = 0;
  for (int32_t seed = 0; seed < kNumStreams; ++seed) {
    std::mt19937 rng(static_cast<uint32_t>(page_size * 7919 + seed));
    const SchedulerConfig config = random_config(rng, page_size);
    const std::vector<RequestSpec> specs = random_requests(rng, config);
    SCOPED_TRACE(::testing::Message()
                 << "seed " << seed << " pages " << config.num_pages << " budget "
                 << config.max_num_batched_tokens << " max_num_seqs " << config.max_num_seqs
                 << " prefix cache " << config.enable_prefix_cache << " window " << config.window);
    const StreamResult together = run_stream(config, specs);
    ASSERT_FALSE(HasFailure());
    const StreamResult ahead = run_stream(config, specs, /*ahead=*/true);
    ASSERT_FALSE(HasFailure());
    total_preemptions += together.stats.preemptions;
    total_hit_tokens += together.stats.prefix_hit_tokens;
    total_released += together.released_entries;
    total_copies += together.copies;
    total_partial_hits += together.stats.prefix_partial_hits;
    total_partial_tokens += together.stats.prefix_partial_hit_tokens;
    EXPECT_LE(together.stats.prefix_partial_hit_tokens, together.stats.prefix_hit_tokens);

    for (const RequestSpec& spec : specs) {
      RequestSpec solo_spec = spec;
      solo_spec.arrival_step = 0;
      solo_spec.cancel_step = -1;
      const StreamResult alone = run_stream(config, {solo_spec});
      ASSERT_FALSE(HasFailure());
      const int64_t id = spec.request.id;
      const Outcome& expected = alone.outcomes.at(id);
      for (const StreamResult* run : {&together, &ahead}) {
        const Outcome& got = run->outcomes.at(id);
        const char* mode = run == &ahead ? " (ahead)" : "";
        if (got.reason == FinishReason::kCancelled) {
          EXPECT_TRUE(is_prefix(got.outputs, expected.outputs)) << "request " << id << mode;
        } else {
          EXPECT_EQ(got.outputs, expected.outputs) << "request " << id << mode;
          EXPECT_EQ(got.reason, expected.reason) << "request " << id << mode;
          EXPECT_NE(got.reason, FinishReason::kNone) << "request " << id << mode;
        }
      }
    }
  }
  // The streams must exercise the paths they are meant to test.
  EXPECT_GT(total_preemptions, 0);
  EXPECT_GT(total_hit_tokens, 0);
  EXPECT_GT(total_released, 0);
  // Every partial hit is one copy; a page of one token has no partial hits.
  EXPECT_EQ(total_copies, total_partial_hits);
  if (page_size > 1) {
    EXPECT_GT(total_partial_hits, 0);
    EXPECT_GE(total_partial_tokens, total_partial_hits);
  } else {
    EXPECT_EQ(total_partial_hits, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(PageSizes, SchedulerPropertyTest, ::testing::Values(1, 4, 16, 32));

}  // namespace
}  // namespace pagedlm
