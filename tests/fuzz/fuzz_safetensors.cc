// The safetensors reader (io/safetensors.h): header length, header JSON and the tensor table.
// Input: the file's bytes. A bad file may only throw pagedlm::Error; every tensor it accepts
// must lie inside the file.
#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/io/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const pagedlm::fuzz::MemFile file(data, size);
  try {
    const pagedlm::SafetensorsFile f = pagedlm::SafetensorsFile::open(file.path());
    size_t total = 0;
    for (const auto& [name, tensor] : f.tensors()) {
      PAGEDLM_FUZZ_EXPECT(tensor.defined());
      total += tensor.nbytes();
      PAGEDLM_FUZZ_EXPECT(total <= size);
      // ASan cannot see past a mapping's end, so each tensor's bytes are looked for in the
      // input: a view that strays out of the file would not match it.
      const auto* bytes = static_cast<const uint8_t*>(tensor.raw());
      PAGEDLM_FUZZ_EXPECT(std::search(data, data + size, bytes, bytes + tensor.nbytes()) !=
                          data + size);
    }
  } catch (const pagedlm::Error&) {
  }
  return 0;
}
