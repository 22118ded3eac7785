// Errors: every failure a user can cause is a pagedlm::Error with a message that names the culprit.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace pagedlm {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// Joins any streamable values into one string: cat("tensor ", name, " has ", n, " dims").
template <typename... Args>
std::string cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}

template <typename... Args>
[[noreturn]] void fail(const Args&... args) {
  throw Error(cat(args...));
}

}  // namespace pagedlm

// Checks a condition that user input can violate; throws pagedlm::Error with the message.
#define PAGEDLM_CHECK(cond, ...)               \
  do {                                         \
    if (!(cond)) ::pagedlm::fail(__VA_ARGS__); \
  } while (0)
