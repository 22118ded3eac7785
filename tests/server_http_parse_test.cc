// The front end's request rules on bytes in memory (parse_request): what RFC 9112 frames as one
// request, and what the server refuses before any handler sees it.
#include <gtest/gtest.h>

#include <string>

#include "pagedlm/server/http_parse.h"

namespace pagedlm::server {
namespace {

constexpr size_t kBody = 1000;

TEST(HttpParse, RequestWithContentLength) {
  const std::string raw =
      "POST /v1/completions?x=1 HTTP/1.1\r\nHost: a\r\nContent-Length: 5\r\n\r\nhello";
  const ParsedRequest p = parse_request(raw, kBody);
  ASSERT_TRUE(p.complete);
  EXPECT_EQ(p.refusal.status, 0);
  EXPECT_EQ(p.method, "POST");
  EXPECT_EQ(p.target, "/v1/completions?x=1");
  EXPECT_EQ(p.body, "hello");
  EXPECT_EQ(p.consumed, raw.size());
}

TEST(HttpParse, ChunkedBodyIsDecoded) {
  // The chunked example of RFC 9112's era, "Wikipedia" in two chunks, with a chunk extension.
  const std::string raw =
      "POST /tokenize HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n"
      "4\r\nWiki\r\n5;ext=1\r\npedia\r\n0\r\n\r\n";
  const ParsedRequest p = parse_request(raw, kBody);
  ASSERT_TRUE(p.complete) << p.refusal.message;
  EXPECT_EQ(p.body, "Wikipedia");
}

TEST(HttpParse, PipelinedRequestsAreTakenOneAtATime) {
  const std::string first = "GET /health HTTP/1.1\r\nHost: a\r\n\r\n";
  const ParsedRequest p = parse_request(first + "GET /metrics HTTP/1.1\r\nHost: a\r\n\r\n", kBody);
  ASSERT_TRUE(p.complete);
  EXPECT_EQ(p.target, "/health");
  EXPECT_EQ(p.consumed, first.size());
}

TEST(HttpParse, IncompleteRequestIsNeitherCompleteNorRefused) {
  for (const std::string raw :
       {"GET /health HTTP/1.1\r\nHo", "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 10\r\n\r\nabc",
        "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n4\r\nWi"}) {
    const ParsedRequest p = parse_request(raw, kBody);
    EXPECT_FALSE(p.complete) << raw;
    EXPECT_EQ(p.refusal.status, 0) << raw;
  }
}

TEST(HttpParse, BodyLimitHoldsForEveryFraming) {
  const std::string big(kBody + 1, 'x');
  ParsedRequest p = parse_request(
      "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: " + std::to_string(big.size()) + "\r\n\r\n",
      kBody);
  EXPECT_EQ(p.refusal.status, 413) << "refused from the Content-Length alone";
  char size[16];
  std::snprintf(size, sizeof(size), "%zx", big.size());
  p = parse_request(
      std::string("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n") + size +
          "\r\n" + big,
      kBody);
  EXPECT_EQ(p.refusal.status, 413);
  // Many small chunks add up.
  std::string chunks;
  for (size_t i = 0; i <= kBody / 10; ++i) chunks += "a\r\n0123456789\r\n";
  p = parse_request("POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks,
                    kBody);
  EXPECT_EQ(p.refusal.status, 413);
  // Exactly at the limit is fine.
  p = parse_request(
      "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 1000\r\n\r\n" + std::string(kBody, 'x'),
      kBody);
  EXPECT_TRUE(p.complete);
}

TEST(HttpParse, HeadLimitIs431) {
  std::string raw = "GET / HTTP/1.1\r\n";
  while (raw.size() <= kMaxHeadBytes) raw += "X-Filler: " + std::string(100, 'v') + "\r\n";
  EXPECT_EQ(parse_request(raw + "\r\n", kBody).refusal.status, 431);
  // One line that never ends.
  EXPECT_EQ(parse_request("GET / HTTP/1.1\r\nX: " + std::string(kMaxHeadBytes, 'v'), kBody)
                .refusal.status,
            431);
}

TEST(HttpParse, AmbiguousFramingIs400) {
  for (const char* head : {
           "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nTransfer-Encoding: chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2, 3\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: -2\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: "
           "chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nTransfer-Encoding: identity\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nno colon here\r\n\r\n",
           "POST / HTTP/1.1\r\nHost: a\r\nBad Name: 2\r\n\r\n",
           "GET / HTTP/1.1 trailing\r\nHost: a\r\n\r\n",
       }) {
    const ParsedRequest p = parse_request(std::string(head) + "{}", kBody);
    EXPECT_EQ(p.refusal.status, 400) << head;
    EXPECT_FALSE(p.complete) << head;
  }
  // Repeating the same length is allowed (RFC 9110 section 8.6).
  EXPECT_TRUE(
      parse_request(
          "POST / HTTP/1.1\r\nHost: a\r\nContent-Length: 2\r\nContent-Length: 2\r\n\r\n{}", kBody)
          .complete);
}

TEST(HttpParse, CompressedBodyIs415) {
  const ParsedRequest p = parse_request(
      "POST / HTTP/1.1\r\nHost: a\r\nContent-Encoding: gzip\r\nContent-Length: 2\r\n\r\n{}", kBody);
  EXPECT_EQ(p.refusal.status, 415);
  EXPECT_TRUE(
      parse_request(
          "POST / HTTP/1.1\r\nHost: a\r\nContent-Encoding: identity\r\nContent-Length: 2\r\n\r\n{}",
          kBody)
          .complete);
}

TEST(HttpParse, HostIsRequiredOnceInHttp11) {
  EXPECT_EQ(parse_request("GET /health HTTP/1.1\r\n\r\n", kBody).refusal.status, 400);
  EXPECT_EQ(
      parse_request("GET /health HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", kBody).refusal.status,
      400);
  // HTTP/1.0 had no Host header.
  EXPECT_TRUE(parse_request("GET /health HTTP/1.0\r\n\r\n", kBody).complete);
}

TEST(HttpParse, FoldedHeaderLinesAre400) {
  for (const char* head : {"GET /health HTTP/1.1\r\nHost: a\r\nX-A: one\r\n two\r\n\r\n",
                           "GET /health HTTP/1.1\r\nHost: a\r\nX-A: one\r\n\ttwo\r\n\r\n",
                           "GET /health HTTP/1.1\r\nHost:\r\n a\r\n\r\n"}) {
    const ParsedRequest p = parse_request(head, kBody);
    EXPECT_EQ(p.refusal.status, 400) << head;
    EXPECT_NE(p.refusal.message.find("folded"), std::string::npos) << p.refusal.message;
  }
  // Spaces and tabs inside a value, or in a body, are no fold.
  EXPECT_TRUE(parse_request("POST / HTTP/1.1\r\nHost: a\r\nX-A: one \t two\r\n"
                            "Content-Length: 4\r\n\r\n\n \n\t",
                            kBody)
                  .complete);
}

TEST(HttpParse, DuplicateAuthorizationIs400) {
  const ParsedRequest p = parse_request(
      "GET /health HTTP/1.1\r\nHost: a\r\nAuthorization: Bearer x\r\nAuthorization: Bearer "
      "y\r\n\r\n",
      kBody);
  EXPECT_EQ(p.refusal.status, 400);
  EXPECT_NE(p.refusal.message.find("Authorization"), std::string::npos) << p.refusal.message;
}

TEST(HttpParse, UnknownExpectationIs417) {
  EXPECT_EQ(parse_request("POST / HTTP/1.1\r\nHost: a\r\nExpect: 999-bogus\r\n"
                          "Content-Length: 2\r\n\r\n{}",
                          kBody)
                .refusal.status,
            417);
  EXPECT_TRUE(parse_request("POST / HTTP/1.1\r\nHost: a\r\nExpect: 100-Continue\r\n"
                            "Content-Length: 2\r\n\r\n{}",
                            kBody)
                  .complete);
}

}  // namespace
}  // namespace pagedlm::server
