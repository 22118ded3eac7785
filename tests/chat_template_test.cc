#include <gtest/gtest.h>

#include "pagedlm/tokenizer/chat_template.h"

TEST(ChatTemplate, Builds) { EXPECT_TRUE(true); }
