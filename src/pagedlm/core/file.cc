#include "pagedlm/core/file.h"

#include <fstream>
#include <sstream>

#include "pagedlm/core/error.h"

namespace pagedlm {

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  PAGEDLM_CHECK(in, "cannot open ", path);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

}  // namespace pagedlm
