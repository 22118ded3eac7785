// The HTTP front end's request reading: server/http_parse.h's parse_request, which runs the
// bounded Boost.Beast parser and the framing checks a connection runs as bytes arrive. Input:
// the bytes a client sends on one connection; the requests in it are parsed one after another
// as the connection would (keep-alive), until one is refused or more bytes would be needed.
// Properties: every refusal is 400, 413, 415, 417 (an Expect other than 100-continue) or 431
// with a message; a complete request's body is within the bound and was counted among the
// consumed bytes; each parse consumes bytes and never more than it was given; nothing is
// accepted after a refusal (the connection closes).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "fuzz_util.h"
#include "pagedlm/server/http_parse.h"

namespace {

// Small, so that inputs of a few KB reach the bound and the refusals behind it.
constexpr size_t kMaxBodyBytes = 1024;

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  while (!bytes.empty()) {
    const pagedlm::server::ParsedRequest r = pagedlm::server::parse_request(bytes, kMaxBodyBytes);
    PAGEDLM_FUZZ_EXPECT(r.consumed <= bytes.size());
    if (r.refusal.status != 0) {
      const int s = r.refusal.status;
      PAGEDLM_FUZZ_EXPECT(s == 400 || s == 413 || s == 415 || s == 417 || s == 431);
      PAGEDLM_FUZZ_EXPECT(!r.refusal.message.empty());
      PAGEDLM_FUZZ_EXPECT(!r.complete);
      return 0;  // the connection answers and closes
    }
    if (!r.complete) return 0;  // more bytes needed
    PAGEDLM_FUZZ_EXPECT(r.body.size() <= kMaxBodyBytes);
    PAGEDLM_FUZZ_EXPECT(r.consumed > 0 && r.body.size() <= r.consumed);
    PAGEDLM_FUZZ_EXPECT(!r.method.empty());
    bytes.remove_prefix(r.consumed);
  }
  return 0;
}
