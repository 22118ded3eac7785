// The GGUF reader (io/gguf.h): the header, metadata and tensor infos of GgufFile::open, the
// typed metadata getters, the tokenizer a GGUF vocabulary makes (Tokenizer::from_gguf) and the
// dequantization of every tensor. Input: the file's bytes. A bad file may only throw
// pagedlm::Error.
#include <cstddef>
#include <cstdint>
#include <string>

#include "fuzz_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/io/gguf.h"
#include "pagedlm/tokenizer/tokenizer.h"

namespace {

// Dequantizing allocates 4 bytes per element: larger tensors (which the file must still hold
// in full, at >= 1/8 byte per element) are skipped to keep runs fast.
constexpr int64_t kMaxElements = int64_t{1} << 16;

void walk(const pagedlm::GgufFile& f) {
  for (const auto& [key, value] : f.metadata()) {
    // Each getter either returns the value or throws naming the key.
    try {
      (void)f.get_int(key);
    } catch (const pagedlm::Error&) {
    }
    try {
      (void)f.get_float(key);
    } catch (const pagedlm::Error&) {
    }
    try {
      (void)f.get_string(key);
    } catch (const pagedlm::Error&) {
    }
    try {
      (void)f.get_string_array(key);
    } catch (const pagedlm::Error&) {
    }
    try {
      (void)f.get_int_array(key);
    } catch (const pagedlm::Error&) {
    }
  }
  for (const pagedlm::GgufTensorInfo& t : f.tensors()) {
    PAGEDLM_FUZZ_EXPECT(f.find_tensor(t.name) == &t);
    PAGEDLM_FUZZ_EXPECT(t.data != nullptr || t.nbytes == 0);
    if (t.numel() > kMaxElements) continue;
    for (int64_t heads : {0, 1, 2}) {
      try {
        const pagedlm::Tensor w = pagedlm::gguf_tensor_f32(t, heads, f.path());
        PAGEDLM_FUZZ_EXPECT(w.numel() == t.numel());
      } catch (const pagedlm::Error&) {
      }
      try {
        (void)pagedlm::gguf_tensor_blocks(t, heads, f.path());
      } catch (const pagedlm::Error&) {
      }
    }
  }
  try {
    const pagedlm::Tokenizer tokenizer = pagedlm::Tokenizer::from_gguf(f);
    (void)tokenizer.decode(tokenizer.encode("Hello, world! 123 \xc3\xa9"));
  } catch (const pagedlm::Error&) {
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const pagedlm::fuzz::MemFile file(data, size);
  try {
    walk(pagedlm::GgufFile::open(file.path()));
  } catch (const pagedlm::Error&) {
  }
  return 0;
}
