#include "pagedlm/ops/exp_cpu.h"
#include "pagedlm/ops/op_check.h"
#include "pagedlm/ops/silu_mul.h"

// GCC vectorizes exp_vectorizable for AVX-512 only (exp_cpu.h); with AVX2 the loops below take
// exp_avx2 through the activations' vector forms (a scalar exp was 3-4% of a prefill's time).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#define PAGEDLM_GATED_AVX2 1
#include <immintrin.h>
#endif

namespace pagedlm::ops {

namespace cpu {
namespace {

// The activations in f32, through the vectorizable exp so that the loops below vectorize.
struct Silu {
  float operator()(float g) const { return g / (1.f + exp_vectorizable(-g)); }
#ifdef PAGEDLM_GATED_AVX2
  __m256 operator()(__m256 g) const {
    const __m256 e = exp_avx2(_mm256_sub_ps(_mm256_setzero_ps(), g));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  }
#endif
};
// HF's 0.5 g (1 + tanh(y)), y = sqrt(2 / pi) (g + 0.044715 g^3), as the equal g * sigmoid(2 y):
// for very negative g, 1 + tanh(y) would cancel to a few bits (or to 0) where
// g / (1 + exp(-2 y)) keeps full relative precision; where g^3 overflows, exp(-2 y) is 0 or
// infinity and the result g or -0, never NaN.
struct GeluTanh {
  static constexpr float kSqrt2OverPi = 0.7978845608028654f, kCubic = 0.044715f;
  float operator()(float g) const {
    const float y = kSqrt2OverPi * (g + kCubic * g * g * g);
    return g / (1.f + exp_vectorizable(-2.f * y));
  }
#ifdef PAGEDLM_GATED_AVX2
  __m256 operator()(__m256 g) const {
    const __m256 cube = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
    const __m256 y = _mm256_mul_ps(_mm256_set1_ps(kSqrt2OverPi),
                                   _mm256_fmadd_ps(_mm256_set1_ps(kCubic), cube, g));
    const __m256 e = exp_avx2(_mm256_mul_ps(_mm256_set1_ps(-2.f), y));
    return _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e));
  }
#endif
};

template <typename Act>
void gated_rows(const float* gate_up, float* out, int64_t n_tokens, int64_t ffn) {
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < n_tokens; ++t) {
    const float* gate = gate_up + t * 2 * ffn;
    const float* up = gate + ffn;
    float* o = out + t * ffn;
    const Act act{};
#ifdef PAGEDLM_GATED_AVX2
    // Every element through the vector form, the tail's one lane at a time, so that an output
    // does not depend on where the row's length puts it.
    int64_t i = 0;
    for (; i + 8 <= ffn; i += 8) {
      _mm256_storeu_ps(o + i,
                       _mm256_mul_ps(act(_mm256_loadu_ps(gate + i)), _mm256_loadu_ps(up + i)));
    }
    for (; i < ffn; ++i) o[i] = _mm256_cvtss_f32(act(_mm256_set1_ps(gate[i]))) * up[i];
#else
    for (int64_t i = 0; i < ffn; ++i) o[i] = act(gate[i]) * up[i];
#endif
  }
}

}  // namespace

void gated_mul(GatedActivation act, const float* gate_up, float* out, int64_t n_tokens,
               int64_t ffn) {
  if (act == GatedActivation::kSilu) {
    gated_rows<Silu>(gate_up, out, n_tokens, ffn);
  } else {
    gated_rows<GeluTanh>(gate_up, out, n_tokens, ffn);
  }
}

}  // namespace cpu

void gated_mul(GatedActivation act, const Tensor& gate_up, const Tensor& out, void* stream,
               const Fp8Unscaled& gate_up_unscaled, const Fp8RowsOut& fp8_out) {
  using detail::kAnyDim;
  const char* op = gated_mul_name(act);
  const DType dt = detail::compute_dtype(gate_up, op, "gate_up");
  detail::expect(gate_up, op, "gate_up", dt, {kAnyDim, kAnyDim});
  PAGEDLM_CHECK(gate_up.dim(1) % 2 == 0, op, ": gate_up has an odd number of columns (",
                gate_up.dim(1), ")");
  const int64_t n_tokens = gate_up.dim(0), ffn = gate_up.dim(1) / 2;
  detail::expect(out, op, "out", dt, {n_tokens, ffn});
  detail::expect_device(out, gate_up.device(), op, "out");
  check_fp8_forms(op, gate_up.device() == Device::kCuda, gated_mul_fuses_fp8(ffn), n_tokens,
                  2 * ffn, gate_up_unscaled, ffn, fp8_out);
  if (gate_up.device() == Device::kCpu) {
    cpu::gated_mul(act, gate_up.data<float>(), out.data<float>(), n_tokens, ffn);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::gated_mul(act, gate_up.raw(), out.raw(), n_tokens, ffn, dt, stream, gate_up_unscaled,
                  fp8_out);
#else
  detail::fail_no_cuda(op);
#endif
}

void silu_mul(const Tensor& gate_up, const Tensor& out, void* stream) {
  gated_mul(GatedActivation::kSilu, gate_up, out, stream);
}

}  // namespace pagedlm::ops
