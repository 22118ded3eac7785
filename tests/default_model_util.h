// The default model (SmolLM2-135M-Instruct Q4_1 GGUF) for the tests that run the real model. CI
// has it (scripts/test.sh fetches it before the tests), so a test that finds it missing fails and
// says how to fetch it: a skip would let a missing model pass unnoticed.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>
#include <vector>

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
    Request r;
    r.prompt.assign(it->second.data<int32_t>(), it->second.data<int32_t>() + it->second.numel());
    r.sampling.max_tokens = 0;
    r.want_prompt_logits = true;
    r.use_prefix_cache = false;
    requests.push_back(std::move(r));
  }
  return requests;
}

}  // namespace pagedlm

// Fails the test, and leaves it, unless the default model is there.
#define REQUIRE_DEFAULT_MODEL()                                         \
  ASSERT_TRUE(std::filesystem::exists(::pagedlm::default_model_path())) \
      << ::pagedlm::default_model_missing()
