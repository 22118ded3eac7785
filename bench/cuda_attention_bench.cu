// Decode attention bandwidth on long contexts, against the device's measured copy bandwidth.
// Each configuration reads far more K/V than the L2 holds (60 MB on an H200), so repeated
// launches stream from HBM. Pages are shuffled so reads are scattered as in a live cache.
// Times: CUDA events, 3 warm-ups, median of 20 runs. Prints one table to stdout. Rows with a
// sliding window ("w" after the context) count only the keys inside the windows as read.
// Arguments: "short" (below), "e4m3" (the caches in e4m3, one byte per value, as
// --kv-cache-dtype fp8 stores them; bandwidth counts those bytes).

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "cuda_timing.h"
#include "pagedlm/ops/cuda/kernels.h"

namespace {

using namespace pagedlm::cuda;

// The caches' format and bytes per value (main sets both from its arguments).
KvCacheFormat g_kv;
size_t g_kv_bytes = 2;

void check(cudaError_t err, const char* what, int line) {
  if (err != cudaSuccess) {
    std::fprintf(stderr, "%s (line %d): %s\n", what, line, cudaGetErrorString(err));
    std::exit(1);
  }
}
#define CK(expr) check((expr), #expr, __LINE__)

// Median of 20 launches after 3 warm-ups, on the default stream.
template <typename F>
double median_ms(F&& fn) {
  return pagedlm::bench::median_ms(nullptr, fn, 3, 20);
}

// A device copy of a host index array (freed by the caller).
int32_t* upload(const std::vector<int32_t>& host) {
  int32_t* dev = nullptr;
  CK(cudaMalloc(&dev, host.size() * sizeof(int32_t)));
  CK(cudaMemcpy(dev, host.data(), host.size() * sizeof(int32_t), cudaMemcpyHostToDevice));
  return dev;
}

double copy_bandwidth() {
  const size_t bytes = size_t{4} << 30;
  void *src, *dst;
  CK(cudaMalloc(&src, bytes));
  CK(cudaMalloc(&dst, bytes));
  CK(cudaMemset(src, 1, bytes));
  const double ms =
      median_ms([&] { CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice)); });
  CK(cudaFree(src));
  CK(cudaFree(dst));
  return 2.0 * bytes / (ms * 1e-3);  // read + written
}

struct Config {
  int batch, ctx, hq, hk, d, page_size;
  int ctx_min = 0;  // > 0: each sequence's length uniform in [ctx_min, ctx] (seeded)
  int window = 0;   // the variant's sliding window (0: none)
  float softcap = 0.f;
  pagedlm::AttentionVariant variant() const { return {0.088f, window, softcap}; }
  std::string ctx_name() const {
    return (ctx_min > 0 ? std::to_string(ctx_min) + "-" : "") + std::to_string(ctx) +
           (window > 0 ? "w" + std::to_string(window) : "") + (softcap > 0.f ? "c" : "");
  }
};

// Sequence lengths of a case: all `ctx`, or uniform in [ctx_min, ctx].
std::vector<int> lengths_of(const Config& c, std::mt19937& rng) {
  std::vector<int> len(c.batch, c.ctx);
  if (c.ctx_min > 0) {
    std::uniform_int_distribution<int> dist(c.ctx_min, c.ctx);
    for (int& n : len) n = dist(rng);
  }
  return len;
}

// A sequence of a prefill launch: its new tokens (the last of its keys) and all its keys.
struct PrefillSeq {
  int new_tokens, keys;
};

// Median ms of the prefill kernel over `seqs` (pages in order, zero data); with
// leading_decodes > 0, of the decode kernel over those first sequences (one new token each) and
// the prefill kernel over the rest, as the engine launches a mixed step.
double prefill_launch_ms(const std::vector<PrefillSeq>& seqs, int hq, int hk, int d, int ps,
                         int leading_decodes = 0,
                         const pagedlm::AttentionVariant& variant = {0.088f}) {
  const int n = static_cast<int>(seqs.size());
  std::vector<int32_t> qi(n + 1, 0), ki(n + 1, 0), ll(n);
  int max_new = 0;
  for (int b = 0; b < n; ++b) {
    const int pages = (seqs[b].keys + ps - 1) / ps;
    qi[b + 1] = qi[b] + seqs[b].new_tokens;
    ki[b + 1] = ki[b] + pages;
    ll[b] = seqs[b].keys - (pages - 1) * ps;
    max_new = std::max(max_new, seqs[b].new_tokens);
  }
  const size_t cache_elems = static_cast<size_t>(ki[n]) * ps * hk * d;
  const size_t q_elems = static_cast<size_t>(qi[n]) * hq * d;
  void *kc, *vc, *q, *out;
  CK(cudaMalloc(&kc, cache_elems * g_kv_bytes));
  CK(cudaMalloc(&vc, cache_elems * g_kv_bytes));
  CK(cudaMalloc(&q, q_elems * 2));
  CK(cudaMalloc(&out, q_elems * 2));
  CK(cudaMemset(kc, 0, cache_elems * g_kv_bytes));
  CK(cudaMemset(vc, 0, cache_elems * g_kv_bytes));
  CK(cudaMemset(q, 0, q_elems * 2));
  std::vector<int32_t> pages(ki[n]);
  std::iota(pages.begin(), pages.end(), 0);
  int32_t *qi_d = upload(qi), *ki_d = upload(ki), *pg_d = upload(pages), *ll_d = upload(ll);
  const int nd = leading_decodes;
  const double ms = median_ms([&] {
    if (nd > 0) {
      CK(launch_paged_attention_decode(q, kc, vc, qi_d, ki_d, pg_d, ll_d, out, nd, qi[n], 1, hq, hk,
                                       d, ps, variant, 1, nullptr, 0, nullptr, nullptr, nullptr,
                                       g_kv));
    }
    CK(launch_paged_attention_prefill(q, kc, vc, qi_d + nd, ki_d + nd, pg_d, ll_d + nd, out, n - nd,
                                      qi[n], max_new, hq, hk, d, ps, variant, nullptr, g_kv));
  });
  for (void* p : {kc, vc, q, out}) CK(cudaFree(p));
  for (int32_t* p : {qi_d, ki_d, pg_d, ll_d}) CK(cudaFree(p));
  return ms;
}

}  // namespace

int main(int argc, char** argv) {
  // "short": only the contexts of up to 1024 keys and the prefill cases.
  bool short_only = false;
  for (int i = 1; i < argc; ++i) {
    const std::string arg = argv[i];
    short_only |= arg == "short";
    if (arg == "e4m3") {
      g_kv.e4m3 = true;
      g_kv_bytes = 1;
    }
  }
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess || n == 0) {
    std::printf("no CUDA device\n");
    return 0;
  }
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, 0));
  const DeviceLimits* limits = nullptr;
  CK(current_device_limits(&limits));
  const double copy_bw = copy_bandwidth();
  std::printf(
      "device %s, %d SMs, kernels' shared memory %zu KB per block%s; D2D copy %.0f GB/s "
      "(read + write); %s caches\n",
      prop.name, prop.multiProcessorCount, limits->smem_per_block / 1024,
      limits->smem_cap_kb > 0 ? " (PAGEDLM_CUDA_SMEM_CAP_KB)" : "", copy_bw / 1e9,
      g_kv.e4m3 ? "e4m3" : "bf16");

  const std::vector<Config> configs = {
      {64, 4096, 32, 8, 128, 16},
      {64, 16384, 32, 8, 128, 16},
      {64, 32768, 32, 8, 128, 16},
      {128, 8192, 32, 8, 128, 16},
      {256, 4096, 32, 8, 128, 16},
      {256, 8192, 32, 8, 128, 64},
      {32, 32768, 32, 8, 128, 32},
      {64, 8192, 9, 3, 64, 16},
      {256, 4096, 9, 3, 64, 16},
      {128, 32768, 9, 3, 64, 16},
      {8, 32768, 32, 8, 128, 16},
      // The random workload's decode steps (256 sequences, ~700 keys on average).
      {256, 512, 32, 8, 128, 16},
      {256, 768, 32, 8, 128, 16},
      {256, 1024, 32, 8, 128, 16},
      {256, 768, 9, 3, 64, 16},
      // Mid-run decode steps of the random workload: prompts of 100-1024 plus up to 256 new
      // tokens, longest sequences started first (as the engine orders them).
      {256, 1280, 32, 8, 128, 16, 100},
      {256, 1280, 9, 3, 64, 16, 100},
      // head_dim 256 (Gemma 2 2B's heads), plain, then its local layers' window and soft-cap
      // over long contexts (about 4096 keys read per sequence), and a 1024-key window.
      {64, 4096, 8, 4, 256, 16},
      {64, 32768, 8, 4, 256, 16},
      {256, 1024, 8, 4, 256, 16},
      {64, 32768, 8, 4, 256, 16, 0, 4096, 50.f},
      {64, 32768, 32, 8, 128, 16, 0, 1024},
      // head_dim 96 (Phi-3-mini: 32 q heads, 32 kv heads) and 80.
      {64, 4096, 32, 32, 96, 16},
      {256, 1024, 32, 32, 96, 16},
      {64, 4096, 32, 8, 80, 16},
  };
  std::printf("%-6s %-9s %-3s %-3s %-4s %-3s | %-7s %9s %8s %6s | %-7s %9s %6s\n", "batch", "ctx",
              "Hq", "Hk", "d", "ps", "splits", "us", "GB/s", "%copy", "best_s", "GB/s", "%copy");
  std::mt19937 rng(1);
  for (const Config& c : configs) {
    if (short_only && c.ctx_min == 0 && c.ctx > 1024) continue;
    const std::vector<int> len = lengths_of(c, rng);
    std::vector<int32_t> qi(c.batch + 1), ki(c.batch + 1, 0), ll(c.batch), order(c.batch);
    for (int b = 0; b < c.batch; ++b) {
      const int pages = (len[b] + c.page_size - 1) / c.page_size;
      ki[b + 1] = ki[b] + pages;
      ll[b] = len[b] - (pages - 1) * c.page_size;
    }
    const int num_pages = ki[c.batch];
    const size_t cache_elems = static_cast<size_t>(num_pages) * c.page_size * c.hk * c.d;
    void *kc, *vc, *q, *out;
    CK(cudaMalloc(&kc, cache_elems * g_kv_bytes));
    CK(cudaMalloc(&vc, cache_elems * g_kv_bytes));
    CK(cudaMemset(kc, 0, cache_elems * g_kv_bytes));
    CK(cudaMemset(vc, 0, cache_elems * g_kv_bytes));
    CK(cudaMalloc(&q, static_cast<size_t>(c.batch) * c.hq * c.d * 2));
    CK(cudaMalloc(&out, static_cast<size_t>(c.batch) * c.hq * c.d * 2));
    CK(cudaMemset(q, 0, static_cast<size_t>(c.batch) * c.hq * c.d * 2));
    std::vector<int32_t> pages(num_pages);
    std::iota(qi.begin(), qi.end(), 0);
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return len[a] > len[b]; });
    std::iota(pages.begin(), pages.end(), 0);
    std::shuffle(pages.begin(), pages.end(), rng);
    int32_t *qi_d = upload(qi), *ki_d = upload(ki), *pg_d = upload(pages), *ll_d = upload(ll),
            *order_d = upload(order);
    const int max_splits = 64;
    const size_t ws_bytes = paged_attention_workspace_bytes(c.batch, c.hq, c.d, max_splits);
    void* ws;
    CK(cudaMalloc(&ws, ws_bytes));
    double keys_read = 0;
    for (const int n : len) keys_read += c.window > 0 ? std::min(n, c.window) : n;
    const double kv_bytes = 2.0 * keys_read * c.hk * c.d * static_cast<double>(g_kv_bytes);
    auto run = [&](int splits) {
      return median_ms([&] {
        CK(launch_paged_attention_decode(q, kc, vc, qi_d, ki_d, pg_d, ll_d, out, c.batch, c.batch,
                                         1, c.hq, c.hk, c.d, c.page_size, c.variant(), splits, ws,
                                         ws_bytes, order_d, nullptr, nullptr, g_kv));
      });
    };
    const int heur = paged_attention_decode_num_splits(c.batch, c.hk, c.d, c.ctx, *limits);
    const double t_heur = run(heur);
    int best_s = heur;
    double best_t = t_heur;
    for (int s : {1, 2, 4, 8, 16, 32}) {
      const double t = run(s);
      if (t < best_t) {
        best_t = t;
        best_s = s;
      }
    }
    const double bw_h = kv_bytes / (t_heur * 1e-3), bw_b = kv_bytes / (best_t * 1e-3);
    const std::string ctx = c.ctx_name();
    std::printf("%-6d %-9s %-3d %-3d %-4d %-3d | %-7d %9.1f %8.0f %5.1f%% | %-7d %9.0f %5.1f%%\n",
                c.batch, ctx.c_str(), c.hq, c.hk, c.d, c.page_size, heur, t_heur * 1e3, bw_h / 1e9,
                100 * bw_h / copy_bw, best_s, bw_b / 1e9, 100 * bw_b / copy_bw);
    for (void* p : {kc, vc, q, out, ws}) CK(cudaFree(p));
    for (int32_t* p : {qi_d, ki_d, pg_d, ll_d, order_d}) CK(cudaFree(p));
  }

  // Prefill: causal self-attention over fresh prompts, reported as TFLOP/s (4 * d * Hq per
  // (query, visible key) pair: n^2/2 pairs per prompt without a window).
  std::printf("\nprefill (causal, no prefix)\n%-6s %-9s %-3s %-3s %-4s | %9s %8s\n", "batch", "len",
              "Hq", "Hk", "d", "ms", "TFLOP/s");
  // The 16384- and 65536-token prompts: the long-context rows (Llama-3.1-8B's heads). The last
  // three: a 16384-token prefill step of the random workload (prompts of ~560 tokens; then of
  // 100-1024).
  for (const Config& c : std::vector<Config>{{4, 4096, 32, 8, 128, 16},
                                             {1, 16384, 32, 8, 128, 16},
                                             {1, 65536, 32, 8, 128, 16},
                                             {16, 1024, 9, 3, 64, 16},
                                             {29, 565, 32, 8, 128, 16},
                                             {29, 565, 9, 3, 64, 16},
                                             {29, 1024, 32, 8, 128, 16, 100},
                                             {4, 4096, 8, 4, 256, 16},
                                             {4, 4096, 32, 32, 96, 16},
                                             {4, 4096, 32, 8, 80, 16},
                                             {4, 8192, 8, 4, 256, 16, 0, 4096, 50.f}}) {
    const std::vector<int> len = lengths_of(c, rng);
    std::vector<PrefillSeq> seqs;
    double pairs = 0;
    for (const int n : len) {
      seqs.push_back({n, n});
      // Windowed: the rows before the window fills, then full windows.
      const double w = std::min(n, c.window);
      pairs += c.window > 0 ? w * (w + 1) / 2 + (n - w) * w : static_cast<double>(n) * n / 2;
    }
    const double ms = prefill_launch_ms(seqs, c.hq, c.hk, c.d, c.page_size, 0, c.variant());
    const double flops = 4.0 * pairs * c.d * c.hq;
    const std::string lens = c.ctx_name();
    std::printf("%-6d %-9s %-3d %-3d %-4d | %9.3f %8.1f\n", c.batch, lens.c_str(), c.hq, c.hk, c.d,
                ms, flops / (ms * 1e-3) / 1e12);
  }

  // A later prefill step of the random workload: 29 prompts (100-1024 tokens) and the decode
  // rows of the sequences prefilled before (one new token each, 100-1024 keys), in one launch,
  // against each part alone (Llama-3.1-8B heads).
  auto prefill_ms = [](const std::vector<PrefillSeq>& seqs, int leading_decodes = 0) {
    return prefill_launch_ms(seqs, 32, 8, 128, 16, leading_decodes);
  };
  std::uniform_int_distribution<int> len_dist(100, 1024);
  std::vector<PrefillSeq> prompts, decodes;
  for (int b = 0; b < 29; ++b) {
    const int len = len_dist(rng);
    prompts.push_back({len, len});
  }
  for (int b = 0; b < 200; ++b) decodes.push_back({1, len_dist(rng) + 1});
  std::vector<PrefillSeq> mixed = decodes;
  mixed.insert(mixed.end(), prompts.begin(), prompts.end());
  const double t_mixed = prefill_ms(mixed), t_prompts = prefill_ms(prompts);
  const double t_decodes = prefill_ms(decodes), t_split = prefill_ms(mixed, 200);
  std::printf(
      "\nprefill step with decode rows (32/8, d 128): 200 decode rows + 29 prompts %.3f ms,"
      " prompts alone %.3f ms, decode rows alone %.3f ms; decode rows through the decode"
      " kernel, then the prompts (the engine's launches) %.3f ms\n",
      t_mixed, t_prompts, t_decodes, t_split);
  return 0;
}
