// testdata/gguf/reference.{json,bin} (scripts/make_gguf_reference.py): ggml blocks and the floats
// gguf-py's dequantization makes of them, the reference the GGUF reader and the CPU's block
// kernels are held to.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <iterator>
#include <nlohmann/json.hpp>
#include <string>

namespace pagedlm::testing {

struct GgufReference {
  nlohmann::json manifest;
  std::string bin;

  static const GgufReference& get() {
    static const GgufReference ref = [] {
      GgufReference r;
      const std::string dir = std::string(PAGEDLM_TESTDATA) + "/gguf/";
      std::ifstream json(dir + "reference.json");
      if (!json) throw std::runtime_error("cannot open " + dir + "reference.json");
      r.manifest = nlohmann::json::parse(json);
      std::ifstream bin(dir + "reference.bin", std::ios::binary);
      r.bin.assign(std::istreambuf_iterator<char>(bin), {});
      return r;
    }();
    return ref;
  }
  const uint8_t* bytes(const nlohmann::json& range) const {
    const size_t off = range.at("offset"), len = range.at("length");
    EXPECT_LE(off + len, bin.size());
    return reinterpret_cast<const uint8_t*>(bin.data() + off);
  }
  const float* floats(const nlohmann::json& range) const {
    return reinterpret_cast<const float*>(bytes(range));
  }
  // The entry of that name; fails the test if there is none.
  const nlohmann::json& block(const std::string& name) const {
    for (const nlohmann::json& c : manifest.at("blocks")) {
      if (c.at("name") == name) return c;
    }
    throw std::runtime_error("reference.json has no blocks named " + name);
  }
};

}  // namespace pagedlm::testing
