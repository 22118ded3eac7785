// Property test of the whole engine on a real (tiny) model: random request streams with shared
// prefixes, cancellations, chunked prefill and page pools small enough to force preemption.
// Every request that completes must produce exactly the tokens it produces when run alone,
// and every page must be free again at the end.
#include <gtest/gtest.h>

#include <cstring>
#include <map>
#include <random>

#include "pagedlm/engine/engine.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

struct Scenario {
  int32_t page_size, num_pages, max_num_batched_tokens, max_num_seqs;
};

std::vector<int32_t> alone(const Checkpoint& ckpt, const Request& r) {
  EngineOptions opts;
  opts.num_pages = 256;
  Engine engine(ckpt, opts);
  return engine.generate({r})[0].tokens;
}

// async: EngineOptions::async_scheduling of the batched engines (the requests alone run
// synchronously, the CPU's default).
void outputs_equal_running_alone(int32_t async) {
  const Checkpoint ckpt = load_checkpoint(std::string(PAGEDLM_TESTDATA) + "/fixtures/llama-gqa");
  const Scenario scenarios[] = {
      {1, 160, 16, 4}, {4, 40, 64, 8}, {16, 12, 32, 16}, {16, 40, 256, 3}, {8, 20, 24, 32}};
  std::mt19937 rng(1234);
  std::map<std::vector<int32_t>, std::vector<int32_t>> alone_cache;
  int64_t total_preemptions = 0, total_hits = 0;
  for (const Scenario& sc : scenarios) {
    EngineOptions opts;
    opts.page_size = sc.page_size;
    opts.num_pages = sc.num_pages;
    opts.max_num_batched_tokens = sc.max_num_batched_tokens;
    opts.max_num_seqs = sc.max_num_seqs;
    opts.async_scheduling = async;
    Engine engine(ckpt, opts);
    std::vector<std::vector<int32_t>> prefixes;
    for (int i = 0; i < 3; ++i) {
      std::vector<int32_t> p(std::uniform_int_distribution<int>(8, 40)(rng));
      for (int32_t& t : p) t = std::uniform_int_distribution<int32_t>(3, 511)(rng);
      prefixes.push_back(p);
    }
    std::map<int64_t, Request> live;
    std::map<int64_t, bool> cancelled;
    for (int i = 0; i < 14; ++i) {
      Request r;
      if (rng() % 2) r.prompt = prefixes[rng() % prefixes.size()];
      const int extra = std::uniform_int_distribution<int>(1, 30)(rng);
      for (int j = 0; j < extra; ++j) {
        r.prompt.push_back(std::uniform_int_distribution<int32_t>(3, 511)(rng));
      }
      r.sampling.max_tokens = std::uniform_int_distribution<int>(1, 10)(rng);
      r.sampling.ignore_eos = true;
      if (rng() % 4 == 0) r.sampling.stop_token_ids = {static_cast<int32_t>(rng() % 512)};
      live.emplace(engine.add_request(r), r);
    }
    int step = 0;
    std::map<int64_t, std::vector<int32_t>> outputs;
    while (engine.has_unfinished()) {
      for (const RequestEvent& e : engine.step()) {
        if (e.finished) outputs[e.request_id] = engine.take_output(e.request_id).tokens;
      }
      if (++step % 7 == 0) {  // cancel a random live request now and then
        for (auto& [id, r] : live) {
          if (!outputs.count(id) && !cancelled.count(id) && rng() % 5 == 0) {
            if (engine.cancel(id)) cancelled[id] = true;
            break;
          }
        }
      }
      const SchedulerStats st = engine.stats();
      ASSERT_EQ(st.pages_used + st.pages_free, st.pages_total);
    }
    const SchedulerStats st = engine.stats();
    EXPECT_EQ(st.pages_used, 0) << "pages leaked, page size " << sc.page_size;
    total_preemptions += st.preemptions;
    total_hits += st.prefix_hit_tokens;
    for (auto& [id, r] : live) {
      if (cancelled.count(id)) continue;
      ASSERT_TRUE(outputs.count(id)) << "request " << id << " never finished";
      auto it = alone_cache.find(r.prompt);
      Request solo = r;
      solo.sampling.max_tokens = 10;
      solo.sampling.stop_token_ids.clear();
      if (it == alone_cache.end()) it = alone_cache.emplace(r.prompt, alone(ckpt, solo)).first;
      // The batched run may stop earlier (max_tokens, stop ids): compare that prefix, and check
      // it stopped exactly where the rules say.
      const std::vector<int32_t>& got = outputs[id];
      const std::vector<int32_t>& want = it->second;
      ASSERT_LE(got.size(), want.size());
      EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()))
          << "request " << id << " differs from running alone (page size " << sc.page_size << ")";
      size_t expected_len = r.sampling.max_tokens;
      for (size_t t = 0; t < static_cast<size_t>(r.sampling.max_tokens); ++t) {
        if (!r.sampling.stop_token_ids.empty() && want[t] == r.sampling.stop_token_ids[0]) {
          expected_len = t + 1;
          break;
        }
      }
      EXPECT_EQ(got.size(), expected_len) << "request " << id;
    }
  }
  EXPECT_GT(total_preemptions, 0) << "the pools were meant to force preemption";
  EXPECT_GT(total_hits, 0) << "the shared prefixes were meant to hit the prefix cache";
}

TEST(EngineProperty, OutputsEqualRunningAloneUnderPreemptionChunkingAndSharing) {
  outputs_equal_running_alone(0);
}

// The same with step N + 1 planned and launched before step N's tokens are known.
TEST(EngineProperty, OutputsEqualRunningAloneWithAsynchronousScheduling) {
  outputs_equal_running_alone(1);
}

}  // namespace
}  // namespace pagedlm

namespace pagedlm {
namespace {

// A prompt's logits are bitwise the same whatever chunks its prefill was split into (chunks of
// a few tokens take attention's decode path, long ones its prefill path) and whichever other
// requests share its steps: the CPU kernels' batch invariance, end to end. Gemma 2 adds a
// sliding window and soft-caps; prompts long enough for whole 32-key tiles.
TEST(EngineProperty, PromptLogitsBitwiseEqualWhateverTheChunks) {
  for (const char* fixture : {"llama-gqa", "gemma2"}) {
    const Checkpoint ckpt = load_checkpoint(std::string(PAGEDLM_TESTDATA) + "/fixtures/" + fixture);
    std::mt19937 rng(77);
    std::vector<Request> requests(3);
    for (Request& r : requests) {
      r.prompt.resize(std::uniform_int_distribution<size_t>(70, 110)(rng));
      for (int32_t& t : r.prompt) t = std::uniform_int_distribution<int32_t>(3, 255)(rng);
      r.sampling.max_tokens = 1;
      r.want_prompt_logits = true;
    }
    std::vector<Tensor> alone;
    for (const Request& r : requests) {
      EngineOptions opts;
      opts.num_pages = 64;
      opts.enable_prefix_cache = false;
      Engine engine(ckpt, opts);
      alone.push_back(engine.generate({r})[0].prompt_logits);
    }
    for (const int32_t budget : {5, 7, 16, 33}) {
      EngineOptions opts;
      opts.num_pages = 64;
      opts.enable_prefix_cache = false;
      opts.max_num_batched_tokens = budget;
      Engine engine(ckpt, opts);
      const std::vector<RequestOutput> together = engine.generate(requests);
      for (size_t i = 0; i < requests.size(); ++i) {
        const Tensor& got = together[i].prompt_logits;
        ASSERT_EQ(got.numel(), alone[i].numel());
        EXPECT_EQ(
            std::memcmp(got.data<float>(), alone[i].data<float>(), got.numel() * sizeof(float)), 0)
            << fixture << ": prompt " << i << " (" << requests[i].prompt.size()
            << " tokens) in chunks of up to " << budget << " tokens";
      }
    }
  }
}

// Under the step-time limit a prompt that arrives while another request decodes is prefilled in
// short chunks beside the decodes (target_itl_ms far below any step, so each chunk is the
// scheduler's minimum of 32 tokens): what every request produces, prompt logits included, is
// bitwise what it produces alone with the limit off.
TEST(EngineProperty, OutputsBitwiseEqualWhileTheStepTimeLimitCutsThePrefill) {
  const Checkpoint ckpt = load_checkpoint(std::string(PAGEDLM_TESTDATA) + "/fixtures/llama-gqa");
  std::mt19937 rng(5);
  const auto prompt = [&rng](size_t len) {
    std::vector<int32_t> p(len);
    for (int32_t& t : p) t = std::uniform_int_distribution<int32_t>(3, 255)(rng);
    return p;
  };
  Request decoding;
  decoding.prompt = prompt(12);
  decoding.sampling.temperature = 0;
  decoding.sampling.ignore_eos = true;
  decoding.sampling.max_tokens = 40;
  Request arriving;
  arriving.prompt = prompt(150);  // 4 chunks of 32 and one of 22
  arriving.sampling.temperature = 0;
  arriving.sampling.ignore_eos = true;
  arriving.sampling.max_tokens = 8;
  arriving.want_prompt_logits = true;

  EngineOptions off;
  off.num_pages = 64;
  off.target_itl_ms = 0;
  std::vector<RequestOutput> alone;
  for (const Request& r : {decoding, arriving}) {
    Engine engine(ckpt, off);
    alone.push_back(engine.generate({r})[0]);
  }

  EngineOptions limited = off;
  limited.target_itl_ms = 1e-6;
  Engine engine(ckpt, limited);
  const int64_t first = engine.add_request(decoding);
  engine.step();  // its prefill, alone: the whole prompt, and the cost model's first sample
  EXPECT_EQ(engine.last_step().num_tokens, 12);
  EXPECT_GT(engine.step_cost().per_token_ms + engine.step_cost().fixed_ms, 0);
  const int64_t second = engine.add_request(arriving);
  std::vector<int32_t> step_tokens;
  while (engine.has_unfinished()) {
    engine.step();
    step_tokens.push_back(engine.last_step().num_tokens);
  }
  // One decode beside each chunk: 33, 33, 33, 33, 23, then decodes of both.
  ASSERT_GE(step_tokens.size(), 5u);
  EXPECT_EQ(std::vector<int32_t>(step_tokens.begin(), step_tokens.begin() + 5),
            (std::vector<int32_t>{33, 33, 33, 33, 23}));
  const RequestOutput got_first = engine.take_output(first);
  const RequestOutput got_second = engine.take_output(second);
  EXPECT_EQ(got_first.tokens, alone[0].tokens);
  EXPECT_EQ(got_second.tokens, alone[1].tokens);
  const Tensor& logits = got_second.prompt_logits;
  ASSERT_EQ(logits.numel(), alone[1].prompt_logits.numel());
  EXPECT_EQ(std::memcmp(logits.data<float>(), alone[1].prompt_logits.data<float>(),
                        logits.numel() * sizeof(float)),
            0);
}

}  // namespace
}  // namespace pagedlm
