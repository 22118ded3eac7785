// The HTTP/1.1 request rules of the front end, apart from its sockets: Boost.Beast's parser,
// bounded in head and body size, plus the framing checks Beast leaves to its user. The
// connection (http_transport.cc) runs them as bytes arrive; parse_request runs the same ones
// over bytes in memory, for tests and fuzzing.
#pragma once

#include <boost/beast/http/parser.hpp>
#include <boost/beast/http/string_body.hpp>
#include <cstddef>
#include <string>
#include <string_view>

namespace pagedlm::server {

// The request line and headers together. Far more than real clients send (browsers and
// proxies stay within 16-32 KB).
inline constexpr size_t kMaxHeadBytes = size_t{64} << 10;

using RequestParser = boost::beast::http::request_parser<boost::beast::http::string_body>;

// A request refused while it is read: the status and the message of its error body. Status 0:
// not refused.
struct Refusal {
  int status = 0;
  std::string message;
};

// Bounds a fresh parser: the head to kMaxHeadBytes, the body to `max_body_bytes` as decoded,
// so a chunked body is held to the same limit as one with a Content-Length.
void bound_parser(RequestParser& parser, size_t max_body_bytes);

// What a parser error answers: 431 past the head limit, 413 past the body limit, else 400.
// Beast itself refuses conflicting Content-Length headers, Content-Length together with
// Transfer-Encoding, and header lines without a colon, any of which a proxy in front might read
// otherwise than we do (request smuggling).
Refusal refusal_for(const boost::system::error_code& ec);

// Checks a complete head for what Beast accepts and the server must not: a Transfer-Encoding
// other than plain "chunked" (Beast would read "gzip, chunked" as chunked and hand over gzip
// bytes; anything else leaves the body's end to guesswork), 400; a compressed body, which
// would have to be inflated past --max-body-bytes and no client of this API sends, 415; an
// HTTP/1.1 request without a Host header, or with two (RFC 9112 3.2), 400; two Authorization
// headers, which a proxy and the server could each read differently, 400; an Expect other than
// "100-continue", which the server cannot meet, 417 (RFC 9110 10.1.1).
Refusal check_head(const boost::beast::http::request_header<>& head);

// Whether the raw bytes of a request head hold a folded header line (obs-fold: a line that
// starts with a space or tab and continues the one before). Beast joins such lines silently;
// RFC 9112 5.2 lets a server refuse them, and a proxy that reads them otherwise would see
// other headers than the server does.
bool has_folded_line(std::string_view head_bytes);
inline constexpr const char* kFoldedLineMessage =
    "folded header lines (a line starting with a space or tab) are not accepted";

struct ParsedRequest {
  bool complete = false;  // a whole request was read and not refused
  Refusal refusal;
  size_t consumed = 0;  // input bytes the request (or the parse up to its refusal) took
  std::string method, target, body;
};

// Parses the first request in `bytes` under the same bounds and checks as a connection:
// complete, refused, or neither (more bytes needed).
ParsedRequest parse_request(std::string_view bytes, size_t max_body_bytes);

}  // namespace pagedlm::server
