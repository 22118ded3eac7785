// An httplib::Server that bounds what one request may make it buffer.
//
// cpp-httplib 0.11 (Debian's, a compiled library, so its CPPHTTPLIB_* limits were fixed when
// it was built) checks the body size only against Content-Length: a chunked body, or one sent
// without a length, is read whole however large. It also keeps any number of header lines, and
// a line of any length until its end arrives. So every connection is read here through a
// stream that counts what each request delivers, and a request whose head (request line and
// headers) passes kMaxHeadBytes gets 431, one whose body passes max_body_bytes (as sent, chunk
// framing included) gets 413; either way the connection is closed without reading more. A
// header line without a colon, which httplib would skip, gets 400.
#pragma once

#include <httplib.h>

#include <cstddef>
#include <functional>
#include <string>

namespace pagedlm::server {

// Far more than real clients send (browsers and proxies stay within 16-32 KB).
inline constexpr size_t kMaxHeadBytes = size_t{64} << 10;

class BoundedServer : public httplib::Server {
 public:
  // `refusal(status)`: the body of the 400, 413 or 431 sent when a request is refused.
  BoundedServer(size_t max_body_bytes, std::function<std::string(int status)> refusal)
      : max_body_bytes_(max_body_bytes), refusal_(std::move(refusal)) {}

  // From a handler: the connection closes after `res`, which says so. For refusals made before
  // the body was read (it would otherwise be parsed as the next request).
  static void close_after_response(httplib::Response& res);

 private:
  // Serves one connection's requests, as httplib's own loop does, through the bounded stream.
  bool process_and_close_socket(socket_t sock) override;

  size_t max_body_bytes_;
  std::function<std::string(int)> refusal_;
};

}  // namespace pagedlm::server
