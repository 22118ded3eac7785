#include <cblas.h>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

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

namespace {

constexpr int kLanes = 16;  // accumulator width: one AVX-512 register, two AVX2 ones
constexpr int64_t kQuantRowTile = 8;
constexpr int64_t kQuantColChunk = 64;

// Block b of a weight row as 32 floats, with the arithmetic of ggml's dequantization.
inline void expand_block(QuantType type, const uint8_t* block, float* w) {
  const float d = f16_to_f32(static_cast<uint16_t>(block[0] | (block[1] << 8)));
  if (type == QuantType::kQ4_1) {
    const float m = f16_to_f32(static_cast<uint16_t>(block[2] | (block[3] << 8)));
    const uint8_t* qs = block + 4;
#pragma omp simd
    for (int j = 0; j < kQuantBlock / 2; ++j) {
      w[j] = static_cast<float>(qs[j] & 0x0F) * d + m;
      w[j + kQuantBlock / 2] = static_cast<float>(qs[j] >> 4) * d + m;
    }
  } else {
    const auto* qs = reinterpret_cast<const int8_t*>(block + 2);
#pragma omp simd
    for (int j = 0; j < kQuantBlock; ++j) w[j] = static_cast<float>(qs[j]) * d;
  }
}

// out[i] = dot(x row i, weight row) for the R rows of a tile: per row kLanes partial sums, lane
// l adding the products of block elements l and l + 16, block by block in order, then the lanes
// summed in a fixed order. The AVX2 path and the portable one keep that lane assignment.
template <int R>
void quant_dot_rows_portable(const float* x, int64_t in_features, const uint8_t* weight_row,
                             QuantType type, float* out) {
  const int64_t num_blocks = in_features / kQuantBlock;
  const int64_t block_bytes = quant_block_bytes(type);
  float acc[R][kLanes] = {};
  alignas(64) float w[kQuantBlock];
  for (int64_t b = 0; b < num_blocks; ++b) {
    expand_block(type, weight_row + b * block_bytes, w);
    for (int i = 0; i < R; ++i) {
      const float* xb = x + i * in_features + b * kQuantBlock;
      for (int l = 0; l < kLanes; ++l) acc[i][l] += w[l] * xb[l];
      for (int l = 0; l < kLanes; ++l) acc[i][l] += w[kLanes + l] * xb[kLanes + l];
    }
  }
  for (int i = 0; i < R; ++i) {
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += acc[i][l];
    out[i] = sum;
  }
}

using QuantDotFn = void (*)(const float*, int64_t, const uint8_t*, QuantType, float*);
constexpr QuantDotFn kPortableDot[kQuantRowTile] = {
    quant_dot_rows_portable<1>, quant_dot_rows_portable<2>, quant_dot_rows_portable<3>,
    quant_dot_rows_portable<4>, quant_dot_rows_portable<5>, quant_dot_rows_portable<6>,
    quant_dot_rows_portable<7>, quant_dot_rows_portable<8>};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
inline float half_to_float(const uint8_t* p) {
  return _cvtsh_ss(static_cast<uint16_t>(p[0] | (p[1] << 8)));
}

template <int R>
void quant_dot_rows(const float* x, int64_t in_features, const uint8_t* weight_row, QuantType type,
                    float* out) {
  const int64_t num_blocks = in_features / kQuantBlock;
  const int64_t block_bytes = quant_block_bytes(type);
  __m256 acc[R][2];
  for (int i = 0; i < R; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  const __m128i low_nibbles = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < num_blocks; ++b) {
    const uint8_t* block = weight_row + b * block_bytes;
    const __m256 d = _mm256_set1_ps(half_to_float(block));
    __m256 w[4];  // elements 0-7, 8-15, 16-23, 24-31
    if (type == QuantType::kQ4_1) {
      const __m256 m = _mm256_set1_ps(half_to_float(block + 2));
      const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 4));
      const __m128i lo = _mm_and_si128(qs, low_nibbles);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low_nibbles);
      const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
      for (int k = 0; k < 4; ++k) {
        const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(parts[k]));
        w[k] = _mm256_fmadd_ps(q, d, m);
      }
    } else {
      for (int k = 0; k < 4; ++k) {
        const __m128i q8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 2 + 8 * k));
        w[k] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q8)), d);
      }
    }
    for (int i = 0; i < R; ++i) {
      const float* xb = x + i * in_features + b * kQuantBlock;
      acc[i][0] = _mm256_fmadd_ps(w[0], _mm256_loadu_ps(xb), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w[1], _mm256_loadu_ps(xb + 8), acc[i][1]);
      acc[i][0] = _mm256_fmadd_ps(w[2], _mm256_loadu_ps(xb + 16), acc[i][0]);
      acc[i][1] = _mm256_fmadd_ps(w[3], _mm256_loadu_ps(xb + 24), acc[i][1]);
    }
  }
  for (int i = 0; i < R; ++i) {
    alignas(32) float lanes[kLanes];
    _mm256_store_ps(lanes, acc[i][0]);
    _mm256_store_ps(lanes + 8, acc[i][1]);
    float sum = 0.f;
    for (int l = 0; l < kLanes; ++l) sum += lanes[l];
    out[i] = sum;
  }
}

constexpr QuantDotFn kQuantDot[kQuantRowTile] = {
    quant_dot_rows<1>, quant_dot_rows<2>, quant_dot_rows<3>, quant_dot_rows<4>,
    quant_dot_rows<5>, quant_dot_rows<6>, quant_dot_rows<7>, quant_dot_rows<8>};
#else
constexpr const QuantDotFn* kQuantDot = kPortableDot;
#endif

// The column-chunk / row-tile driver over one of the tables above.
void linear_blocks(const QuantDotFn* dot, const float* x, const QuantizedMatrix& weight,
                   const float* bias, float* out, int64_t rows) {
  const int64_t out_features = weight.rows, in_features = weight.cols;
  if (rows == 0 || out_features == 0) return;
  const int64_t row_bytes = weight.row_bytes();
  const int64_t num_chunks = (out_features + kQuantColChunk - 1) / kQuantColChunk;
  // Column chunks across threads (a column's arithmetic never depends on the split); within a
  // chunk, row tiles outer so a tile of x stays in L1 while the chunk's weight rows pass by.
#pragma omp parallel for schedule(static)
  for (int64_t chunk = 0; chunk < num_chunks; ++chunk) {
    const int64_t col0 = chunk * kQuantColChunk;
    const int64_t col1 = std::min(out_features, col0 + kQuantColChunk);
    float tile_out[kQuantRowTile];
    for (int64_t r0 = 0; r0 < rows; r0 += kQuantRowTile) {
      const int64_t tile_rows = std::min(kQuantRowTile, rows - r0);
      for (int64_t n = col0; n < col1; ++n) {
        dot[tile_rows - 1](x + r0 * in_features, in_features, weight.blocks.data() + n * row_bytes,
                           weight.type, tile_out);
        for (int64_t i = 0; i < tile_rows; ++i) {
          out[(r0 + i) * out_features + n] = tile_out[i] + (bias != nullptr ? bias[n] : 0.f);
        }
      }
    }
  }
}

}  // namespace

void linear(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
            int64_t rows) {
  linear_blocks(kQuantDot, x, weight, bias, out, rows);
}

void linear_portable(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                     int64_t rows) {
  linear_blocks(kPortableDot, x, weight, bias, out, rows);
}

}  // namespace cpu

void linear(const Tensor& x, const QuantizedMatrix& weight, const Tensor& bias, const Tensor& out) {
  constexpr const char* kOp = "linear (quantized weight)";
  detail::expect(x, kOp, "x", DType::kF32, {detail::kAnyDim, weight.cols});
  detail::expect(out, kOp, "out", DType::kF32, {x.dim(0), weight.rows});
  PAGEDLM_CHECK(x.device() == Device::kCpu && out.device() == Device::kCpu, kOp,
                ": block-quantized weights are a CPU path");
  PAGEDLM_CHECK(weight.cols % kQuantBlock == 0 &&
                    static_cast<int64_t>(weight.blocks.size()) == weight.rows * weight.row_bytes(),
                kOp, ": the weight's blocks do not match its shape [", weight.rows, ", ",
                weight.cols, "]");
  if (bias.defined()) detail::expect(bias, kOp, "bias", DType::kF32, {weight.rows});
  cpu::linear(x.data<float>(), weight, bias.defined() ? bias.data<float>() : nullptr,
              out.data<float>(), x.dim(0));
}

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
