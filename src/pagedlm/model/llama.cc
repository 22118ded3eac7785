// The Llama family: Llama (incl. llama3 rope), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).
// They differ only in optional tensors, so one implementation serves them all.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "pagedlm/model/model.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/rope.h"
#include "pagedlm/ops/silu_mul.h"

namespace pagedlm {
namespace {

// A projection's weight as the backend computes with it: dense in the compute dtype, or, on the
// CPU for a GGUF's Q4_1 / Q8_0 matrices, their blocks (ops::linear expands them in registers).
struct Projection {
  Tensor dense;
  QuantizedMatrix blocks;

  void apply(const Tensor& x, const Tensor& bias, const Tensor& out, void* stream) const {
    if (!blocks.empty()) {
      ops::linear(x, blocks, bias, out);
    } else {
      ops::linear(x, dense, bias, out, stream);
    }
  }
};

struct LayerWeights {
  Tensor input_norm, post_attention_norm;  // [D]
  Projection qkv_proj;                     // [(Hq + 2 Hk) d, D]: q, k, v rows, one GEMM
  Tensor qkv_bias;                         // Qwen2 only
  Projection o_proj;                       // [D, Hq*d]
  Tensor q_norm, k_norm;                   // [d], Qwen3 only
  Projection gate_up_proj;                 // [2F, D]: gate rows then up rows, one GEMM
  Projection down_proj;                    // [D, F]
};

// The named matrices' blocks (shapes checked) stacked by rows, or nothing unless all have
// blocks of one format.
QuantizedMatrix stacked_blocks(const Checkpoint& ckpt,
                               const std::vector<std::pair<std::string, Shape>>& parts) {
  QuantizedMatrix out;
  for (const auto& [name, shape] : parts) {
    const QuantizedMatrix* blocks = ckpt.blocks(name, shape);
    if (blocks == nullptr) return {};
    const QuantizedMatrix& q = *blocks;
    if (out.rows > 0 && (q.type != out.type || q.cols != out.cols)) return {};
    out.type = q.type;
    out.cols = q.cols;
    out.rows += q.rows;
    out.blocks.insert(out.blocks.end(), q.blocks.begin(), q.blocks.end());
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
  // f32 checkpoints (and dummy weights) convert in place of a copy, in parallel: an 8B model
  // is 8G conversions.
  const Tensor f32 = t.dtype() == DType::kF32 ? t : t.to_f32();
  Tensor bf16 = Tensor::empty(DType::kBF16, f32.shape());
  const float* src = f32.data<float>();
  uint16_t* dst = bf16.data<uint16_t>();
  const int64_t n = f32.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = f32_to_bf16(src[i]);
  return bf16.to(device);
}

// Stacks tensors along their first dimension (f32): weights [rows, cols] or biases [rows].
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

class LlamaFamilyModel final : public CausalLM {
 public:
  LlamaFamilyModel(const Checkpoint& ckpt, Device device)
      : config_(ckpt.config), device_(device), dtype_(compute_dtype_of(device)) {
#ifndef PAGEDLM_HAS_CUDA
    PAGEDLM_CHECK(device == Device::kCpu, "this build of pagedlm has no CUDA support");
#endif
    const ModelConfig& c = config_;
    const int64_t D = c.hidden_size, F = c.intermediate_size, d = c.head_dim;
    const int64_t q_rows = c.num_heads * d, kv_rows = c.num_kv_heads * d;
    // Stacks the named [rows, D_in] parts (shapes checked) into one projection; the CPU keeps
    // GGUF blocks where every part has them.
    auto projection = [&](const std::vector<std::pair<std::string, Shape>>& parts) {
      Projection proj;
      if (device == Device::kCpu) proj.blocks = stacked_blocks(ckpt, parts);
      if (proj.blocks.empty()) {
        std::vector<Tensor> dense;
        dense.reserve(parts.size());
        for (const auto& [name, shape] : parts) dense.push_back(ckpt.get(name, shape));
        proj.dense = upload(dense.size() == 1 ? dense.front() : concat_rows(dense), device);
      }
      return proj;
    };
    embed_ = upload(ckpt.get("model.embed_tokens.weight", {c.vocab_size, D}), device);
    final_norm_ = upload(ckpt.get("model.norm.weight", {D}), device);
    if (c.tie_word_embeddings) {
      lm_head_.blocks =
          device == Device::kCpu
              ? stacked_blocks(ckpt, {{"model.embed_tokens.weight", {c.vocab_size, D}}})
              : QuantizedMatrix{};
      if (lm_head_.blocks.empty()) lm_head_.dense = embed_;
    } else {
      lm_head_ = projection({{"lm_head.weight", {c.vocab_size, D}}});
    }
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      LayerWeights w;
      w.input_norm = upload(ckpt.get(p + "input_layernorm.weight", {D}), device);
      w.post_attention_norm = upload(ckpt.get(p + "post_attention_layernorm.weight", {D}), device);
      w.qkv_proj = projection({{p + "self_attn.q_proj.weight", {q_rows, D}},
                               {p + "self_attn.k_proj.weight", {kv_rows, D}},
                               {p + "self_attn.v_proj.weight", {kv_rows, D}}});
      w.o_proj = projection({{p + "self_attn.o_proj.weight", {D, q_rows}}});
      if (c.attention_bias) {
        w.qkv_bias = upload(concat_rows({ckpt.get(p + "self_attn.q_proj.bias", {q_rows}),
                                         ckpt.get(p + "self_attn.k_proj.bias", {kv_rows}),
                                         ckpt.get(p + "self_attn.v_proj.bias", {kv_rows})}),
                            device);
      }
      if (c.qk_norm) {
        w.q_norm = upload(ckpt.get(p + "self_attn.q_norm.weight", {d}), device);
        w.k_norm = upload(ckpt.get(p + "self_attn.k_norm.weight", {d}), device);
      }
      w.gate_up_proj =
          projection({{p + "mlp.gate_proj.weight", {F, D}}, {p + "mlp.up_proj.weight", {F, D}}});
      w.down_proj = projection({{p + "mlp.down_proj.weight", {D, F}}});
      layers_.push_back(std::move(w));
    }
    std::vector<float> inv_freq = ops::rope_inv_freq(c);
    if (ckpt.has("rope_freqs")) {  // GGUF llama3: per-frequency divisors instead of a config
      Tensor divisors = ckpt.get("rope_freqs", {d / 2}).to_f32();
      for (int64_t i = 0; i < d / 2; ++i) inv_freq[i] /= divisors.data<float>()[i];
    }
    // Rope runs in f32 on every backend (angle = float(pos) * inv_freq).
    Tensor inv_freq_host = Tensor::from_f32(inv_freq, {d / 2});
    inv_freq_ = device == Device::kCpu ? inv_freq_host : inv_freq_host.to(device);
  }

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return device_; }
  DType compute_dtype() const override { return dtype_; }

  // Stream rows -> buffers; see CausalLM::reserve.
  void reserve(int64_t rows) override {
    if (rows <= buffers_.capacity) return;
    const ModelConfig& c = config_;
    const int64_t D = c.hidden_size, F = c.intermediate_size, d = c.head_dim;
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
    b.qkv = make({rows, (c.num_heads + 2 * c.num_kv_heads) * d});
    b.q = make({rows, c.num_heads, d});
    b.attn_out = make({rows, c.num_heads, d});
    b.proj_out = make({rows, D});
    b.gate_up = make({rows, 2 * F});
    b.act = make({rows, F});
    b.last = make({rows, D});
    b.last_residual = make_f32({rows, D});
    b.last_update = make({rows, D});
  }

  // token_ids: [L], logits_rows: [S] -> logits: [S, vocab] f32
  void forward(const ForwardInputs& in, Attention& attention, const Tensor& logits) override {
    const ModelConfig& c = config_;
    const int64_t L = in.token_ids.dim(0), S = in.logits_rows.dim(0);
    const int64_t d = c.head_dim, Hq = c.num_heads, Hk = c.num_kv_heads;
    const float eps = c.rms_norm_eps;
    void* const stream = in.stream;
    reserve(L);
    // Views of the preallocated activations: nothing is allocated per step, which keeps the
    // step capturable as a CUDA graph.
    Tensor residual = buffers_.residual.rows(0, L), hidden = buffers_.hidden.rows(0, L);
    Tensor qkv = buffers_.qkv.rows(0, L), q = buffers_.q.rows(0, L);
    Tensor attn_out = buffers_.attn_out.rows(0, L), proj_out = buffers_.proj_out.rows(0, L);
    Tensor gate_up = buffers_.gate_up.rows(0, L), act = buffers_.act.rows(0, L);

    ops::embedding(embed_, in.token_ids, residual, stream);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& w = layers_[i];
      if (i == 0) {
        ops::rms_norm(residual, w.input_norm, eps, hidden, stream);
      } else {
        ops::add_rms_norm(residual, proj_out, w.input_norm, eps, hidden, stream);
      }
      w.qkv_proj.apply(hidden, w.qkv_bias, qkv, stream);
      if (c.qk_norm) {
        ops::head_rms_norm(qkv, 0, Hq, d, w.q_norm, eps, stream);
        ops::head_rms_norm(qkv, Hq, Hk, d, w.k_norm, eps, stream);
      }
      attention.attend(static_cast<int>(i), variant_, qkv, q, inv_freq_, attn_out);
      w.o_proj.apply(attn_out.reshape({L, Hq * d}), Tensor(), proj_out, stream);
      ops::add_rms_norm(residual, proj_out, w.post_attention_norm, eps, hidden, stream);
      w.gate_up_proj.apply(hidden, Tensor(), gate_up, stream);
      ops::silu_mul(gate_up, act, stream);
      w.down_proj.apply(act, Tensor(), proj_out, stream);
    }
    // Only the rows that need logits go through the final norm and the lm_head.
    Tensor last = buffers_.last.rows(0, S), last_residual = buffers_.last_residual.rows(0, S);
    Tensor last_update = buffers_.last_update.rows(0, S);
    ops::gather_rows(residual, in.logits_rows, last_residual, stream);
    ops::gather_rows(proj_out, in.logits_rows, last_update, stream);
    ops::add_rms_norm(last_residual, last_update, final_norm_, eps, last, stream);
    // The lm_head writes f32 directly on every device: no rounding of the logits.
    lm_head_.apply(last, Tensor(), logits, stream);
  }

 private:
  struct Activations {
    int64_t capacity = 0;                                               // rows
    Tensor residual, hidden, qkv, q, attn_out, proj_out, gate_up, act;  // [rows, ...]
    Tensor last, last_residual, last_update;                            // [rows, D]
  };

  ModelConfig config_;
  Device device_;
  DType dtype_;
  AttentionVariant variant_{1.f / std::sqrt(static_cast<float>(config_.head_dim))};
  Tensor embed_, final_norm_, inv_freq_;
  Projection lm_head_;
  std::vector<LayerWeights> layers_;
  Activations buffers_;
};

}  // namespace

std::unique_ptr<CausalLM> create_model(const Checkpoint& checkpoint, Device device) {
  const std::string& arch = checkpoint.config.architecture;
  if (arch == "LlamaForCausalLM" || arch == "MistralForCausalLM" || arch == "Qwen2ForCausalLM" ||
      arch == "Qwen3ForCausalLM") {
    return std::make_unique<LlamaFamilyModel>(checkpoint, device);
  }
  fail("unsupported architecture '", arch, "' (supported: LlamaForCausalLM, MistralForCausalLM, ",
       "Qwen2ForCausalLM, Qwen3ForCausalLM)");
}

}  // namespace pagedlm
