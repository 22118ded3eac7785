// The Tensor entry points of ops/linear_fp8.h: argument checks, then the CUDA launchers. There is
// no CPU kernel: the CPU computes FP8 checkpoints from their dequantized float32 weights.
#include "pagedlm/ops/linear_fp8.h"

#include <cmath>
#include <utility>

#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace {

void expect_gpu(const Tensor& t, std::string_view op, std::string_view name) {
  PAGEDLM_CHECK(t.device() == Device::kCuda, op, ": ", name,
                " must be on the GPU (FP8 GEMMs are a GPU path)");
}

}  // namespace

void check_fp8_compute_capability(int major, int minor, std::string_view device_name,
                                  std::string_view what) {
  PAGEDLM_CHECK(major > 8 || (major == 8 && minor >= 9), what, " needs FP8 tensor cores ",
                "(compute capability 8.9 or later: Ada, Hopper, Blackwell), but ", device_name,
                " has compute capability ", major, ".", minor,
                "; run the checkpoint's weights dequantized to bf16 instead (leave out "
                "--quantization fp8)");
}

bool fp8_gemm_supported() {
#ifdef PAGEDLM_HAS_CUDA
  int major = 0, minor = 0;
  const char* name = nullptr;
  try {
    cuda::device_capability(&major, &minor, &name);
  } catch (const Error&) {
    return false;  // no GPU
  }
  return major > 8 || (major == 8 && minor >= 9);
#else
  return false;
#endif
}

void check_fp8_gemm_supported(std::string_view what) {
#ifdef PAGEDLM_HAS_CUDA
  int major = 0, minor = 0;
  const char* name = nullptr;
  cuda::device_capability(&major, &minor, &name);
  check_fp8_compute_capability(major, minor, name, what);
#else
  fail(what, " needs a GPU with FP8 tensor cores; this build of pagedlm has no CUDA support");
#endif
}

void quantize_fp8_rows(const Tensor& x, const Fp8InputScaling& how, const Tensor& q,
                       const Tensor& scales, void* stream) {
  constexpr const char* kOp = "quantize_fp8_rows";
  detail::expect(x, kOp, "x", DType::kBF16, {detail::kAnyDim, detail::kAnyDim});
  const int64_t rows = x.dim(0), cols = x.dim(1);
  detail::expect(q, kOp, "q", DType::kF8E4M3, {rows, cols});
  detail::expect(scales, kOp, "scales", DType::kF32, {rows});
  PAGEDLM_CHECK(how.static_scale >= 0.f && how.max_abs_ub >= 0.f, kOp,
                ": scales must be >= 0, got static_scale ", how.static_scale, " and max_abs_ub ",
                how.max_abs_ub);
  for (const auto& [t, name] : {std::pair{&x, "x"}, {&q, "q"}, {&scales, "scales"}}) {
    expect_gpu(*t, kOp, name);
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::quantize_fp8_rows(x.raw(), q.raw(), scales.data<float>(), rows, cols, how, stream);
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

bool norm_fuses_fp8(int64_t dim) {
#ifdef PAGEDLM_HAS_CUDA
  return cuda::norm_fuses_fp8(dim);
#else
  (void)dim;
  return false;
#endif
}

bool gated_mul_fuses_fp8(int64_t dim) {
#ifdef PAGEDLM_HAS_CUDA
  return cuda::gated_mul_fuses_fp8(dim);
#else
  (void)dim;
  return false;
#endif
}

void check_fp8_forms(std::string_view op, bool on_gpu, bool fuses, int64_t rows, int64_t in_cols,
                     const Fp8Unscaled& in, int64_t out_cols, const Fp8RowsOut& out) {
  if (!in.on() && !out.on()) return;
  PAGEDLM_CHECK(on_gpu, op, ": the FP8 forms of its input and output are a GPU path");
  PAGEDLM_CHECK(fuses, op, ": rows of ", out_cols, " values take no FP8 form");
  if (in.on()) {
    PAGEDLM_CHECK(in.x_scales.dtype() == DType::kF32 && in.x_scales.numel() >= rows &&
                      in.w_scales.dtype() == DType::kF32 && in.w_scales.numel() == in_cols,
                  op, ": the unscaled input's scales are ", in.x_scales.numel(), " and ",
                  in.w_scales.numel(), " F32; [", rows, ", ", in_cols, "] needs >= ", rows, " and ",
                  in_cols);
    expect_gpu(in.x_scales, op, "x scales");
    expect_gpu(in.w_scales, op, "weight scales");
  }
  if (out.on()) {
    PAGEDLM_CHECK(out.values.dtype() == DType::kF8E4M3 && out.scales.dtype() == DType::kF32 &&
                      out.values.numel() >= rows * out_cols && out.scales.numel() >= rows,
                  op, ": FP8 rows out hold ", out.values.numel(), " e4m3 values and ",
                  out.scales.numel(), " scales; [", rows, ", ", out_cols, "] needs ",
                  rows * out_cols, " and ", rows);
    PAGEDLM_CHECK(out.how.static_scale >= 0.f && out.how.max_abs_ub >= 0.f, op,
                  ": scales must be >= 0, got static_scale ", out.how.static_scale,
                  " and max_abs_ub ", out.how.max_abs_ub);
    expect_gpu(out.values, op, "FP8 values out");
    expect_gpu(out.scales, op, "FP8 scales out");
  }
}

void linear_fp8(const Tensor& x, const Fp8Weight& w, const Tensor& bias, const Tensor& out,
                const Fp8Scratch& scratch, void* stream, DeviceState* state,
                const Fp8Apply& apply) {
  constexpr const char* kOp = "linear (FP8 weight)";
  PAGEDLM_CHECK(w.defined(), kOp, ": the weight is not defined");
  const int64_t out_features = w.rows(), in_features = w.cols();
  detail::expect(x, kOp, "x", DType::kBF16, {detail::kAnyDim, in_features});
  const int64_t rows = x.dim(0);
  detail::expect(w.weight, kOp, "weight", DType::kF8E4M3, {out_features, in_features});
  detail::expect(w.scale, kOp, "weight scale", DType::kF32, {out_features});
  detail::expect(out, kOp, "out", DType::kBF16, {rows, out_features});
  if (bias.defined()) detail::expect(bias, kOp, "bias", DType::kBF16, {out_features});
  PAGEDLM_CHECK(in_features % 16 == 0 && out_features % 16 == 0, kOp,
                ": cuBLASLt's FP8 GEMM needs input and output features in multiples of 16, got [",
                out_features, ", ", in_features, "]");
  PAGEDLM_CHECK(scratch.values.dtype() == DType::kF8E4M3 && scratch.scales.dtype() == DType::kF32 &&
                    scratch.values.numel() >= rows * in_features && scratch.scales.numel() >= rows,
                kOp, ": the scratch holds ", scratch.values.numel(), " e4m3 values and ",
                scratch.scales.numel(), " scales; [", rows, ", ", in_features, "] needs ",
                rows * in_features, " and ", rows);
  for (const auto& [t, name] : {std::pair{&x, "x"},
                                {&w.weight, "weight"},
                                {&w.scale, "weight scale"},
                                {&out, "out"},
                                {&scratch.values, "scratch values"},
                                {&scratch.scales, "scratch scales"}}) {
    expect_gpu(*t, kOp, name);
  }
  if (bias.defined()) expect_gpu(bias, kOp, "bias");
  PAGEDLM_CHECK(state != nullptr, kOp, ": a GPU linear needs its caller's DeviceState");
#ifdef PAGEDLM_HAS_CUDA
  if (!apply.x_quantized) {
    cuda::quantize_fp8_rows(x.raw(), scratch.values.raw(), scratch.scales.data<float>(), rows,
                            in_features, w.inputs, stream);
  }
  bool unscaled = false;
  cuda::linear_fp8(scratch.values.raw(), scratch.scales.data<float>(), w.weight.raw(),
                   w.scale.data<float>(), bias.defined() ? bias.raw() : nullptr, out.raw(), rows,
                   out_features, in_features, stream, *state,
                   apply.unscaled != nullptr ? &unscaled : nullptr);
  if (apply.unscaled != nullptr) {
    *apply.unscaled = unscaled ? Fp8Unscaled{scratch.scales, w.scale} : Fp8Unscaled{};
  }
#else
  (void)stream;
  detail::fail_no_cuda(kOp);
#endif
}

Fp8Weight quantize_fp8_weight(const Tensor& weight, void* stream) {
  constexpr const char* kOp = "quantize_fp8_weight";
  detail::expect(weight, kOp, "weight", DType::kBF16, {detail::kAnyDim, detail::kAnyDim});
  expect_gpu(weight, kOp, "weight");
  Fp8Weight w;
  w.weight = Tensor::empty(DType::kF8E4M3, weight.shape(), Device::kCuda);
  w.scale = Tensor::empty(DType::kF32, {weight.dim(0)}, Device::kCuda);
  quantize_fp8_rows(weight, {}, w.weight, w.scale, stream);
  // The copy waits for the kernel (load time: no step runs), so its errors surface here.
  const Tensor scales = w.scale.to(Device::kCpu);
  for (int64_t r = 0; r < scales.numel(); ++r) {
    const float s = scales.data<float>()[r];
    PAGEDLM_CHECK(std::isfinite(s), kOp, ": row ", r, " of the weight [", weight.dim(0), ", ",
                  weight.dim(1), "] holds a value that is not finite");
  }
  return w;
}

}  // namespace pagedlm::ops
