// Tensor parallelism on the CPU: every golden fixture split over 2 and 4 ranks (threads joined by
// the shared-memory communicator) still gives HF's float64 logits, the sharded quantized blocks of
// the default GGUF model still give its float64 reference, sizes that cannot split a model are
// refused, and a failing or missing rank ends every rank with an error instead of a hang.
#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <random>
#include <thread>

#include "default_model_util.h"
#include "golden_fixture_util.h"
#include "ops_test_util.h"
#include "pagedlm/engine/cpu_ranks.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/io/safetensors.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/dummy_checkpoint.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/ops/communicator.h"

namespace pagedlm {
namespace {

using namespace pagedlm::testing;  // NOLINT: the fixture helpers
using std::chrono::milliseconds;

constexpr double kLogitsTolerance = 1e-4;  // the golden fixtures' own tolerance
constexpr float kMarginThreshold = 1e-3f;

// Expects `body` to throw a pagedlm::Error whose message contains `needle`.
template <typename Body>
void expect_error(Body body, const std::string& needle) {
  try {
    body();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    return;
  }
  ADD_FAILURE() << "no pagedlm::Error thrown (expected one containing \"" << needle << "\")";
}

class TensorParallelFixture : public ::testing::TestWithParam<const char*> {
 protected:
  void SetUp() override {
    checkpoint_ = load_checkpoint(fixture_dir(GetParam()));
    expected_ = load_expected(GetParam());
  }

  std::vector<RequestOutput> logits_of_all_cases(int32_t tp, int32_t budget) {
    EngineOptions opts;
    opts.tensor_parallel_size = tp;
    opts.max_num_batched_tokens = budget;
    opts.num_pages = 256;
    Engine engine(checkpoint_, opts);
    std::vector<Request> requests;
    for (const auto& p : expected_.prompts) requests.push_back(logits_request(p));
    return engine.generate(std::move(requests));
  }

  Checkpoint checkpoint_;
  Expected expected_;
};

// The fixtures have 4 q heads and 2 kv heads: at 2 ranks each holds one kv head, at 4 each kv
// head is held by two ranks.
// Mixture-of-experts fixtures split each expert's intermediate size (128: 64 or 32 a rank).

TEST_P(TensorParallelFixture, LogitsMatchTheReferenceAtOneTwoAndFourRanks) {
  std::vector<RequestOutput> single;
  for (const int32_t tp : {1, 2, 4}) {
    for (const int32_t budget : {4096, 16}) {  // one packed step; chunked prefill
      SCOPED_TRACE(::testing::Message() << GetParam() << ", " << tp << " ranks, budget " << budget);
      const std::vector<RequestOutput> out = logits_of_all_cases(tp, budget);
      for (int i = 0; i < kNumCases; ++i) {
        EXPECT_LT(relative_error(out[i].prompt_logits, expected_.logits[i]), kLogitsTolerance)
            << "case " << i;
      }
      if (tp == 1 && budget == 4096) single = out;
      // The ranks change only the order of float32 sums (partial products per rank, summed by
      // the all-reduce): the logits stay those of one rank to float32 rounding.
      for (int i = 0; i < kNumCases && budget == 4096; ++i) {
        EXPECT_LT(relative_error(out[i].prompt_logits, single[i].prompt_logits), 2e-6)
            << "case " << i << " against 1 rank";
      }
    }
  }
}

TEST_P(TensorParallelFixture, GreedyGenerationMatchesTheReferenceAtTwoAndFourRanks) {
  for (const int32_t tp : {2, 4}) {
    EngineOptions opts;
    opts.tensor_parallel_size = tp;
    opts.num_pages = 256;
    Engine engine(checkpoint_, opts);
    expect_reference_greedy(engine.generate(greedy_requests(expected_)), expected_,
                            kMarginThreshold, cat(GetParam(), " at ", tp, " ranks"));
  }
}

INSTANTIATE_TEST_SUITE_P(Fixtures, TensorParallelFixture, ::testing::ValuesIn(kFixtures),
                         [](const auto& info) {
                           std::string n = info.param;
                           for (char& c : n) c = std::isalnum(c) ? c : '_';
                           return n;
                         });

// The default model keeps its Q4_1 blocks on the CPU; at 3 ranks (9 q heads, 3 kv heads) o and
// down are split along their input columns at block boundaries (192 and 512 columns a rank).
TEST(TensorParallel, ShardedQuantizedBlocksMatchTheSmolLM2Reference) {
  REQUIRE_DEFAULT_MODEL();
  const std::string path = default_model_path();
  SafetensorsFile ref =
      SafetensorsFile::open(std::string(PAGEDLM_TESTDATA) + "/smollm2/reference.safetensors");
  const Checkpoint ckpt = load_checkpoint(path);
  ASSERT_FALSE(ckpt.quantized.empty());
  EngineOptions opts;
  opts.num_pages = 64;
  opts.tensor_parallel_size = 3;
  Engine engine(ckpt, opts);
  std::vector<Request> requests;
  std::vector<Tensor> expected;
  for (int i = 0;; ++i) {
    auto it = ref.tensors().find(cat("case", i, ".prompt"));
    if (it == ref.tensors().end()) break;
    requests.push_back(logits_request(to_ids(it->second)));
    expected.push_back(ref.tensors().at(cat("case", i, ".logits")).to_f32());
  }
  ASSERT_GE(requests.size(), 5u);
  const std::vector<RequestOutput> outputs = engine.generate(requests);
  for (size_t i = 0; i < outputs.size(); ++i) {
    EXPECT_LT(last_rows_relative_error(outputs[i].prompt_logits, expected[i]), 1e-3)
        << "case " << i;  // smollm2_gguf_test's
  }
}

ModelConfig fixture_config() { return load_checkpoint(fixture_dir("llama-gqa")).config; }

TEST(TensorParallel, RefusesSizesThatDoNotSplitTheModel) {
  const ModelConfig c = fixture_config();  // 4 q heads, 2 kv heads, MLP 512, vocab 512
  expect_error([&] { check_tensor_parallel(c, 3); }, "does not divide the 4 attention heads");
  expect_error([&] { check_tensor_parallel(c, 8); }, "does not divide the 4 attention heads");
  expect_error([&] { check_tensor_parallel(c, 0); }, "must be >= 1");
  ModelConfig odd_kv = c;
  odd_kv.num_heads = 12;
  odd_kv.num_kv_heads = 3;
  expect_error([&] { check_tensor_parallel(odd_kv, 2); }, "3 kv heads");
  ModelConfig odd_vocab = c;
  odd_vocab.vocab_size = 511;
  expect_error([&] { check_tensor_parallel(odd_vocab, 2); }, "vocabulary of 511");
  ModelConfig odd_mlp = c;
  odd_mlp.intermediate_size = 510;
  expect_error([&] { check_tensor_parallel(odd_mlp, 4); }, "intermediate size 510");
  const Checkpoint ckpt = load_checkpoint(fixture_dir("llama-gqa"));
  EngineOptions opts;
  opts.tensor_parallel_size = 3;
  expect_error([&] { Engine engine(ckpt, opts); }, "does not divide the 4 attention heads");
}

TEST(TensorParallel, RanksOfFewerKvHeadsShareTheirGroupsKvHead) {
  ModelConfig c = fixture_config();
  c.num_heads = 8;
  c.num_kv_heads = 2;  // q heads 0-3 read kv head 0, 4-7 kv head 1
  for (int32_t r = 0; r < 4; ++r) {
    const RankDims d = rank_dims(c, {r, 4});
    EXPECT_EQ(d.q_heads, 2);
    EXPECT_EQ(d.kv_heads, 1);
    EXPECT_EQ(d.kv_head_begin, r / 2)
        << "rank " << r << " holds q heads " << 2 * r << "-" << 2 * r + 1;
  }
  // A fused q|k|v of rank 3: q rows of heads 6-7, then kv head 1's k rows and v rows.
  const int64_t dh = c.head_dim;
  const ShardRanges s =
      shard_ranges(c, {3, 4}, Shard::kQkvHeadRows, {(8 + 2 * 2) * dh, c.hidden_size});
  ASSERT_EQ(s.ranges.size(), 3u);
  EXPECT_EQ(s.ranges[0], std::make_pair(6 * dh, 8 * dh));
  EXPECT_EQ(s.ranges[1], std::make_pair(9 * dh, 10 * dh));
  EXPECT_EQ(s.ranges[2], std::make_pair(11 * dh, 12 * dh));
}

// A rank's random weights are the single rank's in its share (the rest is never read).
TEST(TensorParallel, ARanksDummyWeightsAreTheWholeModelsInItsShare) {
  const ModelConfig c = fixture_config();
  const Checkpoint whole = make_dummy_checkpoint(c, 5);
  const Checkpoint rank1 = make_dummy_checkpoint(c, 5, {1, 2});
  const Family& family = family_of(c);
  const int64_t D = c.hidden_size, F = c.intermediate_size, dh = c.head_dim;
  for (const auto& [w, begin, end, by_cols] :
       {std::tuple<LayerWeight, int64_t, int64_t, bool>{LayerWeight::kQ, 2 * dh, 4 * dh, false},
        {LayerWeight::kK, dh, 2 * dh, false},
        {LayerWeight::kDown, F / 2, F, true},
        {LayerWeight::kO, 2 * dh, 4 * dh, true}}) {
    const std::string name = hf_weight_name(family, 1, w);
    const Tensor a = whole.tensors.at(name), b = rank1.tensors.at(name);
    const int64_t cols = a.dim(1);
    for (int64_t r = 0; r < a.dim(0); ++r) {
      for (int64_t col = 0; col < cols; ++col) {
        if ((by_cols ? col : r) < begin || (by_cols ? col : r) >= end) continue;
        ASSERT_EQ(a.data<uint16_t>()[r * cols + col], b.data<uint16_t>()[r * cols + col]) << name;
      }
    }
  }
  const Tensor& embed = rank1.tensors.at("model.embed_tokens.weight");
  EXPECT_EQ(embed.data<uint16_t>()[(c.vocab_size - 1) * D],
            whole.tensors.at("model.embed_tokens.weight").data<uint16_t>()[(c.vocab_size - 1) * D]);
  EXPECT_EQ(shard_of_tensor(c, "model.norm.weight"), Shard::kReplicated);
  EXPECT_EQ(shard_of_tensor(c, hf_weight_name(family, 0, LayerWeight::kUp)), Shard::kRows);
}

// GGUF blocks hold 32 weights along a row: a split of the input columns inside a block is
// refused, naming the tensor.
TEST(TensorParallel, RefusesAColumnSplitInsideAQuantizedBlock) {
  ModelConfig c = fixture_config();
  c.intermediate_size = 96;  // 3 blocks: 2 ranks would cut the middle one
  Checkpoint ckpt = make_dummy_checkpoint(c, 1);
  std::mt19937 rng(3);
  const std::string down = hf_weight_name(family_of(c), 0, LayerWeight::kDown);
  ckpt.tensors.erase(down);
  ckpt.quantized.emplace(down, random_blocks(QuantType::kQ8_0, c.hidden_size, 96, rng));
  auto comms = ops::make_thread_communicators(2, milliseconds(1000));
  expect_error(
      [&] {
        create_model(ckpt, Device::kCpu, {0, 2}, comms[0].get());
      },
      "would split it at column 48, inside a block");
}

TEST(ThreadCommunicator, AllReduceSumsEveryRanksTensorInPlace) {
  constexpr int32_t kRanks = 4;
  constexpr int64_t kN = 1001;  // not a multiple of the ranks: uneven slices
  auto comms = ops::make_thread_communicators(kRanks, milliseconds(60000));
  std::vector<Tensor> x;
  for (int32_t r = 0; r < kRanks; ++r) {
    std::vector<float> v(kN);
    for (int64_t i = 0; i < kN; ++i) v[i] = static_cast<float>((r + 1) * 1000 + i);  // exact
    x.push_back(Tensor::from_f32(v, {kN}));
  }
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { comms[r]->all_reduce_sum(x[r], nullptr); });
  }
  for (std::thread& t : threads) t.join();
  for (int32_t r = 0; r < kRanks; ++r) {
    for (int64_t i = 0; i < kN; ++i) {
      // (1 + 2 + 3 + 4) * 1000 + 4 i
      ASSERT_EQ(x[r].data<float>()[i], 10000.f + 4.f * static_cast<float>(i))
          << "rank " << r << " element " << i;
    }
  }
}

TEST(ThreadCommunicator, AllGatherColsLaysTheRanksSideBySide) {
  constexpr int32_t kRanks = 3;
  constexpr int64_t kRows = 5, kCols = 7;
  auto comms = ops::make_thread_communicators(kRanks, milliseconds(60000));
  std::vector<Tensor> local, out;
  for (int32_t r = 0; r < kRanks; ++r) {
    std::vector<float> v(kRows * kCols);
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t j = 0; j < kCols; ++j)
        v[i * kCols + j] = static_cast<float>(i * 100 + r * 10 + j);
    }
    local.push_back(Tensor::from_f32(v, {kRows, kCols}));
    out.push_back(Tensor::zeros(DType::kF32, {kRows, kRanks * kCols}));
  }
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] { comms[r]->all_gather_cols(local[r], out[r], nullptr); });
  }
  for (std::thread& t : threads) t.join();
  for (int32_t r = 0; r < kRanks; ++r) {
    for (int64_t i = 0; i < kRows; ++i) {
      for (int64_t c = 0; c < kRanks * kCols; ++c) {
        const float want = static_cast<float>(i * 100 + (c / kCols) * 10 + c % kCols);
        ASSERT_EQ(out[r].data<float>()[i * kRanks * kCols + c], want) << "rank " << r;
      }
    }
  }
}

TEST(ThreadCommunicator, ARankThatNeverArrivesTimesTheGroupOut) {
  auto comms = ops::make_thread_communicators(2, milliseconds(200));
  Tensor x = Tensor::zeros(DType::kF32, {8});
  const auto begin = std::chrono::steady_clock::now();
  expect_error([&] { comms[0]->all_reduce_sum(x, nullptr); },
               "rank 0 waited 200 ms in a collective");
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(30));
  // The group stays failed: the late rank is told why instead of waiting.
  expect_error([&] { comms[1]->all_reduce_sum(x, nullptr); }, "rank 0 waited");
}

TEST(ThreadCommunicator, AbortWakesTheWaitingRanksWithTheReason) {
  auto comms = ops::make_thread_communicators(3, milliseconds(600000));
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Tensor x = Tensor::zeros(DType::kF32, {4});
      try {
        comms[r]->all_reduce_sum(x, nullptr);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  std::this_thread::sleep_for(milliseconds(50));
  comms[2]->abort("rank 2: out of memory");
  for (std::thread& t : threads) t.join();  // would hang for 10 minutes without the abort
  for (const std::string& e : errors)
    EXPECT_NE(e.find("rank 2: out of memory"), std::string::npos) << e;
}

TEST(ThreadCommunicator, MismatchedSizesAbortInsteadOfReadingPastABuffer) {
  auto comms = ops::make_thread_communicators(2, milliseconds(60000));
  std::vector<std::string> errors(2);
  std::vector<std::thread> threads;
  for (int32_t r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      Tensor x = Tensor::zeros(DType::kF32, {4 + r});
      try {
        comms[r]->all_reduce_sum(x, nullptr);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (const std::string& e : errors)
    EXPECT_NE(e.find("elements but rank"), std::string::npos) << e;
}

// A rank whose step fails ends the step on every rank (the others were waiting in the
// embedding's all-reduce) with its error, and every later step fails at once.
TEST(TensorParallel, AFailingRankEndsTheStepOnEveryRank) {
  const Checkpoint ckpt = load_checkpoint(fixture_dir("llama-gqa"));
  CpuRanks ranks(ckpt, ops::make_thread_communicators(4, milliseconds(600000)));
  EngineOptions options;
  options.page_size = 16;
  ranks.create_ranks(ckpt, options, /*num_pages=*/16);
  StepPlan plan;
  plan.page_size = 16;
  plan.token_ids = {1, 2, 3};
  plan.positions = {0, 1, 2};
  plan.slot_mapping = {0, 1, 2};
  plan.q_indptr = {0, 3};
  plan.kv_indptr = {0, 1};
  plan.kv_page_indices = {0};
  plan.kv_last_page_len = {3};
  plan.logits_rows = {2};
  plan.logits_indptr = {0, 1};
  const ForwardInputs inputs{Tensor::from_i32(plan.token_ids, {3}),
                             Tensor::from_i32(plan.logits_rows, {1})};
  const auto begin = std::chrono::steady_clock::now();
  expect_error([&] { ranks.forward(plan, inputs, [] { fail("out of memory"); }); },
               "tensor-parallel step failed on rank 0: out of memory");
  EXPECT_LT(std::chrono::steady_clock::now() - begin, std::chrono::seconds(60));
  expect_error([&] { ranks.forward(plan, inputs, [] {}); }, "rank 0: out of memory");
}

}  // namespace
}  // namespace pagedlm
