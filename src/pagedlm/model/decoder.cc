// The decoder every family runs: pre-norm attention and a gated MLP per layer, with the pieces a
// family switches on in its ModelConfig (q/k/v biases, q/k norms, sandwich norms, (1 + w) norms,
// GeGLU, scaled embeddings, a final soft-cap, mixture-of-experts MLPs) and one attention spec
// per layer. Weights are found under the family's names (model/family.h).
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "pagedlm/model/family.h"
#include "pagedlm/model/model.h"
#include "pagedlm/model/rope.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/model/weights.h"
#include "pagedlm/ops/communicator.h"
#include "pagedlm/ops/embedding.h"
#include "pagedlm/ops/gather_rows.h"
#include "pagedlm/ops/linear_weight.h"
#include "pagedlm/ops/moe.h"
#include "pagedlm/ops/rms_norm.h"
#include "pagedlm/ops/silu_mul.h"
#include "pagedlm/ops/softcap.h"

namespace pagedlm {
namespace {

struct LayerWeights {
  Tensor attn_norm, ffn_norm;          // [D]: before attention, before the MLP
  Tensor attn_out_norm, ffn_out_norm;  // [D]: after them (sandwich norms only)
  ops::LinearWeight qkv_proj;          // [(Hq + 2 Hk) d, D]: q, k, v rows, one GEMM
  Tensor qkv_bias;                     // Qwen2 only
  ops::LinearWeight o_proj;            // [D, Hq*d]
  Tensor q_norm, k_norm;               // [d], with qk_norm only
  ops::LinearWeight gate_up_proj;      // [2F, D]: gate rows then up rows, one GEMM
  ops::LinearWeight down_proj;         // [D, F]
  ops::LinearWeight router;            // [E, D]: sparse MLPs only, with `experts`
  ops::ExpertWeights experts;          // [E, 2F, D] and [E, D, F] (F: this rank's share)
  Tensor inv_freq;                     // [d/2] f32: the layer's rope (shared between layers)
};

class DecoderModel final : public CausalLM {
 public:
  DecoderModel(const Checkpoint& ckpt, Device device, TensorParallel tp, ops::Communicator* comm,
               const ModelOptions& options)
      : config_(ckpt.config),
        device_(device),
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
    WeightLoader load(ckpt, device, tp, options);
    dtype_ = load.compute_dtype();
    // The embedding and the lm_head are split by vocabulary rows.
    const WeightPart embed_part{"model.embed_tokens.weight", {c.vocab_size, D}, Shard::kRows};
    if (c.tie_word_embeddings) {
      if (device == Device::kCpu) lm_head_ = load.cpu_blocks({embed_part}, /*lm_head=*/true);
    } else {
      lm_head_ = load.lm_head({{"lm_head.weight", {c.vocab_size, D}, Shard::kRows}});
    }
    // On the CPU a GGUF's embedding stays in its blocks (rows dequantized as they are looked
    // up): SmolLM2's as float32 would be 113 MB, its Q8_0 blocks are 30 MB, and those of a tied
    // lm_head are the same blocks, kept once (packed for the integer kernels, as the lm_head's
    // are by default, their rows are read from the packing, the same floats).
    embed_in_lm_head_ = c.tie_word_embeddings &&
                        lm_head_.format() == ops::WeightFormat::kCpuBlocks &&
                        lm_head_.cpu_parts().size() == 1;
    if (device == Device::kCpu && !embed_in_lm_head_) {
      embed_blocks_ = load.cpu_embedding_blocks(embed_part);
    }
    if (!has_embed_blocks()) embed_ = load.dense({embed_part});
    if (c.tie_word_embeddings && !lm_head_.defined()) lm_head_ = ops::LinearWeight::dense(embed_);
    final_norm_ = load.replicated("model.norm.weight", {D});
    const Family& family = family_of(c);
    auto name = [&](int64_t layer, LayerWeight w) { return hf_weight_name(family, layer, w); };
    auto part = [&](int64_t layer, LayerWeight w, Shape shape) {
      return WeightPart{name(layer, w), std::move(shape), layer_weight_shard(family, w)};
    };
    auto vector = [&](const std::string& tensor, int64_t n) {
      return load.replicated(tensor, {n});
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
                       ? load.linear({part(i, LayerWeight::kQkv, {q_rows + 2 * kv_rows, D})})
                       : load.linear({part(i, LayerWeight::kQ, {q_rows, D}),
                                      part(i, LayerWeight::kK, {kv_rows, D}),
                                      part(i, LayerWeight::kV, {kv_rows, D})});
      w.o_proj = load.linear({part(i, LayerWeight::kO, {D, q_rows})});
      if (c.attention_bias) {
        w.qkv_bias = load.dense({part(i, LayerWeight::kQBias, {q_rows}),
                                 part(i, LayerWeight::kKBias, {kv_rows}),
                                 part(i, LayerWeight::kVBias, {kv_rows})});
      }
      if (c.qk_norm) {
        w.q_norm = vector(name(i, LayerWeight::kQNorm), d);
        w.k_norm = vector(name(i, LayerWeight::kKNorm), d);
      }
      if (c.layers[i].sparse_mlp) {
        w.router = load.linear({part(i, LayerWeight::kRouter, {c.moe.num_experts, D})}, false);
        w.experts = load.experts(i);
      } else {
        w.gate_up_proj = has_layer_weight(family, LayerWeight::kGateUp)
                             ? load.linear({part(i, LayerWeight::kGateUp, {2 * F, D})})
                             : load.linear({part(i, LayerWeight::kGate, {F, D}),
                                            part(i, LayerWeight::kUp, {F, D})});
        w.down_proj = load.linear({part(i, LayerWeight::kDown, {D, F})});
      }
      w.inv_freq = inv_freq_of(c.layers[i].rope);
      layers_.push_back(std::move(w));
    }
    load.check_options_used();
    has_fp8_ = load.has_fp8();
    widest_gpu_blocks_ = load.widest_gpu_blocks();
    gpu_blocks_stage_rows_ = load.gpu_blocks_stage_rows();
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
      for (const ops::LinearWeight* p :
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
    if (gpu_blocks_stage_rows_ && rows >= 2) {
      // The widest input of a block projection: o's (Hq d), down's (F) or the hidden size.
      const int64_t widest = std::max({D, Hq * d, F});
      b.projection.staged_rows = Tensor::empty(
          DType::kI32,
          {ops::staged_rows_words(std::min<int64_t>(rows, ops::kStagedRowsMaxRows), widest)},
          device_);
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
    const ops::LinearScratch& scratch = buffers_.projection;

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
    // FP8 projections (ops/linear_fp8.h): the norms and the gated product also write the next
    // projection's e4m3 input, and o, gate/up and down leave their sums unscaled for the kernel
    // that reads them next, which scales them as it reads. The same bits as quantizing and
    // scaling in kernels of their own, with fewer passes over a layer's activations. Not across
    // the tensor-parallel all-reduce (each rank's rows have scales of their own), nor into the
    // sandwich norms or the final norm's gather.
    const int64_t D = c.hidden_size, F = dims_.ffn;
    const auto fp8_rows_for = [&](const ops::LinearWeight& next, bool fuses) {
      const ops::Fp8InputScaling* how = next.fp8_inputs();
      return how != nullptr && fuses ? ops::Fp8RowsOut{scratch.fp8.values, scratch.fp8.scales, *how}
                                     : ops::Fp8RowsOut{};
    };
    const bool norm_fuses = ops::norm_fuses_fp8(D);
    const bool gated_fuses = ops::gated_mul_fuses_fp8(F);
    const bool unscaled_ok = comm_ == nullptr && !c.sandwich_norms;
    ops::Fp8Unscaled update_unscaled;  // proj_out's, when the projection left it unscaled
    for (size_t i = 0; i < layers_.size(); ++i) {
      const LayerWeights& w = layers_[i];
      if (leave_at(2 * i)) return false;
      const ops::Fp8RowsOut qkv_in = fp8_rows_for(w.qkv_proj, norm_fuses);
      if (i == 0) {
        ops::rms_norm(residual, w.attn_norm, eps, hidden, stream, offset, qkv_in);
      } else {
        ops::add_rms_norm(residual, proj_out, w.attn_norm, eps, hidden, stream, offset,
                          update_unscaled, qkv_in);
      }
      w.qkv_proj.apply(hidden, w.qkv_bias, qkv, stream, state, scratch, {qkv_in.on()});
      if (c.qk_norm) {
        ops::head_rms_norm(qkv, 0, Hq, d, w.q_norm, eps, stream, offset);
        ops::head_rms_norm(qkv, Hq, Hk, d, w.k_norm, eps, stream, offset);
      }
      if (leave_at(2 * i)) return false;
      attention.attend(static_cast<int>(i), c.layers[i].attention, qkv, q, w.inv_freq, attn_out);
      if (leave_at(2 * i)) return false;
      w.o_proj.apply(attn_out.reshape({L, Hq * d}), Tensor(), proj_out, stream, state, scratch,
                     {false, unscaled_ok && norm_fuses ? &update_unscaled : nullptr});
      if (comm_ != nullptr) comm_->all_reduce_sum(proj_out, stream);  // the heads' partial sums
      if (c.sandwich_norms) {
        ops::rms_norm(proj_out, w.attn_out_norm, eps, proj_out, stream, offset);
      }
      if (leave_at(2 * i + 1)) return false;
      const ops::Fp8RowsOut gate_up_in = fp8_rows_for(w.gate_up_proj, norm_fuses);
      ops::add_rms_norm(residual, proj_out, w.ffn_norm, eps, hidden, stream, offset,
                        update_unscaled, gate_up_in);
      update_unscaled = {};
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
        ops::Fp8Unscaled gate_up_unscaled;
        w.gate_up_proj.apply(hidden, Tensor(), gate_up, stream, state, scratch,
                             {gate_up_in.on(), gated_fuses ? &gate_up_unscaled : nullptr});
        const ops::Fp8RowsOut down_in = fp8_rows_for(w.down_proj, gated_fuses);
        ops::gated_mul(gated_activation(c), gate_up, act, stream, gate_up_unscaled, down_in);
        if (leave_at(2 * i + 1)) return false;
        const bool last_layer = i + 1 == layers_.size();
        w.down_proj.apply(
            act, Tensor(), proj_out, stream, state, scratch,
            {down_in.on(), unscaled_ok && norm_fuses && !last_layer ? &update_unscaled : nullptr});
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
    ops::LinearScratch projection;
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
      const ops::CpuBlockPart& part = lm_head_.cpu_parts().front();
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
  ops::LinearWeight lm_head_;
  std::vector<LayerWeights> layers_;
  bool has_fp8_ = false;                // some projection is FP8 (reserve() then sizes the scratch)
  int64_t widest_gpu_blocks_ = 0;       // the weights of the largest GPU block projection
  bool gpu_blocks_stage_rows_ = false;  // some GPU block part takes x staged (Q4_K, Q6_K)
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
