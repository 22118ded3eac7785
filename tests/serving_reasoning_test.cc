// Reasoning out of a chat reply (server/reasoning.h), against the chat templates that define the
// block: Qwen3's template writes an assistant turn's reasoning_content as a <think> block (and
// reads one back with strip('\n') / lstrip('\n')), DeepSeek-R1's generation prompt opens the
// block for the reply. The splitter must give back what the template wrote, whatever pieces the
// reply streams in.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "pagedlm/serving/reasoning.h"
#include "pagedlm/tokenizer/chat_template.h"

namespace pagedlm::serving {
namespace {

using json = nlohmann::ordered_json;

std::string read_template(const std::string& file) {
  std::ifstream in(std::filesystem::path(PAGEDLM_TESTDATA) / "chat_templates" / file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

// The reply split in pieces of random sizes, each pushed in turn, then finish().
ReasoningSplitter::Split split_streamed(const std::string& reply, bool opened, std::mt19937& rng) {
  ReasoningSplitter splitter(opened);
  ReasoningSplitter::Split all;
  auto add = [&](const ReasoningSplitter::Split& s) {
    all.reasoning += s.reasoning;
    all.content += s.content;
  };
  for (size_t at = 0; at < reply.size();) {
    const size_t n = std::min<size_t>(reply.size() - at, 1 + rng() % 6);
    add(splitter.push(std::string_view(reply).substr(at, n)));
    at += n;
  }
  add(splitter.finish());
  return all;
}

void expect_split(const std::string& reply, bool opened, const std::string& reasoning,
                  const std::string& content) {
  std::mt19937 rng(3);
  ReasoningSplitter whole(opened);
  ReasoningSplitter::Split once = whole.push(reply);
  const ReasoningSplitter::Split rest = whole.finish();
  once.reasoning += rest.reasoning;
  once.content += rest.content;
  EXPECT_EQ(once.reasoning, reasoning) << reply;
  EXPECT_EQ(once.content, content) << reply;
  for (int trial = 0; trial < 50; ++trial) {
    const ReasoningSplitter::Split streamed = split_streamed(reply, opened, rng);
    EXPECT_EQ(streamed.reasoning, reasoning) << reply;
    EXPECT_EQ(streamed.content, content) << reply;
  }
}

TEST(Reasoning, Qwen3TurnReadBack) {
  const ChatTemplate tmpl(read_template("qwen3.jinja"), "", "<|im_end|>");
  const std::string reasoning = "The user asks for 2 + 2.\n\nThat is 4.";
  const std::string content = "2 + 2 = 4.";
  const json messages = {
      {{"role", "user"}, {"content", "What is 2 + 2?"}},
      {{"role", "assistant"}, {"content", content}, {"reasoning_content", reasoning}}};
  const std::string rendered = tmpl.render(messages, /*add_generation_prompt=*/false);
  const std::string open = "<|im_start|>assistant\n";
  const size_t begin = rendered.rfind(open);
  const size_t end = rendered.find("<|im_end|>", begin);
  ASSERT_NE(end, std::string::npos) << rendered;
  const std::string turn = rendered.substr(begin + open.size(), end - begin - open.size());
  ASSERT_EQ(turn.rfind(kThinkOpen, 0), 0u) << turn;
  expect_split(turn, /*opened=*/false, reasoning, content);

  // The generation prompt leaves the reply to open the block itself; with thinking off, the
  // template writes an empty block into the prompt and the reply is all content.
  const json ask = {{{"role", "user"}, {"content", "What is 2 + 2?"}}};
  EXPECT_FALSE(prompt_opens_reasoning(tmpl.render(ask, /*add_generation_prompt=*/true)));
  const std::string no_thinking =
      tmpl.render(ask, /*add_generation_prompt=*/true, json{{"enable_thinking", false}});
  EXPECT_NE(no_thinking.find("</think>"), std::string::npos) << no_thinking;
  EXPECT_FALSE(prompt_opens_reasoning(no_thinking));
  expect_split(content, /*opened=*/false, "", content);
}

TEST(Reasoning, DeepSeekR1PromptOpensTheBlock) {
  const ChatTemplate tmpl(read_template("deepseek-r1-distill-qwen.jinja"),
                          "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>");
  const std::string prompt =
      tmpl.render(json{{{"role", "user"}, {"content", "What is 2 + 2?"}}}, true);
  ASSERT_TRUE(prompt_opens_reasoning(prompt)) << prompt;
  expect_split("Simple sum.\n</think>\n\n4", /*opened=*/true, "Simple sum.", "4");
  // Cut off by max_tokens inside the block: all of it is reasoning.
  expect_split("Let me think about this\n\ncarefully", /*opened=*/true,
               "Let me think about this\n\ncarefully", "");
}

TEST(Reasoning, EdgesOfTheBlock) {
  // No block: the reply as written, leading whitespace included.
  expect_split("  Hello <think> there", false, "", "  Hello <think> there");
  expect_split("<thinking>not a tag</thinking>", false, "", "<thinking>not a tag</thinking>");
  // An empty block, a block that never closes, a closing tag inside content.
  expect_split("<think>\n\n</think>\n\nAnswer.", false, "", "Answer.");
  expect_split("\n<think>\nstill going\n", false, "still going", "");
  expect_split("<think>a</think>b </think> c", false, "a", "b </think> c");
  // Only the beginning of a tag, or nothing, came.
  expect_split("<thi", false, "", "<thi");
  expect_split("", false, "", "");
  expect_split("", true, "", "");
}

// Random replies built from pieces of the tags, newlines and text: however the reply is cut into
// pieces, streaming splits it as a whole push does, and what it keeps of the reply is in order.
TEST(Reasoning, AnyChunkingSplitsAsTheWhole) {
  const std::vector<std::string> parts = {"<think>", "</think>", "<", "</", "think", ">",  "\n",
                                          "\n\n",    " ",        "a", "bc", "<thi",  "nk>"};
  std::mt19937 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    std::string reply;
    for (int n = static_cast<int>(rng() % 12); n > 0; --n) reply += parts[rng() % parts.size()];
    for (const bool opened : {false, true}) {
      ReasoningSplitter whole(opened);
      ReasoningSplitter::Split once = whole.push(reply);
      const ReasoningSplitter::Split rest = whole.finish();
      once.reasoning += rest.reasoning;
      once.content += rest.content;
      const ReasoningSplitter::Split streamed = split_streamed(reply, opened, rng);
      EXPECT_EQ(streamed.reasoning, once.reasoning) << reply;
      EXPECT_EQ(streamed.content, once.content) << reply;
      // Nothing is invented: both parts appear in the reply, reasoning before content.
      const size_t r = reply.find(once.reasoning);
      EXPECT_NE(r, std::string::npos) << reply;
      EXPECT_NE(reply.rfind(once.content), std::string::npos) << reply;
      if (!once.reasoning.empty()) {
        EXPECT_NE(once.reasoning.front(), '\n') << reply;
        EXPECT_NE(once.reasoning.back(), '\n') << reply;
      }
    }
  }
}

}  // namespace
}  // namespace pagedlm::serving
