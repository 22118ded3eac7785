// Reasoning in a chat reply (`pagedlm serve --reasoning-parser`): models such as Qwen3 and
// DeepSeek-R1 think inside <think>...</think> before they answer. The server returns that text
// as the message's `reasoning_content` and the rest as its `content`, as vLLM's reasoning
// parsers do. The block either opens the reply (Qwen3) or was opened by the chat template at
// the end of the prompt (DeepSeek-R1: the reply starts inside it and only closes it). A reply
// that ends inside the block (max_tokens) is all reasoning; one that does not open it, all
// content. Newlines around the block belong to neither, as the templates read a turn back.
#pragma once

#include <string>
#include <string_view>

#include "pagedlm/engine/stop_strings.h"

namespace pagedlm::serving {

inline constexpr std::string_view kThinkOpen = "<think>";
inline constexpr std::string_view kThinkClose = "</think>";

// Whether the rendered prompt leaves a <think> block open for the reply.
bool prompt_opens_reasoning(std::string_view prompt);

class ReasoningSplitter {
 public:
  struct Split {
    std::string reasoning;
    std::string content;
  };

  // opened: the prompt left the block open (prompt_opens_reasoning).
  explicit ReasoningSplitter(bool opened);
  // The reply's next piece; returns what can be told apart now.
  Split push(std::string_view text);
  // At the end of the reply: what was held back.
  Split finish();

 private:
  enum class State { kStart, kReasoning, kContent };
  // Reasoning text, less the newlines that open the block.
  void add_reasoning(std::string_view text, Split& out);

  State state_;
  StopStringMatcher closing_tag_;  // kReasoning: releases the text before </think>
  // kStart: the reply's beginning, which may still turn into <think>; kReasoning: the newlines
  // at the end of what the matcher released.
  std::string held_;
  bool reasoning_started_ = false;  // past the newlines that open the block
  bool content_started_ = false;    // kContent: past the newlines that follow the block
};

}  // namespace pagedlm::serving
