// Stop strings over streamed text: finds the first occurrence of any stop string in decoded
// text that arrives in pieces (one per token), across piece boundaries, and holds back text that
// may still turn out to be the start of a stop string, so nothing of a stop string is emitted.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace pagedlm {

class StopStringMatcher {
 public:
  // Empty strings are ignored (they would match everywhere).
  explicit StopStringMatcher(std::vector<std::string> stop_strings);

  // Feeds the next piece of text; returns the text that is now safe to emit. Once a stop string
  // matches, the returned text ends right before it, stopped() turns true and later pushes
  // return nothing.
  std::string push(std::string_view text);
  // The end of the text: releases what was held back (no stop string can complete any more).
  std::string finish();

  bool stopped() const { return stopped_; }
  // The stop string that matched; empty while none has.
  const std::string& matched() const { return matched_; }
  // Once stopped: the text of the matching push that followed the stop string (for a caller
  // that splits text at a marker rather than ending it); empty before.
  const std::string& after_match() const { return after_match_; }
  bool empty() const { return stop_strings_.empty(); }

 private:
  std::vector<std::string> stop_strings_;
  std::string held_;  // not yet emitted; a prefix of some stop string ends it
  bool stopped_ = false;
  std::string matched_;
  std::string after_match_;
};

}  // namespace pagedlm
