#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <random>
#include <string>

#include "io_test_util.h"
#include "pagedlm/io/mmap_file.h"
#include "pagedlm/io/safetensors.h"

namespace pagedlm {
namespace {

using nlohmann::json;
using testing::read_bytes;
using testing::safetensors_bytes;
using testing::TempDir;
using testing::write_bytes;

// Runs `open` on bytes written to a file and returns the Error's message ("" if none).
std::string open_error(const TempDir& dir, const std::string& bytes) {
  const std::string path = dir.file("t.safetensors");
  write_bytes(path, bytes);
  try {
    SafetensorsFile::open(path);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::map<std::string, Tensor> sample_tensors() {
  std::map<std::string, Tensor> t;
  t["a.f32"] = Tensor::from_f32({1.5f, -2.f, 3.25f, 0.f, 7.f, -8.5f}, {2, 3});
  t["b.i32"] = Tensor::from_i32({7, -1, 1 << 30}, {3});
  Tensor bf16 = Tensor::empty(DType::kBF16, {3});
  Tensor f16 = Tensor::empty(DType::kF16, {1, 3});
  for (int i = 0; i < 3; ++i) {
    bf16.data<uint16_t>()[i] = f32_to_bf16(0.5f * i - 1.f);
    f16.data<uint16_t>()[i] = f32_to_f16(0.25f * i + 2.f);
  }
  t["c.bf16"] = bf16;
  t["d.f16"] = f16;
  Tensor u8 = Tensor::empty(DType::kU8, {5});
  for (int i = 0; i < 5; ++i) u8.data<uint8_t>()[i] = static_cast<uint8_t>(250 + i);
  t["e.u8"] = u8;
  Tensor f8 = Tensor::empty(DType::kF8E4M3, {2, 2});
  for (int i = 0; i < 4; ++i) f8.data<uint8_t>()[i] = static_cast<uint8_t>(0x38 + i);
  t["e.f8_e4m3"] = f8;
  t["f.empty"] = Tensor::empty(DType::kF32, {0, 4});
  t["g.scalar"] = Tensor::from_f32({42.f}, {});
  return t;
}

TEST(Safetensors, WriteThenReadRoundTrips) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  const auto tensors = sample_tensors();
  write_safetensors(path, tensors);

  const std::string bytes = read_bytes(path);
  uint64_t header_len = 0;
  std::memcpy(&header_len, bytes.data(), 8);
  EXPECT_EQ(header_len % 8, 0u);
  const json header = json::parse(bytes.substr(8, header_len));
  EXPECT_EQ(header["__metadata__"], json({{"format", "pt"}}));
  EXPECT_EQ(header["c.bf16"]["dtype"], "BF16");
  EXPECT_EQ(header["d.f16"]["shape"], json({1, 3}));
  EXPECT_EQ(header["e.f8_e4m3"]["dtype"], "F8_E4M3");  // the Hub's name for torch.float8_e4m3fn

  const SafetensorsFile file = SafetensorsFile::open(path);
  EXPECT_EQ(file.metadata().at("format"), "pt");
  ASSERT_EQ(file.tensors().size(), tensors.size());
  for (const auto& [name, want] : tensors) {
    const Tensor& got = file.tensors().at(name);
    EXPECT_EQ(got.dtype(), want.dtype()) << name;
    EXPECT_EQ(got.shape(), want.shape()) << name;
    ASSERT_EQ(got.nbytes(), want.nbytes()) << name;
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.nbytes()), 0) << name;
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got.raw()) % dtype_size(got.dtype()), 0u) << name;
  }
  EXPECT_EQ(file.tensors().at("g.scalar").data<float>()[0], 42.f);
}

TEST(Safetensors, TensorsOutliveTheFileObject) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  write_safetensors(path, sample_tensors());
  Tensor kept = SafetensorsFile::open(path).tensors().at("a.f32");
  std::filesystem::remove(path);  // the mapping, not the name, keeps the data reachable
  EXPECT_EQ(kept.data<float>()[2], 3.25f);
}

TEST(Safetensors, WriterReplacesAtomicallyAndLeavesNoTempFiles) {
  TempDir dir;
  const std::string path = dir.file("x.safetensors");
  write_safetensors(path, sample_tensors());
  write_safetensors(path, {{"only", Tensor::from_f32({1.f}, {1})}});
  EXPECT_EQ(SafetensorsFile::open(path).tensors().size(), 1u);
  int files = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++files;
  EXPECT_EQ(files, 1);
  EXPECT_THROW(write_safetensors(dir.file("missing/dir/x.safetensors"), sample_tensors()), Error);
}

TEST(Safetensors, MisalignedTensorIsCopiedAligned) {
  // A 1-byte U8 tensor first, then an F32: the F32 starts at an odd file offset.
  const std::string header = R"({"u":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                             R"("f":{"dtype":"F32","shape":[2],"data_offsets":[1,9]}})";
  std::string data(9, '\0');
  const float values[2] = {3.5f, -1.25f};
  data[0] = 7;
  std::memcpy(data.data() + 1, values, 8);
  TempDir dir;
  write_bytes(dir.file("m.safetensors"), safetensors_bytes(header, data));
  const SafetensorsFile file = SafetensorsFile::open(dir.file("m.safetensors"));
  const Tensor& f = file.tensors().at("f");
  EXPECT_EQ(reinterpret_cast<uintptr_t>(f.raw()) % 4, 0u);
  EXPECT_EQ(f.data<float>()[0], 3.5f);
  EXPECT_EQ(f.data<float>()[1], -1.25f);
  EXPECT_EQ(file.tensors().at("u").data<uint8_t>()[0], 7);
}

TEST(Safetensors, ReadsFixtureWeights) {
  const SafetensorsFile file =
      SafetensorsFile::open(PAGEDLM_TESTDATA "/fixtures/llama-gqa/model.safetensors");
  // 9 tensors per layer, 2 layers, embeddings and final norm (tied: no lm_head).
  EXPECT_EQ(file.tensors().size(), 20u);
  const Tensor& k = file.tensors().at("model.layers.1.self_attn.k_proj.weight");
  EXPECT_EQ(k.dtype(), DType::kF32);
  EXPECT_EQ(k.shape(), (Shape{128, 256}));
  EXPECT_EQ(file.metadata().at("format"), "pt");
}

class SafetensorsBadInput : public ::testing::Test {
 protected:
  void SetUp() override {
    write_safetensors(dir_.file("good.safetensors"), sample_tensors());
    good_ = read_bytes(dir_.file("good.safetensors"));
    std::memcpy(&header_len_, good_.data(), 8);
  }
  std::string error_for(const std::string& bytes) const { return open_error(dir_, bytes); }

  TempDir dir_;
  std::string good_;
  uint64_t header_len_ = 0;
};

TEST_F(SafetensorsBadInput, TruncatedAtEveryRegion) {
  ASSERT_EQ(error_for(good_), "");
  const size_t cuts[] = {0,
                         3,
                         7,
                         8,
                         9,
                         8 + header_len_ / 2,
                         8 + header_len_ - 1,
                         8 + header_len_,
                         8 + header_len_ + 5,
                         good_.size() - 1};
  for (size_t cut : cuts) {
    const std::string message = error_for(good_.substr(0, cut));
    EXPECT_NE(message, "") << "cut at " << cut;
    EXPECT_CONTAINS(message, "t.safetensors") << "cut at " << cut;
    if (cut < 8 || cut > 8 + header_len_) {
      EXPECT_CONTAINS(message, "truncated") << "cut at " << cut;
    }
  }
}

TEST_F(SafetensorsBadInput, HeaderLengthPastTheEnd) {
  std::string bytes = good_;
  const uint64_t too_long = bytes.size();
  std::memcpy(bytes.data(), &too_long, 8);
  EXPECT_CONTAINS(error_for(bytes), "runs past the end of the file");

  const uint64_t huge = 1ull << 40;
  std::memcpy(bytes.data(), &huge, 8);
  EXPECT_CONTAINS(error_for(bytes), "exceeds the limit");
}

TEST_F(SafetensorsBadInput, HeaderNotAJsonObject) {
  EXPECT_CONTAINS(error_for(safetensors_bytes("{\"a\": [1, 2", "")), "not valid JSON");
  EXPECT_CONTAINS(error_for(safetensors_bytes("[1, 2]  ", "")), "not a JSON object");
  EXPECT_CONTAINS(error_for(safetensors_bytes(R"({"__metadata__": {"k": 1}})", "")),
                  "__metadata__ value of \"k\"");
}

TEST_F(SafetensorsBadInput, OffsetsMustTileTheBuffer) {
  const std::string data(16, '\0');
  const std::string gap = R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                          R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(gap, data)), "tensor b data_offsets [8, 16]");
  EXPECT_CONTAINS(error_for(safetensors_bytes(gap, data)), "gap");

  const std::string overlap = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                              R"("b":{"dtype":"F32","shape":[3],"data_offsets":[4,16]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(overlap, data)), "overlap");

  const std::string short_cover = R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(short_cover, data)),
                  "cover 8 bytes but the data section holds 16");

  const std::string past_end = R"({"a":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(past_end, data)), "past the end of the data");

  const std::string reversed = R"({"a":{"dtype":"U8","shape":[0],"data_offsets":[8,0]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(reversed, data)), "end before begin");
}

TEST_F(SafetensorsBadInput, ShapeMustMatchByteCount) {
  const std::string header = R"({"w":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})";
  const std::string message = error_for(safetensors_bytes(header, std::string(8, '\0')));
  EXPECT_CONTAINS(message, "tensor w");
  EXPECT_CONTAINS(message, "needs 12");

  const std::string negative = R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(negative, "")), "not a non-negative integer");

  const std::string overflow =
      R"({"w":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,0]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(overflow, "")), "too large");
}

TEST_F(SafetensorsBadInput, DtypeUnknownOrUnsupported) {
  const std::string unknown = R"({"w":{"dtype":"Q9","shape":[1],"data_offsets":[0,1]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(unknown, "x")), "tensor w: unknown dtype Q9");
  const std::string i64 = R"({"ids":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(i64, std::string(8, '\0'))),
                  "tensor ids: unsupported dtype I64");
}

TEST_F(SafetensorsBadInput, EntryFieldsMissing) {
  const std::string no_offsets = R"({"w":{"dtype":"U8","shape":[1]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(no_offsets, "x")), "data_offsets");
  const std::string no_dtype = R"({"w":{"shape":[1],"data_offsets":[0,1]}})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(no_dtype, "x")), "\"dtype\"");
  const std::string not_object = R"({"w":[1]})";
  EXPECT_CONTAINS(error_for(safetensors_bytes(not_object, "x")), "not a JSON object");
}

TEST_F(SafetensorsBadInput, NotARegularFile) {
  EXPECT_THROW(SafetensorsFile::open(dir_.file("absent.safetensors")), Error);
  try {
    SafetensorsFile::open(dir_.path().string());
    ADD_FAILURE() << "opening a directory succeeded";
  } catch (const Error& e) {
    EXPECT_CONTAINS(e.what(), "is a directory");
  }
}

// Random byte flips and truncations of a small valid file: each open either succeeds with
// tensors inside the file or throws Error; nothing else (crash, other exception) may happen.
TEST_F(SafetensorsBadInput, FuzzedFilesNeverCrash) {
  std::mt19937 rng(1234);
  int errors = 0;
  int successes = 0;
  const std::string path = dir_.file("fuzz.safetensors");
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = good_;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      // Most flips land in the length and header, where the parser does its work.
      const size_t limit = rng() % 4 == 0 ? bytes.size() : 8 + header_len_;
      bytes[rng() % limit] ^= static_cast<char>(1 + rng() % 255);
    }
    if (rng() % 3 == 0) bytes.resize(rng() % (bytes.size() + 1));
    write_bytes(path, bytes);
    try {
      const SafetensorsFile file = SafetensorsFile::open(path);
      for (const auto& [name, t] : file.tensors()) {
        volatile uint8_t sink = 0;
        const auto* p = static_cast<const uint8_t*>(t.raw());
        for (size_t b = 0; b < t.nbytes(); ++b) sink = sink + p[b];
      }
      ++successes;
    } catch (const Error&) {
      ++errors;
    }
  }
  EXPECT_EQ(errors + successes, 3000);
  EXPECT_GT(errors, 1000);
}

TEST(MappedFile, MapsBytesAndEmptyFiles) {
  TempDir dir;
  write_bytes(dir.file("a"), "hello");
  const auto file = MappedFile::open(dir.file("a"));
  ASSERT_EQ(file->size(), 5u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(file->data()), 5), "hello");
  EXPECT_EQ(file->path(), dir.file("a"));
  write_bytes(dir.file("empty"), "");
  EXPECT_EQ(MappedFile::open(dir.file("empty"))->size(), 0u);
  try {
    MappedFile::open(dir.file("nope"));
    ADD_FAILURE() << "opening a missing file succeeded";
  } catch (const Error& e) {
    EXPECT_CONTAINS(e.what(), "nope");
  }
}

}  // namespace
}  // namespace pagedlm
