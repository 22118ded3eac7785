// A step left midway (Engine::set_abandon_check: Ctrl-C inside a long CPU prefill) keeps nothing
// it did: its requests end as cancelled, its pages go back to the pool, no later request is
// served from the prefix cache what it half wrote, and the engine then computes what an engine
// that never abandoned a step computes. The llama-gqa fixture has two layers: a pass asks at
// eleven points (five a layer, one before the lm_head); it runs alone and split between two
// tensor-parallel ranks (which must leave together, or one would wait in a collective for good).
#include <gtest/gtest.h>

#include <memory>
#include <ostream>
#include <string>
#include <vector>

#include "pagedlm/engine/engine.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

constexpr int32_t kPageSize = 16;

const Checkpoint& fixture() {
  static const Checkpoint checkpoint =
      load_checkpoint(std::string(PAGEDLM_TESTDATA) + "/fixtures/llama-gqa");
  return checkpoint;
}

EngineOptions options(int32_t tensor_parallel_size) {
  EngineOptions o;
  o.page_size = kPageSize;
  o.num_pages = 32;
  o.threads = 2;
  o.tensor_parallel_size = tensor_parallel_size;
  o.collective_timeout_ms = 60000;  // a rank left waiting fails the test instead of hanging it
  return o;
}

Request greedy(std::vector<int32_t> prompt, int32_t max_tokens) {
  Request r;
  r.prompt = std::move(prompt);
  r.sampling.max_tokens = max_tokens;
  r.sampling.ignore_eos = true;
  return r;
}

// 56 tokens: three full pages and 8 tokens of a fourth.
std::vector<int32_t> prompt() {
  std::vector<int32_t> tokens(56);
  for (size_t i = 0; i < tokens.size(); ++i) tokens[i] = static_cast<int32_t>(3 + (i * 37) % 500);
  return tokens;
}

// Holds from the `leave_at`-th time it is asked on (0: the first); counts the asks.
struct LeaveAt {
  int32_t leave_at = 0;
  std::shared_ptr<int32_t> asked = std::make_shared<int32_t>(0);
  bool operator()() const { return (*asked)++ >= leave_at; }
};

RequestOutput run_alone(const EngineOptions& o, Request request) {
  Engine engine(fixture(), o);
  return engine.generate({std::move(request)}).at(0);
}

struct Case {
  int32_t tensor_parallel_size;
  int32_t leave_at;  // the ask at which the pass leaves (alone) or rank 0 decides (two ranks)
};

void PrintTo(const Case& c, std::ostream* os) {
  *os << c.tensor_parallel_size << " rank(s), point " << c.leave_at;
}

class EngineAbandon : public testing::TestWithParam<Case> {};

TEST_P(EngineAbandon, AbandonedStepEndsItsRequestsAndLeavesNothingBehind) {
  const auto [tp, leave_at] = GetParam();
  const EngineOptions o = options(tp);
  Engine engine(fixture(), o);
  // Two requests with one prompt admitted in one step: the second holds the first one's pages
  // through the prefix cache (hits on pages the same step is writing).
  const int64_t a = engine.add_request(greedy(prompt(), 4));
  const int64_t b = engine.add_request(greedy(prompt(), 4));
  LeaveAt check{leave_at};
  engine.set_abandon_check(check);
  const std::vector<RequestEvent> events = engine.step();
  // Alone the pass leaves where it is told; two ranks leave together past the next all-reduce.
  EXPECT_EQ(*check.asked, leave_at + 1);
  ASSERT_EQ(events.size(), 2u);
  for (const RequestEvent& e : events) {
    EXPECT_TRUE(e.finished);
    EXPECT_EQ(e.reason, FinishReason::kCancelled);
    EXPECT_EQ(e.token, -1);
  }
  EXPECT_FALSE(engine.has_unfinished());
  for (const int64_t id : {a, b}) {
    const RequestOutput out = engine.take_output(id);
    EXPECT_EQ(out.reason, FinishReason::kCancelled);
    EXPECT_TRUE(out.tokens.empty());
  }
  SchedulerStats stats = engine.stats();
  EXPECT_EQ(stats.pages_used, 0);
  EXPECT_EQ(stats.pages_cached, 0);  // nothing the step wrote can be found
  EXPECT_EQ(stats.pages_free, stats.pages_total);

  // Steps run to the end again: the same prompt is computed anew, as by a fresh engine (on two
  // ranks: the group goes on, no rank waits in a collective the others left).
  engine.set_abandon_check({});
  const RequestOutput again = engine.generate({greedy(prompt(), 4)}).at(0);
  const RequestOutput fresh = run_alone(o, greedy(prompt(), 4));
  EXPECT_EQ(again.num_cached_tokens, 0);
  EXPECT_EQ(again.reason, FinishReason::kLength);
  EXPECT_EQ(again.tokens, fresh.tokens);
}

// Alone: before the first layer, before an attention, before a down projection, before the
// lm_head. Two ranks: rank 0 decides before the first layer, before an attention, before an
// o_proj (the ranks leave after its all-reduce), before either layer's down projection (they
// leave after its all-reduce: the second layer's is the last point with a point after it).
INSTANTIATE_TEST_SUITE_P(Points, EngineAbandon,
                         testing::Values(Case{1, 0}, Case{1, 1}, Case{1, 4}, Case{1, 10},
                                         Case{2, 0}, Case{2, 1}, Case{2, 2}, Case{2, 4},
                                         Case{2, 9}),
                         [](const testing::TestParamInfo<Case>& info) {
                           return "tp" + std::to_string(info.param.tensor_parallel_size) +
                                  "_point" + std::to_string(info.param.leave_at);
                         });

// What finished steps put in the prefix cache stays there; only what the abandoned step was
// writing goes: a whole page (by hash) and a partly filled one (by its leading tokens).
TEST(EngineAbandon, PagesOfFinishedStepsStayCached) {
  const EngineOptions o = options(1);
  Engine engine(fixture(), o);
  const std::vector<int32_t> full = prompt();
  // Its two full pages are cached once it has finished.
  const std::vector<int32_t> first_pages(full.begin(), full.begin() + 2 * kPageSize);
  engine.generate({greedy(first_pages, 1)});
  const int64_t id = engine.add_request(greedy(full, 4));
  engine.set_abandon_check(LeaveAt{7});  // both layers have written K/V
  const std::vector<RequestEvent> events = engine.step();
  ASSERT_EQ(events.size(), 1u);
  EXPECT_EQ(events[0].reason, FinishReason::kCancelled);
  EXPECT_EQ(engine.take_output(id).num_cached_tokens, 2 * kPageSize);
  EXPECT_EQ(engine.stats().pages_cached, 2);

  engine.set_abandon_check({});
  const RequestOutput again = engine.generate({greedy(full, 4)}).at(0);
  // The two pages of the finished request, not the third page and the partial fourth that the
  // abandoned step was writing (those would make 55).
  EXPECT_EQ(again.num_cached_tokens, 2 * kPageSize);
  EXPECT_EQ(again.tokens, run_alone(o, greedy(full, 4)).tokens);
}

// A check that never holds changes nothing.
TEST(EngineAbandon, ACheckThatNeverHoldsChangesNothing) {
  const EngineOptions o = options(1);
  Engine engine(fixture(), o);
  engine.set_abandon_check([] { return false; });
  const RequestOutput out = engine.generate({greedy(prompt(), 6)}).at(0);
  EXPECT_EQ(out.tokens, run_alone(o, greedy(prompt(), 6)).tokens);
  EXPECT_EQ(out.reason, FinishReason::kLength);
}

}  // namespace
}  // namespace pagedlm
