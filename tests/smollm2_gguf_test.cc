// The default model end to end: pagedlm's logits on the SmolLM2 Q4_1 GGUF against a float64
// numpy forward over the same GGUF dequantized by llama.cpp's own `gguf` package
// (scripts/make_smollm2_reference.py).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>

#include "default_model_util.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/text_model.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/io/safetensors.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

TEST(SmolLM2Gguf, LogitsMatchFloat64ReferenceOfTheSameGguf) {
  REQUIRE_DEFAULT_MODEL();
  const std::string path = default_model_path();
  SafetensorsFile ref =
      SafetensorsFile::open(std::string(PAGEDLM_TESTDATA) + "/smollm2/reference.safetensors");
  Checkpoint ckpt = load_checkpoint(path);
  EngineOptions opts;
  opts.num_pages = 64;
  Engine engine(ckpt, opts);
  const std::vector<Request> requests = reference_logit_requests(ref);
  std::vector<Tensor> expected;
  for (size_t i = 0; i < requests.size(); ++i) {
    expected.push_back(ref.tensors().at("case" + std::to_string(i) + ".logits"));
  }
  ASSERT_GE(requests.size(), 5u);
  auto outputs = engine.generate(requests);
  EXPECT_EQ(engine.num_steps(), 1);
  for (size_t i = 0; i < outputs.size(); ++i) {
    const double err = last_rows_relative_error(outputs[i].prompt_logits, expected[i]);
    std::printf("case %zu: relative error %.2e\n", i, err);
    EXPECT_LT(err, 1e-3) << "case " << i;
  }
}

TEST(SmolLM2Gguf, GreedyChatAnswerNamesParis) {
  REQUIRE_DEFAULT_MODEL();
  const std::string path = default_model_path();
  TextModel model = load_text_model(path);
  ASSERT_TRUE(model.chat_template.has_value());
  const std::string prompt = model.chat_template->render(
      nlohmann::ordered_json::array(
          {{{"role", "user"}, {"content", "What is the capital of France?"}}}),
      /*add_generation_prompt=*/true);
  EXPECT_EQ(prompt,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
            "Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
            "<|im_start|>assistant\n");
  Engine engine(model.checkpoint, EngineOptions{});
  Request r;
  r.prompt = model.tokenizer->encode(prompt);
  r.sampling.max_tokens = 32;
  const RequestOutput out = engine.generate({r})[0];
  const std::string answer = model.tokenizer->decode(out.tokens, /*skip_special_tokens=*/true);
  EXPECT_NE(answer.find("Paris"), std::string::npos) << answer;
  EXPECT_EQ(out.reason, FinishReason::kStop) << "the answer should end with <|im_end|>";
}

// What a decode step reads of the weights (the benchmark's bytes and GB/s): the GGUF's blocks as
// the CPU keeps them, not float32. The sizes are the GGUF's own, listed by llama.cpp's `gguf`
// package: 210 Q4_1 matrices of 66355200 bytes, which the CPU repacks with float32 scales (20 ->
// 24 bytes a block, core/quantized.h), and the tied head's Q8_0 embedding of 30081024 bytes.
TEST(SmolLM2Gguf, StepWeightBytesAreTheBlocksRead) {
  REQUIRE_DEFAULT_MODEL();
  const std::string path = default_model_path();
  EngineOptions opts;
  opts.num_pages = 16;
  Engine engine(load_checkpoint(path), opts);
  EXPECT_EQ(engine.step_weight_bytes(), int64_t{66355200} / 20 * 24 + 30081024);
}

}  // namespace
}  // namespace pagedlm
