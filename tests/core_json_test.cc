// core/json.h builds the same value as nlohmann's own parser, in time linear in the text
// whatever its shape. nlohmann's callback parser, which it replaced, scanned the enclosing
// container after every object that closed, and ordered_json objects searched their keys on
// every insert: quadratic in arrays of objects and in objects with many keys (2-core Intel
// Xeon, 2026-12-02: 40,000 `{}` in an array 5.7 s, as an object's values 61 s).
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "pagedlm/core/json.h"

namespace pagedlm {
namespace {

using ojson = nlohmann::ordered_json;

// `items` joined by commas inside `open`/`close`, grown until the text has `bytes` bytes.
std::string repeated(const std::string& open, const std::string& close, size_t bytes,
                     const std::function<std::string(size_t)>& item) {
  std::string text = open;
  for (size_t i = 0; text.size() < bytes; ++i) {
    if (i > 0) text += ',';
    text += item(i);
  }
  return text + close;
}

struct Shape {
  const char* name;
  std::function<std::string(size_t bytes)> make;
};

std::vector<Shape> shapes() {
  return {
      {"array of empty objects",
       [](size_t n) { return repeated("[", "]", n, [](size_t) { return "{}"; }); }},
      {"array of objects with a key",
       [](size_t n) { return repeated("[", "]", n, [](size_t) { return R"({"a":1})"; }); }},
      {"array of empty arrays",
       [](size_t n) { return repeated("[", "]", n, [](size_t) { return "[]"; }); }},
      {"array of numbers",
       [](size_t n) { return repeated("[", "]", n, [](size_t i) { return std::to_string(i); }); }},
      {"object with many keys",
       [](size_t n) {
         return repeated("{", "}", n, [](size_t i) { return "\"k" + std::to_string(i) + "\":1"; });
       }},
      {"object whose values are objects",
       [](size_t n) {
         return repeated("{", "}", n, [](size_t i) { return "\"k" + std::to_string(i) + "\":{}"; });
       }},
      {"one key repeated",
       [](size_t n) {
         return repeated("{", "}", n, [](size_t i) { return R"("a":)" + std::to_string(i); });
       }},
      {"request with a large logit_bias",
       [](size_t n) {
         return R"({"prompt":"hi","logit_bias":)" +
                repeated("{", "}", n, [](size_t i) { return "\"" + std::to_string(i) + "\":1"; }) +
                "}";
       }},
  };
}

// The same value as nlohmann's plain parser (no callback: the reference), with keys in their
// order and a repeated key's last value in its first place.
TEST(JsonParse, BuildsWhatNlohmannBuilds) {
  for (const Shape& shape : shapes()) {
    const std::string text = shape.make(20000);
    EXPECT_EQ(parse_json<ojson>(text), ojson::parse(text)) << shape.name;
    EXPECT_EQ(parse_json<nlohmann::json>(text), nlohmann::json::parse(text)) << shape.name;
  }
  const std::string text = R"({"b":1,"a":[true,null,{"x":"s","x":2.5}],"b":[],"c":-3})";
  EXPECT_EQ(parse_json<ojson>(text).dump(), R"({"b":[],"a":[true,null,{"x":2.5}],"c":-3})");
  EXPECT_EQ(parse_json<ojson>(text), ojson::parse(text));
  EXPECT_EQ(parse_json<ojson>("7"), 7);
  EXPECT_THROW(parse_json<ojson>(R"({"a":1,})"), ojson::parse_error);
  EXPECT_THROW(parse_json<ojson>("[1e999]"), ojson::out_of_range);
}

// A parse given an abandon flag builds the same value while the flag is down, and throws
// JsonParseAbandoned, whatever the shape, once it is up (the server raises it when it drains).
TEST(JsonParse, AbandonsOnceItsFlagIsUp) {
  std::atomic<bool> abandon{false};
  for (const Shape& shape : shapes()) {
    const std::string text = shape.make(20000);
    abandon = false;
    EXPECT_EQ(parse_json<ojson>(text, kMaxJsonDepth, &abandon), ojson::parse(text)) << shape.name;
    abandon = true;
    EXPECT_THROW(parse_json<ojson>(text, kMaxJsonDepth, &abandon), JsonParseAbandoned)
        << shape.name;
    EXPECT_THROW(parse_json<nlohmann::json>(text, kMaxJsonDepth, &abandon), JsonParseAbandoned)
        << shape.name;
  }
  EXPECT_THROW(parse_json<ojson>("7", kMaxJsonDepth, &abandon), JsonParseAbandoned);
  // Text that is not JSON is still refused as such when the refusal comes first.
  EXPECT_THROW(parse_json<ojson>("]", kMaxJsonDepth, &abandon), ojson::parse_error);
}

// 8 MB of each shape (the server's default --max-body-bytes) parses in well under the bound
// on a loaded 2-core machine (about 1-2 s each on the Xeon above, under load); quadratic
// parsing takes hours at this size.
TEST(JsonParse, EightMegabytesOfAnyShapeParseInLinearTime) {
  constexpr double kBoundSeconds = 10;
  for (const Shape& shape : shapes()) {
    const std::string text = shape.make(size_t{8} << 20);
    const auto start = std::chrono::steady_clock::now();
    {
      const ojson value = parse_json<ojson>(text);
      EXPECT_FALSE(value.empty()) << shape.name;
    }  // freeing the value is part of the cost
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_LT(seconds, kBoundSeconds) << shape.name;
    std::printf("%-34s %zu bytes: %.2f s\n", shape.name, text.size(), seconds);
  }
}

}  // namespace
}  // namespace pagedlm
