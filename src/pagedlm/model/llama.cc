// The Llama family: Llama (incl. llama3 rope), Mistral, Qwen2 (q/k/v bias), Qwen3 (q/k norm).
// They differ only in optional tensors, so one implementation serves them all.
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "pagedlm/model/model.h"
#include "pagedlm/ops/activation.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/rope.h"

namespace pagedlm {
namespace {

struct LayerWeights {
  Tensor input_norm, post_attention_norm;  // [D]
  Tensor q_proj, k_proj, v_proj, o_proj;   // [Hq*d, D], [Hk*d, D], [Hk*d, D], [D, Hq*d]
  Tensor q_bias, k_bias, v_bias;           // Qwen2 only
  Tensor q_norm, k_norm;                   // [d], Qwen3 only
  Tensor gate_up_proj;                     // [2F, D]: gate rows then up rows, one GEMM
  Tensor down_proj;                        // [D, F]
};

// Weights in the compute dtype on the target device.
Tensor upload(const Tensor& t, Device device) {
  Tensor f32 = t.to_f32();
  return device == Device::kCpu ? f32 : f32.to(device);
}

Tensor concat_rows(const Tensor& a, const Tensor& b) {
  Tensor fa = a.to_f32(), fb = b.to_f32();
  Tensor out = Tensor::empty(DType::kF32, {fa.dim(0) + fb.dim(0), fa.dim(1)});
  std::memcpy(out.data<float>(), fa.data<float>(), fa.nbytes());
  std::memcpy(out.data<float>() + fa.numel(), fb.data<float>(), fb.nbytes());
  return out;
}

class LlamaFamilyModel final : public CausalLM {
 public:
  LlamaFamilyModel(const Checkpoint& ckpt, Device device) : config_(ckpt.config), device_(device) {
    PAGEDLM_CHECK(device == Device::kCpu, "the CUDA model path is not built yet");
    const ModelConfig& c = config_;
    const int64_t D = c.hidden_size, F = c.intermediate_size, d = c.head_dim;
    const int64_t q_rows = c.num_heads * d, kv_rows = c.num_kv_heads * d;
    embed_ = upload(ckpt.get("model.embed_tokens.weight", {c.vocab_size, D}), device);
    final_norm_ = upload(ckpt.get("model.norm.weight", {D}), device);
    lm_head_ = c.tie_word_embeddings ? embed_
                                     : upload(ckpt.get("lm_head.weight", {c.vocab_size, D}), device);
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = "model.layers." + std::to_string(i) + ".";
      LayerWeights w;
      w.input_norm = upload(ckpt.get(p + "input_layernorm.weight", {D}), device);
      w.post_attention_norm = upload(ckpt.get(p + "post_attention_layernorm.weight", {D}), device);
      w.q_proj = upload(ckpt.get(p + "self_attn.q_proj.weight", {q_rows, D}), device);
      w.k_proj = upload(ckpt.get(p + "self_attn.k_proj.weight", {kv_rows, D}), device);
      w.v_proj = upload(ckpt.get(p + "self_attn.v_proj.weight", {kv_rows, D}), device);
      w.o_proj = upload(ckpt.get(p + "self_attn.o_proj.weight", {D, q_rows}), device);
      if (c.attention_bias) {
        w.q_bias = upload(ckpt.get(p + "self_attn.q_proj.bias", {q_rows}), device);
        w.k_bias = upload(ckpt.get(p + "self_attn.k_proj.bias", {kv_rows}), device);
        w.v_bias = upload(ckpt.get(p + "self_attn.v_proj.bias", {kv_rows}), device);
      }
      if (c.qk_norm) {
        w.q_norm = upload(ckpt.get(p + "self_attn.q_norm.weight", {d}), device);
        w.k_norm = upload(ckpt.get(p + "self_attn.k_norm.weight", {d}), device);
      }
      w.gate_up_proj = upload(concat_rows(ckpt.get(p + "mlp.gate_proj.weight", {F, D}),
                                          ckpt.get(p + "mlp.up_proj.weight", {F, D})),
                              device);
      w.down_proj = upload(ckpt.get(p + "mlp.down_proj.weight", {D, F}), device);
      layers_.push_back(std::move(w));
    }
    std::vector<float> inv_freq = rope_inv_freq(c);
    if (ckpt.has("rope_freqs")) {  // GGUF llama3: per-frequency divisors instead of a config
      Tensor divisors = ckpt.get("rope_freqs", {d / 2}).to_f32();
      for (int64_t i = 0; i < d / 2; ++i) inv_freq[i] /= divisors.data<float>()[i];
    }
    inv_freq_ = upload(Tensor::from_f32(inv_freq, {d / 2}), device);
  }

  const ModelConfig& config() const override { return config_; }
  Device device() const override { return device_; }

  void forward(const ForwardInputs& in, Attention& attention, Tensor& logits) override {
    const ModelConfig& c = config_;
    const int64_t L = in.token_ids.dim(0), D = c.hidden_size, F = c.intermediate_size;
    const int64_t d = c.head_dim, Hq = c.num_heads, Hk = c.num_kv_heads;
    const float eps = c.rms_norm_eps;
    // Activations: [L, ...] each.
    Tensor residual = Tensor::empty(DType::kF32, {L, D}, device_);
    Tensor hidden = Tensor::empty(DType::kF32, {L, D}, device_);
    Tensor q = Tensor::empty(DType::kF32, {L, Hq, d}, device_);
    Tensor k = Tensor::empty(DType::kF32, {L, Hk, d}, device_);
    Tensor v = Tensor::empty(DType::kF32, {L, Hk, d}, device_);
    Tensor attn_out = Tensor::empty(DType::kF32, {L, Hq, d}, device_);
    Tensor proj_out = Tensor::empty(DType::kF32, {L, D}, device_);
    Tensor gate_up = Tensor::empty(DType::kF32, {L, 2 * F}, device_);
    Tensor act = Tensor::empty(DType::kF32, {L, F}, device_);

    ops::embedding(embed_, in.token_ids, residual);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& w = layers_[i];
      if (i == 0) {
        ops::rms_norm(residual, w.input_norm, eps, hidden);
      } else {
        ops::add_rms_norm(residual, proj_out, w.input_norm, eps, hidden);
      }
      Tensor q2 = q.reshape({L, Hq * d}), k2 = k.reshape({L, Hk * d}), v2 = v.reshape({L, Hk * d});
      ops::linear(hidden, w.q_proj, w.q_bias, q2);
      ops::linear(hidden, w.k_proj, w.k_bias, k2);
      ops::linear(hidden, w.v_proj, w.v_bias, v2);
      if (c.qk_norm) {
        Tensor qn = q.reshape({L * Hq, d}), kn = k.reshape({L * Hk, d});
        ops::rms_norm(qn, w.q_norm, eps, qn);
        ops::rms_norm(kn, w.k_norm, eps, kn);
      }
      ops::rope(q, k, in.positions, inv_freq_);
      attention.attend(static_cast<int>(i), q, k, v, attn_out);
      ops::linear(attn_out.reshape({L, Hq * d}), w.o_proj, Tensor(), proj_out);
      ops::add_rms_norm(residual, proj_out, w.post_attention_norm, eps, hidden);
      ops::linear(hidden, w.gate_up_proj, Tensor(), gate_up);
      ops::silu_mul(gate_up, act);
      ops::linear(act, w.down_proj, Tensor(), proj_out);
    }
    // Only the rows that need logits go through the final norm and the lm_head.
    const int64_t S = in.logits_rows.dim(0);
    Tensor last = Tensor::empty(DType::kF32, {S, D}, device_);
    Tensor last_residual = Tensor::empty(DType::kF32, {S, D}, device_);
    Tensor last_update = Tensor::empty(DType::kF32, {S, D}, device_);
    ops::gather_rows(residual, in.logits_rows, last_residual);
    ops::gather_rows(proj_out, in.logits_rows, last_update);
    ops::add_rms_norm(last_residual, last_update, final_norm_, eps, last);
    ops::linear(last, lm_head_, Tensor(), logits);
  }

 private:
  ModelConfig config_;
  Device device_;
  Tensor embed_, final_norm_, lm_head_, inv_freq_;
  std::vector<LayerWeights> layers_;
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
