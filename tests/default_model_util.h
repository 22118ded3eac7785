// The default model (SmolLM2-135M-Instruct Q4_1 GGUF) for the tests that run the real model. CI
// has it (scripts/test.sh fetches it before the tests), so a test that finds it missing fails and
// says how to fetch it: a skip would let a missing model pass unnoticed.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

#include "golden_fixture_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/io/safetensors.h"

namespace pagedlm {

// What a test that found no default model says.
inline std::string default_model_missing() {
  return default_model_path() +
         " is missing: run scripts/fetch_model.sh (it fetches the model into $PAGEDLM_CACHE, else "
         "~/.cache/pagedlm)";
}

// The prompts of the default model's reference (testdata/smollm2/reference.safetensors:
// case<i>.prompt, in order), each as a request for its prompt's logits only, outside the prefix
// cache.
inline std::vector<Request> reference_logit_requests(const SafetensorsFile& ref) {
  std::vector<Request> requests;
  for (int i = 0;; ++i) {
    auto it = ref.tensors().find("case" + std::to_string(i) + ".prompt");
    if (it == ref.tensors().end()) break;
    requests.push_back(testing::logits_request(testing::to_ids(it->second)));
  }
  return requests;
}

// Relative Frobenius error of the last `want.dim(0)` rows of `got` against `want` (the reference
// keeps the logits of a prompt's last positions only).
inline double last_rows_relative_error(const Tensor& got, const Tensor& want) {
  return testing::relative_error(got.rows(got.dim(0) - want.dim(0), got.dim(0)), want);
}

}  // namespace pagedlm

// Fails the test, and leaves it, unless the default model is there.
#define REQUIRE_DEFAULT_MODEL()                                         \
  ASSERT_TRUE(std::filesystem::exists(::pagedlm::default_model_path())) \
      << ::pagedlm::default_model_missing()
