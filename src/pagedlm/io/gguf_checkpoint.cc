#include "pagedlm/core/error.h"
#include "pagedlm/io/checkpoint.h"

namespace pagedlm {

Checkpoint load_gguf_checkpoint(const std::string& path, const LoadProgress& progress) {
  fail("GGUF support is not built yet (cannot load ", path, ")");
}

}  // namespace pagedlm
