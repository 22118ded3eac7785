// Tool calls out of a chat reply (server/tool_calls.h), against the chat templates that define
// the form: a conversation whose assistant turn holds tool calls is rendered by the model's own
// template (Qwen2.5, Qwen3, Hermes 3, Llama 3.1, Mistral v0.3; byte-identical to transformers'
// rendering, see chat_template_test.cc), and the parser must read the calls back out of that
// turn.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/serving/tool_calls.h"
#include "pagedlm/tokenizer/chat_template.h"

namespace pagedlm::serving {
namespace {

using json = nlohmann::ordered_json;

const std::filesystem::path kTemplates = std::filesystem::path(PAGEDLM_TESTDATA) / "chat_templates";

std::string read_template(const std::string& file) {
  std::ifstream in(kTemplates / file);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const json kCalls = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather",
                                    "arguments": {"city": "Paris", "unit": "celsius"}}},
  {"type": "function", "function": {"name": "local_time", "arguments": {"tz": "Europe/Paris"}}}
])");

// The tools of the request, as OpenAI's API takes them.
const json kTools = json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "description": "Current weather.",
   "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                  "unit": {"type": "string"}},
                  "required": ["city"]}}},
  {"type": "function", "function": {"name": "local_time", "description": "Local time.",
   "parameters": {"type": "object", "properties": {"tz": {"type": "string"}},
                  "required": ["tz"]}}}
])");

// The last assistant turn of `messages` (with kTools) as the template renders it, i.e. as the
// model would have written it: the text between the turn's header and its end marker.
std::string assistant_turn(const ChatTemplate& tmpl, const json& messages, const std::string& open,
                           const std::string& close) {
  const std::string rendered =
      tmpl.render(messages, /*add_generation_prompt=*/false, json{{"tools", kTools}});
  const size_t begin = rendered.rfind(open);
  const size_t end = begin == std::string::npos ? begin : rendered.find(close, begin);
  if (end == std::string::npos) ADD_FAILURE() << "no assistant turn in " << rendered;
  return end == std::string::npos ? ""
                                  : rendered.substr(begin + open.size(), end - begin - open.size());
}

TEST(ToolCalls, ReadBackFromTheTemplatesOwnRendering) {
  // Hermes 3's template writes an assistant turn with calls without its text.
  for (const auto& [file, keeps_text] : std::vector<std::pair<std::string, bool>>{
           {"qwen2.5.jinja", true}, {"qwen3.jinja", true}, {"hermes3-tool-use.jinja", false}}) {
    SCOPED_TRACE(file);
    const std::string source = read_template(file);
    ASSERT_FALSE(source.empty());
    EXPECT_EQ(tool_call_format(source), ToolCallFormat::kTags);
    const ChatTemplate tmpl(source, "", "<|im_end|>");
    const json messages = {
        {{"role", "user"}, {"content", "Weather and time in Paris?"}},
        {{"role", "assistant"}, {"content", "Let me check."}, {"tool_calls", kCalls}}};
    const std::string turn =
        assistant_turn(tmpl, messages, "<|im_start|>assistant\n", "<|im_end|>");

    const ParsedReply reply = parse_tool_calls(ToolCallFormat::kTags, turn);
    ASSERT_EQ(reply.calls.size(), 2u) << turn;
    for (size_t i = 0; i < 2; ++i) {
      EXPECT_EQ(reply.calls[i].name, kCalls[i]["function"]["name"]);
      EXPECT_EQ(json::parse(reply.calls[i].arguments), kCalls[i]["function"]["arguments"]);
    }
    const std::string text = keeps_text ? "Let me check." : "";
    EXPECT_EQ(reply.content.find_first_not_of(" \n"), text.empty() ? std::string::npos : 0)
        << reply.content;
    EXPECT_NE(reply.content.find(text), std::string::npos) << reply.content;
    EXPECT_EQ(reply.content.find("tool_call"), std::string::npos) << reply.content;
  }
  for (const std::string file :
       {"smollm2.jinja", "gemma2.jinja", "phi3.5.jinja", "deepseek-r1-distill-qwen.jinja"}) {
    EXPECT_EQ(tool_call_format(read_template(file)), ToolCallFormat::kNone) << file;
  }
}

// Llama 3.1 writes one call as the whole assistant turn, its arguments under "parameters".
TEST(ToolCalls, LlamaJsonReplyReadBack) {
  const std::string source = read_template("llama3.1.jinja");
  ASSERT_EQ(tool_call_format(source), ToolCallFormat::kJsonReply);
  const ChatTemplate tmpl(source, "<|begin_of_text|>", "<|eot_id|>");
  const json messages = {{{"role", "user"}, {"content", "Weather in Paris?"}},
                         {{"role", "assistant"}, {"tool_calls", json::array({kCalls[0]})}}};
  const std::string turn = assistant_turn(
      tmpl, messages, "<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eot_id|>");
  const ParsedReply reply = parse_tool_calls(ToolCallFormat::kJsonReply, turn);
  ASSERT_EQ(reply.calls.size(), 1u) << turn;
  EXPECT_EQ(reply.calls[0].name, "get_weather");
  EXPECT_EQ(json::parse(reply.calls[0].arguments), kCalls[0]["function"]["arguments"]);
  EXPECT_EQ(reply.content, "");
  // Anything else is text: prose, JSON that is not a call, a call with other "parameters".
  for (const std::string text :
       {"It is sunny.", "{\"answer\": 4}", "[1, 2]", "{\"name\": \"f\", \"parameters\": [1]}"}) {
    const ParsedReply r = parse_tool_calls(ToolCallFormat::kJsonReply, text);
    EXPECT_TRUE(r.calls.empty()) << text;
    EXPECT_EQ(r.content, text);
  }
}

// Mistral v0.3 writes its calls as [TOOL_CALLS] and a JSON list (each with a 9-character id).
TEST(ToolCalls, MistralMarkerListReadBack) {
  const std::string source = read_template("mistral-v0.3.jinja");
  ASSERT_EQ(tool_call_format(source), ToolCallFormat::kMarkerList);
  const ChatTemplate tmpl(source, "<s>", "</s>");
  json calls = kCalls;
  calls[0]["id"] = "abcdefgh1";
  calls[1]["id"] = "abcdefgh2";
  const json messages = {{{"role", "user"}, {"content", "Weather and time in Paris?"}},
                         {{"role", "assistant"}, {"tool_calls", calls}}};
  const std::string turn = assistant_turn(tmpl, messages, "[/INST]", "</s>");
  ASSERT_EQ(turn.rfind(kMistralMarker, 0), 0u) << turn;
  const ParsedReply reply = parse_tool_calls(ToolCallFormat::kMarkerList, turn);
  ASSERT_EQ(reply.calls.size(), 2u) << turn;
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(reply.calls[i].name, kCalls[i]["function"]["name"]);
    EXPECT_EQ(json::parse(reply.calls[i].arguments), kCalls[i]["function"]["arguments"]);
  }
  EXPECT_EQ(reply.content, "");

  // Text before the marker is content; a call without arguments has empty ones.
  const ParsedReply r =
      parse_tool_calls(ToolCallFormat::kMarkerList, "Sure. [TOOL_CALLS] [{\"name\": \"now\"}]");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "now");
  EXPECT_EQ(r.calls[0].arguments, "{}");
  EXPECT_EQ(r.content, "Sure. ");
  // Anything else is text, marker included.
  for (const std::string text : {"It is sunny.", "[TOOL_CALLS] not json", "[TOOL_CALLS] []",
                                 "[TOOL_CALLS] {\"name\": \"f\"}", "[TOOL_CALLS] [{\"name\": 3}]",
                                 "[TOOL_CALLS] [{\"name\": \"f\"}, 5]",
                                 "[TOOL_CALLS] [{\"name\": \"f\", \"arguments\": [1]}]"}) {
    const ParsedReply bad = parse_tool_calls(ToolCallFormat::kMarkerList, text);
    EXPECT_TRUE(bad.calls.empty()) << text;
    EXPECT_EQ(bad.content, text);
  }
}

// Mistral's tokenizers hold [TOOL_CALLS] as a special token, which decoding drops: the server
// asks for its id to write the marker back.
TEST(ToolCalls, DroppedCallMarkerIsTheSpecialToken) {
  std::ifstream in(std::filesystem::path(PAGEDLM_TESTDATA) / "tokenizer/tiny/tokenizer.json");
  json spec = json::parse(in);
  const int32_t id = static_cast<int32_t>(spec["model"]["vocab"].size()) +
                     static_cast<int32_t>(spec["added_tokens"].size());
  json marker = spec["added_tokens"][0];
  marker["id"] = id;
  marker["content"] = kMistralMarker;
  spec["added_tokens"].push_back(marker);
  for (const bool special : {true, false}) {
    spec["added_tokens"].back()["special"] = special;
    const Tokenizer tok = Tokenizer::from_tokenizer_json_text(spec.dump(), "test");
    const std::vector<int32_t> ids = {id};
    EXPECT_EQ(tok.decode(ids, /*skip_special_tokens=*/true), special ? "" : kMistralMarker);
    EXPECT_EQ(dropped_call_marker(tok, ToolCallFormat::kMarkerList), special ? id : -1);
    EXPECT_EQ(dropped_call_marker(tok, ToolCallFormat::kTags), -1);
  }
  spec["added_tokens"].erase(spec["added_tokens"].size() - 1);
  EXPECT_EQ(dropped_call_marker(Tokenizer::from_tokenizer_json_text(spec.dump(), "test"),
                                ToolCallFormat::kMarkerList),
            -1);
}

TEST(ToolCalls, WhatIsNotACallStaysText) {
  const std::string plain = "No tools needed: 2 + 2 = 4.";
  EXPECT_TRUE(parse_tool_calls(ToolCallFormat::kTags, plain).calls.empty());
  EXPECT_EQ(parse_tool_calls(ToolCallFormat::kTags, plain).content, plain);
  for (const std::string bad :
       {"<tool_call>\n{\"name\": \"f\", \"arguments\": {\n</tool_call>",       // not JSON
        "<tool_call>\n[1, 2]\n</tool_call>",                                   // not an object
        "<tool_call>\n{\"arguments\": {}}\n</tool_call>",                      // no name
        "<tool_call>\n{\"name\": 3}\n</tool_call>",                            // name not a string
        "<tool_call>\n{\"name\": \"f\", \"arguments\": \"x\"}\n</tool_call>",  // args not object
        "text <tool_call>\n{\"name\": \"f\"}"}) {                              // unclosed
    const ParsedReply r = parse_tool_calls(ToolCallFormat::kTags, bad);
    EXPECT_TRUE(r.calls.empty()) << bad;
    EXPECT_EQ(r.content, bad);
  }
  // A call without arguments has empty ones; text around the blocks is kept.
  const ParsedReply r = parse_tool_calls(
      ToolCallFormat::kTags,
      "a <tool_call>{\"name\": \"now\"}</tool_call> b <tool_call>oops</tool_call>");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "now");
  EXPECT_EQ(r.calls[0].arguments, "{}");
  EXPECT_EQ(r.content, "a  b <tool_call>oops</tool_call>");
}

// The reply is the model's, and a prompt can make it write brackets: a call nested past
// kMaxJsonDepth is text, not a walk down 100000 levels (which would run off the stack).
TEST(ToolCalls, DeeplyNestedCallStaysText) {
  const size_t depth = 100000;
  const std::string args = std::string(depth, '[') + std::string(depth, ']');
  const std::string tagged =
      "<tool_call>{\"name\": \"f\", \"arguments\": " + args + "}</tool_call>";
  const ParsedReply r = parse_tool_calls(ToolCallFormat::kTags, tagged);
  EXPECT_TRUE(r.calls.empty());
  EXPECT_EQ(r.content, tagged);
  const std::string marked =
      std::string(kMistralMarker) + "[{\"name\": \"f\", \"arguments\": {\"a\": " + args + "}}]";
  EXPECT_TRUE(parse_tool_calls(ToolCallFormat::kMarkerList, marked).calls.empty());
}

// Whatever pieces the reply arrives in: the content sent while streaming plus what finish()
// leaves equals the parsed content, no piece of a tag goes out early, and a reply without calls
// is passed through whole.
TEST(ToolCalls, StreamHoldsBackOnlyWhatMayBeACall) {
  const std::vector<std::pair<ToolCallFormat, std::string>> replies = {
      {ToolCallFormat::kTags,
       "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
       "\"Paris\"}}\n</tool_call>"},
      {ToolCallFormat::kTags, "Plain answer with a < sign and <tool but no call."},
      {ToolCallFormat::kTags,
       "<tool_call>{\"name\": \"a\"}</tool_call>\n<tool_call>{\"name\": \"b\"}</tool_call> done"},
      {ToolCallFormat::kTags, "<tool_call>{not json}</tool_call> after"},
      {ToolCallFormat::kJsonReply, " {\"name\": \"get_weather\", \"parameters\": {\"city\": 1}}"},
      {ToolCallFormat::kJsonReply, "{\"not\": \"a call\"}"},
      {ToolCallFormat::kJsonReply, "\n Sunny, 21 degrees."},
      {ToolCallFormat::kMarkerList,
       "[TOOL_CALLS] [{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]"},
      {ToolCallFormat::kMarkerList, "Checking. [TOOL_CALLS] [{\"name\": \"now\"}]"},
      {ToolCallFormat::kMarkerList, "A list [1, 2] and [TOOL brackets, no call."},
  };
  std::mt19937 rng(4);
  for (const auto& [format, reply] : replies) {
    const ParsedReply whole = parse_tool_calls(format, reply);
    for (int trial = 0; trial < 50; ++trial) {
      ToolCallStream stream(format);
      std::string sent;
      for (size_t at = 0; at < reply.size();) {
        const size_t n = std::min<size_t>(reply.size() - at, 1 + rng() % 7);
        const std::string out = stream.push(reply.substr(at, n));
        sent += out;
        at += n;
        EXPECT_EQ(sent.find("<tool_call>"), std::string::npos) << reply;
        EXPECT_EQ(sent.find(kMistralMarker), std::string::npos) << reply;
      }
      std::string unsent;
      const ParsedReply got = stream.finish(reply, &unsent);
      EXPECT_EQ(sent + unsent, whole.content) << reply;
      ASSERT_EQ(got.calls.size(), whole.calls.size()) << reply;
      const std::string_view opener =
          format == ToolCallFormat::kTags ? "<tool_call>" : kMistralMarker;
      if (format != ToolCallFormat::kJsonReply && reply.find(opener) == std::string::npos) {
        // No tag at all: only a tail that looked like the start of one waited for the end.
        EXPECT_LE(unsent.size(), opener.size() - 1) << reply;
      }
      if (format == ToolCallFormat::kJsonReply && reply[reply.find_first_not_of(" \n")] != '{') {
        EXPECT_EQ(unsent, "") << "a reply that does not open with '{' streams as it comes";
      }
    }
  }
}

}  // namespace
}  // namespace pagedlm::serving
