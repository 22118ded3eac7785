// --dtype (EngineOptions::compute_dtype): the names it takes, and the engine's refusal of a dtype
// the device's kernels do not compute in.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "golden_fixture_util.h"
#include "ops_test_util.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

using testing::expect_error;

// The compute dtype is an option; the kernels take the device's own only, and another is refused
// before any weight is loaded: the engine's check and the command line's parser (the model's:
// model_weights_test.cc).
TEST(ComputeDtype, OnlyTheDevicesOwnIsTakenAndNamedOnesParse) {
  EXPECT_EQ(compute_dtype_named("auto"), std::nullopt);
  EXPECT_EQ(compute_dtype_named("float32"), DType::kF32);
  EXPECT_EQ(compute_dtype_named("float"), DType::kF32);
  EXPECT_EQ(compute_dtype_named("bfloat16"), DType::kBF16);
  EXPECT_EQ(compute_dtype_named("half"), DType::kF16);
  expect_error([] { compute_dtype_named("int8"); },
               {"--dtype int8", "not auto, float32, bfloat16 or float16"});

  const Checkpoint checkpoint = load_checkpoint(testing::fixture_dir("llama-gqa"));
  EngineOptions o;
  o.num_pages = 16;
  o.compute_dtype = DType::kBF16;
  expect_error([&] { Engine engine(checkpoint, o); },
               {"the CPU computes in f32, not in bf16", "--dtype"});

  // float32 named is the default: the same logits, bit for bit.
  auto logits = [&](std::optional<DType> dtype) {
    EngineOptions e;
    e.num_pages = 16;
    e.compute_dtype = dtype;
    Engine engine(checkpoint, e);
    Request r;
    r.prompt = {5, 17, 42, 9, 31};
    r.sampling.max_tokens = 1;
    r.want_prompt_logits = true;
    return engine.generate({r})[0].prompt_logits;
  };
  const Tensor implicit = logits(std::nullopt), named = logits(DType::kF32);
  ASSERT_EQ(implicit.numel(), named.numel());
  for (int64_t i = 0; i < implicit.numel(); ++i) {
    ASSERT_EQ(implicit.data<float>()[i], named.data<float>()[i]) << i;
  }
}

}  // namespace
}  // namespace pagedlm
