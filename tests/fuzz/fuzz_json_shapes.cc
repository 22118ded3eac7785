// Request bodies shaped to be slow to parse, through one endpoint's OpenAI request parser
// (openai_request_check.h): a short input describes a body of up to 2 MB, one field holding
// a unit repeated many times, in an array or as the values of an object's distinct keys. Each
// input is one request and must finish within fuzz.sh's -timeout like any other: parsing in
// time quadratic in the body (as nlohmann's callback parser did for `[{},{},...]` and for
// objects with many keys, one 990 KB body taking over a minute) would make a 2 MB body take
// many minutes. Linear work is not cheap under the sanitizers either: a chat of 65k messages
// rendered and tokenized takes ~0.3 s in a release build and ~3.5 s here.
//
// Input: byte 0 picks the field (an unknown one, logit_bias, chat_template_kwargs, messages,
// tools, stop, prompt, response_format, tokens); byte 1 the container (bit 0: object with keys
// "k<i>", else array) and the endpoint (bits 1-2: completions, chat completions, tokenize,
// detokenize); bytes 2-3 the repeat count (times 32); the rest is the unit, the empty object
// if empty.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "openai_request_check.h"

namespace {

constexpr size_t kMaxBodyBytes = size_t{2} << 20;

std::string shaped_body(const uint8_t* data, size_t size) {
  static constexpr std::string_view kFields[] = {
      "x",    "logit_bias", "chat_template_kwargs", "messages", "tools",
      "stop", "prompt",     "response_format",      "tokens"};
  const std::string_view field = kFields[data[0] % std::size(kFields)];
  const bool object = (data[1] & 1) != 0;
  const size_t repeats = (size_t{data[2]} << 8 | data[3]) * 32 + 1;
  const std::string unit =
      size > 4 ? std::string(reinterpret_cast<const char*>(data + 4), size - 4) : "{}";
  std::string body = R"({"prompt":"hi","messages":[{"role":"user","content":"hi"}],")";
  body.append(field).append("\":").push_back(object ? '{' : '[');
  for (size_t i = 0; i < repeats && body.size() + unit.size() + 16 < kMaxBodyBytes; ++i) {
    if (i > 0) body.push_back(',');
    if (object) body.append("\"k").append(std::to_string(i)).append("\":");
    body.append(unit);
  }
  body.push_back(object ? '}' : ']');
  body.push_back('}');
  return body;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 4) return 0;
  using pagedlm::fuzz::Endpoint;
  const std::optional<pagedlm::fuzz::request_json> body =
      pagedlm::fuzz::parsed_body(shaped_body(data, size));
  if (body) pagedlm::fuzz::check_endpoint(*body, static_cast<Endpoint>((data[1] >> 1) & 3));
  return 0;
}
