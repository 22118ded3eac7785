// The default model (SmolLM2-135M-Instruct Q4_1 GGUF) for the tests that run the real model. CI
// has it (scripts/test.sh fetches it before the tests), so a test that finds it missing fails and
// says how to fetch it: a skip would let a missing model pass unnoticed.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "pagedlm/io/model_cache.h"

namespace pagedlm {

// What a test that found no default model says.
inline std::string default_model_missing() {
  return default_model_path() +
         " is missing: run scripts/fetch_model.sh (it fetches the model into $PAGEDLM_CACHE, else "
         "~/.cache/pagedlm)";
}

}  // namespace pagedlm

// Fails the test, and leaves it, unless the default model is there.
#define REQUIRE_DEFAULT_MODEL()                                         \
  ASSERT_TRUE(std::filesystem::exists(::pagedlm::default_model_path())) \
      << ::pagedlm::default_model_missing()
