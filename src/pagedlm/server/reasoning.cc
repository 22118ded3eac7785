#include "pagedlm/server/reasoning.h"

#include <algorithm>

namespace pagedlm::server {

namespace {

constexpr std::string_view kSpace = " \t\r\n";

// The length of the longest suffix of `text` that is a proper prefix of `tag`.
size_t partial_tag_at_end(std::string_view text, std::string_view tag) {
  for (size_t n = std::min(text.size(), tag.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

// `text` without its trailing newlines.
std::string_view without_trailing_newlines(std::string_view text) {
  const size_t last = text.find_last_not_of('\n');
  return last == std::string_view::npos ? std::string_view() : text.substr(0, last + 1);
}

}  // namespace

bool prompt_opens_reasoning(std::string_view prompt) {
  const size_t end = prompt.find_last_not_of(kSpace);
  if (end == std::string_view::npos) return false;
  prompt = prompt.substr(0, end + 1);
  return prompt.size() >= kThinkOpen.size() &&
         prompt.substr(prompt.size() - kThinkOpen.size()) == kThinkOpen;
}

ReasoningSplitter::ReasoningSplitter(bool opened)
    : state_(opened ? State::kReasoning : State::kStart) {}

void ReasoningSplitter::add_reasoning(std::string_view text, Split& out) {
  if (!reasoning_started_) {  // the newlines that open the block
    const size_t first = text.find_first_not_of('\n');
    if (first == std::string_view::npos) return;
    text.remove_prefix(first);
    reasoning_started_ = true;
  }
  out.reasoning += text;
}

ReasoningSplitter::Split ReasoningSplitter::push(std::string_view text) {
  Split out;
  held_ += text;
  if (state_ == State::kStart) {
    // Whitespace, then either the opening tag or anything else (then the reply is content).
    const size_t first = held_.find_first_not_of(kSpace);
    if (first == std::string::npos) return out;
    const std::string_view rest = std::string_view(held_).substr(first);
    if (rest.size() < kThinkOpen.size() && kThinkOpen.substr(0, rest.size()) == rest) return out;
    if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
      held_.erase(0, first + kThinkOpen.size());
      state_ = State::kReasoning;
    } else {
      state_ = State::kContent;
      content_started_ = true;  // no block: the reply is content as written
    }
  }
  if (state_ == State::kReasoning) {
    const size_t close = held_.find(kThinkClose);
    if (close == std::string::npos) {
      // Hold back what may begin the closing tag, and the newlines before it (the block's edge
      // if the tag follows, reasoning if more text does).
      const std::string_view ready = without_trailing_newlines(
          std::string_view(held_).substr(0, held_.size() - partial_tag_at_end(held_, kThinkClose)));
      add_reasoning(ready, out);
      held_.erase(0, ready.size());
      return out;
    }
    add_reasoning(without_trailing_newlines(std::string_view(held_).substr(0, close)), out);
    held_.erase(0, close + kThinkClose.size());
    state_ = State::kContent;
  }
  if (!content_started_) {  // the newlines that follow the block
    const size_t first = held_.find_first_not_of('\n');
    if (first == std::string::npos) {
      held_.clear();
      return out;
    }
    held_.erase(0, first);
    content_started_ = true;
  }
  out.content += held_;
  held_.clear();
  return out;
}

ReasoningSplitter::Split ReasoningSplitter::finish() {
  Split out;
  if (state_ == State::kReasoning) {
    add_reasoning(without_trailing_newlines(held_), out);  // the reply ended inside the block
  } else {
    out.content = held_;  // kStart: only whitespace or the beginning of a tag came
  }
  held_.clear();
  return out;
}

}  // namespace pagedlm::server
