// The chat page served at "/": plain HTML and JavaScript, no build step.
#pragma once

namespace pagedlm::server {

extern const char kChatPageHtml[];

}  // namespace pagedlm::server
