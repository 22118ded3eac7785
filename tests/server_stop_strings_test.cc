#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "pagedlm/engine/stop_strings.h"

namespace pagedlm {
namespace {

// Feeds `pieces` one at a time; returns everything emitted (finish() included unless stopped).
std::string run(StopStringMatcher& m, const std::vector<std::string>& pieces) {
  std::string out;
  for (const std::string& p : pieces) out += m.push(p);
  if (!m.stopped()) out += m.finish();
  return out;
}

TEST(StopStringMatcher, NoStopStringsPassesThrough) {
  StopStringMatcher m({});
  EXPECT_TRUE(m.empty());
  EXPECT_EQ(m.push("abc"), "abc");
  EXPECT_EQ(run(m, {"d", "e"}), "de");
  EXPECT_FALSE(m.stopped());
}

TEST(StopStringMatcher, MatchWithinOnePiece) {
  StopStringMatcher m({"STOP"});
  EXPECT_EQ(run(m, {"hello STOP world"}), "hello ");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.matched(), "STOP");
  EXPECT_EQ(m.after_match(), " world");
  EXPECT_EQ(m.push("more"), "");
}

TEST(StopStringMatcher, MatchAcrossPiecesHoldsBackPrefix) {
  StopStringMatcher m({"</end>"});
  EXPECT_EQ(m.push("answer <"), "answer ");  // "<" may start the stop string
  EXPECT_EQ(m.push("/e"), "");
  EXPECT_EQ(m.after_match(), "");
  EXPECT_EQ(m.push("nd> tail"), "");
  EXPECT_TRUE(m.stopped());
  EXPECT_EQ(m.after_match(), " tail");  // what followed the match in the piece that completed it
}

TEST(StopStringMatcher, ReleasesHeldTextWhenPrefixBreaks) {
  StopStringMatcher m({"</end>"});
  EXPECT_EQ(m.push("a </e"), "a ");
  EXPECT_EQ(m.push("x"), "</ex");
  EXPECT_EQ(m.push("</en"), "");
  EXPECT_EQ(m.finish(), "</en");  // the text ended before the stop string could complete
  EXPECT_FALSE(m.stopped());
}

TEST(StopStringMatcher, EarliestMatchWinsAmongSeveral) {
  StopStringMatcher m({"world", "lo w", ""});
  EXPECT_EQ(run(m, {"hel", "lo", " wor", "ld"}), "hel");
  EXPECT_EQ(m.matched(), "lo w");
}

TEST(StopStringMatcher, LongestWinsAtTheSamePosition) {
  StopStringMatcher m({"ab", "abc"});
  EXPECT_EQ(run(m, {"xabcd"}), "x");
  EXPECT_EQ(m.matched(), "abc");
}

TEST(StopStringMatcher, OneCharacterPieces) {
  const std::string text = "The quick brown fox jumps";
  StopStringMatcher m({"fox"});
  std::vector<std::string> pieces;
  for (char c : text) pieces.emplace_back(1, c);
  EXPECT_EQ(run(m, pieces), "The quick brown ");
}

TEST(StopStringMatcher, MultibyteStopString) {
  StopStringMatcher m({"\xc3\xa9t\xc3\xa9"});  // "été"
  EXPECT_EQ(m.push("un \xc3\xa9"), "un ");     // held: a whole "é", a stop-string prefix
  EXPECT_EQ(m.push("t\xc3\xa9 chaud"), "");
  EXPECT_TRUE(m.stopped());
}

TEST(StopStringMatcher, RepeatedPrefixCharacters) {
  StopStringMatcher m({"aab"});
  EXPECT_EQ(m.push("aaa"), "a");  // "aa" may still become "aab"
  EXPECT_EQ(m.push("ab"), "a");   // "aaaab": the stop string starts at index 2
  EXPECT_TRUE(m.stopped());
}

}  // namespace
}  // namespace pagedlm
