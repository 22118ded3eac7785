// EngineLoop's admission hold: requests submitted one call at a time while a hold stands are
// admitted together at one step boundary, as a batch handed over at once. Its OutputWaker: one
// wake per step for all the channels that share it.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <thread>
#include <vector>

#include "pagedlm/engine/engine.h"
#include "pagedlm/model/dummy_checkpoint.h"
#include "pagedlm/serving/engine_loop.h"

namespace pagedlm::serving {
namespace {

using namespace std::chrono_literals;

Checkpoint tiny_checkpoint() {
  return make_dummy_checkpoint(
      (std::filesystem::path(PAGEDLM_TESTDATA) / "fixtures" / "llama3-rope" / "config.json")
          .string());
}

EngineOptions one_thread_options() {
  EngineOptions options;
  options.threads = 1;
  options.kv_cache_bytes = 16 << 20;
  return options;
}

GenerationJob one_token_job(int32_t first_token) {
  GenerationJob job;
  job.request.prompt = {first_token, first_token + 1, first_token + 2, first_token + 3};
  job.request.sampling.max_tokens = 1;
  job.request.sampling.temperature = 0.f;
  job.request.sampling.ignore_eos = true;
  return job;
}

// Waits for the channel's finishing event (at most a minute, for a loaded machine).
TokenEvent wait_finished(OutputChannel& channel) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (std::chrono::steady_clock::now() < deadline) {
    std::vector<TokenEvent> events;
    channel.wait_pop(&events, 100ms);
    for (TokenEvent& e : events) {
      if (e.finished) return e;
    }
  }
  ADD_FAILURE() << "no finishing event within a minute";
  return {};
}

// The waker's count once it reached `count` (a step's wake follows its last push, so a reader
// can see the events first), or after a minute.
uint64_t wakes_reaching(const OutputWaker& waker, uint64_t count) {
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  uint64_t seen = waker.wakes();
  while (seen < count && std::chrono::steady_clock::now() < deadline) {
    waker.wait_past(seen, 100ms);
    seen = waker.wakes();
  }
  return seen;
}

TEST(EngineLoop, HeldSubmissionsAreAdmittedTogetherAtOneStep) {
  const Checkpoint checkpoint = tiny_checkpoint();
  Engine engine(checkpoint, one_thread_options());
  EngineLoop loop(engine, /*max_waiting=*/64);

  loop.hold_admissions();
  std::vector<std::shared_ptr<OutputChannel>> channels;
  for (int32_t i = 0; i < 3; ++i) {
    channels.push_back(std::make_shared<OutputChannel>());
    ASSERT_TRUE(loop.submit({one_token_job(20 + 10 * i)}, channels.back()));
    // Without the hold the engine thread would run the first request alone meanwhile.
    std::this_thread::sleep_for(100ms);
  }
  std::vector<TokenEvent> early;
  for (auto& c : channels) EXPECT_FALSE(c->wait_pop(&early, 0ms)) << "ran while held";
  EXPECT_EQ(engine.num_steps(), 0);

  loop.release_admissions();
  for (auto& c : channels) {
    const TokenEvent e = wait_finished(*c);
    EXPECT_EQ(e.reason, FinishReason::kLength);
    EXPECT_TRUE(e.error.empty()) << e.error;
  }
  // One step prefilled all three prompts and sampled each one's only token.
  EXPECT_EQ(engine.num_steps(), 1);
  loop.stop();
}

TEST(EngineLoop, SharedWakerWakesOncePerStepNotPerEvent) {
  const Checkpoint checkpoint = tiny_checkpoint();
  Engine engine(checkpoint, one_thread_options());
  EngineLoop loop(engine, /*max_waiting=*/64);
  auto waker = std::make_shared<OutputWaker>();
  EXPECT_FALSE(waker->wait_past(0, 0ms));

  loop.hold_admissions();
  std::vector<std::shared_ptr<OutputChannel>> channels;
  for (int32_t i = 0; i < 3; ++i) {
    channels.push_back(std::make_shared<OutputChannel>(waker));
    GenerationJob job = one_token_job(20 + 10 * i);
    job.request.sampling.max_tokens = 3;
    ASSERT_TRUE(loop.submit({std::move(job)}, channels.back()));
  }
  loop.release_admissions();
  EXPECT_TRUE(waker->wait_past(0, 60s)) << "no wake after the first step";
  for (auto& c : channels) EXPECT_EQ(wait_finished(*c).reason, FinishReason::kLength);
  // Three steps (the prefill's token, then two decodes), each with an event for every channel:
  // nine events, three wakes.
  EXPECT_EQ(engine.num_steps(), 3);
  EXPECT_EQ(wakes_reaching(*waker, 3), 3u);

  // An event pushed outside a step (a refused request) wakes it at once.
  GenerationJob refused = one_token_job(20);
  refused.request.prompt.clear();
  ASSERT_TRUE(loop.submit({std::move(refused)}, channels[0]));
  EXPECT_TRUE(waker->wait_past(3, 60s));
  EXPECT_FALSE(wait_finished(*channels[0]).error.empty());
  loop.stop();
}

TEST(EngineLoop, ReleaseWithoutHoldIsRefused) {
  const Checkpoint checkpoint = tiny_checkpoint();
  Engine engine(checkpoint, one_thread_options());
  EngineLoop loop(engine, /*max_waiting=*/64);
  EXPECT_THROW(loop.release_admissions(), Error);
  loop.stop();
}

}  // namespace
}  // namespace pagedlm::serving
