#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/op_check.h"

namespace pagedlm::ops {

namespace cpu {
namespace {

// Output features per OpenBLAS call; the unit of work handed to the OpenMP threads.
constexpr int64_t kLinearColChunk = 128;

// tile_out[j * kLinearRowTile + i] = dot(x_tile row i, weight row j) for j < n_cols: column-major
// [kLinearRowTile, n_cols], so the tile's rows are OpenBLAS's M dimension (the SIMD lanes of one
// micro-kernel) rather than its N dimension (register columns with edge kernels).
void gemm_tile(const float* x_tile, const float* weight_chunk, float* tile_out, int64_t n_cols,
               int64_t in_features) {
  const auto k = static_cast<blasint>(in_features);
  cblas_sgemm(CblasColMajor, CblasTrans, CblasNoTrans, static_cast<blasint>(kLinearRowTile),
              static_cast<blasint>(n_cols), k, 1.f, x_tile, k, weight_chunk, k, 0.f, tile_out,
              static_cast<blasint>(kLinearRowTile));
}

}  // namespace

// Batch invariance: a row's output bits must not depend on how many rows share the call or where
// the row sits. OpenBLAS chooses blockings, edge kernels and its thread split from (M, N, K), and
// measured results do change with all three: a row differs between M = 1 and M = 16, and with
// the row index inside a 16-row call when rows are OpenBLAS's N dimension (6-wide register
// blocks plus a 4-wide edge kernel) or when OpenBLAS splits M across its threads. So:
//   - every call has M == kLinearRowTile (a short last tile is zero-padded in scratch), and the
//     rows are M, i.e. lanes of the same SIMD instructions, which treat every lane alike;
//   - OpenBLAS runs single-threaded and the threads of core/parallel.h split the output features
//     into fixed kLinearColChunk chunks, so a column's chunk, and with it its arithmetic, depends
//     only on the weight's shape (the result is also independent of the thread count).
// Decode steps, the case that pays for the padding, are bound by streaming the weights from
// memory, and a 16-row tile reads each weight once just as a 1-row GEMV would.
void linear(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
            int64_t out_features, int64_t in_features) {
  if (rows == 0 || out_features == 0) return;
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
  const int64_t num_tiles = (rows + kLinearRowTile - 1) / kLinearRowTile;
  const int64_t tail = rows - (num_tiles - 1) * kLinearRowTile;
  thread_local std::vector<float> x_pad;
  const float* last_tile = x + (num_tiles - 1) * kLinearRowTile * in_features;
  if (tail < kLinearRowTile) {
    x_pad.assign(kLinearRowTile * in_features, 0.f);
    std::memcpy(x_pad.data(), last_tile, tail * in_features * sizeof(float));
    last_tile = x_pad.data();
  }
  const int64_t num_chunks = (out_features + kLinearColChunk - 1) / kLinearColChunk;
  // Chunk-major so a thread keeps its slice of the weights in cache across the row tiles.
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    thread_local std::vector<float> tile_out;
    tile_out.resize(kLinearRowTile * kLinearColChunk);
    const int64_t col0 = chunk * kLinearColChunk;
    const int64_t n_cols = std::min(kLinearColChunk, out_features - col0);
    for (int64_t tile = 0; tile < num_tiles; ++tile) {
      const bool is_last = tile == num_tiles - 1;
      const float* x_tile = is_last ? last_tile : x + tile * kLinearRowTile * in_features;
      gemm_tile(x_tile, weight + col0 * in_features, tile_out.data(), n_cols, in_features);
      const int64_t tile_rows = is_last ? tail : kLinearRowTile;
      for (int64_t i = 0; i < tile_rows; ++i) {
        float* dst = out + (tile * kLinearRowTile + i) * out_features + col0;
        for (int64_t j = 0; j < n_cols; ++j) {
          dst[j] = tile_out[j * kLinearRowTile + i] + (bias != nullptr ? bias[col0 + j] : 0.f);
        }
      }
    }
  }
}

}  // namespace cpu

void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
            void* stream) {
  using detail::kAnyDim;
  constexpr const char* kOp = "linear";
  const DType dt = detail::compute_dtype(x, kOp, "x");
  detail::expect(x, kOp, "x", dt, {kAnyDim, kAnyDim});
  const int64_t rows = x.dim(0), in_features = x.dim(1);
  detail::expect(weight, kOp, "weight", dt, {kAnyDim, in_features});
  const int64_t out_features = weight.dim(0);
  const DType out_dt = out.dtype() == DType::kF32 ? DType::kF32 : dt;
  detail::expect(out, kOp, "out", out_dt, {rows, out_features});
  detail::expect_device(weight, x.device(), kOp, "weight");
  detail::expect_device(out, x.device(), kOp, "out");
  // An undefined Tensor (default-constructed, shape []) means "no bias".
  const bool has_bias = bias.defined();
  if (has_bias) {
    PAGEDLM_CHECK(out_dt == dt, kOp, ": a bias needs out in the compute dtype (", dtype_name(dt),
                  "), got ", dtype_name(out_dt));
    detail::expect(bias, kOp, "bias", dt, {out_features});
    detail::expect_device(bias, x.device(), kOp, "bias");
  }
  if (x.device() == Device::kCpu) {
    cpu::linear(x.data<float>(), weight.data<float>(), has_bias ? bias.data<float>() : nullptr,
                out.data<float>(), rows, out_features, in_features);
    return;
  }
#ifdef PAGEDLM_HAS_CUDA
  cuda::linear(x.raw(), weight.raw(), has_bias ? bias.raw() : nullptr, out.raw(), rows,
               out_features, in_features, dt, out_dt, stream);
#else
  detail::fail_no_cuda(kOp);
#endif
}

}  // namespace pagedlm::ops
