#include "pagedlm/io/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <limits>

#include "pagedlm/core/error.h"

namespace pagedlm {
namespace {

constexpr uint32_t kGgufMagic = 0x46554747;  // "GGUF" read as little-endian u32
constexpr uint32_t kDefaultAlignment = 32;
constexpr uint32_t kMaxDims = 4;
// Nested arrays are legal, but a hostile file could nest deeply enough to exhaust the stack.
constexpr int kMaxArrayDepth = 16;
// Each array element becomes a GgufValue of ~50 bytes, so one byte of a u8 array would cost 50
// of memory: the elements of all arrays together are bounded. Real files hold well under a
// million (Qwen's 151k tokens and merges; Gemma's 256k tokens).
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 24;

enum ValueType : uint32_t {
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

// Smallest encoding of one value of `type`: bounds array counts by the bytes left in the file.
uint64_t min_encoded_size(uint32_t type) {
  switch (type) {
    case kU8:
    case kI8:
    case kBool:
      return 1;
    case kU16:
    case kI16:
      return 2;
    case kU32:
    case kI32:
    case kF32:
      return 4;
    case kU64:
    case kI64:
    case kF64:
    case kString:
      return 8;
    case kArray:
      return 12;
  }
  return 0;
}

// Maps a whole file read-only; the returned pointer unmaps it when the last owner goes away.
std::shared_ptr<void> map_file(const std::string& path, uint64_t* size) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  PAGEDLM_CHECK(fd >= 0, "cannot open GGUF file '", path, "': ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    fail("cannot stat GGUF file '", path, "': ", std::strerror(err));
  }
  *size = static_cast<uint64_t>(st.st_size);
  if (*size == 0) {
    ::close(fd);
    fail("GGUF file '", path, "' is empty");
  }
  void* p = ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0);
  const int err = errno;
  ::close(fd);  // the mapping stays valid without the descriptor
  PAGEDLM_CHECK(p != MAP_FAILED, "cannot mmap GGUF file '", path, "': ", std::strerror(err));
  const size_t length = *size;
  return std::shared_ptr<void>(p, [length](void* q) { ::munmap(q, length); });
}

// Bounds-checked little-endian cursor over the mapped bytes.
class Reader {
 public:
  Reader(const std::string& path, const uint8_t* base, uint64_t size)
      : path_(path), base_(base), size_(size) {}

  uint64_t pos() const { return pos_; }
  // Counts `n` more array elements against kMaxMetadataValues; false past it.
  bool take_values(uint64_t n) {
    if (n > kMaxMetadataValues - values_) return false;
    values_ += n;
    return true;
  }
  uint64_t remaining() const { return size_ - pos_; }

  template <typename... Args>
  [[noreturn]] void error(const Args&... args) const {
    fail("GGUF file '", path_, "': ", args...);
  }

  void need(uint64_t n, const std::string& what) const {
    if (n > remaining()) {
      error("truncated while reading ", what, " at offset ", pos_, " (needs ", n, " bytes, ",
            remaining(), " left)");
    }
  }

  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, base_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }

  std::string read_string(const std::string& what) {
    const uint64_t len = read<uint64_t>(what + " length");
    if (len > remaining()) {
      error(what, " claims a length of ", len, " bytes but only ", remaining(), " remain");
    }
    std::string s(reinterpret_cast<const char*>(base_ + pos_), len);
    pos_ += len;
    return s;
  }

 private:
  const std::string& path_;
  const uint8_t* base_;
  uint64_t size_;
  uint64_t pos_ = 0;
  uint64_t values_ = 0;  // array elements read so far
};

GgufValue read_value(Reader& r, uint32_t type, const std::string& what, int depth) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case kU8:
      v.value = uint64_t{r.read<uint8_t>(what)};
      break;
    case kI8:
      v.value = int64_t{r.read<int8_t>(what)};
      break;
    case kU16:
      v.value = uint64_t{r.read<uint16_t>(what)};
      break;
    case kI16:
      v.value = int64_t{r.read<int16_t>(what)};
      break;
    case kU32:
      v.value = uint64_t{r.read<uint32_t>(what)};
      break;
    case kI32:
      v.value = int64_t{r.read<int32_t>(what)};
      break;
    case kU64:
      v.value = r.read<uint64_t>(what);
      break;
    case kI64:
      v.value = r.read<int64_t>(what);
      break;
    case kF32:
      v.value = double{r.read<float>(what)};
      break;
    case kF64:
      v.value = r.read<double>(what);
      break;
    case kBool: {
      const uint8_t b = r.read<uint8_t>(what);
      if (b > 1) r.error(what, " is a bool with the value ", int{b});
      v.value = b == 1;
      break;
    }
    case kString:
      v.value = r.read_string(what);
      break;
    case kArray: {
      if (depth >= kMaxArrayDepth) r.error(what, " nests arrays deeper than ", kMaxArrayDepth);
      const uint32_t elem_type = r.read<uint32_t>(what + " element type");
      if (min_encoded_size(elem_type) == 0) {
        r.error(what, " has an array of unknown value type ", elem_type);
      }
      const uint64_t count = r.read<uint64_t>(what + " element count");
      if (!r.take_values(count)) {
        r.error(what, " takes the metadata past ", kMaxMetadataValues, " array elements in all");
      }
      if (count > r.remaining() / min_encoded_size(elem_type)) {
        r.error(what, " claims ", count, " array elements but only ", r.remaining(),
                " bytes remain");
      }
      GgufValue::Array elems;
      elems.reserve(count);
      for (uint64_t i = 0; i < count; ++i) {
        elems.push_back(read_value(r, elem_type, what, depth + 1));
      }
      v.value = std::move(elems);
      break;
    }
    default:
      r.error(what, " has unknown value type ", type);
  }
  return v;
}

bool known_ggml_type(uint32_t t) {
  switch (static_cast<GgmlType>(t)) {
    case GgmlType::kF32:
    case GgmlType::kF16:
    case GgmlType::kBF16:
    case GgmlType::kQ4_0:
    case GgmlType::kQ4_1:
    case GgmlType::kQ5_0:
    case GgmlType::kQ5_1:
    case GgmlType::kQ8_0:
    case GgmlType::kQ2_K:
    case GgmlType::kQ3_K:
    case GgmlType::kQ4_K:
    case GgmlType::kQ5_K:
    case GgmlType::kQ6_K:
    case GgmlType::kIQ4_NL:
    case GgmlType::kIQ4_XS:
      return true;
  }
  return false;
}

const char* value_type_name(uint32_t type) {
  static constexpr const char* kNames[] = {"u8",   "i8",     "u16",   "i16", "u32", "i32", "f32",
                                           "bool", "string", "array", "u64", "i64", "f64"};
  return type < std::size(kNames) ? kNames[type] : "unknown";
}

}  // namespace

bool GgufValue::is_int() const {
  return std::holds_alternative<int64_t>(value) || std::holds_alternative<uint64_t>(value);
}

int64_t GgufValue::as_int() const {
  if (const auto* i = std::get_if<int64_t>(&value)) return *i;
  if (const auto* u = std::get_if<uint64_t>(&value)) {
    PAGEDLM_CHECK(*u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()), "GGUF value ",
                  *u, " does not fit in int64");
    return static_cast<int64_t>(*u);
  }
  fail("GGUF value of type ", value_type_name(type), " is not an integer");
}

double GgufValue::as_float() const {
  if (const auto* d = std::get_if<double>(&value)) return *d;
  if (const auto* i = std::get_if<int64_t>(&value)) return static_cast<double>(*i);
  if (const auto* u = std::get_if<uint64_t>(&value)) return static_cast<double>(*u);
  fail("GGUF value of type ", value_type_name(type), " is not a number");
}

const std::string& GgufValue::as_string() const {
  if (const auto* s = std::get_if<std::string>(&value)) return *s;
  fail("GGUF value of type ", value_type_name(type), " is not a string");
}

const GgufValue::Array& GgufValue::as_array() const {
  if (const auto* a = std::get_if<Array>(&value)) return *a;
  fail("GGUF value of type ", value_type_name(type), " is not an array");
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

size_t GgufTensorInfo::row_bytes() const {
  const int64_t ne0 = dims.empty() ? 1 : dims[0];
  return static_cast<size_t>(ne0 / ggml_block_elems(type)) * ggml_block_bytes(type);
}

GgufFile GgufFile::open(const std::string& path) {
  GgufFile f;
  f.path_ = path;
  uint64_t size = 0;
  f.mapping_ = map_file(path, &size);
  const auto* base = static_cast<const uint8_t*>(f.mapping_.get());
  Reader r(f.path_, base, size);

  const uint32_t magic = r.read<uint32_t>("the magic");
  if (magic != kGgufMagic) r.error("bad magic 0x", std::hex, magic, " (not a GGUF file)");
  f.version_ = r.read<uint32_t>("the version");
  if (f.version_ != 2 && f.version_ != 3) {
    r.error("unsupported GGUF version ", f.version_, " (supported: 2, 3)");
  }
  const uint64_t tensor_count = r.read<uint64_t>("the tensor count");
  const uint64_t kv_count = r.read<uint64_t>("the metadata count");
  // Each KV takes at least 13 bytes (key length, value type, one value byte) and each tensor
  // info at least 24, so larger counts cannot be honest.
  if (kv_count > r.remaining() / 13) {
    r.error("metadata count ", kv_count, " is larger than the file can hold");
  }
  if (tensor_count > r.remaining() / 24) {
    r.error("tensor count ", tensor_count, " is larger than the file can hold");
  }

  for (uint64_t i = 0; i < kv_count; ++i) {
    std::string key = r.read_string(cat("metadata key #", i));
    const std::string what = cat("metadata '", key, "'");
    const uint32_t type = r.read<uint32_t>(what + " value type");
    GgufValue value = read_value(r, type, what, 0);
    if (!f.metadata_.emplace(key, std::move(value)).second) r.error("duplicate ", what);
  }

  if (const GgufValue* a = f.find("general.alignment")) {
    const int64_t align = a->is_int() ? a->as_int() : 0;
    if (align <= 0 || align > (int64_t{1} << 30) || (align & (align - 1)) != 0) {
      r.error("general.alignment must be a power of two, got ",
              a->is_int() ? cat(align) : cat("a ", value_type_name(a->type)));
    }
    f.alignment_ = static_cast<uint32_t>(align);
  } else {
    f.alignment_ = kDefaultAlignment;
  }

  f.tensors_.reserve(tensor_count);
  for (uint64_t i = 0; i < tensor_count; ++i) {
    GgufTensorInfo t;
    t.name = r.read_string(cat("the name of tensor #", i));
    const std::string what = cat("tensor '", t.name, "'");
    const uint32_t n_dims = r.read<uint32_t>(what + " n_dims");
    if (n_dims > kMaxDims) r.error(what, " has ", n_dims, " dims (at most ", kMaxDims, ")");
    // The product of the nonzero dims must fit, not just the element count: with a 0 dim the
    // count is 0 whatever follows, but a product taken in another order (the HF shape is the
    // reverse) would overflow before it reached the 0 (found by fuzzing).
    int64_t nonzero = 1;
    bool empty = false;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t dim = r.read<uint64_t>(what + " dims");
      if (dim > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) ||
          (dim != 0 && static_cast<uint64_t>(nonzero) >
                           static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) / dim)) {
        r.error(what, " has dims whose element count overflows");
      }
      t.dims.push_back(static_cast<int64_t>(dim));
      if (dim == 0) empty = true;
      if (dim != 0) nonzero *= static_cast<int64_t>(dim);
    }
    const int64_t numel = empty ? 0 : nonzero;
    const uint32_t type = r.read<uint32_t>(what + " type");
    if (!known_ggml_type(type)) r.error(what, " has unknown or unsupported ggml type ", type);
    t.type = static_cast<GgmlType>(type);
    t.offset = r.read<uint64_t>(what + " offset");

    const int64_t ne0 = t.dims.empty() ? 1 : t.dims[0];
    if (ne0 % ggml_block_elems(t.type) != 0) {
      r.error(what, " has ne0 ", ne0, ", not a multiple of the ", ggml_type_name(t.type),
              " block size ", ggml_block_elems(t.type));
    }
    // numel fits in int64, but the byte count (4 per F32 element) may not.
    const uint64_t blocks = static_cast<uint64_t>(numel / ggml_block_elems(t.type));
    if (blocks > std::numeric_limits<uint64_t>::max() / ggml_block_bytes(t.type)) {
      r.error(what, " is too large");
    }
    t.nbytes = blocks * ggml_block_bytes(t.type);
    if (t.offset % f.alignment_ != 0) {
      r.error(what, " offset ", t.offset, " is not a multiple of the alignment ", f.alignment_);
    }
    if (!f.tensor_index_.emplace(t.name, f.tensors_.size()).second) r.error("duplicate ", what);
    f.tensors_.push_back(std::move(t));
  }

  const uint64_t end_of_infos = r.pos();
  f.data_offset_ = (end_of_infos + f.alignment_ - 1) / f.alignment_ * f.alignment_;
  const uint64_t data_size = f.data_offset_ <= size ? size - f.data_offset_ : 0;
  for (GgufTensorInfo& t : f.tensors_) {
    if (t.offset > data_size || t.nbytes > data_size - t.offset) {
      r.error("tensor '", t.name, "' (", t.nbytes, " bytes at data offset ", t.offset,
              ") extends past the end of the file");
    }
    t.data = base + f.data_offset_ + t.offset;
  }
  return f;
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = metadata_.find(key);
  return it == metadata_.end() ? nullptr : &it->second;
}

namespace {

const GgufValue& require(const GgufFile& f, const std::string& key) {
  const GgufValue* v = f.find(key);
  PAGEDLM_CHECK(v != nullptr, "GGUF file '", f.path(), "' has no metadata key '", key, "'");
  return *v;
}

// Runs a GgufValue accessor, adding the key and file to its error message.
template <typename Fn>
auto with_key(const GgufFile& f, const std::string& key, Fn&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (const Error& e) {
    fail("GGUF file '", f.path(), "' metadata '", key, "': ", e.what());
  }
}

}  // namespace

int64_t GgufFile::get_int(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  return with_key(*this, key, [&] { return v.as_int(); });
}

double GgufFile::get_float(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  return with_key(*this, key, [&] { return v.as_float(); });
}

const std::string& GgufFile::get_string(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  return with_key(*this, key, [&]() -> const std::string& { return v.as_string(); });
}

std::vector<std::string> GgufFile::get_string_array(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  return with_key(*this, key, [&] {
    std::vector<std::string> out;
    out.reserve(v.as_array().size());
    for (const GgufValue& e : v.as_array()) out.push_back(e.as_string());
    return out;
  });
}

std::vector<int64_t> GgufFile::get_int_array(const std::string& key) const {
  const GgufValue& v = require(*this, key);
  return with_key(*this, key, [&] {
    std::vector<int64_t> out;
    out.reserve(v.as_array().size());
    for (const GgufValue& e : v.as_array()) out.push_back(e.as_int());
    return out;
  });
}

const GgufTensorInfo* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

}  // namespace pagedlm
