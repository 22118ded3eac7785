// pagedlm inspect: what a model file holds, as the engine reads it (config, tensors, tokenizer).
#include <map>
#include <string>

#include "pagedlm/cli/commands.h"
#include "pagedlm/cli/model_path.h"
#include "pagedlm/engine/text_model.h"

namespace pagedlm::cli {

namespace {

const char* rope_type_name(RopeType t) {
  switch (t) {
    case RopeType::kLlama3:
      return "llama3";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kYarn:
      return "yarn";
    case RopeType::kDefault:
      break;
  }
  return "default";
}

// One line per run of layers with the same attention and rope.
void print_layers(const ModelConfig& c) {
  for (size_t i = 0; i < c.layers.size();) {
    size_t j = i + 1;
    while (j < c.layers.size() && c.layers[j].attention == c.layers[i].attention &&
           c.layers[j].rope == c.layers[i].rope) {
      ++j;
    }
    const LayerSpec& l = c.layers[i];
    std::printf(
        "layers %zu-%zu%*s scale %g, window %d, soft-cap %g; rope %s theta %g (factor %g)\n", i,
        j - 1, i < 10 && j - 1 < 10 ? 4 : 2, "", l.attention.scale, l.attention.window,
        l.attention.softcap, rope_type_name(l.rope.type), l.rope.theta, l.rope.factor);
    i = j;
  }
}

void print_model(const TextModel& model, bool list_tensors) {
  const ModelConfig& c = model.checkpoint.config;
  std::printf("architecture      %s (%s)\n", c.architecture.c_str(), c.model_type.c_str());
  std::printf("layers            %lld\n", static_cast<long long>(c.num_layers));
  std::printf("hidden / ffn      %lld / %lld\n", static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.intermediate_size));
  std::printf("heads / kv heads  %lld / %lld, head_dim %lld\n", static_cast<long long>(c.num_heads),
              static_cast<long long>(c.num_kv_heads), static_cast<long long>(c.head_dim));
  std::printf("vocab             %lld\n", static_cast<long long>(c.vocab_size));
  std::printf("max positions     %lld\n", static_cast<long long>(c.max_position_embeddings));
  print_layers(c);
  std::printf("rms_norm_eps      %g\n", c.rms_norm_eps);
  std::printf("tied lm_head      %s; q/k/v bias %s; q/k norm %s\n",
              c.tie_word_embeddings ? "yes" : "no", c.attention_bias ? "yes" : "no",
              c.qk_norm ? "yes" : "no");
  std::printf("block             %s MLP; norms x(%g + w)%s; embeddings x%g; logit soft-cap %g\n",
              c.activation == Activation::kGeluTanh ? "GeGLU (tanh)" : "SwiGLU",
              c.norm_weight_offset, c.sandwich_norms ? ", around both sublayers" : "",
              c.embedding_scale, c.final_logit_softcap);
  if (c.moe.num_experts > 0) {
    std::string sparse;
    for (int64_t i = 0; i < c.num_layers; ++i) {
      if (c.layers[i].sparse_mlp) sparse += cat(sparse.empty() ? "" : ",", i);
    }
    std::printf("experts           %lld, top %lld%s, expert ffn %lld; sparse layers %s\n",
                static_cast<long long>(c.moe.num_experts),
                static_cast<long long>(c.moe.experts_per_token),
                c.moe.normalize_top_k ? " renormalized" : "",
                static_cast<long long>(c.moe.expert_intermediate_size), sparse.c_str());
  }
  std::printf("eos ids          ");
  for (int32_t id : c.eos_token_ids) std::printf(" %d", id);
  std::printf("\n");
  const Checkpoint& ckpt = model.checkpoint;
  const std::map<std::string, Shape> shapes = ckpt.shapes();
  int64_t params = 0;
  for (const auto& [name, shape] : shapes) {
    int64_t n = 1;
    for (int64_t dim : shape) n *= dim;
    params += n;
  }
  std::printf("tensors           %zu (%.1fM parameters)\n", shapes.size(),
              static_cast<double>(params) / 1e6);
  if (ckpt.quantization.quantized()) {
    std::printf("quantization      %s\n", ckpt.quantization.describe().c_str());
    std::printf(
        "                  %zu FP8 matrices, %zu kv cache scales; computed dequantized "
        "(CPU f32, GPU bf16)\n",
        ckpt.fp8.size(), ckpt.kv_scales.size());
  }
  if (model.tokenizer) {
    std::printf("tokenizer         %d tokens, bos %d, eos %d\n", model.tokenizer->vocab_size(),
                model.tokenizer->bos_id(), model.tokenizer->eos_id());
  } else {
    std::printf("tokenizer         none (token ids only)\n");
  }
  std::printf("chat template     %s\n", model.chat_template ? "yes" : "no");
  if (!list_tensors) return;
  for (const auto& [name, shape] : shapes) {
    const auto q = ckpt.quantized.find(name);
    const auto f = ckpt.fp8.find(name);
    std::string type;
    if (q != ckpt.quantized.end()) {
      type = quant_format(q->second.type).name;
    } else if (f != ckpt.fp8.end()) {
      type = "f8_e4m3";
    } else {
      type = dtype_name(ckpt.tensors.at(name).dtype());
    }
    std::printf("  %-56s %-5s %s", name.c_str(), type.c_str(), shape_str(shape).c_str());
    if (f != ckpt.fp8.end()) std::printf("  %s", f->second.describe().c_str());
    std::printf("\n");
  }
  for (const auto& [name, t] : ckpt.kv_scales) {
    std::printf("  %-56s %-5s %s  %g\n", name.c_str(), std::string(dtype_name(t.dtype())).c_str(),
                shape_str(t.shape()).c_str(), t.to_f32().data<float>()[0]);
  }
}

}  // namespace

void register_inspect(CLI::App& app) {
  auto* cmd = app.add_subcommand("inspect", "show a model's config, tensors and tokenizer");
  struct Args {
    std::string model;
    bool tensors = false;
  };
  auto args = std::make_shared<Args>();
  cmd->add_option("--model", args->model, "HF folder or .gguf file (default: SmolLM2 GGUF)");
  cmd->add_flag("--tensors", args->tensors, "list every tensor with its dtype and shape");
  cmd->callback([args] {
    print_model(load_text_model(resolve_model_path(args->model), progress_bar()), args->tensors);
  });
}

}  // namespace pagedlm::cli
