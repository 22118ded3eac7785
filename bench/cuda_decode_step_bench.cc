// One decode step of a real-shaped model at a fixed batch and context, through the engine with
// CUDA graphs, split by timing variants: the step's GEMMs alone (replayed as one graph at the
// step's shapes), its attention alone (the decode kernel over the same page table shape), and
// the rest (norms, rope + cache write, embedding, sampling, plan upload, host scheduling) as the
// difference. A mixture of experts adds its router (projection and top-k) and its experts
// (plan, grouped GEMMs, combine) alone, routed as the random model routes: uniformly. Prints the
// bandwidth lower bound: weights (the experts a step activates) + KV read once at copy speed. One
// further step runs between cudaProfilerStart and Stop, for a profiler's kernel-by-kernel view.
// Usage: cuda_decode_step_bench config.json [batch] [context] [copy GB/s] [--quantization NAME]
//        [--kv-cache-dtype NAME]   (the engine step's weights and pages, as the command line's
//        flags name them; the parts timed alone stay bf16)
#include <cuda_profiler_api.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/model/dummy_checkpoint.h"
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/cuda/kernels.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/moe.h"
#include "pagedlm/ops/paged_attention.h"

using namespace pagedlm;

int main(int argc, char** argv) {
  // The named flags first (they take the engine step's formats), then the positional arguments.
  std::string quantization = "none", kv_dtype = "auto";
  {
    int kept = 1;
    for (int i = 1; i < argc; ++i) {
      const std::string a = argv[i];
      if ((a == "--quantization" || a == "--kv-cache-dtype") && i + 1 < argc) {
        (a == "--quantization" ? quantization : kv_dtype) = argv[++i];
      } else {
        argv[kept++] = argv[i];
      }
    }
    argc = kept;
  }
  if (argc < 2) {
    std::fprintf(stderr,
                 "usage: %s config.json [batch] [context] [copy GB/s] [--quantization NAME] "
                 "[--kv-cache-dtype NAME]\n",
                 argv[0]);
    return 2;
  }
  const int batch = argc > 2 ? std::atoi(argv[2]) : 256;
  const int context = argc > 3 ? std::atoi(argv[3]) : 1024;
  const double copy_gbs = argc > 4 ? std::atof(argv[4]) : 4280;
  const Quantization quant = quantization_named(quantization, /*dummy_weights=*/true);
  const Checkpoint ckpt = make_dummy_checkpoint(argv[1], 0, {}, quant.dummy_blocks);
  const ModelConfig& c = ckpt.config;
  const int page_size = 16;

  // 1. The engine's decode step: prefill `batch` prompts of `context` tokens, then time steps.
  EngineOptions o;
  o.device = Device::kCuda;
  o.fp8_weights = quant.fp8_weights;
  o.kv_cache_dtype = kv_cache_dtype_named(kv_dtype);
  o.gguf_blocks_on_gpu = quant.dummy_blocks.has_value();
  o.max_num_seqs = batch;
  o.max_num_batched_tokens = 8192;
  // Until every request decodes: prefill chunks share each step's budget with the decodes of
  // the requests already prefilled; then a few decode steps capture the graph, 30 are timed and
  // one is profiled. No request may finish before: each may generate max_new tokens, and the
  // pool holds them all.
  const int64_t prefill_steps = (int64_t{batch} * context + 8191 - batch) / (8192 - batch);
  const int max_new = static_cast<int>(prefill_steps) + 64;
  o.num_pages = batch * ((context + max_new) / page_size + 2);
  Engine engine(ckpt, o);
  for (int i = 0; i < batch; ++i) {
    Request r;
    r.prompt.resize(context);
    for (int t = 0; t < context; ++t) r.prompt[t] = (i * 7919 + t * 31) % (c.vocab_size - 10) + 5;
    r.use_prefix_cache = false;
    r.sampling.max_tokens = max_new;
    r.sampling.ignore_eos = true;
    engine.add_request(r);
  }
  while (engine.num_steps() < prefill_steps + 4) engine.step();
  const int timed = 30;
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < timed; ++i) engine.step();
  const double step_ms =
      std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() /
      timed;
  // One more step between profiler start and stop: `ncu --profile-from-start off` times each of
  // its kernels alone.
  cuda::check(cudaProfilerStart(), "cudaProfilerStart");
  engine.step();
  cuda::check(cudaProfilerStop(), "cudaProfilerStop");

  // 2. The same step's GEMMs and attention alone, on fresh buffers of the same shapes.
  cudaStream_t s;
  cuda::check(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), "stream");
  cuda::GemmHandle* gemm = nullptr;
  cuda::check(cuda::gemm_create(&gemm, size_t{32} << 20), "gemm");
  cuda::gemm_set_tuning(gemm, o.tune_gemms);  // as the engine's plans (tuned in the eager call)
  const int D = c.hidden_size, F = c.intermediate_size, d = c.head_dim;
  const int Hq = c.num_heads, Hk = c.num_kv_heads, V = c.vocab_size, layers = c.num_layers;
  struct Shape {
    int n, k;
  };
  // As the model runs them: fused q/k/v, o, fused gate/up, down; a sparse layer's router (f32
  // logits) in place of gate/up and down.
  const int E = static_cast<int>(c.moe.num_experts), k = static_cast<int>(c.moe.experts_per_token);
  std::vector<std::vector<Shape>> layer_shapes;
  for (int l = 0; l < layers; ++l) {
    if (c.layers[l].sparse_mlp) {
      layer_shapes.push_back({{(Hq + 2 * Hk) * d, D}, {D, Hq * d}, {E, D}});
    } else {
      layer_shapes.push_back({{(Hq + 2 * Hk) * d, D}, {D, Hq * d}, {2 * F, D}, {D, F}});
    }
  }
  std::vector<void*> weights;
  size_t weight_bytes = 0;
  for (int l = 0; l < layers; ++l) {
    for (const Shape& sh : layer_shapes[l]) {
      void* w;
      cuda::check(cudaMalloc(&w, size_t{2} * sh.n * sh.k), "malloc");
      weights.push_back(w);
      weight_bytes += size_t{2} * sh.n * sh.k;
    }
  }
  void *lm_head, *x, *y;
  cuda::check(cudaMalloc(&lm_head, size_t{2} * V * D), "malloc");
  weight_bytes += size_t{2} * V * D;
  cuda::check(cudaMalloc(&x, size_t{2} * batch * std::max(F, std::max(D, Hq * d))), "malloc");
  // 4 bytes per element: the lm_head writes f32 logits.
  cuda::check(cudaMalloc(&y, size_t{4} * batch * std::max({V, 2 * F, (Hq + 2 * Hk) * d})),
              "malloc");
  cudaMemset(x, 0, size_t{2} * batch * std::max(F, std::max(D, Hq * d)));
  for (void* w : weights) cudaMemset(w, 0, 2);
  auto step_gemms = [&] {
    size_t w = 0;
    for (int l = 0; l < layers; ++l) {
      for (const Shape& sh : layer_shapes[l]) {
        const bool router = c.layers[l].sparse_mlp && sh.n == E && sh.k == D;
        cuda::check(cuda::launch_gemm_bf16(gemm, x, weights[w++], nullptr, y, /*y_f32=*/router,
                                           batch, sh.n, sh.k, s),
                    "gemm");
      }
    }
    cuda::check(
        cuda::launch_gemm_bf16(gemm, x, lm_head, nullptr, y, /*y_f32=*/true, batch, V, D, s),
        "gemm");
  };
  const double gemm_ms = bench::graph_mean_ms(s, step_gemms, 50);

  // The average context mid-way through the timed steps (early requests decoded during the
  // later prefill steps).
  const int kv_len = context + static_cast<int>(prefill_steps / 2) + 4 + 15;
  const int pages_per_seq = (kv_len + page_size - 1) / page_size;
  std::vector<int32_t> q_indptr(batch + 1), kv_indptr(batch + 1), pages, last(batch);
  for (int b = 0; b <= batch; ++b) {
    q_indptr[b] = b;
    kv_indptr[b] = b * pages_per_seq;
  }
  for (int i = 0; i < batch * pages_per_seq; ++i) pages.push_back(i);
  for (int b = 0; b < batch; ++b) last[b] = kv_len - (pages_per_seq - 1) * page_size;
  // The page table as the engine hands it to attention: device tensors in an AttentionPlan.
  auto upload = [](const std::vector<int32_t>& v) {
    int32_t* p;
    cuda::check(cudaMalloc(&p, v.size() * 4), "malloc");
    cudaMemcpy(p, v.data(), v.size() * 4, cudaMemcpyHostToDevice);
    return Tensor::wrap(p, DType::kI32, {static_cast<int64_t>(v.size())}, Device::kCuda, {});
  };
  ops::AttentionPlan plan;
  plan.q_indptr = upload(q_indptr);
  plan.kv_indptr = upload(kv_indptr);
  plan.kv_page_indices = upload(pages);
  plan.kv_last_page_len = upload(last);
  plan.max_q_len = 1;
  plan.decode = true;
  const int64_t num_pages = int64_t{batch} * pages_per_seq;
  const pagedlm::Shape cache_shape = {num_pages, page_size, Hk, d};
  const Tensor kc = Tensor::zeros(DType::kBF16, cache_shape, Device::kCuda);
  const Tensor vc = Tensor::zeros(DType::kBF16, cache_shape, Device::kCuda);
  const Tensor q = Tensor::zeros(DType::kBF16, {batch, Hq, d}, Device::kCuda);
  const Tensor out = Tensor::empty(DType::kBF16, {batch, Hq, d}, Device::kCuda);
  int dev_id = 0;
  cudaGetDevice(&dev_id);
  plan.num_splits = ops::cuda::paged_attention_decode_num_splits(batch, Hk, d, kv_len, dev_id);
  plan.workspace_bytes = ops::cuda::paged_attention_workspace_bytes(batch, Hq, d, plan.num_splits);
  if (plan.workspace_bytes) {
    cuda::check(cudaMalloc(&plan.workspace, plan.workspace_bytes), "malloc");
    // As the engine runs it: the last block of a sequence's splits merges them.
    const size_t counter_bytes = sizeof(unsigned) * batch * Hk;
    cuda::check(cudaMalloc(&plan.merge_counters, counter_bytes), "malloc");
    cuda::check(cudaMemset(plan.merge_counters, 0, counter_bytes), "memset");
  }
  const AttentionVariant variant{1.f / std::sqrt(static_cast<float>(d))};
  auto step_attention = [&] {
    for (int l = 0; l < layers; ++l) ops::paged_attention(q, kc, vc, plan, variant, out, s);
  };
  const double attn_ms = bench::graph_mean_ms(s, step_attention, 50);

  // 3. Mixtures of experts: top-k over the router's logits, and the experts (two layers'
  // weights, used in turn: each is far larger than the L2).
  double route_ms = 0, experts_ms = 0, expert_bytes = 0;
  int sparse_layers = 0;
  for (int l = 0; l < layers; ++l) sparse_layers += c.layers[l].sparse_mlp ? 1 : 0;
  if (sparse_layers > 0) {
    const int Fe = static_cast<int>(c.moe.expert_intermediate_size);
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> uni(-1.f, 1.f);
    auto random_bf16 = [&](pagedlm::Shape shape, float scale) {
      Tensor t = Tensor::empty(DType::kBF16, shape);
      for (int64_t i = 0; i < t.numel(); ++i) t.data<uint16_t>()[i] = f32_to_bf16(scale * uni(rng));
      return t.to(Device::kCuda);
    };
    ops::ExpertWeights experts[2];
    for (ops::ExpertWeights& w : experts) {
      w.num_experts = E;
      w.hidden = D;
      w.ffn = Fe;
      w.gate_up = random_bf16({E, 2 * Fe, D}, 1.f / std::sqrt(static_cast<float>(D)));
      w.down = random_bf16({E, D, Fe}, 1.f / std::sqrt(static_cast<float>(Fe)));
    }
    std::vector<float> logits_host(static_cast<size_t>(batch) * E);
    for (float& v : logits_host) v = uni(rng);
    const Tensor logits = Tensor::from_f32(logits_host, {batch, E}).to(Device::kCuda);
    const Tensor ids = Tensor::empty(DType::kI32, {batch, k}, Device::kCuda);
    const Tensor weights_k = Tensor::empty(DType::kF32, {batch, k}, Device::kCuda);
    auto step_route = [&] {
      for (int l = 0; l < sparse_layers; ++l) {
        ops::moe_route(logits, c.moe.normalize_top_k, ids, weights_k, s);
      }
    };
    route_ms = bench::graph_mean_ms(s, step_route, 50);
    const Tensor xs = random_bf16({batch, D}, 1.f);
    const Tensor out_moe = Tensor::empty(DType::kBF16, {batch, D}, Device::kCuda);
    ops::MoeWorkspace ws;
    ws.plan =
        Tensor::empty(DType::kI32, {ops::moe_plan_size(int64_t{batch} * k, E)}, Device::kCuda);
    ws.act = Tensor::empty(DType::kBF16, {int64_t{batch} * k, Fe}, Device::kCuda);
    ws.expert_out = Tensor::empty(DType::kBF16, {int64_t{batch} * k, D}, Device::kCuda);
    ws.activated = Tensor::zeros(DType::kI32, {1}, Device::kCuda);
    auto step_experts = [&] {
      for (int l = 0; l < sparse_layers; ++l) {
        ops::moe_experts(xs, ids, weights_k, experts[l % 2], ops::GatedActivation::kSilu, ws,
                         out_moe, s);
      }
    };
    experts_ms = bench::graph_mean_ms(s, step_experts, 20);
    // The experts the routed batch activates, in every sparse layer.
    const Tensor host_ids = ids.to(Device::kCpu);
    std::vector<bool> used(E, false);
    for (int64_t i = 0; i < host_ids.numel(); ++i) used[host_ids.data<int32_t>()[i]] = true;
    const auto activated = std::count(used.begin(), used.end(), true);
    expert_bytes = 2.0 * sparse_layers * static_cast<double>(activated) * 3 * D * Fe;
    weight_bytes += static_cast<size_t>(expert_bytes);
    std::printf("experts: %d of %d activated by %d tokens (top %d) in each of %d layers\n",
                static_cast<int>(activated), E, batch, k, sparse_layers);
  }

  const double kv_bytes = 2.0 * layers * batch * kv_len * Hk * d * 2;
  const double bound_ms = (weight_bytes + kv_bytes) / (copy_gbs * 1e9) * 1e3;
  std::printf("decode step: batch %d, context %d, %d layers, splits %d\n", batch, kv_len, layers,
              plan.num_splits);
  std::printf("  step (engine, graphs, wall)  %8.3f ms  %8.0f tok/s\n", step_ms,
              batch / step_ms * 1e3);
  const double dense_bytes = static_cast<double>(weight_bytes) - expert_bytes;
  std::printf("  GEMMs alone                  %8.3f ms  (%.0f MB of weights: %.0f GB/s)\n", gemm_ms,
              dense_bytes / 1e6, dense_bytes / gemm_ms / 1e6);
  if (sparse_layers > 0) {
    std::printf("  router top-k alone           %8.3f ms\n", route_ms);
    std::printf("  experts alone                %8.3f ms  (%.0f MB of experts: %.0f GB/s)\n",
                experts_ms, expert_bytes / 1e6, expert_bytes / experts_ms / 1e6);
  }
  std::printf("  attention alone              %8.3f ms  (%.0f MB of KV: %.0f GB/s)\n", attn_ms,
              kv_bytes / 1e6, kv_bytes / attn_ms / 1e6);
  std::printf("  rest (step - the above)      %8.3f ms\n",
              step_ms - gemm_ms - attn_ms - route_ms - experts_ms);
  std::printf("  bandwidth lower bound        %8.3f ms  (weights + KV at %.0f GB/s)\n", bound_ms,
              copy_gbs);
  return 0;
}
