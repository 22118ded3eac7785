#include "pagedlm/model/weights.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <tuple>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/ops/linear_fp8.h"

namespace pagedlm {
namespace {

// This rank's share of the named matrices' blocks (shapes checked) stacked by rows, one matrix
// per run of parts in one format, or nothing unless all have blocks. A split by input columns
// must keep whole blocks.
std::vector<QuantizedMatrix> stacked_blocks(const Checkpoint& ckpt, TensorParallel tp,
                                            const std::vector<WeightPart>& parts) {
  std::vector<QuantizedMatrix> stacked;
  for (const WeightPart& part : parts) {
    const QuantizedMatrix* blocks = ckpt.blocks(part.name, part.shape);
    if (blocks == nullptr) return {};
    const QuantizedMatrix& q = *blocks;
    const ShardRanges shard = shard_ranges(ckpt.config, tp, part.shard, part.shape);
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
Tensor shard_of(const Checkpoint& ckpt, TensorParallel tp, const std::vector<WeightPart>& parts) {
  std::vector<Tensor> pieces;
  bool whole = true;
  for (const WeightPart& part : parts) {
    const Tensor t = ckpt.get(part.name, part.shape);
    const ShardRanges shard = shard_ranges(ckpt.config, tp, part.shard, part.shape);
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
Tensor stack_converted(const std::vector<Tensor>& pieces, int64_t rows, Device device, DType dtype,
                       const RowPlacement& place) {
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

// This rank's share of an FP8 checkpoint's parts (shapes checked), stacked by rows into one
// W8A8 weight on the GPU; undefined where some part is not FP8, has per-block scales (which
// cuBLASLt's per-feature scaling cannot apply: those run dequantized to bf16), or a size the FP8
// GEMM does not take. Per-tensor scales become one per row; the stacked parts' inputs are
// quantized statically where all of them ask for it, with the largest of their input scales (so
// that none saturates earlier than its own would), else per token (also where a checkpoint asks
// for weights only, or for one dynamic scale per step: per token is the finer of the two).
ops::Fp8Weight checkpoint_fp8(const Checkpoint& ckpt, TensorParallel tp,
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
    const ShardRanges shard = shard_ranges(ckpt.config, tp, parts[i].shard, parts[i].shape);
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

// Whether the exact mode gives a projection of this format 32-bit fixed-point activations, at
// every step so that its arithmetic does not depend on the step (batch invariance), where the
// build's integer kernels take the format with VNNI. Fixed point is as exact as the float32
// kernels (to float32 rounding), decodes faster and prefills slower (docs/PERF.md), so the
// float32 kernels keep what they decode at llama.cpp's speed or better, and fixed point takes:
//   the lm_head, which a prefill sends only the rows that need logits;
//   Q2_K, whose float32 kernels spend a decode step expanding 2-bit weights with a scale and a
//   min per 16 (1.5x Q4_0's time a weight), below llama.cpp's single-stream decode.
bool exact_mode_takes_fixed32(QuantType type, bool lm_head) {
  return (lm_head || type == QuantType::kQ2_K) && ops::fixed32_on_vnni(type);
}

// The option that asks for these activations, for errors.
const char* int_activations_option(ops::IntActivations input) {
  return input == ops::IntActivations::kFixed32
             ? "32-bit fixed-point activations (--cpu-fixed32-activations)"
             : "8-bit activations (--cpu-q8-activations)";
}

}  // namespace

DType checked_compute_dtype(const ModelOptions& options, Device device) {
  const DType kernels = default_compute_dtype(device);
  const DType asked = options.compute_dtype.value_or(kernels);
  PAGEDLM_CHECK(asked == kernels, "the ", device == Device::kCpu ? "CPU" : "GPU", " computes in ",
                dtype_name(kernels), ", not in ", dtype_name(asked),
                " (--dtype; auto takes the device's)");
  if (options.cpu_int_activations.has_value()) {
    PAGEDLM_CHECK(device == Device::kCpu, int_activations_option(*options.cpu_int_activations),
                  " are a CPU option, not for the GPU");
  }
  return asked;
}

WeightLoader::WeightLoader(const Checkpoint& ckpt, Device device, TensorParallel tp,
                           const ModelOptions& options)
    : ckpt_(ckpt),
      device_(device),
      tp_(tp),
      options_(options),
      dtype_(checked_compute_dtype(options, device)) {
  fp8_ = runs_fp8(ckpt, device, options.fp8_weights);
}

ops::LinearWeight WeightLoader::lm_head(const std::vector<WeightPart>& parts) {
  if (device_ == Device::kCpu) {
    ops::LinearWeight blocks = cpu_blocks(parts, /*lm_head=*/true);
    if (blocks.defined()) return blocks;
  }
  return linear(parts, /*may_fp8=*/false);
}

ops::LinearWeight WeightLoader::linear(const std::vector<WeightPart>& parts, bool may_fp8) {
  if (device_ == Device::kCpu) {
    ops::LinearWeight blocks = cpu_blocks(parts);
    if (blocks.defined()) return blocks;
  } else {
    // FP8 (--quantization fp8) takes a GGUF's weights through bf16 as before.
    if (options_.gguf_blocks_on_gpu && !(fp8_ && may_fp8)) {
      ops::LinearWeight blocks = gpu_blocks(parts);
      if (blocks.defined()) return blocks;
    }
    if (fp8_ && may_fp8) {
      ops::LinearWeight w = fp8(parts);
      if (w.defined()) return w;
    }
  }
  return ops::LinearWeight::dense(dense(parts));
}

// The CPU's blocks in the form its kernels take: packed for the integer kernels where the format
// has that packing and they were asked for, or in the exact mode where fixed point serves it
// (exact_mode_takes_fixed32), or else repacked for the exact kernels (the same weights, read
// faster).
ops::LinearWeight WeightLoader::cpu_blocks(const std::vector<WeightPart>& parts, bool lm_head) {
  std::vector<QuantizedMatrix> stacked = stacked_blocks(ckpt_, tp_, parts);
  if (stacked.empty()) return {};
  std::vector<ops::CpuBlockPart> cpu_parts;
  cpu_parts.reserve(stacked.size());
  for (QuantizedMatrix& blocks : stacked) {
    ops::CpuBlockPart part;
    if (options_.cpu_int_activations.has_value() && ops::q8_packs(blocks.type)) {
      part.q8 = ops::pack_for_q8(blocks);
      part.q8_input = *options_.cpu_int_activations;
      ++num_int_projections_;
    } else if (exact_mode_takes_fixed32(blocks.type, lm_head)) {
      part.q8 = ops::pack_for_q8(blocks);
      part.q8_input = ops::IntActivations::kFixed32;
    } else {
      part.blocks = ops::repack_for_cpu(std::move(blocks));
    }
    cpu_parts.push_back(std::move(part));
  }
  return ops::LinearWeight::cpu_blocks(std::move(cpu_parts));
}

QuantizedMatrix WeightLoader::cpu_embedding_blocks(const WeightPart& part) {
  return ops::repack_for_cpu(one_format(stacked_blocks(ckpt_, tp_, {part})));
}

// The GPU's blocks uploaded as they are, where it has kernels for all of a projection's formats;
// else the projection is expanded to bf16, as stderr says once per format.
ops::LinearWeight WeightLoader::gpu_blocks(const std::vector<WeightPart>& parts) {
  const std::vector<QuantizedMatrix> stacked = stacked_blocks(ckpt_, tp_, parts);
  if (stacked.empty()) return {};
  for (const QuantizedMatrix& blocks : stacked) {
    const char* format = quant_format(blocks.type).name;
    if (ops::gpu_computes_blocks(blocks.type)) continue;
    if (expanded_formats_.insert(format).second) {
      std::fprintf(stderr,
                   "note: the GPU has no kernel for %s blocks: the projections that hold them are "
                   "expanded to bf16 at load\n",
                   format);
    }
    return {};
  }
  std::vector<ops::DeviceBlocks> gpu_parts;
  gpu_parts.reserve(stacked.size());
  for (const QuantizedMatrix& blocks : stacked) gpu_parts.push_back(ops::upload_blocks(blocks));
  for (const ops::DeviceBlocks& part : gpu_parts) {
    // Two rows are the fewest that a format's kernels take from staged x.
    gpu_blocks_stage_rows_ = gpu_blocks_stage_rows_ || ops::takes_staged_rows(part.type, 2);
  }
  ops::LinearWeight w = ops::LinearWeight::gpu_blocks(std::move(gpu_parts));
  widest_gpu_blocks_ = std::max(widest_gpu_blocks_, w.out_features() * w.in_features());
  return w;
}

ops::LinearWeight WeightLoader::fp8(const std::vector<WeightPart>& parts) {
  ops::Fp8Weight w = checkpoint_fp8(ckpt_, tp_, parts);
  // A checkpoint's own FP8 weights (per-block ones) are not quantized a second time.
  const bool in_checkpoint = std::any_of(
      parts.begin(), parts.end(), [&](const auto& p) { return ckpt_.fp8.count(p.name) != 0; });
  if (!w.defined() && !in_checkpoint && options_.fp8_weights == Fp8Weights::kAll) {
    Tensor weight = dense(parts);
    // cuBLASLt's FP8 layouts take multiples of 16; other shapes stay bf16 (uploaded once).
    if (weight.dim(0) % 16 != 0 || weight.dim(1) % 16 != 0) {
      return ops::LinearWeight::dense(std::move(weight));
    }
    w = ops::quantize_fp8_weight(weight);
  }
  if (!w.defined()) return {};
  has_fp8_ = true;
  return ops::LinearWeight::fp8(std::move(w));
}

Tensor WeightLoader::dense(const std::vector<WeightPart>& parts) {
  return upload(shard_of(ckpt_, tp_, parts));
}

Tensor WeightLoader::replicated(const std::string& name, const Shape& shape) {
  return upload(ckpt_.get(name, shape));
}

Tensor WeightLoader::upload(const Tensor& t) const { return pagedlm::upload(t, device_); }

void WeightLoader::check_options_used() const {
  // Mixture-of-experts experts keep the exact kernels (ops::moe_experts).
  if (!options_.cpu_int_activations.has_value()) return;
  PAGEDLM_CHECK(num_int_projections_ > 0, int_activations_option(*options_.cpu_int_activations),
                " need a GGUF with projection weights in ggml's blocks; this model has none");
}

ops::ExpertWeights WeightLoader::experts(int64_t layer) {
  const ModelConfig& c = ckpt_.config;
  const Family& family = family_of(c);
  const int64_t E = c.moe.num_experts, D = c.hidden_size, F = c.moe.expert_intermediate_size;
  const int64_t Fr = F / tp_.size;  // check_tensor_parallel: the ranks divide F
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
  if (device_ == Device::kCpu) {
    for (int64_t e = 0; e < E; ++e) {
      QuantizedMatrix gu =
          one_format(stacked_blocks(ckpt_, tp_, {gate_up[2 * e], gate_up[2 * e + 1]}));
      QuantizedMatrix dn = one_format(stacked_blocks(ckpt_, tp_, {down[e]}));
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
  PAGEDLM_CHECK(device_ == Device::kCpu || Fr % 8 == 0, "the GPU's experts need a size (per ",
                "tensor-parallel rank) that is a multiple of 8, got ", Fr);
  std::vector<Tensor> pieces;
  pieces.reserve(gate_up.size());
  for (const WeightPart& p : gate_up) pieces.push_back(shard_of(ckpt_, tp_, {p}));
  w.gate_up = stack_converted(pieces, E * 2 * Fr, device_, dtype_, [&](size_t p, int64_t r) {
                const auto e = static_cast<int64_t>(p / 2);
                return e * 2 * Fr + ops::moe_gate_up_row(r, p % 2 == 1, Fr, device_);
              }).reshape({E, 2 * Fr, D});
  pieces.clear();
  for (const WeightPart& p : down) pieces.push_back(shard_of(ckpt_, tp_, {p}));
  w.down = stack_converted(pieces, E * D, device_, dtype_, [&](size_t p, int64_t r) {
             return static_cast<int64_t>(p) * D + r;
           }).reshape({E, D, Fr});
  return w;
}

}  // namespace pagedlm
