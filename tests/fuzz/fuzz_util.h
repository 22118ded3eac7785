// Helpers shared by the libFuzzer targets.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>

namespace pagedlm::fuzz {

// A failed property: a finding as much as a crash, so it aborts (libFuzzer saves the input).
[[noreturn]] inline void violated(const char* what) {
  std::fprintf(stderr, "fuzz property violated: %s\n", what);
  std::abort();
}

// Checks a property of the code under test; the message names the condition and its line.
#define PAGEDLM_FUZZ_STR2(x) #x
#define PAGEDLM_FUZZ_STR(x) PAGEDLM_FUZZ_STR2(x)
#define PAGEDLM_FUZZ_EXPECT(cond)                                                                 \
  do {                                                                                            \
    if (!(cond)) ::pagedlm::fuzz::violated(#cond " at " __FILE__ ":" PAGEDLM_FUZZ_STR(__LINE__)); \
  } while (0)

// The readers under test take a path and map the file, as they do for real models: the input
// goes into an in-memory file, opened through /proc/self/fd.
class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) {
    fd_ = memfd_create("pagedlm-fuzz", MFD_CLOEXEC);
    if (fd_ < 0) violated("memfd_create failed");
    size_t done = 0;
    while (done < size) {
      const ssize_t n = ::write(fd_, data + done, size - done);
      if (n <= 0) violated("write to the memfd failed");
      done += static_cast<size_t>(n);
    }
    path_ = "/proc/self/fd/" + std::to_string(fd_);
  }
  ~MemFile() { ::close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;

  const std::string& path() const { return path_; }

 private:
  int fd_ = -1;
  std::string path_;
};

inline std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in.good()) violated(("cannot read " + path).c_str());
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline std::string_view as_text(const uint8_t* data, size_t size) {
  return std::string_view(reinterpret_cast<const char*>(data), size);
}

}  // namespace pagedlm::fuzz
