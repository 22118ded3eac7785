#include "pagedlm/engine/stop_strings.h"

#include <algorithm>

namespace pagedlm {

StopStringMatcher::StopStringMatcher(std::vector<std::string> stop_strings) {
  for (std::string& s : stop_strings) {
    if (!s.empty()) stop_strings_.push_back(std::move(s));
  }
}

std::string StopStringMatcher::push(std::string_view text) {
  if (stopped_) return {};
  if (stop_strings_.empty()) return std::string(text);
  held_.append(text);
  // Everything emitted so far was checked not to start a stop string, so any match starts in
  // held_; the earliest one wins, and at one position the longest.
  size_t best = std::string::npos;
  for (const std::string& s : stop_strings_) {
    const size_t pos = held_.find(s);
    if (pos == std::string::npos) continue;
    if (pos < best || (pos == best && s.size() > matched_.size())) {
      best = pos;
      matched_ = s;
    }
  }
  if (best != std::string::npos) {
    stopped_ = true;
    std::string out = held_.substr(0, best);
    after_match_ = held_.substr(best + matched_.size());
    held_.clear();
    return out;
  }
  // Hold back the longest tail of held_ that is a proper prefix of a stop string. Stop strings
  // and held_ are whole UTF-8 characters, so the cut never splits a character.
  size_t keep = 0;
  for (const std::string& s : stop_strings_) {
    for (size_t len = std::min(s.size() - 1, held_.size()); len > keep; --len) {
      if (held_.compare(held_.size() - len, len, s, 0, len) == 0) {
        keep = len;
        break;
      }
    }
  }
  std::string out = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

std::string StopStringMatcher::finish() {
  std::string out;
  out.swap(held_);
  return out;
}

}  // namespace pagedlm
