#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "default_model_util.h"
#include "gguf_reference_util.h"
#include "io_test_util.h"
#include "pagedlm/core/dtype.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/io/model_cache.h"
#include "pagedlm/model/checkpoint.h"

namespace pagedlm {
namespace {

namespace fs = std::filesystem;
using testing::GgufReference;

// ---- A tiny GGUF writer, so hostile files can be built byte by byte ----

enum : uint32_t {
  kU8 = 0,
  kI8 = 1,
  kU16 = 2,
  kI16 = 3,
  kU32 = 4,
  kI32 = 5,
  kF32 = 6,
  kBool = 7,
  kString = 8,
  kArray = 9,
  kU64 = 10,
  kI64 = 11,
  kF64 = 12,
};

class Bytes {
 public:
  template <typename T>
  Bytes& put(T v) {
    char b[sizeof(T)];
    std::memcpy(b, &v, sizeof(T));
    s_.append(b, sizeof(T));
    return *this;
  }
  Bytes& str(const std::string& v) {
    put<uint64_t>(v.size());
    s_ += v;
    return *this;
  }
  Bytes& raw(const std::string& v) {
    s_ += v;
    return *this;
  }
  size_t size() const { return s_.size(); }
  const std::string& bytes() const { return s_; }

 private:
  std::string s_;
};

struct Kv {
  std::string key;
  uint32_t type;
  std::string value;  // the encoded value, without the type
};

template <typename T>
Kv kv(const std::string& key, uint32_t type, T v) {
  return {key, type, Bytes().put(v).bytes()};
}
Kv kv_str(const std::string& key, const std::string& v) {
  return {key, kString, Bytes().str(v).bytes()};
}
Kv kv_str_array(const std::string& key, const std::vector<std::string>& v) {
  Bytes b;
  b.put<uint32_t>(kString).put<uint64_t>(v.size());
  for (const std::string& s : v) b.str(s);
  return {key, kArray, b.bytes()};
}

struct TinyTensor {
  std::string name;
  std::vector<uint64_t> dims;
  GgmlType type;
  std::string data;
};

// A GGUF file plus the positions of the fields the corruption tests patch.
struct Built {
  std::string bytes;
  std::map<std::string, size_t> at;

  template <typename T>
  Built patched(const std::string& field, T v) const {
    Built b = *this;
    std::memcpy(b.bytes.data() + at.at(field), &v, sizeof(T));
    return b;
  }
};

Built build_gguf(const std::vector<Kv>& kvs, const std::vector<TinyTensor>& tensors,
                 uint32_t alignment = 32, uint32_t version = 3) {
  Built out;
  Bytes b;
  b.put<uint32_t>(0x46554747).put<uint32_t>(version);
  out.at["tensor_count"] = b.size();
  b.put<uint64_t>(tensors.size());
  out.at["kv_count"] = b.size();
  b.put<uint64_t>(kvs.size());
  for (const Kv& e : kvs) {
    out.at["key_len:" + e.key] = b.size();
    b.str(e.key).put<uint32_t>(e.type);
    out.at["value:" + e.key] = b.size();
    b.raw(e.value);
  }
  std::vector<uint64_t> offsets;
  uint64_t offset = 0;
  for (const TinyTensor& t : tensors) {
    offsets.push_back(offset);
    offset = (offset + t.data.size() + alignment - 1) / alignment * alignment;
  }
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TinyTensor& t = tensors[i];
    b.str(t.name);
    out.at["n_dims:" + t.name] = b.size();
    b.put<uint32_t>(t.dims.size());
    out.at["dims:" + t.name] = b.size();
    for (uint64_t d : t.dims) b.put<uint64_t>(d);
    out.at["type:" + t.name] = b.size();
    b.put<uint32_t>(static_cast<uint32_t>(t.type));
    out.at["offset:" + t.name] = b.size();
    b.put<uint64_t>(offsets[i]);
  }
  std::string data;
  for (size_t i = 0; i < tensors.size(); ++i) {
    data.resize(offsets[i], '\0');
    data += tensors[i].data;
  }
  std::string bytes = b.bytes();
  bytes.resize((bytes.size() + alignment - 1) / alignment * alignment, '\0');
  out.at["data"] = bytes.size();
  out.bytes = bytes + data;
  return out;
}

std::string f32_bytes(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * 4);
}

// One Q8_0 block: d = 0.5, qs = -16..15.
std::string q8_0_block() {
  Bytes b;
  b.put<uint16_t>(f32_to_f16(0.5f));
  for (int j = 0; j < 32; ++j) b.put<int8_t>(static_cast<int8_t>(j - 16));
  return b.bytes();
}

Built valid_tiny() {
  Bytes nested;  // [[1, 2], [3]] of i32
  nested.put<uint32_t>(kArray).put<uint64_t>(2);
  nested.put<uint32_t>(kI32).put<uint64_t>(2).put<int32_t>(1).put<int32_t>(2);
  nested.put<uint32_t>(kI32).put<uint64_t>(1).put<int32_t>(3);
  Bytes i16s;
  i16s.put<uint32_t>(kI16).put<uint64_t>(3).put<int16_t>(-1).put<int16_t>(0).put<int16_t>(7);
  std::vector<Kv> kvs = {
      kv_str("general.architecture", "llama"),
      kv("general.alignment", kU32, uint32_t{64}),
      kv("t.u8", kU8, uint8_t{200}),
      kv("t.i8", kI8, int8_t{-5}),
      kv("t.u16", kU16, uint16_t{60000}),
      kv("t.i16", kI16, int16_t{-300}),
      kv("t.u32", kU32, uint32_t{4000000000u}),
      kv("t.i32", kI32, int32_t{-7}),
      kv("t.f32", kF32, 1.5f),
      kv("t.bool", kBool, uint8_t{1}),
      kv("t.u64", kU64, uint64_t{1} << 40),
      kv("t.i64", kI64, -(int64_t{1} << 40)),
      kv("t.f64", kF64, 2.25),
      kv_str_array("t.strings", {"a", "bc"}),
      {"t.nested", kArray, nested.bytes()},
      {"t.i16s", kArray, i16s.bytes()},
  };
  std::vector<TinyTensor> tensors = {
      {"a", {4, 2}, GgmlType::kF32, f32_bytes({0, 1, 2, 3, 4, 5, 6, 7})},
      {"b", {32, 1}, GgmlType::kQ8_0, q8_0_block()},
  };
  return build_gguf(kvs, tensors, 64);
}

// Each test's files in a folder of its own (ctest runs tests in parallel processes), removed
// with the fixture.
class TempFiles : public ::testing::Test {
 protected:
  std::string write(const std::string& bytes, const std::string& name = "t.gguf") {
    const std::string path = dir_.file(name);
    std::ofstream(path, std::ios::binary).write(bytes.data(), bytes.size());
    return path;
  }

 private:
  pagedlm::testing::TempDir dir_;
};

// Expects GgufFile::open to throw a pagedlm::Error whose message contains every `needle`.
void expect_open_error(const std::string& path, std::initializer_list<std::string> needles) {
  try {
    GgufFile::open(path);
    ADD_FAILURE() << "no error for " << path;
  } catch (const Error& e) {
    for (const std::string& n : needles) {
      EXPECT_NE(std::string(e.what()).find(n), std::string::npos)
          << "message '" << e.what() << "' lacks '" << n << "'";
    }
  }
}

// ---- Reader ----

using GgufReader = TempFiles;

TEST_F(GgufReader, ReadsEveryValueTypeAndTensorInfo) {
  const Built built = valid_tiny();
  const GgufFile f = GgufFile::open(write(built.bytes));
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.alignment(), 64u);
  EXPECT_EQ(f.data_offset(), built.at.at("data"));
  EXPECT_EQ(f.data_offset() % 64, 0u);
  EXPECT_EQ(f.metadata().size(), 16u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("t.u8"), 200);
  EXPECT_EQ(f.get_int("t.i8"), -5);
  EXPECT_EQ(f.get_int("t.u16"), 60000);
  EXPECT_EQ(f.get_int("t.i16"), -300);
  EXPECT_EQ(f.get_int("t.u32"), 4000000000LL);
  EXPECT_EQ(f.get_int("t.i32"), -7);
  EXPECT_EQ(f.get_float("t.f32"), 1.5);
  EXPECT_EQ(f.get_float("t.i32"), -7.0);  // integers read as floats too
  EXPECT_TRUE(std::get<bool>(f.find("t.bool")->value));
  EXPECT_EQ(f.get_int("t.u64"), int64_t{1} << 40);
  EXPECT_EQ(f.get_int("t.i64"), -(int64_t{1} << 40));
  EXPECT_EQ(f.get_float("t.f64"), 2.25);
  EXPECT_EQ(f.find("t.u32")->type, kU32);
  EXPECT_EQ(f.get_string_array("t.strings"), (std::vector<std::string>{"a", "bc"}));
  EXPECT_EQ(f.get_int_array("t.i16s"), (std::vector<int64_t>{-1, 0, 7}));
  const GgufValue::Array& nested = f.find("t.nested")->as_array();
  ASSERT_EQ(nested.size(), 2u);
  EXPECT_EQ(nested[0].as_array().size(), 2u);
  EXPECT_EQ(nested[0].as_array()[1].as_int(), 2);
  EXPECT_EQ(nested[1].as_array()[0].as_int(), 3);

  EXPECT_THROW(f.get_int("t.f32"), Error);
  EXPECT_THROW(f.get_string("t.u8"), Error);
  EXPECT_THROW(f.get_int_array("t.strings"), Error);
  try {
    f.get_int("missing.key");
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("missing.key"), std::string::npos);
  }
  EXPECT_EQ(f.find("missing.key"), nullptr);

  ASSERT_EQ(f.tensors().size(), 2u);
  const GgufTensorInfo* a = f.find_tensor("a");
  ASSERT_NE(a, nullptr);
  EXPECT_EQ(a->dims, (std::vector<int64_t>{4, 2}));
  EXPECT_EQ(a->type, GgmlType::kF32);
  EXPECT_EQ(a->nbytes, 32u);
  EXPECT_EQ(a->numel(), 8);
  float av[8];
  dequantize_row(a->type, a->data, av, 8);
  EXPECT_EQ(av[7], 7.f);
  const GgufTensorInfo* b = f.find_tensor("b");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->offset, 64u);
  EXPECT_EQ(b->nbytes, 34u);
  EXPECT_EQ(b->row_bytes(), 34u);
  float bv[32];
  dequantize_row(b->type, b->data, bv, 32);
  EXPECT_EQ(bv[0], -8.f);
  EXPECT_EQ(bv[31], 7.5f);
  EXPECT_EQ(f.find_tensor("c"), nullptr);
}

TEST_F(GgufReader, AcceptsVersion2AndDefaultAlignment) {
  const Built built = build_gguf({kv_str("general.architecture", "llama")},
                                 {{"x", {32}, GgmlType::kQ8_0, q8_0_block()}}, 32, 2);
  const GgufFile f = GgufFile::open(write(built.bytes));
  EXPECT_EQ(f.version(), 2u);
  EXPECT_EQ(f.alignment(), 32u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
}

TEST_F(GgufReader, RejectsCorruptHeadersWithNamedErrors) {
  const Built v = valid_tiny();
  Built magic = v;
  magic.bytes[3] = 'G';
  expect_open_error(write(magic.bytes), {"magic"});
  expect_open_error(write(v.patched("tensor_count", uint64_t{1} << 60).bytes), {"tensor count"});
  expect_open_error(write(v.patched("kv_count", uint64_t{1} << 61).bytes), {"metadata count"});
  Built version1 = v;
  version1.bytes[4] = 1;
  expect_open_error(write(version1.bytes), {"version 1"});
  Built version4 = v;
  version4.bytes[4] = 4;
  expect_open_error(write(version4.bytes), {"version 4"});
  expect_open_error(write(v.patched("key_len:t.u8", uint64_t{1} << 62).bytes), {"length"});
  // The array count sits after the u32 element type.
  Built huge_array = v;
  const uint64_t huge = uint64_t{1} << 59;
  std::memcpy(huge_array.bytes.data() + v.at.at("value:t.strings") + 4, &huge, 8);
  expect_open_error(write(huge_array.bytes), {"t.strings", "array elements"});
  expect_open_error(write(v.patched("value:t.bool", uint8_t{7}).bytes), {"t.bool", "bool"});
  expect_open_error(write(v.patched("value:general.alignment", uint32_t{48}).bytes),
                    {"general.alignment"});
  expect_open_error(write(v.patched("value:general.alignment", uint32_t{0}).bytes),
                    {"general.alignment"});
  Built bad_value_type = v;
  const uint32_t t99 = 99;
  std::memcpy(bad_value_type.bytes.data() + v.at.at("value:t.u8") - 4, &t99, 4);
  expect_open_error(write(bad_value_type.bytes), {"t.u8", "unknown value type 99"});
}

TEST_F(GgufReader, RejectsCorruptTensorInfosNamingTheTensor) {
  const Built v = valid_tiny();
  expect_open_error(write(v.patched("n_dims:a", uint32_t{5}).bytes), {"'a'", "5 dims"});
  expect_open_error(write(v.patched("type:b", uint32_t{99}).bytes), {"'b'", "type 99"});
  expect_open_error(write(v.patched("offset:b", uint64_t{65}).bytes),
                    {"'b'", "not a multiple of the alignment"});
  expect_open_error(write(v.patched("offset:b", uint64_t{64 * 100}).bytes),
                    {"'b'", "past the end"});
  expect_open_error(write(v.patched("offset:b", ~uint64_t{63}).bytes), {"'b'", "past the end"});
  expect_open_error(write(v.patched("dims:b", uint64_t{64}).bytes), {"'b'", "past the end"});
  expect_open_error(write(v.patched("dims:b", uint64_t{16}).bytes),
                    {"'b'", "not a multiple of the Q8_0 block size"});
  Built overflow = v.patched("dims:a", uint64_t{1} << 32);
  std::memcpy(overflow.bytes.data() + v.at.at("dims:a") + 8, &overflow.bytes[v.at.at("dims:a")], 8);
  expect_open_error(write(overflow.bytes), {"'a'", "overflow"});
  expect_open_error(write(v.patched("dims:a", ~uint64_t{0}).bytes), {"'a'", "overflow"});
}

TEST_F(GgufReader, RejectsDuplicatesAndDeepNesting) {
  expect_open_error(
      write(build_gguf({kv("k", kU8, uint8_t{1}), kv("k", kU8, uint8_t{2})}, {}).bytes),
      {"duplicate", "'k'"});
  expect_open_error(write(build_gguf({}, {{"x", {1}, GgmlType::kF32, f32_bytes({1})},
                                          {"x", {1}, GgmlType::kF32, f32_bytes({2})}})
                              .bytes),
                    {"duplicate", "'x'"});
  Bytes deep;
  for (int i = 0; i < 1000; ++i) deep.put<uint32_t>(kArray).put<uint64_t>(1);
  deep.put<uint32_t>(kU8).put<uint64_t>(1).put<uint8_t>(0);
  expect_open_error(write(build_gguf({{"deep", kArray, deep.bytes()}}, {}).bytes),
                    {"'deep'", "nests"});
}

// A size bound next to the depth bound: array elements in all, before any is read.
TEST_F(GgufReader, RejectsMoreMetadataValuesThanTheBound) {
  Bytes many;
  many.put<uint32_t>(kU8).put<uint64_t>((uint64_t{1} << 24) + 1);
  expect_open_error(write(build_gguf({{"many", kArray, many.bytes()}}, {}).bytes),
                    {"'many'", "array elements in all"});
}

// ne0 = 0 passes the block-size check: such a tensor is empty, not a division by zero (found by
// fuzzing).
TEST_F(GgufReader, EmptyQuantizedTensorsHaveNoRows) {
  const GgufFile f = GgufFile::open(write(
      build_gguf({}, {{"e2", {0, 4}, GgmlType::kQ8_0, ""}, {"e3", {0, 2, 3}, GgmlType::kQ4_1, ""}})
          .bytes));
  for (const char* name : {"e2", "e3"}) {
    const std::optional<QuantizedMatrix> q = gguf_tensor_blocks(*f.find_tensor(name), 0, "t");
    ASSERT_TRUE(q.has_value()) << name;
    EXPECT_EQ(q->rows, 0) << name;
    EXPECT_TRUE(q->blocks.empty()) << name;
    EXPECT_EQ(gguf_tensor_f32(*f.find_tensor(name), 0, "t").numel(), 0) << name;
  }
}

// With a 0 dim the element count is 0 whatever follows, but the HF shape multiplies the dims
// in the other order: the other dims' product must fit too (found by fuzzing: UBSan reported the
// overflow in Tensor::numel).
TEST_F(GgufReader, DimsAfterAZeroDimMustNotOverflow) {
  expect_open_error(
      write(build_gguf({}, {{"z", {0, uint64_t{1} << 59, 219}, GgmlType::kF32, ""}}).bytes),
      {"'z'", "overflows"});
  const GgufFile f = GgufFile::open(
      write(build_gguf({}, {{"z", {0, uint64_t{1} << 20, 7}, GgmlType::kF32, ""}}).bytes));
  EXPECT_EQ(gguf_tensor_f32(*f.find_tensor("z"), 0, "t").numel(), 0);
}

TEST_F(GgufReader, EveryTruncationIsAnError) {
  const Built v = valid_tiny();
  for (size_t cut = 0; cut < v.bytes.size(); ++cut) {
    SCOPED_TRACE(cut);
    EXPECT_THROW(GgufFile::open(write(v.bytes.substr(0, cut))), Error);
  }
  expect_open_error(write("", "empty.gguf"), {"empty"});
  expect_open_error(write("", "x.gguf") + ".absent", {"cannot open"});
}

TEST_F(GgufReader, RandomByteFlipsNeverCrash) {
  const Built v = valid_tiny();
  std::mt19937 rng(1234);
  int opened = 0;
  for (int iter = 0; iter < 3000; ++iter) {
    std::string bytes = v.bytes;
    const int flips = 1 + static_cast<int>(rng() % 4);
    for (int i = 0; i < flips; ++i) {
      bytes[rng() % bytes.size()] = static_cast<char>(rng() & 0xff);
    }
    try {
      const GgufFile f = GgufFile::open(write(bytes));
      ++opened;
      // Whatever survived validation must be readable in full.
      for (const GgufTensorInfo& t : f.tensors()) {
        std::vector<float> out(static_cast<size_t>(t.numel()));
        dequantize_row(t.type, t.data, out.data(), t.numel());
      }
    } catch (const Error&) {
    }
  }
  EXPECT_GT(opened, 0);  // flips in tensor data or metadata values are harmless
}

// ---- Dequantization ----

TEST(GgufDequant, NibbleOrderAndMinSign) {
  Bytes q40;  // Q4_0, d = 1: qs[0] = 0x21 -> y[0] = 1 - 8, y[16] = 2 - 8
  q40.put<uint16_t>(f32_to_f16(1.f)).put<uint8_t>(0x21);
  for (int j = 1; j < 16; ++j) q40.put<uint8_t>(0x88);
  float y[256];
  dequantize_row(GgmlType::kQ4_0, reinterpret_cast<const uint8_t*>(q40.bytes().data()), y, 32);
  EXPECT_EQ(y[0], -7.f);
  EXPECT_EQ(y[16], -6.f);
  EXPECT_EQ(y[1], 0.f);

  // Q4_K with d = 1, dmin = 1, sub-block 0 scale 2 and min 3, all quants 5: y = 2*5 - 3.
  Bytes q4k;
  q4k.put<uint16_t>(f32_to_f16(1.f)).put<uint16_t>(f32_to_f16(1.f));
  const uint8_t scales[12] = {2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0};
  for (uint8_t s : scales) q4k.put<uint8_t>(s);
  for (int j = 0; j < 128; ++j) q4k.put<uint8_t>(0x55);
  dequantize_row(GgmlType::kQ4_K, reinterpret_cast<const uint8_t*>(q4k.bytes().data()), y, 256);
  EXPECT_EQ(y[0], 7.f);
  EXPECT_EQ(y[32], 0.f);  // sub-block 1: scale 0, min 0

  EXPECT_THROW(dequantize_row(GgmlType::kQ8_0, nullptr, y, 31), Error);
  EXPECT_EQ(ggml_block_bytes(GgmlType::kQ6_K), 210u);
  EXPECT_EQ(ggml_block_elems(GgmlType::kQ4_K), 256);
  EXPECT_STREQ(ggml_type_name(GgmlType::kQ5_1), "Q5_1");
}

void expect_close(const float* got, const float* want, int64_t n, const std::string& what) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; ++i) {
    // 1e-6 relative, on a scale of at least 1 so that Q4_1/Q5_1's x*d + m may be fused.
    if (!(std::abs(got[i] - want[i]) <= 1e-6f * std::max(1.f, std::abs(want[i]))) && bad++ < 5) {
      ADD_FAILURE() << what << " element " << i << ": " << got[i] << " vs " << want[i];
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

TEST(GgufDequant, MatchesGgufPythonPackage) {
  const GgufReference& ref = GgufReference::get();
  std::set<std::string> types;
  for (const nlohmann::json& c : ref.manifest.at("blocks")) {
    const auto type = static_cast<GgmlType>(c.at("type").get<uint32_t>());
    const int64_t rows = c.at("rows"), cols = c.at("cols");
    ASSERT_EQ(c.at("bytes").at("length").get<size_t>(),
              rows * (cols / ggml_block_elems(type)) * ggml_block_bytes(type))
        << c.at("name");
    std::vector<float> out(rows * cols);
    const size_t row_bytes = cols / ggml_block_elems(type) * ggml_block_bytes(type);
    for (int64_t r = 0; r < rows; ++r) {
      dequantize_row(type, ref.bytes(c.at("bytes")) + r * row_bytes, out.data() + r * cols, cols);
    }
    expect_close(out.data(), ref.floats(c.at("floats")), rows * cols, c.at("name"));
    types.insert(ggml_type_name(type));
  }
  EXPECT_EQ(types,
            (std::set<std::string>{"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
                                   "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS"}));
}

// ---- Config mapping and checkpoint loading on synthetic files ----

using GgufCheckpoint = TempFiles;

std::vector<Kv> arch_kvs(const std::string& arch, int64_t heads, int64_t kv_heads, int64_t hidden) {
  const std::string p = arch + ".";
  return {
      kv_str("general.architecture", arch),
      kv(p + "block_count", kU32, uint32_t{1}),
      kv(p + "context_length", kU64, uint64_t{4096}),
      kv(p + "embedding_length", kI32, static_cast<int32_t>(hidden)),
      kv(p + "feed_forward_length", kU16, uint16_t{64}),
      kv(p + "attention.head_count", kU32, static_cast<uint32_t>(heads)),
      kv(p + "attention.head_count_kv", kU8, static_cast<uint8_t>(kv_heads)),
      kv(p + "rope.freq_base", kF32, 1e6f),
      kv(p + "attention.layer_norm_rms_epsilon", kF32, 1e-6f),
      kv_str_array("tokenizer.ggml.tokens", {"a", "b", "c", "d", "e"}),
      kv("tokenizer.ggml.eos_token_id", kU32, uint32_t{4}),
      kv("tokenizer.ggml.bos_token_id", kI64, int64_t{3}),
  };
}

// A [rows, 32] F32 matrix (GGUF dims [32, rows]) whose row r holds the value r.
TinyTensor row_index_matrix(const std::string& name, int rows) {
  std::vector<float> v;
  for (int r = 0; r < rows; ++r) v.insert(v.end(), 32, static_cast<float>(r));
  return {name, {32, static_cast<uint64_t>(rows)}, GgmlType::kF32, f32_bytes(v)};
}

TinyTensor row_index_vector(const std::string& name, int n) {
  std::vector<float> v;
  for (int r = 0; r < n; ++r) v.push_back(static_cast<float>(r));
  return {name, {static_cast<uint64_t>(n)}, GgmlType::kF32, f32_bytes(v)};
}

// Checkpoint::get lives with the safetensors loader; this test needs only the GGUF side.
// The tensor as the model gets it (quantized matrices dequantized), checked as f32 [shape].
Tensor tensor_of(const Checkpoint& c, const std::string& name, const Shape& shape) {
  if (!c.has(name)) {
    ADD_FAILURE() << "checkpoint lacks " << name;
    return {};
  }
  const Tensor t = c.get(name, shape);
  EXPECT_EQ(t.dtype(), DType::kF32) << name;
  return t;
}

Tensor dense(const Checkpoint& c, const std::string& name) {
  return c.get(name, c.shapes().at(name));
}

std::vector<float> column0(const Tensor& t) {
  std::vector<float> out;
  const int64_t cols = t.ndim() == 2 ? t.dim(1) : 1;
  for (int64_t r = 0; r < t.dim(0); ++r) out.push_back(t.data<float>()[r * cols]);
  return out;
}

TEST_F(GgufCheckpoint, LlamaUndoesTheQkPermutationOfWeightsAndBiases) {
  // 2 heads of head_dim 4 for q, 1 kv head for k: HF rows per head are GGUF rows 0, 2, 1, 3.
  std::vector<Kv> kvs = arch_kvs("llama", 2, 1, 32);
  kvs.push_back(kv("llama.rope.dimension_count", kU32, uint32_t{4}));
  const Built b = build_gguf(
      kvs, {row_index_matrix("blk.0.attn_q.weight", 8), row_index_matrix("blk.0.attn_k.weight", 4),
            row_index_matrix("blk.0.attn_v.weight", 4), row_index_vector("blk.0.attn_q.bias", 8),
            row_index_vector("rope_freqs.weight", 2)});
  std::vector<std::pair<size_t, size_t>> calls;
  const Checkpoint c = load_gguf_checkpoint(
      write(b.bytes), [&](size_t done, size_t total) { calls.emplace_back(done, total); });
  EXPECT_EQ(calls.size(), 5u);
  EXPECT_EQ(calls.back(), (std::pair<size_t, size_t>{5, 5}));
  EXPECT_EQ(c.config.head_dim, 4);
  EXPECT_TRUE(c.config.attention_bias);
  const Tensor q = tensor_of(c, "model.layers.0.self_attn.q_proj.weight", {8, 32});
  EXPECT_EQ(column0(q), (std::vector<float>{0, 2, 1, 3, 4, 6, 5, 7}));
  EXPECT_EQ(q.data<float>()[8 * 32 - 1], 7.f);
  EXPECT_EQ(column0(tensor_of(c, "model.layers.0.self_attn.q_proj.bias", {8})),
            (std::vector<float>{0, 2, 1, 3, 4, 6, 5, 7}));
  EXPECT_EQ(column0(tensor_of(c, "model.layers.0.self_attn.k_proj.weight", {4, 32})),
            (std::vector<float>{0, 2, 1, 3}));
  EXPECT_EQ(column0(tensor_of(c, "model.layers.0.self_attn.v_proj.weight", {4, 32})),
            (std::vector<float>{0, 1, 2, 3}));
  EXPECT_EQ(column0(tensor_of(c, "rope_freqs", {2})), (std::vector<float>{0, 1}));
  EXPECT_EQ(c.config.rope.type, RopeType::kDefault);
  EXPECT_FALSE(c.has("lm_head.weight"));
}

TEST_F(GgufCheckpoint, Qwen2IsNotPermutedAndHasBiases) {
  const Built b =
      build_gguf(arch_kvs("qwen2", 2, 1, 32),
                 {row_index_matrix("blk.0.attn_q.weight", 32),
                  row_index_vector("blk.0.attn_q.bias", 32), row_index_matrix("output.weight", 5)});
  const Checkpoint c = load_gguf_checkpoint(write(b.bytes));
  EXPECT_EQ(c.config.architecture, "Qwen2ForCausalLM");
  EXPECT_EQ(c.config.model_type, "qwen2");
  EXPECT_EQ(c.config.head_dim, 16);   // embedding / heads
  EXPECT_EQ(c.config.vocab_size, 5);  // from the token list
  EXPECT_EQ(c.config.num_kv_heads, 1);
  EXPECT_EQ(c.config.max_position_embeddings, 4096);
  EXPECT_EQ(c.config.intermediate_size, 64);
  EXPECT_FLOAT_EQ(c.config.rope.theta, 1e6f);
  EXPECT_FLOAT_EQ(c.config.rms_norm_eps, 1e-6f);
  EXPECT_EQ(c.config.eos_token_ids, (std::vector<int32_t>{4}));
  EXPECT_EQ(c.config.bos_token_id, 3);
  EXPECT_TRUE(c.config.attention_bias);
  EXPECT_FALSE(c.config.qk_norm);
  EXPECT_FALSE(c.config.tie_word_embeddings);
  std::vector<float> want(32);
  for (int i = 0; i < 32; ++i) want[i] = static_cast<float>(i);
  EXPECT_EQ(column0(tensor_of(c, "model.layers.0.self_attn.q_proj.weight", {32, 32})), want);
  EXPECT_EQ(column0(tensor_of(c, "model.layers.0.self_attn.q_proj.bias", {32})), want);
  EXPECT_TRUE(c.has("lm_head.weight"));
}

TEST_F(GgufCheckpoint, Qwen3HeadDimFromKeyLengthAndQkNorm) {
  std::vector<Kv> kvs = arch_kvs("qwen3", 4, 2, 32);
  kvs.push_back(kv("qwen3.attention.key_length", kU32, uint32_t{16}));
  kvs.push_back(kv("qwen3.vocab_size", kU32, uint32_t{7}));
  kvs.push_back(kv("tokenizer.ggml.eot_token_id", kI32, int32_t{2}));
  kvs.push_back(kv("tokenizer.ggml.eom_token_id", kU16, uint16_t{4}));  // same as eos
  const Built b = build_gguf(kvs, {row_index_vector("blk.0.attn_q_norm.weight", 16),
                                   row_index_vector("blk.0.attn_k_norm.weight", 16)});
  const Checkpoint c = load_gguf_checkpoint(write(b.bytes));
  EXPECT_EQ(c.config.architecture, "Qwen3ForCausalLM");
  EXPECT_EQ(c.config.head_dim, 16);
  EXPECT_EQ(c.config.vocab_size, 7);
  EXPECT_TRUE(c.config.qk_norm);
  EXPECT_FALSE(c.config.attention_bias);
  EXPECT_EQ(c.config.eos_token_ids, (std::vector<int32_t>{4, 2}));
  EXPECT_TRUE(c.config.tie_word_embeddings);
  EXPECT_TRUE(c.has("model.layers.0.self_attn.q_norm.weight"));
  EXPECT_TRUE(c.has("model.layers.0.self_attn.k_norm.weight"));
}

TEST_F(GgufCheckpoint, RejectsUnsupportedArchitecturesAndUnknownTensors) {
  try {
    config_from_gguf(GgufFile::open(write(build_gguf(arch_kvs("gpt2", 2, 1, 32), {}).bytes)));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'gpt2'"), std::string::npos) << e.what();
  }
  try {
    load_gguf_checkpoint(
        write(build_gguf(arch_kvs("llama", 2, 1, 32), {row_index_vector("blk.0.mystery.weight", 4)})
                  .bytes));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("blk.0.mystery.weight"), std::string::npos);
  }
  std::vector<Kv> missing = arch_kvs("llama", 2, 1, 32);
  missing.erase(missing.begin() + 1);  // block_count
  try {
    config_from_gguf(GgufFile::open(write(build_gguf(missing, {}).bytes)));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("llama.block_count"), std::string::npos);
  }
}

// ---- The real SmolLM2 GGUF ----

TEST(GgufSmolLM2, Metadata) {
  REQUIRE_DEFAULT_MODEL();
  const GgufFile f = GgufFile::open(default_model_path());
  EXPECT_EQ(f.version(), 3u);
  EXPECT_EQ(f.get_string("general.architecture"), "llama");
  EXPECT_EQ(f.get_int("llama.block_count"), 30);
  EXPECT_EQ(f.get_int("llama.embedding_length"), 576);
  EXPECT_EQ(f.get_int("llama.attention.head_count"), 9);
  EXPECT_EQ(f.get_int("llama.attention.head_count_kv"), 3);
  EXPECT_EQ(f.get_int("llama.context_length"), 8192);
  EXPECT_EQ(f.get_float("llama.rope.freq_base"), 100000.0);
  EXPECT_EQ(f.get_int("llama.vocab_size"), 49152);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.tokens").size(), 49152u);
  EXPECT_EQ(f.get_string_array("tokenizer.ggml.merges").size(), 48900u);
  EXPECT_EQ(f.get_string("tokenizer.ggml.pre"), "smollm");
  EXPECT_EQ(f.tensors().size(), 272u);
  const GgufTensorInfo* embd = f.find_tensor("token_embd.weight");
  ASSERT_NE(embd, nullptr);
  EXPECT_EQ(embd->type, GgmlType::kQ8_0);
  EXPECT_EQ(embd->dims, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(f.find_tensor("blk.0.attn_k.weight")->dims, (std::vector<int64_t>{576, 192}));
  EXPECT_EQ(f.find_tensor("blk.0.attn_q.weight")->type, GgmlType::kQ4_1);
  EXPECT_EQ(f.find_tensor("output_norm.weight")->type, GgmlType::kF32);
  EXPECT_EQ(f.find_tensor("output.weight"), nullptr);
  // The tensors tile the data section up to the end of the file.
  const GgufTensorInfo& last = f.tensors().back();
  EXPECT_EQ(f.data_offset() + last.offset + last.nbytes, fs::file_size(default_model_path()));
}

TEST(GgufSmolLM2, Config) {
  REQUIRE_DEFAULT_MODEL();
  const ModelConfig c = config_from_gguf(GgufFile::open(default_model_path()));
  EXPECT_EQ(c.architecture, "LlamaForCausalLM");
  EXPECT_EQ(c.model_type, "llama");
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.hidden_size, 576);
  EXPECT_EQ(c.intermediate_size, 1536);
  EXPECT_EQ(c.num_layers, 30);
  EXPECT_EQ(c.num_heads, 9);
  EXPECT_EQ(c.num_kv_heads, 3);
  EXPECT_EQ(c.head_dim, 64);
  EXPECT_EQ(c.max_position_embeddings, 8192);
  EXPECT_FLOAT_EQ(c.rope.theta, 100000.f);
  EXPECT_FLOAT_EQ(c.rms_norm_eps, 1e-5f);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_FALSE(c.attention_bias);
  EXPECT_FALSE(c.qk_norm);
  EXPECT_EQ(c.rope.type, RopeType::kDefault);
  EXPECT_EQ(c.eos_token_ids, (std::vector<int32_t>{2}));
  EXPECT_EQ(c.bos_token_id, 1);
}

TEST(GgufSmolLM2, CheckpointMatchesReference) {
  REQUIRE_DEFAULT_MODEL();
  size_t progress_calls = 0;
  const Checkpoint c = load_gguf_checkpoint(default_model_path(), [&](size_t, size_t total) {
    ++progress_calls;
    EXPECT_EQ(total, 272u);
  });
  EXPECT_EQ(progress_calls, 272u);
  EXPECT_EQ(c.tensors.size() + c.quantized.size(), 272u);
  // The Q4_1 / Q8_0 matrices stay in their blocks (211 of them: every projection and the
  // embedding), the rest (norms) are f32.
  EXPECT_EQ(c.quantized.size(), 211u);
  EXPECT_EQ(c.blocks("model.layers.0.mlp.down_proj.weight", {576, 1536})->type, QuantType::kQ4_1);
  EXPECT_EQ(c.blocks("model.embed_tokens.weight", {49152, 576})->type, QuantType::kQ8_0);
  EXPECT_FALSE(c.has("lm_head.weight"));
  tensor_of(c, "model.embed_tokens.weight", {49152, 576});
  tensor_of(c, "model.norm.weight", {576});
  for (int layer : {0, 29}) {
    const std::string p = "model.layers." + std::to_string(layer) + ".";
    tensor_of(c, p + "self_attn.q_proj.weight", {576, 576});
    tensor_of(c, p + "self_attn.k_proj.weight", {192, 576});
    tensor_of(c, p + "self_attn.v_proj.weight", {192, 576});
    tensor_of(c, p + "self_attn.o_proj.weight", {576, 576});
    tensor_of(c, p + "mlp.gate_proj.weight", {1536, 576});
    tensor_of(c, p + "mlp.up_proj.weight", {1536, 576});
    tensor_of(c, p + "mlp.down_proj.weight", {576, 1536});
    tensor_of(c, p + "input_layernorm.weight", {576});
    tensor_of(c, p + "post_attention_layernorm.weight", {576});
  }
  for (const auto& [name, t] : c.tensors) EXPECT_EQ(t.dtype(), DType::kF32) << name;

  const GgufReference& ref = GgufReference::get();
  ASSERT_FALSE(ref.manifest.at("unpermuted").empty())
      << "reference.json was generated without the model";
  for (const nlohmann::json& u : ref.manifest.at("unpermuted")) {
    const int64_t begin = u.at("row_begin"), end = u.at("row_end"), cols = u.at("cols");
    const Tensor t = dense(c, u.at("name").get<std::string>());
    ASSERT_EQ(t.dim(1), cols);
    expect_close(t.data<float>() + begin * cols, ref.floats(u.at("floats")), (end - begin) * cols,
                 u.at("name"));
  }
  // Unpermuted tensors equal their plain dequantization, in the same row order.
  const std::map<std::string, std::string> plain = {
      {"token_embd.weight[1000:1002]", "model.embed_tokens.weight"},
      {"blk.0.attn_v.weight[0:8]", "model.layers.0.self_attn.v_proj.weight"},
      {"blk.0.attn_norm.weight[0:1]", "model.layers.0.input_layernorm.weight"},
  };
  size_t checked = 0;
  for (const nlohmann::json& b : ref.manifest.at("blocks")) {
    auto it = plain.find(b.at("name").get<std::string>());
    if (it == plain.end()) continue;
    const int64_t first_row = it->first.find("[1000") != std::string::npos ? 1000 : 0;
    const int64_t n = b.at("rows").get<int64_t>() * b.at("cols").get<int64_t>();
    expect_close(dense(c, it->second).data<float>() + first_row * b.at("cols").get<int64_t>(),
                 ref.floats(b.at("floats")), n, it->first);
    ++checked;
  }
  EXPECT_EQ(checked, plain.size());
}

}  // namespace
}  // namespace pagedlm
