// The parsers of a model's reply (server/tool_calls.h, server/reasoning.h), which read text a
// client can steer through its prompt. Input: a first byte choosing the tool-call form (bits
// 0-1) and whether the prompt opened a <think> block (bit 2), then the reply, streamed in pieces
// cut at each '\x01' byte. Properties: nothing throws; what a ToolCallStream sends is a prefix
// of the parsed content and, with its unsent rest, the content itself; a ReasoningSplitter
// gives the same reasoning and content however the reply is cut.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "fuzz_util.h"
#include "pagedlm/serving/reasoning.h"
#include "pagedlm/serving/tool_calls.h"

namespace {

using pagedlm::serving::ParsedReply;
using pagedlm::serving::ReasoningSplitter;
using pagedlm::serving::ToolCallFormat;
using pagedlm::serving::ToolCallStream;

void check_tool_calls(ToolCallFormat format, const std::vector<std::string_view>& pieces,
                      const std::string& reply) {
  ToolCallStream stream(format);
  std::string sent;
  for (std::string_view piece : pieces) sent += stream.push(piece);
  std::string unsent;
  const ParsedReply streamed = stream.finish(reply, &unsent);
  PAGEDLM_FUZZ_EXPECT(streamed.content.compare(0, sent.size(), sent) == 0);
  PAGEDLM_FUZZ_EXPECT(sent + unsent == streamed.content);
  const ParsedReply whole = pagedlm::serving::parse_tool_calls(format, reply);
  PAGEDLM_FUZZ_EXPECT(whole.content == streamed.content);
  PAGEDLM_FUZZ_EXPECT(whole.calls.size() == streamed.calls.size());
  for (const pagedlm::serving::ToolCall& call : whole.calls) {
    PAGEDLM_FUZZ_EXPECT(!call.arguments.empty() && call.arguments.front() == '{');
  }
}

ReasoningSplitter::Split split(bool opened, const std::vector<std::string_view>& pieces) {
  ReasoningSplitter splitter(opened);
  ReasoningSplitter::Split all;
  auto add = [&all](const ReasoningSplitter::Split& s) {
    all.reasoning += s.reasoning;
    all.content += s.content;
  };
  for (std::string_view piece : pieces) add(splitter.push(piece));
  add(splitter.finish());
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  static constexpr ToolCallFormat kFormats[] = {ToolCallFormat::kNone, ToolCallFormat::kTags,
                                                ToolCallFormat::kJsonReply,
                                                ToolCallFormat::kMarkerList};
  const ToolCallFormat format = kFormats[data[0] & 3];
  const bool opened = (data[0] & 4) != 0;
  const std::string_view input = pagedlm::fuzz::as_text(data + 1, size - 1);

  std::vector<std::string_view> pieces;
  std::string reply;
  for (size_t begin = 0;;) {
    const size_t end = input.find('\x01', begin);
    pieces.push_back(input.substr(begin, end - begin));
    reply += pieces.back();
    if (end == std::string_view::npos) break;
    begin = end + 1;
  }

  check_tool_calls(format, pieces, reply);

  const ReasoningSplitter::Split streamed = split(opened, pieces);
  const ReasoningSplitter::Split whole = split(opened, {std::string_view(reply)});
  PAGEDLM_FUZZ_EXPECT(streamed.reasoning == whole.reasoning);
  PAGEDLM_FUZZ_EXPECT(streamed.content == whole.content);
  (void)pagedlm::serving::prompt_opens_reasoning(reply);
  return 0;
}
