// The command line as a user meets it: the logits command against the golden reference, and
// bad input that must end in a clear message and a non-zero exit, never a crash.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>

#include "default_model_util.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/io/safetensors.h"

namespace pagedlm {
namespace {

namespace fs = std::filesystem;

struct RunResult {
  int exit_code = -1;
  bool crashed = false;
  std::string output;  // stdout and stderr
};

RunResult run(const std::string& args) {
  const std::string cmd = std::string(PAGEDLM_BINARY) + " " + args + " 2>&1";
  RunResult r;
  FILE* pipe = popen(cmd.c_str(), "r");
  std::array<char, 4096> buf;
  while (size_t n = fread(buf.data(), 1, buf.size(), pipe)) r.output.append(buf.data(), n);
  const int status = pclose(pipe);
  r.crashed = WIFSIGNALED(status);
  r.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class CliTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("pagedlm_cli_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string write(const std::string& name, const std::string& content) {
    const std::string path = (dir_ / name).string();
    std::ofstream(path, std::ios::binary) << content;
    return path;
  }

  // A copy of a fixture folder whose files the test may damage.
  std::string copy_fixture(const std::string& name) {
    const fs::path dst = dir_ / name;
    fs::copy(fs::path(PAGEDLM_TESTDATA) / "fixtures" / name, dst);
    return dst.string();
  }

  void expect_failure(const std::string& args, const std::string& needle) {
    const RunResult r = run(args);
    EXPECT_FALSE(r.crashed) << args << "\n" << r.output;
    EXPECT_NE(r.exit_code, 0) << args << "\n" << r.output;
    EXPECT_NE(r.output.find(needle), std::string::npos)
        << "expected '" << needle << "' in the output of: " << args << "\n"
        << r.output;
  }

  fs::path dir_;
};

const std::string kFixture = std::string(PAGEDLM_TESTDATA) + "/fixtures/qwen2-bias";

TEST_F(CliTest, LogitsCommandMatchesTheGoldenReference) {
  SafetensorsFile expected = SafetensorsFile::open(kFixture + "/expected.safetensors");
  std::string prompts = "[";
  for (int i = 0; i < 6; ++i) {
    const Tensor& p = expected.tensors().at("case" + std::to_string(i) + ".prompt");
    prompts += i ? ",[" : "[";
    for (int64_t j = 0; j < p.numel(); ++j) {
      prompts += (j ? "," : "") + std::to_string(p.data<int32_t>()[j]);
    }
    prompts += "]";
  }
  prompts += "]";
  const std::string out = (dir_ / "logits.safetensors").string();
  const RunResult r =
      run("logits --model " + kFixture + " --input " + write("prompts.json", prompts) +
          " --output " + out + " --max-num-batched-tokens 64 --page-size 8");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  SafetensorsFile got = SafetensorsFile::open(out);
  for (int i = 0; i < 6; ++i) {
    const Tensor& ref = expected.tensors().at("case" + std::to_string(i) + ".logits");
    const Tensor& mine = got.tensors().at("logits." + std::to_string(i));
    ASSERT_EQ(mine.shape(), ref.shape());
    double diff = 0, norm = 0;
    for (int64_t j = 0; j < ref.numel(); ++j) {
      const double a = mine.data<float>()[j], b = ref.data<float>()[j];
      diff += (a - b) * (a - b);
      norm += b * b;
    }
    EXPECT_LT(std::sqrt(diff / norm), 1e-4) << "case " << i;
  }
}

TEST_F(CliTest, InspectShowsConfigAndTensors) {
  const RunResult r = run("inspect --tensors --model " + kFixture);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* needle : {"Qwen2ForCausalLM", "q/k/v bias yes", "heads / kv heads  4 / 2",
                             "model.layers.1.self_attn.k_proj.bias", "bf16  [128]"}) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  }
}

// An FP8 checkpoint: each projection's format and scales, the kv cache scales.
TEST_F(CliTest, InspectShowsFp8FormatsAndScales) {
  const RunResult r = run("inspect --tensors --model " PAGEDLM_TESTDATA "/fixtures/ct-mixed");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (const char* needle :
       {"quantization      compressed-tensors: weights e4m3 per-tensor, activations static "
        "per-tensor for re:.*self_attn\\.(q|k|v|o)_proj$",
        "14 FP8 matrices, 4 kv cache scales",
        "model.layers.1.mlp.down_proj.weight                      f8_e4m3 [128, 256]  x per-block "
        "32x32 scale (bf16 [4, 8]); activations dynamic per-token",
        "model.layers.0.mlp.up_proj.weight                        f8_e4m3 [256, 128]  x "
        "per-channel scale (bf16 [256, 1])",
        "input_scale 0.0400391",
        "model.layers.1.self_attn.v_scale                         bf16  "
        "[]  0.0100098"}) {
    EXPECT_NE(r.output.find(needle), std::string::npos) << needle << "\n" << r.output;
  }
}

TEST_F(CliTest, GenerateTokensRunsAndReportsFinish) {
  const RunResult r = run("generate --model " + kFixture + " --tokens \"5 6 7\" --max-tokens 3");
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("finish: length"), std::string::npos) << r.output;
}

TEST_F(CliTest, StopStringCutsTheTextAndFinishesTheRequest) {
  REQUIRE_DEFAULT_MODEL();  // the binary's default, from the same PAGEDLM_CACHE
  const std::string common =
      "generate --chat --prompt \"What is the capital of France?\" --max-tokens 24";
  const RunResult full = run(common);
  ASSERT_EQ(full.exit_code, 0) << full.output;
  const size_t paris = full.output.find("Paris");
  ASSERT_NE(paris, std::string::npos) << full.output;
  const RunResult cut = run(common + " --stop Paris");
  ASSERT_EQ(cut.exit_code, 0) << cut.output;
  // Everything before the stop string, then nothing of it.
  const size_t line_start = full.output.rfind('\n', paris) + 1;
  const std::string before = full.output.substr(line_start, paris - line_start);
  EXPECT_NE(cut.output.find(before + "\n(finish: stop string"), std::string::npos) << cut.output;
  EXPECT_EQ(cut.output.find("Paris"), std::string::npos) << cut.output;
}

// --chat-template renders --chat prompts with the given file: the same tokens as its rendering
// given as a plain text prompt (ChatML's markers parse as the tokenizer's special tokens).
TEST_F(CliTest, ChatTemplateFileRendersTheChatPrompt) {
  REQUIRE_DEFAULT_MODEL();  // the binary's default, from the same PAGEDLM_CACHE
  const fs::path tmpl = fs::temp_directory_path() / "pagedlm_cli_chatml.jinja";
  std::ofstream(tmpl) << "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
                         "<|im_end|>\n{% endfor %}<|im_start|>assistant\nIn one word:";
  const RunResult templated = run("generate --chat --chat-template " + tmpl.string() +
                                  " --prompt \"Capital of France?\" --max-tokens 8");
  const RunResult raw =
      run("generate --prompt \"<|im_start|>user\nCapital of France?<|im_end|>\n"
          "<|im_start|>assistant\nIn one word:\" --max-tokens 8");
  fs::remove(tmpl);
  ASSERT_EQ(templated.exit_code, 0) << templated.output;
  ASSERT_EQ(raw.exit_code, 0) << raw.output;
  // The text and the finish line (the last line holds timings).
  auto reply = [](const std::string& out) { return out.substr(0, out.find("\n1 sequences")); };
  EXPECT_NE(templated.output.find("finish:"), std::string::npos) << templated.output;
  EXPECT_EQ(reply(templated.output), reply(raw.output));
  const RunResult missing = run("generate --chat --chat-template /nonexistent.jinja --prompt x");
  EXPECT_NE(missing.exit_code, 0);
  EXPECT_NE(missing.output.find("nonexistent.jinja"), std::string::npos) << missing.output;
}

TEST_F(CliTest, BadPromptsFilesFailClearly) {
  const std::string model = "--model " + kFixture + " --output " + (dir_ / "o").string();
  expect_failure("logits " + model + " --input " + write("a.json", "[[1, 2"), "not valid JSON");
  expect_failure("logits " + model + " --input " + write("b.json", "{}"), "list");
  expect_failure("logits " + model + " --input " + write("c.json", "[[]]"), "prompt 0");
  expect_failure("logits " + model + " --input " + write("d.json", "[[1, \"x\"]]"),
                 "not a token id");
  expect_failure("logits " + model + " --input " + write("e.json", "[[1, 512]]"), "token id 512");
  expect_failure("logits " + model + " --input " + write("f.json", "[[1, -3]]"), "token id");
  expect_failure("logits " + model + " --input " + (dir_ / "absent.json").string(), "cannot read");
  std::string too_long = "[[";
  for (int i = 0; i < 1100; ++i) too_long += (i ? ",5" : "5");
  too_long += "]]";
  expect_failure("logits " + model + " --input " + write("g.json", too_long), "1100");
}

TEST_F(CliTest, BadTokenPromptsFailClearly) {
  expect_failure("generate --model " + kFixture + " --tokens \"1 x 3\"", "bad token id");
  expect_failure("generate --model " + kFixture + " --tokens \"\"", "no token ids");
  expect_failure("generate --model " + kFixture + " --tokens \"1 99999\"", "out of range");
  expect_failure("generate --model " + kFixture + " --tokens \"1 2\" --page-size 3",
                 "power of two");
  expect_failure("generate --model " + kFixture + " --tokens \"1 2\" --temperature -1",
                 "temperature");
  // The fixture is float32 safetensors: no blocks for 8-bit activations to multiply.
  expect_failure("generate --model " + kFixture + " --tokens \"1 2\" --cpu-q8-activations",
                 "need a GGUF with projection weights in ggml's blocks");
}

TEST_F(CliTest, BrokenModelFilesFailClearly) {
  const std::string prompts =
      " --input " + write("p.json", "[[1,2,3]]") + " --output " + (dir_ / "o").string();
  expect_failure("logits --model " + (dir_ / "missing").string() + prompts, "not found");

  const std::string truncated = copy_fixture("llama-gqa");
  fs::resize_file(truncated + "/model.safetensors", 1000);
  expect_failure("logits --model " + truncated + prompts, "model.safetensors");

  const std::string bad_header = copy_fixture("qwen3-qknorm");
  {
    std::fstream f(bad_header + "/model.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(8);
    f.write("!!!!", 4);
  }
  expect_failure("logits --model " + bad_header + prompts, "model.safetensors");

  const std::string bad_config = copy_fixture("mistral");
  write("mistral/config.json", "{\"architectures\": [\"MistralForCausalLM\"], \"hidden_size\": ");
  expect_failure("logits --model " + bad_config + prompts, "config.json");

  const std::string unsupported = copy_fixture("llama3-rope");
  write("llama3-rope/config.json", "{\"architectures\": [\"GPT2LMHeadModel\"]}");
  expect_failure("logits --model " + unsupported + prompts, "GPT2LMHeadModel");

  const std::string bad_gguf = write("broken.gguf", "GGUF\x03\x00\x00\x00garbage");
  expect_failure("logits --model " + bad_gguf + prompts, "broken.gguf");
}

}  // namespace
}  // namespace pagedlm
