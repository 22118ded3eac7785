#include "pagedlm/io/safetensors.h"

#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>
#include <string_view>
#include <vector>

#include "pagedlm/core/error.h"
#include "pagedlm/core/json.h"
#include "pagedlm/io/mmap_file.h"

namespace pagedlm {

namespace {

using nlohmann::json;

// The reference reader's cap: a larger header is rejected before any allocation.
constexpr uint64_t kMaxHeaderBytes = 100'000'000;
constexpr size_t kLengthBytes = 8;

std::optional<DType> parse_dtype(std::string_view s) {
  if (s == "F32") return DType::kF32;
  if (s == "F16") return DType::kF16;
  if (s == "BF16") return DType::kBF16;
  if (s == "I32") return DType::kI32;
  if (s == "U8") return DType::kU8;
  if (s == "F8_E4M3") return DType::kF8E4M3;
  return std::nullopt;
}

// Valid in the format but with no DType of ours to hold them.
bool is_known_unsupported_dtype(std::string_view s) {
  for (std::string_view known : {"BOOL", "I8", "F8_E5M2", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2",
                                 "I16", "U16", "U32", "F64", "I64", "U64"}) {
    if (s == known) return true;
  }
  return false;
}

std::string_view format_dtype(DType t) {
  switch (t) {
    case DType::kF32:
      return "F32";
    case DType::kF16:
      return "F16";
    case DType::kBF16:
      return "BF16";
    case DType::kI32:
      return "I32";
    case DType::kU8:
      return "U8";
    case DType::kF8E4M3:
      return "F8_E4M3";
  }
  fail("dtype ", dtype_name(t), " cannot be written to safetensors");
}

uint64_t read_u64_le(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = v << 8 | p[i];
  return v;
}

struct Entry {
  std::string name;
  DType dtype;
  Shape shape;
  uint64_t begin;
  uint64_t end;
};

// Validates one header entry; `where` prefixes every message ("<file>: tensor <name>").
Entry parse_entry(const std::string& name, const json& j, const std::string& where) {
  PAGEDLM_CHECK(j.is_object(), where, ": header entry is not a JSON object");
  const auto dtype_it = j.find("dtype");
  const auto shape_it = j.find("shape");
  const auto offsets_it = j.find("data_offsets");
  PAGEDLM_CHECK(dtype_it != j.end() && dtype_it->is_string(), where,
                ": missing or non-string \"dtype\"");
  PAGEDLM_CHECK(shape_it != j.end() && shape_it->is_array(), where,
                ": missing or non-array \"shape\"");
  PAGEDLM_CHECK(offsets_it != j.end() && offsets_it->is_array() && offsets_it->size() == 2, where,
                ": \"data_offsets\" must be an array [begin, end]");

  const std::string& dtype_str = dtype_it->get_ref<const std::string&>();
  const std::optional<DType> dtype = parse_dtype(dtype_str);
  if (!dtype) {
    fail(where, ": ", is_known_unsupported_dtype(dtype_str) ? "unsupported" : "unknown", " dtype ",
         dtype_str, " (supported: F32, F16, BF16, I32, U8, F8_E4M3)");
  }

  Entry e{name, *dtype, {}, 0, 0};
  uint64_t expected_bytes = dtype_size(*dtype);
  for (const json& d : *shape_it) {
    PAGEDLM_CHECK(d.is_number_unsigned(), where, ": shape ", shape_it->dump(),
                  " has an entry that is not a non-negative integer");
    const uint64_t dim = d.get<uint64_t>();
    PAGEDLM_CHECK(dim <= static_cast<uint64_t>(INT64_MAX) &&
                      !__builtin_mul_overflow(expected_bytes, dim, &expected_bytes),
                  where, ": shape ", shape_it->dump(), " is too large");
    e.shape.push_back(static_cast<int64_t>(dim));
  }
  const json& offsets = *offsets_it;
  PAGEDLM_CHECK(offsets[0].is_number_unsigned() && offsets[1].is_number_unsigned(), where,
                ": data_offsets ", offsets.dump(), " are not non-negative integers");
  e.begin = offsets[0].get<uint64_t>();
  e.end = offsets[1].get<uint64_t>();
  PAGEDLM_CHECK(e.begin <= e.end, where, ": data_offsets ", offsets.dump(), " end before begin");
  PAGEDLM_CHECK(e.end - e.begin == expected_bytes, where, ": data_offsets ", offsets.dump(),
                " span ", e.end - e.begin, " bytes but ", dtype_str, " shape ", shape_it->dump(),
                " needs ", expected_bytes);
  return e;
}

}  // namespace

SafetensorsFile SafetensorsFile::open(const std::string& path) {
  std::shared_ptr<MappedFile> file = MappedFile::open(path);
  const uint64_t file_size = file->size();
  PAGEDLM_CHECK(file_size >= kLengthBytes, path, ": truncated safetensors file (", file_size,
                " bytes, shorter than the 8-byte header length)");
  const uint64_t header_bytes = read_u64_le(file->data());
  PAGEDLM_CHECK(header_bytes <= kMaxHeaderBytes, path, ": header length ", header_bytes,
                " exceeds the limit of ", kMaxHeaderBytes, " bytes");
  PAGEDLM_CHECK(header_bytes <= file_size - kLengthBytes, path, ": header length ", header_bytes,
                " runs past the end of the file (", file_size, " bytes); truncated file?");

  const char* header_text = reinterpret_cast<const char*>(file->data() + kLengthBytes);
  json header;
  try {
    header = parse_json(std::string_view(header_text, header_bytes));
  } catch (const json::exception& e) {
    fail(path, ": header is not valid JSON (", e.what(), ")");
  } catch (const Error& e) {
    fail(path, ": header: ", e.what());
  }
  PAGEDLM_CHECK(header.is_object(), path, ": header is not a JSON object");

  SafetensorsFile result;
  std::vector<Entry> entries;
  for (const auto& [key, value] : header.items()) {
    if (key == "__metadata__") {
      PAGEDLM_CHECK(value.is_object(), path, ": __metadata__ is not a JSON object");
      for (const auto& [mkey, mvalue] : value.items()) {
        PAGEDLM_CHECK(mvalue.is_string(), path, ": __metadata__ value of \"", mkey,
                      "\" is not a string");
        result.metadata_[mkey] = mvalue.get<std::string>();
      }
      continue;
    }
    entries.push_back(parse_entry(key, value, cat(path, ": tensor ", key)));
  }

  // The offsets must tile the buffer exactly: no gaps, no overlaps, nothing after the last
  // tensor. Zero-sized tensors sort before a tensor starting at the same offset.
  const uint64_t data_start = kLengthBytes + header_bytes;
  const uint64_t buffer_bytes = file_size - data_start;
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected_begin = 0;
  for (const Entry& e : entries) {
    PAGEDLM_CHECK(e.begin == expected_begin, path, ": tensor ", e.name, " data_offsets [", e.begin,
                  ", ", e.end, "] ",
                  e.begin < expected_begin ? "overlap the previous tensor"
                                           : "leave a gap after the previous tensor",
                  " (expected begin ", expected_begin, ")");
    PAGEDLM_CHECK(e.end <= buffer_bytes, path, ": tensor ", e.name, " data_offsets [", e.begin,
                  ", ", e.end, "] run past the end of the data (", buffer_bytes,
                  " bytes); truncated file?");
    expected_begin = e.end;
  }
  PAGEDLM_CHECK(expected_begin == buffer_bytes, path, ": tensors cover ", expected_begin,
                " bytes but the data section holds ", buffer_bytes);

  for (const Entry& e : entries) {
    const uint8_t* bytes = file->data() + data_start + e.begin;
    // A writer that does not align its header or sort by alignment leaves some tensors
    // misaligned for their element type; those are copied so every Tensor is aligned.
    if (reinterpret_cast<uintptr_t>(bytes) % dtype_size(e.dtype) != 0) {
      Tensor copy = Tensor::empty(e.dtype, e.shape);
      std::memcpy(copy.raw(), bytes, copy.nbytes());
      result.tensors_.emplace(e.name, std::move(copy));
    } else {
      result.tensors_.emplace(
          e.name, Tensor::wrap(const_cast<uint8_t*>(bytes), e.dtype, e.shape, Device::kCpu, file));
    }
  }
  return result;
}

void write_safetensors(const std::string& path, const std::map<std::string, Tensor>& tensors) {
  // Largest element first (then by name), as HF's writer does, so every tensor starts aligned
  // to its element size once the header is padded to a multiple of 8.
  std::vector<const std::pair<const std::string, Tensor>*> order;
  for (const auto& item : tensors) {
    PAGEDLM_CHECK(item.second.device() == Device::kCpu, "write_safetensors(", path, "): tensor ",
                  item.first, " is not on the CPU");
    PAGEDLM_CHECK(item.second.defined(), "write_safetensors(", path, "): tensor ", item.first,
                  " is undefined");
    PAGEDLM_CHECK(item.first != "__metadata__", "write_safetensors(", path,
                  "): a tensor cannot be named __metadata__");
    order.push_back(&item);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto* a, const auto* b) {
    return dtype_size(a->second.dtype()) > dtype_size(b->second.dtype());
  });

  json header = json::object();
  header["__metadata__"] = {{"format", "pt"}};
  uint64_t offset = 0;
  for (const auto* item : order) {
    const Tensor& t = item->second;
    header[item->first] = {{"dtype", format_dtype(t.dtype())},
                           {"shape", t.shape()},
                           {"data_offsets", {offset, offset + t.nbytes()}}};
    offset += t.nbytes();
  }
  std::string header_text = header.dump();
  header_text.append((8 - header_text.size() % 8) % 8, ' ');

  // Written beside the target and renamed over it, so a reader never sees a partial file.
  const std::string tmp_path = cat(path, ".tmp.", ::getpid());
  {
    std::ofstream out(tmp_path, std::ios::binary | std::ios::trunc);
    PAGEDLM_CHECK(out.good(), "cannot create ", tmp_path);
    uint8_t length[kLengthBytes];
    for (size_t i = 0; i < kLengthBytes; ++i) length[i] = (header_text.size() >> (8 * i)) & 0xff;
    out.write(reinterpret_cast<const char*>(length), kLengthBytes);
    out.write(header_text.data(), static_cast<std::streamsize>(header_text.size()));
    for (const auto* item : order) {
      out.write(static_cast<const char*>(item->second.raw()),
                static_cast<std::streamsize>(item->second.nbytes()));
    }
    out.flush();
    if (!out.good()) {
      out.close();
      std::filesystem::remove(tmp_path);
      fail("error writing ", tmp_path);
    }
  }
  std::error_code ec;
  std::filesystem::rename(tmp_path, path, ec);
  if (ec) {
    std::filesystem::remove(tmp_path);
    fail("cannot rename ", tmp_path, " to ", path, ": ", ec.message());
  }
}

}  // namespace pagedlm
