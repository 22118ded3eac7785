// Whole-file reads for the small text inputs (tokenizer JSON, chat templates).
#pragma once

#include <string>

namespace pagedlm {

// The file's bytes; throws pagedlm::Error naming the path when it cannot be opened.
std::string read_file(const std::string& path);

}  // namespace pagedlm
