// The OpenAI request parsers on any body (openai_request_check.h). Input: the body.
#include <cstddef>
#include <cstdint>

#include "fuzz_util.h"
#include "openai_request_check.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  pagedlm::fuzz::check_request_body(pagedlm::fuzz::as_text(data, size));
  return 0;
}
