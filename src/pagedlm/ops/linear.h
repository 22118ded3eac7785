// Dense projection y = x W^T + b: every projection of a layer but the experts (ops/moe.h).
#pragma once

#include <cstdint>
#include <vector>

#include "pagedlm/core/dtype.h"
#include "pagedlm/core/quantized.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/ops/device_state.h"

namespace pagedlm::ops {

// The CPU kernel always multiplies tiles of exactly this many rows (see linear_cpu.cc for why).
inline constexpr int64_t kLinearRowTile = 16;

// x: [n_tokens, in], weight: [out_features, in] (HF layout), bias: [out_features] or an
// undefined Tensor, out: [n_tokens, out_features]. All in the compute dtype, except that out may
// be f32 (then without a bias): the logits, which need no rounding to the compute dtype.
// Batch invariant: each output row is bitwise the same whatever other rows share the call.
// On the GPU, `state` is the caller's (its cuBLASLt handle and plans) and must be given.
void linear(const Tensor& x, const Tensor& weight, const Tensor& bias, const Tensor& out,
            void* stream = nullptr, DeviceState* state = nullptr);

// The same with the weight in ggml blocks (CPU, f32 x / bias / out). With AVX-512, one
// register-blocked micro-kernel (4 rows x 4 weight rows) computes every step: a step of up to 4
// rows feeds it blocks expanded in registers, so it streams the blocks instead of float32; a
// larger one first expands panels of 8 weight rows to float32, once per step, and multiplies all
// its rows with them. Batch invariant as well: every output is defined by one arithmetic (its
// own 16-lane accumulation over the blocks in order, summed as a tree; see linear_cpu.cc) that
// every kernel and the portable loops reproduce bit for bit.
// With out_col0, out may be wider than the weight's rows: the weight's outputs go to its columns
// [out_col0, out_col0 + weight.rows), so that parts of one projection in different formats fill
// one output (a bias then covers all of out's columns).
void linear(const Tensor& x, const QuantizedMatrix& weight, const Tensor& bias, const Tensor& out,
            int64_t out_col0 = 0);

// The blocks in the format the CPU's linear reads fastest, with the same weights (the format's
// cpu_form, core/quantized.h: f16 scales made f32, K-quant scales unpacked; Q4_0 and IQ4_NL 18 ->
// 20 bytes a block, Q4_1 20 -> 24, Q5_0 22 -> 24, Q2_K 84 -> 88, Q3_K 110 -> 116, Q4_K 144 ->
// 152, Q5_K 176 -> 184, Q6_K 210 -> 212, IQ4_XS 136 -> 140); Q5_1 and Q8_0 stay as they are. Done
// once at load; the outputs of linear are bitwise the same either way (the AVX-512 kernels read
// only the repacked layouts of Q5_0 and the K-quants: ggml's own go the portable way).
QuantizedMatrix repack_for_cpu(QuantizedMatrix weight);

// 8-bit activations (an option, not the default): each row of x is quantized to int8 per block
// of 32 (of 256 for the K-quants) and the block dot products are computed in integers, as
// llama.cpp does. Faster, but
// no longer exact (see linear_q8_cpu.cc). The weight's blocks regrouped for it: 16 output
// features side by side, so one int32 / f32 lane of a 512-bit register is one output feature.
struct Q8PackedMatrix {
  QuantType type = QuantType::kQ4_1;
  int64_t rows = 0, cols = 0;  // [out_features, in_features], as the QuantizedMatrix
  std::vector<uint8_t> data;
  // Q8_0: some quant is -128, to which AVX2's maddubs cannot give x's sign (linear_q8's fixed
  // point then takes the portable kernel for it; ggml's quantizer writes -127..127).
  bool has_q_minus_128 = false;

  bool empty() const { return rows == 0; }
};
// Takes every ggml format the CPU keeps (q8_packs): Q4_1 and Q8_0 regrouped as they are; Q4_0,
// Q5_0, Q5_1, the K-quants, IQ4_NL and IQ4_XS in a super-block layout (linear_q8_cpu.cc) that
// keeps their bits per weight, computed as llama.cpp does with its q8_K activations: x quantized
// per 256 (32 for Q4_0, Q5_0, Q5_1 and IQ4_NL), the sub-block scales and mins applied in
// integers, one float step per super-block.
Q8PackedMatrix pack_for_q8(const QuantizedMatrix& weight);
bool q8_packs(QuantType type);
// Whether this build's default integer kernels take the format with VNNI's dot products, where
// 32-bit fixed-point activations (IntActivations below) multiply a row faster than the exact
// kernels, and 32 rows no slower. AVX2's maddubs kernels are faster at one row but slower at 32
// (Q8_0: 2.4x the f32 kernels' time); the portable kernels are slower still.
bool fixed32_on_vnni(QuantType type);
// Row r's weights as floats (cols of them), bit for bit those of the format's reference
// dequantization of the blocks it was packed from (a tied embedding reads its rows here).
void dequantize_row(const Q8PackedMatrix& m, int64_t r, float* out);

// How linear_q8 turns each row of x into integers for the integer kernels:
//   kInt8:    one int8 a value per block, d = max |x| / 127 (ggml's Q8_1 / q8_K with f32
//             scales): lossy, as llama.cpp's, hence an option (--cpu-q8-activations).
//   kFixed32: 32-bit fixed point per block, held as four int8 digit planes (base 256, most
//             significant first, each in [-128, 127]): the block's unit is 2^(e - 29) for
//             2^e <= max |x| < 2^(e + 1), so every value within 2^6 of the block's largest is
//             kept exactly and any other is off by at most 2^-30 of it. Each plane runs through
//             the integer kernels as its own row (the weight's expansion shared by the four) and
//             the planes' outputs are summed, least significant first. The result is the exact
//             product to float32 rounding, held in tests to the same bound as ops::linear
//             (--cpu-fixed32-activations). Blocks whose largest |x| is below 2^-96 count as zeros
//             (their products are below float32's normal range); a block holding a NaN or an
//             infinity makes its row's outputs NaN.
enum class IntActivations : uint8_t { kInt8, kFixed32 };

// y = x W^T + b with x in integers as `input` says (CPU, f32 x / bias / out). Batch invariant:
// each output is one lane's own sequence of operations over the blocks in order, whatever the
// rows around it.
// out_col0 as for linear above.
void linear_q8(const Tensor& x, const Q8PackedMatrix& weight, const Tensor& bias, const Tensor& out,
               int64_t out_col0 = 0, IntActivations input = IntActivations::kInt8);

namespace cpu {
// bias may be null.
void linear(const float* x, const float* weight, const float* bias, float* out, int64_t rows,
            int64_t out_features, int64_t in_features);
// Output row i at out + i * out_stride (out_stride < 0: weight.rows).
void linear(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
            int64_t rows, int64_t out_stride = -1);
// The same with the portable block kernel (plain loops), which machines without AVX2 + FMA +
// F16C run; exposed so that tests hold the SIMD kernels to it bit for bit.
void linear_portable(const float* x, const QuantizedMatrix& weight, const float* bias, float* out,
                     int64_t rows);

// x quantized row by row, `block` values a block (32, or 256 for the K-quants as ggml's q8_K),
// as ggml's Q8_1 (which also keeps the block sum for Q4_1's min term) but with f32 scales:
// d = max |x| / 127, q = x * (1 / d) rounded to nearest, ties to even (as ggml's AVX2 quantizer
// rounds), the block's sum of q and d * sum, and the sum of q per 16 (the K-quants' mins).
struct Q8Activations {
  int64_t rows = 0, cols = 0, block = 32;
  std::vector<int8_t> qs;         // [rows, cols]
  std::vector<float> scale;       // [rows, cols / block]: d
  std::vector<int32_t> sum;       // [rows, cols / block]: sum of the block's q
  std::vector<float> scaled_sum;  // [rows, cols / block]: d * sum
  std::vector<int32_t> sum16;     // [rows, cols / 16]: sum of q per 16
};
void quantize_q8(const float* x, int64_t rows, int64_t cols, Q8Activations& out,
                 int64_t block = 32);
// IntActivations::kFixed32: row r of x becomes rows 4 r .. 4 r + 3 of out, its digit planes
// (most significant first), plane p's scale 2^(e - 5 - 8 p) for the block's e, the sums as
// quantize_q8's over each plane's digits.
inline constexpr int64_t kFixed32Planes = 4;
void quantize_fixed32(const float* x, int64_t rows, int64_t cols, Q8Activations& out,
                      int64_t block = 32);

// The integer dot-product kernels this build has (all give the same bits): portable C++;
// AVX2 (maddubs / madd); 256-bit VNNI (AVX-VNNI or AVX-512 VL); 512-bit AVX-512 VNNI.
enum class Q8Kernel { kPortable, kAvx2, kAvxVnni, kAvx512Vnni };
std::vector<Q8Kernel> q8_kernels();  // those built, the one linear_q8 uses by default first
const char* q8_kernel_name(Q8Kernel kernel);
void linear_q8(const float* x, const Q8PackedMatrix& weight, const float* bias, float* out,
               int64_t rows, Q8Kernel kernel, int64_t out_stride = -1,
               IntActivations input = IntActivations::kInt8);
}  // namespace cpu

#ifdef PAGEDLM_HAS_CUDA
namespace cuda {
// Same contract as cpu::linear; x, weight and bias hold `dtype` elements, out `out_dtype` ones.
void linear(const void* x, const void* weight, const void* bias, void* out, int64_t rows,
            int64_t out_features, int64_t in_features, DType dtype, DType out_dtype, void* stream,
            DeviceState& state);
}  // namespace cuda
#endif

}  // namespace pagedlm::ops
