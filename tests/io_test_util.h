// Helpers shared by the io tests: scratch folders and raw file bytes.
#pragma once

#include <gtest/gtest.h>
#include <stdlib.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

namespace pagedlm::testing {

// A golden fixture's folder under testdata/fixtures (config, weights, float64 logits).
inline std::string fixture_dir(const std::string& name) {
  return std::string(PAGEDLM_TESTDATA) + "/fixtures/" + name;
}

// For EXPECT_CONTAINS(text, part): passes when `part` occurs in `text`.
inline ::testing::AssertionResult contains_format(const char* text_expr, const char* part_expr,
                                                  const std::string& text,
                                                  const std::string& part) {
  if (text.find(part) != std::string::npos) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure() << text_expr << " = \"" << text << "\" lacks " << part_expr;
}

// A fresh folder under the test temp dir, removed with everything in it on destruction.
class TempDir {
 public:
  TempDir() {
    std::string pattern = ::testing::TempDir() + "pagedlm_io_XXXXXX";
    const char* made = ::mkdtemp(pattern.data());
    if (made == nullptr) throw std::runtime_error("mkdtemp failed for " + pattern);
    path_ = made;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;

  const std::filesystem::path& path() const { return path_; }
  std::string file(const std::string& name) const { return (path_ / name).string(); }

 private:
  std::filesystem::path path_;
};

inline std::string read_bytes(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

inline void write_bytes(const std::filesystem::path& path, const std::string& bytes) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  if (!out.good()) throw std::runtime_error("cannot write " + path.string());
}

// A safetensors file's bytes from its parts: u64 little-endian header length, header, data.
inline std::string safetensors_bytes(const std::string& header, const std::string& data) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>((header.size() >> (8 * i)) & 0xff);
  return bytes + header + data;
}

}  // namespace pagedlm::testing

#define EXPECT_CONTAINS(text, part) \
  EXPECT_PRED_FORMAT2(::pagedlm::testing::contains_format, text, part)
