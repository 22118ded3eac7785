#include "pagedlm/server/http_parse.h"

#include <boost/beast/core/buffers_prefix.hpp>
#include <boost/beast/core/string.hpp>
#include <boost/beast/http/error.hpp>

namespace pagedlm::server {

namespace http = boost::beast::http;

void bound_parser(RequestParser& parser, size_t max_body_bytes) {
  parser.header_limit(static_cast<std::uint32_t>(kMaxHeadBytes));
  parser.body_limit(max_body_bytes);
}

Refusal refusal_for(const boost::system::error_code& ec) {
  if (ec == http::error::header_limit) return {431, "the request headers are too large"};
  if (ec == http::error::body_limit) return {413, "the request body is too large"};
  if (ec == http::error::bad_content_length) {
    return {400,
            "a malformed Content-Length, conflicting Content-Length headers, or both "
            "Content-Length and Transfer-Encoding"};
  }
  if (ec == http::error::bad_transfer_encoding) {
    return {400,
            "a request must not have both Content-Length and Transfer-Encoding, nor "
            "Transfer-Encoding twice"};
  }
  if (ec == http::error::bad_field) {
    return {400, "malformed request head: a header line without a colon, or a bad field name"};
  }
  return {400, "malformed request: " + ec.message()};
}

Refusal check_head(const http::request_header<>& head) {
  const auto te = head.find(http::field::transfer_encoding);
  if (te != head.end() && !boost::beast::iequals(te->value(), "chunked")) {
    return {400, "unsupported Transfer-Encoding: only \"chunked\" is accepted"};
  }
  const auto ce = head.find(http::field::content_encoding);
  if (ce != head.end() && !ce->value().empty() && !boost::beast::iequals(ce->value(), "identity")) {
    return {415, "compressed request bodies (Content-Encoding) are not supported"};
  }
  const size_t hosts = head.count(http::field::host);
  if (hosts > 1) return {400, "more than one Host header"};
  if (hosts == 0 && head.version() >= 11) return {400, "an HTTP/1.1 request needs a Host header"};
  if (head.count(http::field::authorization) > 1) {
    return {400, "more than one Authorization header"};
  }
  const auto expect = head.find(http::field::expect);
  if (expect != head.end() && !boost::beast::iequals(expect->value(), "100-continue")) {
    return {417, "unsupported Expect: only \"100-continue\" is accepted"};
  }
  return {};
}

bool has_folded_line(std::string_view head_bytes) {
  // The request line holds no line break, so any line after a line break that starts with
  // whitespace continues a header line.
  for (size_t at = head_bytes.find('\n');
       at != std::string_view::npos && at + 1 < head_bytes.size();
       at = head_bytes.find('\n', at + 1)) {
    if (head_bytes[at + 1] == ' ' || head_bytes[at + 1] == '\t') return true;
  }
  return false;
}

ParsedRequest parse_request(std::string_view bytes, size_t max_body_bytes) {
  ParsedRequest out;
  RequestParser parser;
  bound_parser(parser, max_body_bytes);
  parser.eager(true);  // the body in the same put() as the head, as far as it has arrived
  bool head_checked = false;
  while (!parser.is_done()) {
    boost::system::error_code ec;
    const size_t before = out.consumed;
    const size_t used = parser.put(
        boost::asio::const_buffer(bytes.data() + out.consumed, bytes.size() - out.consumed), ec);
    out.consumed += used;
    // The head's checks come first, as on a connection, which runs them before reading the body.
    // Beast parses a head in one put(), once all of it is there, so `used` bytes from `before`
    // hold the whole head (and, eager, what of the body followed; a body may hold anything).
    if (parser.is_header_done() && !head_checked) {
      head_checked = true;
      const std::string_view taken = bytes.substr(before, used);
      const size_t head_end = taken.find("\r\n\r\n");
      if (has_folded_line(taken.substr(0, head_end))) {
        out.refusal = {400, kFoldedLineMessage};
        return out;
      }
      out.refusal = check_head(parser.get().base());
      if (out.refusal.status != 0) return out;
    }
    if (ec == http::error::need_more) return out;
    if (ec) {
      out.refusal = refusal_for(ec);
      return out;
    }
    if (used == 0 && !parser.is_done()) return out;  // needs bytes that are not there
  }
  http::request<http::string_body> request = parser.release();
  out.complete = true;
  out.method = std::string(request.method_string());
  out.target = std::string(request.target());
  out.body = std::move(request.body());
  return out;
}

}  // namespace pagedlm::server
