// A Jinja2 interpreter for the subset real chat templates use (see jinja_parser.h for the
// environment it mirrors). Values follow Python semantics so that output matches Python
// Jinja2 byte for byte.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "pagedlm/tokenizer/jinja_parser.h"
#include "pagedlm/tokenizer/jinja_value.h"

namespace pagedlm::jinja {

class Template {
 public:
  // Throws pagedlm::Error "chat template syntax error at line N: ..." for malformed templates.
  explicit Template(const std::string& source);

  // Renders with `context` as the template's variables. Besides them the template sees
  // range, namespace, dict, raise_exception and strftime_now. Throws pagedlm::Error for
  // runtime errors ("chat template error at line N: ...") and with the bare message for
  // raise_exception(message). Safe to call from several threads at once: the parsed template
  // is never changed after construction.
  std::string render(const std::vector<std::pair<std::string, Value>>& context) const;

 private:
  std::shared_ptr<const Body> body_;
};

}  // namespace pagedlm::jinja
