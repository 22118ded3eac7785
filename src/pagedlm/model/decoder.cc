// The decoder every family runs: pre-norm attention and a gated MLP per layer, with the pieces a
// family switches on in its ModelConfig (q/k/v biases, q/k norms, sandwich norms, (1 + w) norms,
// GeGLU, scaled embeddings, a final soft-cap, mixture-of-experts MLPs) and one attention spec
// per layer. Weights are found under the family's names (model/family.h).
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include "pagedlm/model/family.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/rope.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/ops/communicator.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/linear_blocks.h"
#include "pagedlm/ops/linear_fp8.h"
#include "pagedlm/ops/moe.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/silu_mul.h"
#include "pagedlm/ops/softcap.h"

namespace pagedlm {
namespace {

// A row range of a projection's output features kept in blocks of one format: their blocks
// (ops::linear expands them in registers) or those blocks regrouped for the integer kernels,
// which take the input as 8-bit or 32-bit fixed-point integers (ModelOptions::cpu_q8_activations,
// cpu_fixed32_activations).
struct BlockPart {
  QuantizedMatrix blocks;
  ops::Q8PackedMatrix q8;
  ops::IntActivations q8_input = ops::IntActivations::kInt8;

  int64_t rows() const { return q8.empty() ? blocks.rows : q8.rows; }
  int64_t bytes() const {
    return static_cast<int64_t>(q8.empty() ? blocks.blocks.size() : q8.data.size());
  }
  std::string format() const {
    if (q8.empty()) return quant_format(blocks.type).name;
    return std::string(quant_format(q8.type).name) + (q8_input == ops::IntActivations::kFixed32
                                                          ? " (32-bit fixed-point activations)"
                                                          : " (8-bit activations)");
  }
};

// How a projection's weight is kept, and so which kernel multiplies by it.
enum class WeightFormat : uint8_t {
  kDense,   // the compute dtype: f32 on the CPU, bf16 on the GPU
  kBlocks,  // CPU, a GGUF's block formats: its parts' blocks
  kFp8,     // GPU with FP8 tensor cores: e4m3 with per-feature scales, W8A8 GEMMs
  // GPU, a GGUF's block formats the GPU has kernels for (ops/linear_blocks.h): its parts' blocks
  // as the file holds them
  kGpuBlocks,
};

// What apply() may overwrite besides its output: an FP8 projection's quantized input; the bf16
// expansion of a block projection's weight for a step too large for the matrix-vector kernel
// ([>= rows * cols] of the largest such projection).
struct ProjectionScratch {
  ops::Fp8Scratch fp8;
  Tensor dequantized;
};

// A projection's weight as the backend computes with it: dense in the compute dtype; on the CPU
// for a GGUF's block formats, its parts' blocks in order of their output features (one part
// unless the stacked matrices differ in format, as a Q4_K_M file's q, k and v projections do);
// or in FP8 on the GPU, or on the GPU in blocks (gpu_parts, in order of output features as parts).
struct Projection {
  WeightFormat format = WeightFormat::kDense;
  Tensor dense;
  std::vector<BlockPart> parts;
  ops::Fp8Weight fp8;
  std::vector<ops::DeviceBlocks> gpu_parts;

  void apply(const Tensor& x, const Tensor& bias, const Tensor& out, void* stream,
             ops::DeviceState* state, const ProjectionScratch& scratch) const {
    if (format == WeightFormat::kDense) {
      ops::linear(x, dense, bias, out, stream, state);
      return;
    }
    if (format == WeightFormat::kFp8) {
      ops::linear_fp8(x, fp8, bias, out, scratch.fp8, stream, state);
      return;
    }
    if (format == WeightFormat::kGpuBlocks) {
      apply_gpu_blocks(x, bias, out, stream, state, scratch);
      return;
    }
    int64_t col0 = 0;
    for (const BlockPart& part : parts) {
      if (!part.q8.empty()) {
        ops::linear_q8(x, part.q8, bias, out, col0, part.q8_input);
      } else {
        ops::linear(x, part.blocks, bias, out, col0);
      }
      col0 += part.rows();
    }
    PAGEDLM_CHECK(col0 == out.dim(1), "a projection's parts have ", col0, " outputs, out has ",
                  out.dim(1));
  }

  // Decode: each part's blocks through the matrix-vector kernel into its columns of out. Larger
  // steps: all parts expanded to bf16 into the scratch, one GEMM (the expansion writes 2 bytes and
  // the GEMM reads them back per weight, on top of the blocks: a cost per prefill call, not per
  // token).
  void apply_gpu_blocks(const Tensor& x, const Tensor& bias, const Tensor& out, void* stream,
                        ops::DeviceState* state, const ProjectionScratch& scratch) const {
    if (x.dim(0) <= ops::kBlockMatvecMaxRows) {
      int64_t col0 = 0;
      for (const ops::DeviceBlocks& part : gpu_parts) {
        ops::linear_blocks(x, part, bias, out, col0, stream);
        col0 += part.rows;
      }
      PAGEDLM_CHECK(col0 == out.dim(1), "a projection's parts have ", col0, " outputs, out has ",
                    out.dim(1));
      return;
    }
    const int64_t rows = gpu_rows(), cols = gpu_parts.front().cols;
    PAGEDLM_CHECK(scratch.dequantized.defined() && scratch.dequantized.numel() >= rows * cols,
                  "a GPU block projection [", rows, ", ", cols,
                  "] needs a bf16 scratch of that size for steps of ", x.dim(0), " rows");
    const Tensor dense = scratch.dequantized.rows(0, rows * cols).reshape({rows, cols});
    int64_t row0 = 0;
    for (const ops::DeviceBlocks& part : gpu_parts) {
      ops::dequantize_blocks(part, dense, row0, stream);
      row0 += part.rows;
    }
    ops::linear(x, dense, bias, out, stream, state);
  }

  // The output features of a GPU block projection.
  int64_t gpu_rows() const {
    int64_t rows = 0;
    for (const ops::DeviceBlocks& part : gpu_parts) rows += part.rows;
    return rows;
  }

  // The bytes apply() reads by format, added to `by_format`.
  void add_bytes(std::map<std::string, int64_t>& by_format) const {
    if (format == WeightFormat::kDense && dense.defined())
      by_format[std::string(dtype_name(dense.dtype()))] += bytes();
    if (format == WeightFormat::kFp8) by_format["f8_e4m3 (W8A8)"] += bytes();
    for (const BlockPart& part : parts) by_format[part.format()] += part.bytes();
    for (const ops::DeviceBlocks& part : gpu_parts) {
      by_format[quant_format(part.type).name] += part.bytes();
    }
  }

  // The bytes apply() reads: whichever form it computes with.
  int64_t bytes() const {
    if (format == WeightFormat::kDense) {
      return dense.defined() ? static_cast<int64_t>(dense.nbytes()) : 0;
    }
    if (format == WeightFormat::kFp8) return fp8.bytes();
    int64_t total = 0;
    for (const BlockPart& part : parts) total += part.bytes();
    for (const ops::DeviceBlocks& part : gpu_parts) total += part.bytes();
    return total;  // none: no router
  }
};

struct LayerWeights {
  Tensor attn_norm, ffn_norm;          // [D]: before attention, before the MLP
  Tensor attn_out_norm, ffn_out_norm;  // [D]: after them (sandwich norms only)
  Projection qkv_proj;                 // [(Hq + 2 Hk) d, D]: q, k, v rows, one GEMM
  Tensor qkv_bias;                     // Qwen2 only
  Projection o_proj;                   // [D, Hq*d]
  Tensor q_norm, k_norm;               // [d], with qk_norm only
  Projection gate_up_proj;             // [2F, D]: gate rows then up rows, one GEMM
  Projection down_proj;                // [D, F]
  Projection router;                   // [E, D]: sparse MLPs only, with `experts`
  ops::ExpertWeights experts;          // [E, 2F, D] and [E, D, F] (F: this rank's share)
  Tensor inv_freq;                     // [d/2] f32: the layer's rope (shared between layers)
};

// A weight of a projection: its HF name and full shape, and how tensor parallelism splits it.
struct WeightPart {
  std::string name;
  Shape shape;
  Shard shard;
};

// This rank's share of the named matrices' blocks (shapes checked) stacked by rows, one matrix
// per run of parts in one format, or nothing unless all have blocks. A split by input columns
// must keep whole blocks.
std::vector<QuantizedMatrix> stacked_blocks(const Checkpoint& ckpt, const ModelConfig& config,
                                            TensorParallel tp,
                                            const std::vector<WeightPart>& parts) {
  std::vector<QuantizedMatrix> stacked;
  for (const WeightPart& part : parts) {
    const QuantizedMatrix* blocks = ckpt.blocks(part.name, part.shape);
    if (blocks == nullptr) return {};
    const QuantizedMatrix& q = *blocks;
    const ShardRanges shard = shard_ranges(config, tp, part.shard, part.shape);
    const int64_t block_elems = quant_block_elems(q.type);
    int64_t cols = q.cols;
    if (shard.by_cols) {
      const auto [begin, end] = shard.ranges.front();
      PAGEDLM_CHECK(begin % block_elems == 0 && end % block_elems == 0, "tensor ", part.name,
                    " keeps ", block_elems, "-weight blocks along its ", q.cols,
                    " input columns; tensor parallel size ", tp.size, " would split it at column ",
                    begin % block_elems != 0 ? begin : end, ", inside a block");
      cols = end - begin;
    }
    if (stacked.empty() || q.type != stacked.back().type) stacked.emplace_back();
    QuantizedMatrix& out = stacked.back();
    out.type = q.type;
    out.cols = cols;
    const int64_t row_bytes = q.row_bytes();
    if (shard.by_cols) {
      const int64_t block_bytes = quant_block_bytes(q.type);
      const int64_t first = shard.ranges.front().first / block_elems * block_bytes;
      const int64_t bytes = cols / block_elems * block_bytes;
      for (int64_t r = 0; r < q.rows; ++r) {
        const uint8_t* src = q.blocks.data() + r * row_bytes + first;
        out.blocks.insert(out.blocks.end(), src, src + bytes);
      }
      out.rows += q.rows;
      continue;
    }
    for (const auto& [begin, end] : shard.ranges) {
      out.blocks.insert(out.blocks.end(), q.blocks.begin() + begin * row_bytes,
                        q.blocks.begin() + end * row_bytes);
      out.rows += end - begin;
    }
  }
  return stacked;
}

// The one matrix of blocks stacked_blocks made, or none where it made several (or none).
QuantizedMatrix one_format(std::vector<QuantizedMatrix> stacked) {
  if (stacked.size() != 1) return {};
  return std::move(stacked.front());
}

// Columns [begin, end) of every row of a CPU matrix (any dtype), copied.
Tensor slice_cols(const Tensor& t, int64_t begin, int64_t end) {
  const int64_t rows = t.dim(0), cols = t.dim(1);
  const auto elem = static_cast<int64_t>(dtype_size(t.dtype()));
  Tensor out = Tensor::empty(t.dtype(), {rows, end - begin});
  const char* src = static_cast<const char*>(t.raw());
  char* dst = static_cast<char*>(out.raw());
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(dst + r * (end - begin) * elem, src + (r * cols + begin) * elem,
                (end - begin) * elem);
  }
  return out;
}

DType compute_dtype_of(Device device) {
  return device == Device::kCpu ? DType::kF32 : DType::kBF16;
}

// Weights in the compute dtype on the target device: f32 on the CPU, bf16 on the GPU (f16 and
// f32 checkpoints are rounded to bf16 too, so one set of kernels serves every checkpoint).
Tensor upload(const Tensor& t, Device device) {
  if (device == Device::kCpu) {
    // f32 is shared, not copied (a GGUF matrix Checkpoint::get dequantized for this call, an f32
    // tensor in a mapped safetensors file), where it is aligned like the buffers we allocate.
    if (t.dtype() == DType::kF32 && reinterpret_cast<uintptr_t>(t.raw()) % 64 == 0) return t;
    return t.to_f32();
  }
  if (t.dtype() == DType::kBF16) return t.to(device);
  // f32 checkpoints convert in place of a copy, in parallel: an 8B model is 8G conversions.
  const Tensor f32 = t.dtype() == DType::kF32 ? t : t.to_f32();
  Tensor bf16 = Tensor::empty(DType::kBF16, f32.shape());
  const float* src = f32.data<float>();
  uint16_t* dst = bf16.data<uint16_t>();
  const int64_t n = f32.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  return bf16.to(device);
}

// Stacks tensors along their first dimension into a new f32 tensor: weights [rows, cols] or
// biases [rows].
Tensor concat_rows(const std::vector<Tensor>& parts) {
  Shape shape = parts.front().shape();
  shape[0] = 0;
  for (const Tensor& t : parts) shape[0] += t.dim(0);
  Tensor out = Tensor::empty(DType::kF32, shape);
  float* dst = out.data<float>();
  for (const Tensor& t : parts) {
    const Tensor f = t.to_f32();
    std::memcpy(dst, f.data<float>(), f.nbytes());
    dst += f.numel();
  }
  return out;
}

// This rank's share of the parts, stacked by rows. Unsplit, a part is the checkpoint's tensor
// itself (a view of the mapped file); a share is always copied, so that no rank keeps a whole
// tensor alive through a view (a GGUF matrix dequantized for this call is freed after it).
Tensor shard_of(const Checkpoint& ckpt, const ModelConfig& config, TensorParallel tp,
                const std::vector<WeightPart>& parts) {
  std::vector<Tensor> pieces;
  bool whole = true;
  for (const WeightPart& part : parts) {
    const Tensor t = ckpt.get(part.name, part.shape);
    const ShardRanges shard = shard_ranges(config, tp, part.shard, part.shape);
    if (shard.by_cols) {
      pieces.push_back(slice_cols(t, shard.ranges.front().first, shard.ranges.front().second));
      whole = false;
      continue;
    }
    for (const auto& [begin, end] : shard.ranges) {
      pieces.push_back(t.rows(begin, end));
      whole &= begin == 0 && end == t.dim(0);
    }
  }
  return pieces.size() == 1 && whole ? pieces.front() : concat_rows(pieces);
}

// Where row `row` of piece `piece` goes in a stacked tensor.
using RowPlacement = std::function<int64_t(size_t piece, int64_t row)>;

// The pieces ([rows_i, cols] each, f32, f16 or bf16) stacked into one [rows, cols] tensor, row r
// of piece p at row place(p, r), in the compute dtype on `device`, converted piece by piece: a
// layer of experts is never held in f32.
Tensor stack_converted(const std::vector<Tensor>& pieces, int64_t rows, Device device,
                       const RowPlacement& place) {
  const DType dtype = compute_dtype_of(device);
  const int64_t cols = pieces.front().dim(1);
  Tensor host = Tensor::empty(dtype, {rows, cols});
  const auto elem = static_cast<int64_t>(dtype_size(dtype));
  for (size_t p = 0; p < pieces.size(); ++p) {
    const Tensor converted = pieces[p].dtype() == dtype ? pieces[p] : pieces[p].to_f32();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < converted.dim(0); ++r) {
      char* dst = static_cast<char*>(host.raw()) + place(p, r) * cols * elem;
      if (converted.dtype() == dtype) {
        std::memcpy(dst, static_cast<const char*>(converted.raw()) + r * cols * elem, cols * elem);
      } else {
        const float* src = converted.data<float>() + r * cols;
        auto* out = reinterpret_cast<uint16_t*>(dst);
        for (int64_t i = 0; i < cols; ++i) out[i] = f32_to_bf16(src[i]);
      }
    }
  }
  return device == Device::kCpu ? host : host.to(device);
}

// A sparse layer's experts (this rank's share of each expert's intermediate size) as
// ops::moe_experts takes them: per-expert blocks on the CPU where every expert's matrices have
// them (GGUF Q4_1 / Q8_0), else stacked in the compute dtype.
ops::ExpertWeights load_experts(const Checkpoint& ckpt, const ModelConfig& c, TensorParallel tp,
                                int64_t layer, Device device) {
  const Family& family = family_of(c);
  const int64_t E = c.moe.num_experts, D = c.hidden_size, F = c.moe.expert_intermediate_size;
  const int64_t Fr = F / tp.size;  // check_tensor_parallel: the ranks divide F
  ops::ExpertWeights w;
  w.num_experts = E;
  w.hidden = D;
  w.ffn = Fr;
  auto part = [&](LayerWeight lw, int64_t e, Shape shape) {
    return WeightPart{hf_weight_name(family, layer, lw, e), std::move(shape),
                      layer_weight_shard(family, lw)};
  };
  std::vector<WeightPart> gate_up, down;  // gate_up: each expert's gate, then its up
  for (int64_t e = 0; e < E; ++e) {
    gate_up.push_back(part(LayerWeight::kExpertGate, e, {F, D}));
    gate_up.push_back(part(LayerWeight::kExpertUp, e, {F, D}));
    down.push_back(part(LayerWeight::kExpertDown, e, {D, F}));
  }
  if (device == Device::kCpu) {
    for (int64_t e = 0; e < E; ++e) {
      QuantizedMatrix gu =
          one_format(stacked_blocks(ckpt, c, tp, {gate_up[2 * e], gate_up[2 * e + 1]}));
      QuantizedMatrix dn = one_format(stacked_blocks(ckpt, c, tp, {down[e]}));
      if (gu.empty() || dn.empty()) {
        w.gate_up_blocks.clear();
        w.down_blocks.clear();
        break;
      }
      w.gate_up_blocks.push_back(ops::repack_for_cpu(std::move(gu)));
      w.down_blocks.push_back(ops::repack_for_cpu(std::move(dn)));
    }
    if (w.quantized()) return w;
  }
  PAGEDLM_CHECK(device == Device::kCpu || Fr % 8 == 0, "the GPU's experts need a size (per ",
                "tensor-parallel rank) that is a multiple of 8, got ", Fr);
  std::vector<Tensor> pieces;
  pieces.reserve(gate_up.size());
  for (const WeightPart& p : gate_up) pieces.push_back(shard_of(ckpt, c, tp, {p}));
  w.gate_up = stack_converted(pieces, E * 2 * Fr, device, [&](size_t p, int64_t r) {
                const auto e = static_cast<int64_t>(p / 2);
                return e * 2 * Fr + ops::moe_gate_up_row(r, p % 2 == 1, Fr, device);
              }).reshape({E, 2 * Fr, D});
  pieces.clear();
  for (const WeightPart& p : down) pieces.push_back(shard_of(ckpt, c, tp, {p}));
  w.down = stack_converted(pieces, E * D, device, [&](size_t p, int64_t r) {
             return static_cast<int64_t>(p) * D + r;
           }).reshape({E, D, Fr});
  return w;
}

// This rank's share of an FP8 checkpoint's parts (shapes checked), stacked by rows into one
// W8A8 weight on the GPU; undefined where some part is not FP8, has per-block scales (which
// cuBLASLt's per-feature scaling cannot apply: those run dequantized to bf16), or a size the FP8
// GEMM does not take. Per-tensor scales become one per row; the stacked parts' inputs are
// quantized statically where all of them ask for it, with the largest of their input scales (so
// that none saturates earlier than its own would), else per token (also where a checkpoint asks
// for weights only, or for one dynamic scale per step: per token is the finer of the two).
ops::Fp8Weight checkpoint_fp8(const Checkpoint& ckpt, const ModelConfig& config, TensorParallel tp,
                              const std::vector<WeightPart>& parts) {
  std::vector<const Fp8Matrix*> matrices;
  for (const WeightPart& part : parts) {
    const auto it = ckpt.fp8.find(part.name);
    if (it == ckpt.fp8.end() || it->second.spec.layout == WeightScaleLayout::kBlock) return {};
    PAGEDLM_CHECK(it->second.weight.shape() == part.shape, "tensor ", part.name, " has shape ",
                  shape_str(it->second.weight.shape()), " but the config implies ",
                  shape_str(part.shape));
    matrices.push_back(&it->second);
  }
  std::vector<uint8_t> values;
  std::vector<float> scales;
  int64_t cols = 0;
  bool all_static = true;
  float input_scale = 0.f;
  double scale_ub = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const Fp8Matrix& m = *matrices[i];
    const ShardRanges shard = shard_ranges(config, tp, parts[i].shard, parts[i].shape);
    const Tensor scale = m.scale.to_f32();
    const float* sv = scale.data<float>();
    const bool per_row = m.spec.layout == WeightScaleLayout::kChannel;
    int64_t col0 = 0, col1 = m.cols();
    std::vector<std::pair<int64_t, int64_t>> row_ranges = shard.ranges;
    if (shard.by_cols) {
      std::tie(col0, col1) = shard.ranges.front();
      row_ranges = {{0, m.rows()}};
    }
    cols = col1 - col0;
    const auto* w = m.weight.data<uint8_t>();
    for (const auto& [begin, end] : row_ranges) {
      for (int64_t r = begin; r < end; ++r) {
        values.insert(values.end(), w + r * m.cols() + col0, w + r * m.cols() + col1);
        scales.push_back(per_row ? sv[r] : sv[0]);
      }
    }
    if (m.inputs == ActivationQuant::kStaticTensor) {
      const float s = m.input_scale.to_f32().data<float>()[0];
      PAGEDLM_CHECK(std::isfinite(s) && s > 0.f, "the input_scale of ", parts[i].name,
                    " must be a positive number, got ", s);
      input_scale = std::max(input_scale, s);
    } else {
      all_static = false;
    }
    scale_ub = std::max(scale_ub, m.activation_scale_ub);
  }
  const auto rows = static_cast<int64_t>(scales.size());
  if (rows % 16 != 0 || cols % 16 != 0) return {};
  Tensor host = Tensor::empty(DType::kF8E4M3, {rows, cols});
  std::memcpy(host.raw(), values.data(), values.size());
  ops::Fp8Weight out;
  out.weight = host.to(Device::kCuda);
  out.scale = Tensor::from_f32(scales, {rows}).to(Device::kCuda);
  out.inputs.static_scale = all_static ? input_scale : 0.f;
  out.inputs.max_abs_ub = all_static ? 0.f : static_cast<float>(scale_ub);
  return out;
}

// Whether the model runs W8A8 GEMMs at all: only on a GPU with FP8 tensor cores, and only where
// the checkpoint has FP8 weights or all are to be quantized. Throws where --quantization fp8
// asks for it on the CPU or a GPU without FP8 tensor cores; an FP8 checkpoint on such a GPU runs
// dequantized to bf16, as it says on stderr.
bool runs_fp8(const Checkpoint& ckpt, Device device, Fp8Weights mode) {
  if (mode == Fp8Weights::kNone) return false;
  if (mode == Fp8Weights::kAll) {
    PAGEDLM_CHECK(device != Device::kCpu, "FP8 weights (--quantization fp8) are a GPU option: ",
                  "the CPU computes in float32");
    ops::check_fp8_gemm_supported("FP8 weights (--quantization fp8)");
    return true;
  }
  if (ckpt.fp8.empty() || device == Device::kCpu) return false;
  if (ops::fp8_gemm_supported()) return true;
  std::fprintf(stderr,
               "pagedlm: this GPU has no FP8 tensor cores (compute capability below 8.9): the "
               "checkpoint's FP8 weights run dequantized to bf16\n");
  return false;
}

class DecoderModel final : public CausalLM {
 public:
  DecoderModel(const Checkpoint& ckpt, Device device, TensorParallel tp, ops::Communicator* comm,
               const ModelOptions& options)
      : config_(ckpt.config),
        device_(device),
        dtype_(compute_dtype_of(device)),
        tp_(tp),
        dims_(rank_dims(ckpt.config, tp)),
        comm_(tp.size > 1 ? comm : nullptr) {
#ifndef PAGEDLM_HAS_CUDA
    PAGEDLM_CHECK(device == Device::kCpu, "this build of pagedlm has no CUDA support");
#endif
    PAGEDLM_CHECK(
        tp.size == 1 || (comm != nullptr && comm->size() == tp.size && comm->rank() == tp.rank),
        "tensor-parallel rank ", tp.rank, " of ", tp.size,
        " needs a communicator of that rank and size");
    const ModelConfig& c = config_;
    const int64_t D = c.hidden_size, F = c.intermediate_size, d = c.head_dim;
    const int64_t q_rows = c.num_heads * d, kv_rows = c.num_kv_heads * d;
    // Stacks this rank's share of the named [rows, D_in] parts (shapes checked) into one
    // projection; the CPU keeps GGUF blocks where every part has them.
    PAGEDLM_CHECK(!options.cpu_q8_activations || device == Device::kCpu,
                  "8-bit activations (--cpu-q8-activations) are a CPU option");
    PAGEDLM_CHECK(!options.cpu_fixed32_activations || device == Device::kCpu,
                  "32-bit fixed-point activations (--cpu-fixed32-activations) are a CPU option");
    PAGEDLM_CHECK(!(options.cpu_q8_activations && options.cpu_fixed32_activations),
                  "--cpu-q8-activations and --cpu-fixed32-activations are two ways to take the "
                  "projections' inputs: choose one");
    const bool integer_kernels = options.cpu_q8_activations || options.cpu_fixed32_activations;
    const ops::IntActivations q8_input = options.cpu_fixed32_activations
                                             ? ops::IntActivations::kFixed32
                                             : ops::IntActivations::kInt8;
    int64_t num_q8 = 0;
    // The CPU's blocks in the form its kernels take: packed for the integer kernels where the
    // format has that packing and they were asked for, or else repacked for the exact kernels
    // (the same weights, read faster).
    auto cpu_form = [&](std::vector<QuantizedMatrix> stacked) {
      Projection proj;
      if (!stacked.empty()) proj.format = WeightFormat::kBlocks;
      for (QuantizedMatrix& blocks : stacked) {
        BlockPart part;
        if (integer_kernels && ops::q8_packs(blocks.type)) {
          part.q8 = ops::pack_for_q8(blocks);
          part.q8_input = q8_input;
          ++num_q8;
        } else {
          part.blocks = ops::repack_for_cpu(std::move(blocks));
        }
        proj.parts.push_back(std::move(part));
      }
      return proj;
    };
    // The GPU's blocks uploaded as they are, where it has kernels for all of a projection's
    // formats; else (or with gguf_blocks_on_gpu off) the projection is expanded to bf16, as
    // stderr says once per format.
    std::set<std::string> expanded_formats;
    auto gpu_form = [&](const std::vector<QuantizedMatrix>& stacked) {
      Projection proj;
      if (stacked.empty()) return proj;
      for (const QuantizedMatrix& blocks : stacked) {
        const char* format = quant_format(blocks.type).name;
        if (ops::gpu_computes_blocks(blocks.type)) continue;
        if (expanded_formats.insert(format).second) {
          std::fprintf(stderr,
                       "note: the GPU has no kernel for %s blocks: the projections that hold "
                       "them are expanded to bf16 at load\n",
                       format);
        }
        return proj;
      }
      proj.format = WeightFormat::kGpuBlocks;
      for (const QuantizedMatrix& blocks : stacked) {
        proj.gpu_parts.push_back(ops::upload_blocks(blocks));
      }
      widest_gpu_blocks_ =
          std::max(widest_gpu_blocks_, proj.gpu_rows() * proj.gpu_parts.front().cols);
      return proj;
    };
    const bool fp8 = runs_fp8(ckpt, device, options.fp8_weights);
    // may_fp8: false for the projections that stay bf16 whatever the mode (the lm_head, a
    // router: both write f32).
    auto projection = [&](const std::vector<WeightPart>& parts, bool may_fp8 = true) {
      Projection proj;
      if (device == Device::kCpu) proj = cpu_form(stacked_blocks(ckpt, c, tp, parts));
      // FP8 (--quantization fp8) takes a GGUF's weights through bf16 as before.
      if (device != Device::kCpu && options.gguf_blocks_on_gpu && !(fp8 && may_fp8)) {
        proj = gpu_form(stacked_blocks(ckpt, c, tp, parts));
        if (proj.format == WeightFormat::kGpuBlocks) return proj;
      }
      if (fp8 && may_fp8) {
        proj.fp8 = checkpoint_fp8(ckpt, c, tp, parts);
        // A checkpoint's own FP8 weights (per-block ones) are not quantized a second time.
        const bool in_checkpoint = std::any_of(
            parts.begin(), parts.end(), [&](const auto& p) { return ckpt.fp8.count(p.name) != 0; });
        if (!proj.fp8.defined() && !in_checkpoint && options.fp8_weights == Fp8Weights::kAll) {
          proj.dense = upload(shard_of(ckpt, c, tp, parts), device);
          if (proj.dense.dim(0) % 16 == 0 && proj.dense.dim(1) % 16 == 0) {
            proj.fp8 = ops::quantize_fp8_weight(proj.dense);
            proj.dense = Tensor();
          }
        }
        if (proj.fp8.defined()) {
          proj.format = WeightFormat::kFp8;
          has_fp8_ = true;
          return proj;
        }
      }
      if (proj.parts.empty() && !proj.dense.defined()) {
        proj.dense = upload(shard_of(ckpt, c, tp, parts), device);
      }
      return proj;
    };
    // The embedding and the lm_head are split by vocabulary rows.
    const WeightPart embed_part{"model.embed_tokens.weight", {c.vocab_size, D}, Shard::kRows};
    if (c.tie_word_embeddings) {
      if (device == Device::kCpu) lm_head_ = cpu_form(stacked_blocks(ckpt, c, tp, {embed_part}));
    } else {
      lm_head_ = projection({{"lm_head.weight", {c.vocab_size, D}, Shard::kRows}}, false);
    }
    // On the CPU a GGUF's embedding stays in its blocks (rows dequantized as they are looked
    // up): SmolLM2's as float32 would be 113 MB, its Q8_0 blocks are 30 MB, and those of a tied
    // lm_head are the same blocks, kept once (packed for 8-bit activations, their rows are
    // read from the packing, the same floats).
    embed_in_lm_head_ = c.tie_word_embeddings && lm_head_.parts.size() == 1;
    if (device == Device::kCpu && !embed_in_lm_head_) {
      embed_blocks_ = ops::repack_for_cpu(one_format(stacked_blocks(ckpt, c, tp, {embed_part})));
    }
    if (!has_embed_blocks()) embed_ = upload(shard_of(ckpt, c, tp, {embed_part}), device);
    if (c.tie_word_embeddings && lm_head_.parts.empty()) lm_head_.dense = embed_;
    final_norm_ = upload(ckpt.get("model.norm.weight", {D}), device);
    const Family& family = family_of(c);
    auto name = [&](int64_t layer, LayerWeight w) { return hf_weight_name(family, layer, w); };
    auto part = [&](int64_t layer, LayerWeight w, Shape shape) {
      return WeightPart{name(layer, w), std::move(shape), layer_weight_shard(family, w)};
    };
    auto vector = [&](const std::string& tensor, int64_t n) {
      return upload(ckpt.get(tensor, {n}), device);
    };
    // Layers with the same rope share one frequency table.
    std::vector<std::pair<RopeSpec, Tensor>> rope_tables;
    auto inv_freq_of = [&](const RopeSpec& spec) {
      for (const auto& [s, t] : rope_tables) {
        if (s == spec) return t;
      }
      std::vector<float> inv_freq = rope_inv_freq(spec, d);
      if (ckpt.has("rope_freqs")) {  // GGUF llama3: per-frequency divisors instead of a config
        Tensor divisors = ckpt.get("rope_freqs", {d / 2}).to_f32();
        for (int64_t i = 0; i < d / 2; ++i) inv_freq[i] /= divisors.data<float>()[i];
      }
      // Rope runs in f32 on every backend (angle = float(pos) * inv_freq).
      const Tensor host = Tensor::from_f32(inv_freq, {d / 2});
      rope_tables.emplace_back(spec, device == Device::kCpu ? host : host.to(device));
      return rope_tables.back().second;
    };
    for (int64_t i = 0; i < c.num_layers; ++i) {
      LayerWeights w;
      w.attn_norm = vector(name(i, LayerWeight::kAttnNorm), D);
      w.ffn_norm = vector(name(i, LayerWeight::kFfnNorm), D);
      if (c.sandwich_norms) {
        w.attn_out_norm = vector(name(i, LayerWeight::kAttnOutNorm), D);
        w.ffn_out_norm = vector(name(i, LayerWeight::kFfnOutNorm), D);
      }
      w.qkv_proj = has_layer_weight(family, LayerWeight::kQkv)
                       ? projection({part(i, LayerWeight::kQkv, {q_rows + 2 * kv_rows, D})})
                       : projection({part(i, LayerWeight::kQ, {q_rows, D}),
                                     part(i, LayerWeight::kK, {kv_rows, D}),
                                     part(i, LayerWeight::kV, {kv_rows, D})});
      w.o_proj = projection({part(i, LayerWeight::kO, {D, q_rows})});
      if (c.attention_bias) {
        w.qkv_bias = upload(shard_of(ckpt, c, tp,
                                     {part(i, LayerWeight::kQBias, {q_rows}),
                                      part(i, LayerWeight::kKBias, {kv_rows}),
                                      part(i, LayerWeight::kVBias, {kv_rows})}),
                            device);
      }
      if (c.qk_norm) {
        w.q_norm = vector(name(i, LayerWeight::kQNorm), d);
        w.k_norm = vector(name(i, LayerWeight::kKNorm), d);
      }
      if (c.layers[i].sparse_mlp) {
        w.router = projection({part(i, LayerWeight::kRouter, {c.moe.num_experts, D})}, false);
        w.experts = load_experts(ckpt, c, tp, i, device);
      } else {
        w.gate_up_proj = has_layer_weight(family, LayerWeight::kGateUp)
                             ? projection({part(i, LayerWeight::kGateUp, {2 * F, D})})
                             : projection({part(i, LayerWeight::kGate, {F, D}),
                                           part(i, LayerWeight::kUp, {F, D})});
        w.down_proj = projection({part(i, LayerWeight::kDown, {D, F})});
      }
      w.inv_freq = inv_freq_of(c.layers[i].rope);
      layers_.push_back(std::move(w));
    }
    // Mixture-of-experts experts keep the exact kernels (ops::moe_experts).
    PAGEDLM_CHECK(!integer_kernels || num_q8 > 0,
                  options.cpu_q8_activations
                      ? "8-bit activations (--cpu-q8-activations)"
                      : "32-bit fixed-point activations (--cpu-fixed32-activations)",
                  " need a GGUF with projection weights in ggml's blocks; this model has none");
    experts_activated_ = Tensor::zeros(DType::kI32, {c.num_layers}, device);
  }

  int64_t expert_bytes_read() const override {
    const ModelConfig& c = config_;
    if (c.moe.num_experts == 0) return 0;
    const Tensor counts = experts_activated_.to(Device::kCpu);
    int64_t activated = 0;
    for (int64_t i = 0; i < c.num_layers; ++i) activated += counts.data<int32_t>()[i];
    // This rank's share of each activated expert.
    return activated * 3 * (c.moe.expert_intermediate_size / tp_.size) * c.hidden_size *
           static_cast<int64_t>(dtype_size(dtype_));
  }

  std::map<std::string, int64_t> step_weight_bytes_by_format() const override {
    std::map<std::string, int64_t> by_format;
    lm_head_.add_bytes(by_format);
    for (const LayerWeights& w : layers_) {
      for (const Projection* p :
           {&w.qkv_proj, &w.o_proj, &w.gate_up_proj, &w.down_proj, &w.router}) {
        p->add_bytes(by_format);
      }
    }
    return by_format;
  }

  int64_t step_weight_bytes() const override {
    int64_t bytes = lm_head_.bytes();
    for (const LayerWeights& w : layers_) {
      bytes += w.qkv_proj.bytes() + w.o_proj.bytes() + w.gate_up_proj.bytes() +
               w.down_proj.bytes() + w.router.bytes();
    }
    return bytes;
  }

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return device_; }
  DType compute_dtype() const override { return dtype_; }
  TensorParallel tensor_parallel() const override { return tp_; }

  // Stream rows -> buffers; see CausalLM::reserve.
  void reserve(int64_t rows) override {
    if (rows <= buffers_.capacity) return;
    const ModelConfig& c = config_;
    // This rank's share of the heads and of the MLP (all of them without tensor parallelism).
    const int64_t D = c.hidden_size, F = dims_.ffn, d = c.head_dim;
    const int64_t Hq = dims_.q_heads, Hk = dims_.kv_heads;
    auto make = [&](Shape shape) { return Tensor::empty(dtype_, std::move(shape), device_); };
    // The residual stream is f32 on every device: in bf16 it would be rounded at each of a
    // layer's two adds, the largest avoidable error of bf16 compute.
    auto make_f32 = [&](Shape shape) {
      return Tensor::empty(DType::kF32, std::move(shape), device_);
    };
    Activations& b = buffers_;
    b = Activations{};  // frees the old buffers first
    b.capacity = rows;
    b.residual = make_f32({rows, D});
    b.hidden = make({rows, D});
    b.qkv = make({rows, (Hq + 2 * Hk) * d});
    b.q = make({rows, Hq, d});
    b.attn_out = make({rows, Hq, d});
    b.proj_out = make({rows, D});
    b.gate_up = make({rows, 2 * F});
    b.act = make({rows, F});
    if (c.moe.num_experts > 0) {
      const int64_t E = c.moe.num_experts, k = c.moe.experts_per_token;
      const int64_t Fe = c.moe.expert_intermediate_size / tp_.size;
      b.router_logits = make_f32({rows, E});
      b.expert_ids = Tensor::empty(DType::kI32, {rows, k}, device_);
      b.expert_weights = make_f32({rows, k});
      b.moe.plan = Tensor::empty(DType::kI32, {ops::moe_plan_size(rows * k, E)}, device_);
      if (device_ == Device::kCpu) b.moe.gate_up = make({rows * k, 2 * Fe});
      b.moe.act = make({rows * k, Fe});
      b.moe.expert_out = make({rows * k, D});
    }
    if (has_fp8_) {
      // The widest input of an FP8 projection: o's (Hq d), down's (F) or the hidden size.
      const int64_t widest = std::max({D, Hq * d, F});
      b.projection.fp8.values = Tensor::empty(DType::kF8E4M3, {rows * widest}, device_);
      b.projection.fp8.scales = make_f32({rows});
    }
    if (widest_gpu_blocks_ > 0 && rows > ops::kBlockMatvecMaxRows) {
      b.projection.dequantized = make({widest_gpu_blocks_});
    }
    b.last = make({rows, D});
    b.last_residual = make_f32({rows, D});
    b.last_update = make({rows, D});
    if (comm_ != nullptr) {
      b.local_logits = make_f32({rows, dims_.vocab});
      comm_->reserve(rows, dims_.vocab);
    }
  }

  // token_ids: [L], logits_rows: [S] -> logits: [S, vocab] f32
  bool forward(const ForwardInputs& in, Attention& attention, const Tensor& logits) override {
    const ModelConfig& c = config_;
    const int64_t L = in.token_ids.dim(0), S = in.logits_rows.dim(0);
    const int64_t d = c.head_dim, Hq = dims_.q_heads, Hk = dims_.kv_heads;
    const float eps = c.rms_norm_eps;
    void* const stream = in.stream;
    ops::DeviceState* const state = in.device_state;
    reserve(L);
    // Views of the preallocated activations: nothing is allocated per step, which keeps the
    // step capturable as a CUDA graph.
    Tensor residual = buffers_.residual.rows(0, L), hidden = buffers_.hidden.rows(0, L);
    Tensor qkv = buffers_.qkv.rows(0, L), q = buffers_.q.rows(0, L);
    Tensor attn_out = buffers_.attn_out.rows(0, L), proj_out = buffers_.proj_out.rows(0, L);
    Tensor gate_up = buffers_.gate_up.rows(0, L), act = buffers_.act.rows(0, L);
    const ProjectionScratch& scratch = buffers_.projection;

    const float offset = c.norm_weight_offset;
    if (comm_ == nullptr) {
      if (!embed_in_blocks(in.token_ids, residual, std::nullopt)) {
        ops::embedding(embed_, in.token_ids, residual, stream, c.embedding_scale);
      }
    } else if (embed_in_blocks(in.token_ids, residual, dims_.vocab_begin)) {
      comm_->all_reduce_sum(residual, stream);
    } else {
      // Each rank embeds the tokens of its share of the vocabulary (zeros elsewhere): the sum
      // over the ranks is every token's row.
      ops::embedding(embed_, in.token_ids, residual, stream, c.embedding_scale, dims_.vocab_begin);
      comm_->all_reduce_sum(residual, stream);
    }
    // Points where the pass may be left (ForwardStop), before each large operation; `joined`
    // counts the all-reduces behind (two a layer: after o_proj and after the MLP).
    const auto leave_at = [&](size_t joined) {
      return in.stop != nullptr && in.stop->leave_at(tp_, static_cast<int64_t>(joined));
    };
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& w = layers_[i];
      if (leave_at(2 * i)) return false;
      if (i == 0) {
        ops::rms_norm(residual, w.attn_norm, eps, hidden, stream, offset);
      } else {
        ops::add_rms_norm(residual, proj_out, w.attn_norm, eps, hidden, stream, offset);
      }
      w.qkv_proj.apply(hidden, w.qkv_bias, qkv, stream, state, scratch);
      if (c.qk_norm) {
        ops::head_rms_norm(qkv, 0, Hq, d, w.q_norm, eps, stream, offset);
        ops::head_rms_norm(qkv, Hq, Hk, d, w.k_norm, eps, stream, offset);
      }
      if (leave_at(2 * i)) return false;
      attention.attend(static_cast<int>(i), c.layers[i].attention, qkv, q, w.inv_freq, attn_out);
      if (leave_at(2 * i)) return false;
      w.o_proj.apply(attn_out.reshape({L, Hq * d}), Tensor(), proj_out, stream, state, scratch);
      if (comm_ != nullptr) comm_->all_reduce_sum(proj_out, stream);  // the heads' partial sums
      if (c.sandwich_norms) {
        ops::rms_norm(proj_out, w.attn_out_norm, eps, proj_out, stream, offset);
      }
      if (leave_at(2 * i + 1)) return false;
      ops::add_rms_norm(residual, proj_out, w.ffn_norm, eps, hidden, stream, offset);
      if (c.layers[i].sparse_mlp) {
        // Every rank routes alike (the router is replicated) and runs its share of each
        // expert's intermediate size: the all-reduce below sums the shares.
        const Tensor router_logits = buffers_.router_logits.rows(0, L);
        const Tensor expert_ids = buffers_.expert_ids.rows(0, L);
        const Tensor expert_weights = buffers_.expert_weights.rows(0, L);
        w.router.apply(hidden, Tensor(), router_logits, stream, state, scratch);
        ops::moe_route(router_logits, c.moe.normalize_top_k, expert_ids, expert_weights, stream);
        ops::MoeWorkspace ws = buffers_.moe;
        ws.activated =
            experts_activated_.rows(static_cast<int64_t>(i), static_cast<int64_t>(i) + 1);
        ops::moe_experts(hidden, expert_ids, expert_weights, w.experts, gated_activation(c), ws,
                         proj_out, stream);
      } else {
        w.gate_up_proj.apply(hidden, Tensor(), gate_up, stream, state, scratch);
        ops::gated_mul(gated_activation(c), gate_up, act, stream);
        if (leave_at(2 * i + 1)) return false;
        w.down_proj.apply(act, Tensor(), proj_out, stream, state, scratch);
      }
      if (comm_ != nullptr) comm_->all_reduce_sum(proj_out, stream);
      if (c.sandwich_norms) {
        ops::rms_norm(proj_out, w.ffn_out_norm, eps, proj_out, stream, offset);
      }
    }
    if (leave_at(2 * layers_.size())) return false;  // a decode step of many rows: a large lm_head
    // Only the rows that need logits go through the final norm and the lm_head.
    Tensor last = buffers_.last.rows(0, S), last_residual = buffers_.last_residual.rows(0, S);
    Tensor last_update = buffers_.last_update.rows(0, S);
    ops::gather_rows(residual, in.logits_rows, last_residual, stream);
    ops::gather_rows(proj_out, in.logits_rows, last_update, stream);
    ops::add_rms_norm(last_residual, last_update, final_norm_, eps, last, stream, offset);
    // The lm_head writes f32 directly on every device: no rounding of the logits.
    if (comm_ == nullptr) {
      lm_head_.apply(last, Tensor(), logits, stream, state, scratch);
    } else {
      // Each rank scores its share of the vocabulary; the gather lays them side by side.
      const Tensor local = buffers_.local_logits.rows(0, S);
      lm_head_.apply(last, Tensor(), local, stream, state, scratch);
      comm_->all_gather_cols(local, logits, stream);
    }
    if (c.final_logit_softcap > 0.f) ops::softcap(logits, c.final_logit_softcap, stream);
    return true;
  }

 private:
  struct Activations {
    int64_t capacity = 0;                                               // rows
    Tensor residual, hidden, qkv, q, attn_out, proj_out, gate_up, act;  // [rows, ...]
    Tensor last, last_residual, last_update;                            // [rows, D]
    Tensor local_logits;  // [rows, vocab / ranks] f32: this rank's lm_head rows (TP only)
    // Mixture-of-experts layers: router logits [rows, E], each token's experts and weights
    // [rows, k], and the experts' scratch for rows * k (token, slot) pairs.
    Tensor router_logits, expert_ids, expert_weights;
    ops::MoeWorkspace moe;
    // FP8 projections' quantized inputs ([rows * widest input], [rows]); GPU block
    // projections' bf16 weights ([widest_gpu_blocks_], for steps of more rows than
    // ops::kBlockMatvecMaxRows).
    ProjectionScratch projection;
  };

  static ops::GatedActivation gated_activation(const ModelConfig& c) {
    return c.activation == Activation::kGeluTanh ? ops::GatedActivation::kGeluTanh
                                                 : ops::GatedActivation::kSilu;
  }

  ModelConfig config_;
  Device device_;
  DType dtype_;
  TensorParallel tp_;
  RankDims dims_;            // this rank's share (the whole model without tensor parallelism)
  ops::Communicator* comm_;  // null without tensor parallelism
  // The CPU's embedding in its GGUF blocks, instead of embed_: the tied lm_head's (in either of
  // its forms), or its own.
  bool has_embed_blocks() const { return embed_in_lm_head_ || !embed_blocks_.empty(); }
  // Looks the ids up in those blocks; false where the embedding is embed_.
  bool embed_in_blocks(const Tensor& ids, const Tensor& out,
                       std::optional<int64_t> vocab_begin) const {
    const float scale = config_.embedding_scale;
    if (embed_in_lm_head_) {
      const BlockPart& part = lm_head_.parts.front();
      if (part.q8.empty()) {
        ops::embedding(part.blocks, ids, out, scale, vocab_begin);
      } else {
        ops::embedding(part.q8, ids, out, scale, vocab_begin);
      }
      return true;
    }
    if (embed_blocks_.empty()) return false;
    ops::embedding(embed_blocks_, ids, out, scale, vocab_begin);
    return true;
  }

  Tensor embed_, final_norm_;
  QuantizedMatrix embed_blocks_;
  bool embed_in_lm_head_ = false;
  Projection lm_head_;
  std::vector<LayerWeights> layers_;
  bool has_fp8_ = false;           // some projection is FP8 (reserve() then sizes the scratch)
  int64_t widest_gpu_blocks_ = 0;  // the weights of the largest GPU block projection
  Activations buffers_;
  Tensor experts_activated_;  // [layers] i32: experts that received tokens, summed over calls
};

}  // namespace

std::unique_ptr<CausalLM> create_model(const Checkpoint& checkpoint, Device device,
                                       TensorParallel tp, ops::Communicator* comm,
                                       const ModelOptions& options) {
  return std::make_unique<DecoderModel>(checkpoint, device, tp, comm, options);
}

}  // namespace pagedlm
