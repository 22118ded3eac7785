// tokenizer.json loading (Tokenizer::from_tokenizer_json_text), then encoding and decoding with
// what loaded. Input: the file's text. A bad file may only throw pagedlm::Error.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "fuzz_util.h"
#include "pagedlm/core/error.h"
#include "pagedlm/tokenizer/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::optional<pagedlm::Tokenizer> tokenizer;
  try {
    tokenizer.emplace(pagedlm::Tokenizer::from_tokenizer_json_text(
        pagedlm::fuzz::as_text(data, size), "fuzz/tokenizer.json"));
  } catch (const pagedlm::Error&) {
    return 0;
  }
  // Text that reaches the added-token split, the pre-tokenizer's classes and byte-level BPE.
  const std::string text = "Hello, world! <|begin|> 123 don't\n\n\t  \xc3\xa9\xe4\xb8\xad \xff";
  for (bool special : {false, true}) {
    const std::vector<int32_t> ids = tokenizer->encode(text, special, special);
    for (int32_t id : ids) {
      PAGEDLM_FUZZ_EXPECT(id >= 0 && id < tokenizer->vocab_size());
    }
    (void)tokenizer->decode(ids, special);
  }
  // Every id decodes, piece by piece as a stream does.
  const int32_t n = std::min(tokenizer->vocab_size(), 4096);
  pagedlm::StreamDecoder stream(*tokenizer);
  for (int32_t id = -1; id <= n; ++id) {
    (void)tokenizer->token_to_piece(id);
    (void)stream.push(id);
  }
  (void)stream.finish();
  return 0;
}
