#include "pagedlm/serving/reasoning.h"

namespace pagedlm::serving {

namespace {

constexpr std::string_view kSpace = " \t\r\n";

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
    : state_(opened ? State::kReasoning : State::kStart),
      closing_tag_({std::string(kThinkClose)}) {}

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
  std::string rest(text);
  if (state_ == State::kStart) {
    // Whitespace, then either the opening tag or anything else (then the reply is content).
    held_ += rest;
    rest.clear();
    const size_t first = held_.find_first_not_of(kSpace);
    if (first == std::string::npos) return out;
    const std::string_view start = std::string_view(held_).substr(first);
    if (start.size() < kThinkOpen.size() && kThinkOpen.substr(0, start.size()) == start) return out;
    if (start.substr(0, kThinkOpen.size()) == kThinkOpen) {
      rest = held_.substr(first + kThinkOpen.size());
      state_ = State::kReasoning;
    } else {
      rest.swap(held_);
      state_ = State::kContent;
      content_started_ = true;  // no block: the reply is content as written
    }
    held_.clear();
  }
  if (state_ == State::kReasoning) {
    // The closing tag's matcher holds back what may begin the tag; held_ keeps the newlines
    // before it (the block's edge if the tag follows, reasoning if more text does).
    held_ += closing_tag_.push(rest);
    if (!closing_tag_.stopped()) {
      const std::string_view ready = without_trailing_newlines(held_);
      add_reasoning(ready, out);
      held_.erase(0, ready.size());
      return out;
    }
    add_reasoning(without_trailing_newlines(held_), out);
    held_.clear();
    rest = closing_tag_.after_match();
    state_ = State::kContent;
  }
  if (!content_started_) {  // the newlines that follow the block
    const size_t first = rest.find_first_not_of('\n');
    if (first == std::string::npos) return out;
    rest.erase(0, first);
    content_started_ = true;
  }
  out.content += rest;
  return out;
}

ReasoningSplitter::Split ReasoningSplitter::finish() {
  Split out;
  if (state_ == State::kReasoning) {  // the reply ended inside the block
    held_ += closing_tag_.finish();
    add_reasoning(without_trailing_newlines(held_), out);
  } else {
    out.content = held_;  // kStart: only whitespace or the beginning of a tag came
  }
  held_.clear();
  return out;
}

}  // namespace pagedlm::serving
