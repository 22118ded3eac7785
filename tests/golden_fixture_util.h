// Reading the golden fixtures (testdata/fixtures/*: tiny HF checkpoints with float64 reference
// logits and greedy continuations), shared by the CPU and GPU model tests.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "io_test_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/io/safetensors.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/sched/request.h"

namespace pagedlm::testing {

inline constexpr int kNumCases = 6;

// The last four: FP8 checkpoints (scripts/make_fixtures_fp8.py), their reference the float64
// logits of the dequantized weights.
inline const char* const kFixtures[] = {
    "llama-gqa",  "llama3-rope", "qwen2-bias", "qwen3-qknorm", "mistral", "gemma2",
    "gemma3",     "phi3",        "qwen3-yarn", "qwen3-moe",    "mixtral", "phi3-d96",
    "gemma2-d80", "fp8-tensor",  "fp8-block",  "ct-mixed",     "fbgemm"};

struct Expected {
  std::vector<std::vector<int32_t>> prompts, greedy;
  std::vector<std::vector<float>> margins;  // reference top-1 minus top-2 logit per greedy step
  std::vector<Tensor> logits;               // [prompt_len, vocab] each
};

inline std::vector<int32_t> to_ids(const Tensor& t) {
  return std::vector<int32_t>(t.data<int32_t>(), t.data<int32_t>() + t.numel());
}

inline Expected load_expected(const std::string& name) {
  SafetensorsFile f = SafetensorsFile::open(fixture_dir(name) + "/expected.safetensors");
  Expected e;
  for (int i = 0; i < kNumCases; ++i) {
    const std::string p = "case" + std::to_string(i) + ".";
    e.prompts.push_back(to_ids(f.tensors().at(p + "prompt")));
    e.greedy.push_back(to_ids(f.tensors().at(p + "greedy")));
    const Tensor& m = f.tensors().at(p + "greedy_margin");
    e.margins.emplace_back(m.data<float>(), m.data<float>() + m.numel());
    e.logits.push_back(f.tensors().at(p + "logits").to_f32());
  }
  return e;
}

// ||out - ref|| / ||ref|| over rows [first_row, ref rows) of both.
inline double relative_error(const Tensor& out, const Tensor& ref, int64_t first_row = 0) {
  const int64_t cols = ref.dim(1);
  double diff = 0, norm = 0;
  for (int64_t i = first_row * cols; i < ref.numel(); ++i) {
    const double r = ref.data<float>()[i], o = out.data<float>()[i];
    diff += (o - r) * (o - r);
    norm += r * r;
  }
  return std::sqrt(diff / norm);
}

// Mixtures of experts are discontinuous where two experts' router probabilities are within
// rounding of each other: a forward that rounds anything (bf16 weights, activations or KV cache)
// may pick the other expert there, and that position's logits then differ by the two experts'
// difference, far beyond the rounding. A position this far from the reference counts as such a
// flip.
inline constexpr double kFlippedPosition = 5e-2;

// Per-position relative errors of logits [rows, vocab] against the reference.
inline std::vector<double> position_errors(const Tensor& got, const Tensor& ref) {
  const int64_t rows = ref.dim(0), vocab = ref.dim(1);
  std::vector<double> errors;
  for (int64_t r = 0; r < rows; ++r) {
    double diff = 0, norm = 0;
    for (int64_t v = 0; v < vocab; ++v) {
      const double want = ref.data<float>()[r * vocab + v];
      const double d = got.data<float>()[r * vocab + v] - want;
      diff += d * d;
      norm += want * want;
    }
    errors.push_back(std::sqrt(diff / norm));
  }
  return errors;
}

inline bool has_experts(const Checkpoint& ckpt) { return ckpt.config.moe.num_experts > 0; }

// One case's prompt logits of two runs (whole prompts and chunked ones, errors err and
// chunked_err) against the reference `ref`: each within `tolerance`, or, for a mixture of
// experts, their per-position errors added to `positions` for expect_moe_positions.
inline void expect_case_logits(const RequestOutput& whole, double err, const RequestOutput& chunked,
                               double chunked_err, const Tensor& ref, bool moe, double tolerance,
                               std::vector<double>& positions, const std::string& label) {
  if (!moe) {
    EXPECT_LT(err, tolerance) << label;
    EXPECT_LT(chunked_err, tolerance) << label << " chunked";
    return;
  }
  for (const RequestOutput* run : {&whole, &chunked}) {
    const std::vector<double> e = position_errors(run->prompt_logits, ref);
    positions.insert(positions.end(), e.begin(), e.end());
  }
}

// A mixture of experts' per-position errors over all its cases (position_errors): the median
// within `tolerance`, and at most 1 in 10 positions beyond `flipped` (where a rounding picked
// another expert). Prints both, after `label`.
inline void expect_moe_positions(std::vector<double> positions, double tolerance, double flipped,
                                 const std::string& label) {
  ASSERT_FALSE(positions.empty()) << label;
  const auto beyond =
      std::count_if(positions.begin(), positions.end(), [&](double e) { return e > flipped; });
  std::nth_element(positions.begin(), positions.begin() + positions.size() / 2, positions.end());
  const double median = positions[positions.size() / 2];
  std::printf("%s: median position error %.2e, %lld of %zu positions beyond %.3g\n", label.c_str(),
              median, static_cast<long long>(beyond), positions.size(), flipped);
  EXPECT_LT(median, tolerance) << label;
  EXPECT_LE(beyond * 10, static_cast<int64_t>(positions.size())) << label;
}

// Every position's logits, computed (no prefix-cache hit), no generated token.
inline Request logits_request(const std::vector<int32_t>& prompt) {
  Request r;
  r.prompt = prompt;
  r.sampling.max_tokens = 0;
  r.want_prompt_logits = true;
  r.use_prefix_cache = false;
  return r;
}

// The reference's greedy continuations are this long.
inline constexpr int32_t kGreedyTokens = 12;

// A greedy request (EOS ignored) per fixture prompt.
inline std::vector<Request> greedy_requests(const Expected& e) {
  std::vector<Request> requests;
  for (const auto& p : e.prompts) {
    Request r;
    r.prompt = p;
    r.sampling.max_tokens = kGreedyTokens;
    r.sampling.ignore_eos = true;
    requests.push_back(std::move(r));
  }
  return requests;
}

// Each case's tokens equal the reference's greedy ones up to the first step whose reference
// top-2 gap is at most `margin`: there an engine of other precision may legitimately pick the
// other token, and past it the continuations diverge.
inline void expect_reference_greedy(const std::vector<RequestOutput>& outputs, const Expected& e,
                                    float margin, const std::string& label) {
  for (int i = 0; i < kNumCases; ++i) {
    ASSERT_EQ(outputs[i].tokens.size(), static_cast<size_t>(kGreedyTokens)) << label;
    for (int t = 0; t < kGreedyTokens; ++t) {
      if (e.margins[i][t] <= margin) break;
      ASSERT_EQ(outputs[i].tokens[t], e.greedy[i][t]) << label << " case " << i << " step " << t;
    }
  }
}

// Two engines in one process, each engine i (0 and 1) built by make(i) and given
// greedy_requests(e): stepped in turns on this thread, then at the same time on a thread each,
// they must each give exactly the tokens the same engine gives alone (nothing of one engine's
// state, on the host or the device, may leak into the other's). check(i) runs on the thread
// that has just stepped engine i (after use_on_this_thread and after each of its steps in
// turns, after its last step at once), for checks of that thread's state.
inline void expect_two_engines_give_their_tokens_alone(
    const std::function<std::unique_ptr<Engine>(int)>& make, const Expected& e,
    const std::function<void(int)>& check = [](int) {}) {
  auto tokens_of = [](const std::vector<RequestOutput>& outputs) {
    std::vector<std::vector<int32_t>> tokens;
    for (const RequestOutput& o : outputs) tokens.push_back(o.tokens);
    return tokens;
  };
  std::vector<std::vector<int32_t>> alone[2];
  for (int i = 0; i < 2; ++i) alone[i] = tokens_of(make(i)->generate(greedy_requests(e)));

  {  // In turns on this thread.
    std::unique_ptr<Engine> engines[2] = {make(0), make(1)};
    std::vector<int64_t> ids[2];
    for (int i = 0; i < 2; ++i) {
      for (Request& r : greedy_requests(e)) ids[i].push_back(engines[i]->add_request(std::move(r)));
    }
    while (engines[0]->has_unfinished() || engines[1]->has_unfinished()) {
      for (int i = 0; i < 2; ++i) {
        if (!engines[i]->has_unfinished()) continue;
        engines[i]->use_on_this_thread();
        engines[i]->step();
        check(i);
      }
    }
    for (int i = 0; i < 2; ++i) {
      for (size_t c = 0; c < ids[i].size(); ++c) {
        EXPECT_EQ(engines[i]->take_output(ids[i][c]).tokens, alone[i][c])
            << "in turns: engine " << i << " case " << c;
      }
    }
  }

  {  // At the same time, a thread each.
    std::unique_ptr<Engine> engines[2] = {make(0), make(1)};
    std::vector<std::vector<int32_t>> got[2];
    std::exception_ptr failed[2];
    std::vector<std::thread> threads;
    for (int i = 0; i < 2; ++i) {
      threads.emplace_back([&, i] {
        try {
          engines[i]->use_on_this_thread();
          got[i] = tokens_of(engines[i]->generate(greedy_requests(e)));
          check(i);
        } catch (...) {
          failed[i] = std::current_exception();
        }
      });
    }
    for (std::thread& t : threads) t.join();
    for (int i = 0; i < 2; ++i) {
      if (failed[i]) std::rethrow_exception(failed[i]);
      EXPECT_EQ(got[i], alone[i]) << "at the same time: engine " << i;
    }
  }
}

}  // namespace pagedlm::testing
