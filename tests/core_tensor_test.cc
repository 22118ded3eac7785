#include <gtest/gtest.h>

#include <cmath>

#include "pagedlm/core/tensor.h"

namespace pagedlm {
namespace {

TEST(Tensor, RowsShareStorage) {
  Tensor t = Tensor::from_f32({1, 2, 3, 4, 5, 6}, {3, 2});
  Tensor r = t.rows(1, 3);
  EXPECT_EQ(r.shape(), (Shape{2, 2}));
  EXPECT_EQ(r.data<float>()[0], 3.f);
  r.data<float>()[0] = 9.f;
  EXPECT_EQ(t.data<float>()[2], 9.f);
  EXPECT_THROW(t.rows(2, 4), Error);
  EXPECT_THROW(t.reshape({4}), Error);
}

TEST(DType, HalfConversionsRoundTrip) {
  for (float f : {0.f, -0.f, 1.f, -2.5f, 65504.f, 6.1035156e-05f, 5.9604645e-08f, 3.14159f}) {
    const float back = f16_to_f32(f32_to_f16(f));
    EXPECT_NEAR(back, f, std::abs(f) * 1e-3 + 1e-9) << f;
  }
  EXPECT_EQ(bf16_to_f32(f32_to_bf16(1.5f)), 1.5f);
  EXPECT_TRUE(std::isinf(f16_to_f32(f32_to_f16(1e6f))));
}

}  // namespace
}  // namespace pagedlm
