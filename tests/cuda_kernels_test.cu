// What needs the raw launchers (ops/cuda/kernels.h); every op's cases through its ops:: entry
// point, on the CPU and CUDA, are in tests/backend_ops_test.cc. Here: CUDA graph capture of the
// decode launch replayed after the page table changes, the split-count heuristic on the device's
// real multiprocessor count, the decode kernel's several-token rows (outside AttentionPlan's
// contract), launch refusals, and cuBLASLt's GEMM plan tuning. Attention is checked against a
// double-precision loop over contiguous K/V gathered from the same bf16 pages, outputs poisoned
// (NaN) first so that an unwritten element fails. Skips cleanly on machines without a GPU.

#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <vector>

#include "pagedlm/ops/cuda/kernels.h"

// A named namespace: gtest's registration statics in an unnamed one trip nvcc warning 177.
namespace pagedlm::cuda::kernels_test {

bool has_gpu() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

#define SKIP_WITHOUT_GPU() \
  if (!has_gpu()) GTEST_SKIP() << "no CUDA device"

void check(cudaError_t err, const char* what) {
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + ": " + cudaGetErrorString(err));
  }
}
#define CK(expr) check((expr), #expr)

uint16_t f2bf(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
float bf2f(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

template <typename T>
class DevBuf {
 public:
  explicit DevBuf(size_t n) : n_(n) { CK(cudaMalloc(&p_, std::max<size_t>(n, 1) * sizeof(T))); }
  explicit DevBuf(const std::vector<T>& v) : DevBuf(v.size()) { upload(v); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  ~DevBuf() { cudaFree(p_); }
  T* get() const { return p_; }
  void upload(const std::vector<T>& v) {
    CK(cudaMemcpy(p_, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  }
  std::vector<T> download() const {
    std::vector<T> v(n_);
    CK(cudaMemcpy(v.data(), p_, n_ * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
  }
  void poison() { CK(cudaMemset(p_, 0xFF, n_ * sizeof(T))); }

 private:
  T* p_ = nullptr;
  size_t n_;
};

std::vector<uint16_t> random_bf16(size_t n, std::mt19937& rng, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = f2bf(dist(rng));
  return v;
}

struct ErrStats {
  double diff2 = 0, ref2 = 0;
  int64_t non_finite = 0;
  void add(double got, double ref) {
    if (!std::isfinite(got)) {
      ++non_finite;
      return;
    }
    diff2 += (got - ref) * (got - ref);
    ref2 += ref * ref;
  }
  double rel() const { return std::sqrt(diff2 / std::max(ref2, 1e-30)); }
};

// ------------------------------------------------------------------------------------------
// Paged attention.
// ------------------------------------------------------------------------------------------

struct AttnCase {
  std::vector<int> n_new;  // query rows per sequence (0 = padding sequence)
  std::vector<int> n_ctx;  // cached keys before the new tokens
  int num_q_heads = 8, num_kv_heads = 8, head_dim = 128, page_size = 16;
  bool decode = false;
  int num_splits = 1;        // decode only; 0 = the heuristic
  bool padded_tail = false;  // extra sequences with no rows and no pages
  // Runs of sequences that share leading pages: {first, count, pages} gives sequences first+1 ..
  // first+count-1 the first `pages` pages of sequence `first` (as prefix-cache hits do).
  std::vector<std::array<int, 3>> shared;
  bool cascade = false;   // decode with the shared-prefix pass over the `shared` runs
  int shared_splits = 0;  // 0 = the heuristic
  int window = 0;         // the variant's sliding window
  float softcap = 0.f;    // the variant's soft-cap
  float scale = 0.f;      // the variant's scale; 0 = head_dim^-0.5
  AttentionVariant variant() const {
    return {scale > 0.f ? scale : 1.f / std::sqrt(static_cast<float>(head_dim)), window, softcap};
  }
  std::string name() const {
    return "B=" + std::to_string(n_new.size()) + " Hq=" + std::to_string(num_q_heads) +
           " Hk=" + std::to_string(num_kv_heads) + " d=" + std::to_string(head_dim) +
           " ps=" + std::to_string(page_size) + (decode ? " decode splits=" : " prefill") +
           (decode ? std::to_string(num_splits) : "") +
           (cascade ? " cascade splits=" + std::to_string(shared_splits) : "") +
           (window > 0 ? " window=" + std::to_string(window) : "") +
           (softcap > 0.f ? " softcap=" + std::to_string(softcap) : "");
  }
};

// The first key a query at position pos sees (HF: kv_idx > q_idx - sliding_window).
int first_visible_key(const AttentionVariant& v, int pos) {
  return v.window > 0 ? std::max(0, pos - v.window + 1) : 0;
}

// One query row's attention over keys lo .. hi-1 in float64: key s's row of k and v starts at
// s * kv_stride; acc gets the output row.
void reference_attention(const uint16_t* q, const float* k, const float* v, size_t kv_stride, int D,
                         int lo, int hi, const AttentionVariant& var, std::vector<double>& acc) {
  std::vector<double> p(hi - lo);
  double mx = -1e300;
  for (int s = lo; s < hi; ++s) {
    double dot = 0;
    for (int i = 0; i < D; ++i) dot += static_cast<double>(bf2f(q[i])) * k[s * kv_stride + i];
    double score = dot * var.scale;
    if (var.softcap > 0.f) score = var.softcap * std::tanh(score / var.softcap);
    mx = std::max(mx, p[s - lo] = score);
  }
  double sum = 0;
  for (double& x : p) sum += (x = std::exp(x - mx));
  acc.assign(D, 0.0);
  for (int s = lo; s < hi; ++s) {
    for (int i = 0; i < D; ++i) acc[i] += p[s - lo] * v[s * kv_stride + i];
  }
  for (double& x : acc) x /= sum;
}

struct AttnData {
  std::vector<uint16_t> q, k_cache, v_cache;
  std::vector<int32_t> q_indptr, kv_indptr, pages, last_len;
  int num_tokens = 0, num_seqs = 0, max_q_len = 0, max_kv = 0, num_pages = 0;
};

AttnData build(const AttnCase& c, std::mt19937& rng) {
  AttnData d;
  const int B = static_cast<int>(c.n_new.size());
  d.num_seqs = B + (c.padded_tail ? 3 : 0);
  d.q_indptr = {0};
  d.kv_indptr = {0};
  int total_pages = 0;
  std::vector<int> pages_per_seq;
  for (int b = 0; b < B; ++b) {
    const int n_kv = c.n_new[b] + c.n_ctx[b];
    const int np = n_kv > 0 ? (n_kv + c.page_size - 1) / c.page_size : 0;
    pages_per_seq.push_back(np);
    total_pages += np;
  }
  d.num_pages = total_pages + 5;  // spare pages hold garbage that must never be read
  std::vector<int32_t> perm(d.num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  int next = 0;
  for (int b = 0; b < B; ++b) {
    const int n_kv = c.n_new[b] + c.n_ctx[b];
    for (int i = 0; i < pages_per_seq[b]; ++i) d.pages.push_back(perm[next++]);
    d.kv_indptr.push_back(static_cast<int32_t>(d.pages.size()));
    d.last_len.push_back(n_kv > 0 ? n_kv - (pages_per_seq[b] - 1) * c.page_size : 0);
    d.q_indptr.push_back(d.q_indptr.back() + c.n_new[b]);
    d.max_q_len = std::max(d.max_q_len, c.n_new[b]);
    d.max_kv = std::max(d.max_kv, n_kv);
  }
  for (const auto& [first, count, pages] : c.shared) {
    for (int b = first + 1; b < first + count; ++b) {
      std::copy_n(d.pages.begin() + d.kv_indptr[first], pages, d.pages.begin() + d.kv_indptr[b]);
    }
  }
  for (int b = B; b < d.num_seqs; ++b) {
    d.kv_indptr.push_back(d.kv_indptr.back());
    d.last_len.push_back(0);
    d.q_indptr.push_back(d.q_indptr.back());
  }
  d.num_tokens = d.q_indptr.back();
  const size_t slot = static_cast<size_t>(c.num_kv_heads) * c.head_dim;
  d.q = random_bf16(static_cast<size_t>(d.num_tokens) * c.num_q_heads * c.head_dim, rng, -2, 2);
  d.k_cache = random_bf16(static_cast<size_t>(d.num_pages) * c.page_size * slot, rng);
  d.v_cache = random_bf16(static_cast<size_t>(d.num_pages) * c.page_size * slot, rng);
  // Keys before every row's window are NaN: a kernel that loads them at all (rather than
  // skipping their tiles) multiplies a NaN value by a zero probability and fails. Pages shared
  // between sequences stay clean (another member's window may cover them).
  if (c.window > 0 && c.shared.empty()) {
    for (int b = 0; b < B; ++b) {
      const int unseen = first_visible_key(c.variant(), c.n_ctx[b]);
      for (int pos = 0; pos < unseen; ++pos) {
        const size_t at =
            (static_cast<size_t>(d.pages[d.kv_indptr[b] + pos / c.page_size]) * c.page_size +
             pos % c.page_size) *
            slot;
        std::fill_n(d.k_cache.begin() + at, slot, uint16_t{0x7fc0});
        std::fill_n(d.v_cache.begin() + at, slot, uint16_t{0x7fc0});
      }
    }
  }
  return d;
}

// Returns the relative Frobenius error over the checked rows; counts non-finite outputs over
// all rows (every row of every sequence must be written).
ErrStats run_attention(const AttnCase& c, uint32_t seed) {
  std::mt19937 rng(seed);
  AttnData d = build(c, rng);
  const int D = c.head_dim, Hq = c.num_q_heads, Hk = c.num_kv_heads, G = Hq / Hk;
  DevBuf<uint16_t> q(d.q), kc(d.k_cache), vc(d.v_cache);
  DevBuf<int32_t> qi(d.q_indptr), ki(d.kv_indptr), pg(d.pages), ll(d.last_len);
  DevBuf<uint16_t> out(static_cast<size_t>(d.num_tokens) * Hq * D);
  out.poison();
  const AttentionVariant variant = c.variant();
  if (c.decode) {
    int splits = c.num_splits;
    const DeviceLimits* device = nullptr;
    CK(current_device_limits(&device));
    if (splits == 0)
      splits = paged_attention_decode_num_splits(d.num_seqs, Hk, D, d.max_kv, *device);
    // The shared pass's arrays, built from the runs as kernels.h documents them.
    const int per_item = shared_prefix_members_per_item(Hq, Hk);
    std::vector<int32_t> kv_skip(d.num_seqs, 0), items, members;
    for (const auto& [first, count, pages] : c.shared) {
      for (int i = 0; i < count; i += per_item) {
        const int n = std::min(per_item, count - i);
        items.insert(items.end(), {static_cast<int32_t>(members.size()), n, d.kv_indptr[first],
                                   pages * c.page_size});
        for (int b = first + i; b < first + i + n; ++b) {
          members.push_back(b);
          kv_skip[b] = pages * c.page_size;
        }
      }
    }
    const int max_items = d.num_seqs;
    const std::vector<int32_t> num_items = {static_cast<int32_t>(items.size() / 4)};
    items.resize(static_cast<size_t>(max_items) * 4, -7);  // unused items: never read
    members.resize(d.num_seqs, -7);
    SharedPrefixPass pass;
    pass.max_items = max_items;
    pass.num_splits =
        c.shared_splits > 0
            ? c.shared_splits
            : shared_prefix_num_splits((d.num_seqs + per_item - 1) / per_item, Hk, *device);
    DevBuf<int32_t> skip_d(kv_skip), n_items_d(num_items), items_d(items), members_d(members);
    pass.kv_skip = skip_d.get();
    pass.num_items = n_items_d.get();
    pass.items = items_d.get();
    pass.members = members_d.get();
    const int slots = splits + (c.cascade ? pass.num_splits : 0);
    // Blocks start longest sequence first, as the engine orders them.
    std::vector<int32_t> order_h(d.num_seqs);
    std::iota(order_h.begin(), order_h.end(), 0);
    auto keys = [&](int b) { return d.kv_indptr[b + 1] - d.kv_indptr[b]; };
    std::stable_sort(order_h.begin(), order_h.end(),
                     [&](int a, int b) { return keys(a) > keys(b); });
    DevBuf<int32_t> order(order_h);
    const size_t ws_bytes = paged_attention_workspace_bytes(d.num_tokens, Hq, D, slots);
    DevBuf<char> ws(ws_bytes);
    ws.poison();
    CK(launch_paged_attention_decode(q.get(), kc.get(), vc.get(), qi.get(), ki.get(), pg.get(),
                                     ll.get(), out.get(), d.num_seqs, d.num_tokens, d.max_q_len, Hq,
                                     Hk, D, c.page_size, variant, splits, ws.get(), ws_bytes,
                                     order.get(), c.cascade ? &pass : nullptr, nullptr));
    CK(cudaDeviceSynchronize());
    // The same launch with the merge in the decode blocks (the engine's way where it applies):
    // the same bits, every counter zero again; twice, so that the second run starts from the
    // counters the first left.
    const std::vector<uint16_t> merged_by_kernel = out.download();
    DevBuf<unsigned> counters(std::vector<unsigned>(static_cast<size_t>(d.num_seqs) * Hk, 0u));
    for (int run = 0; run < 2; ++run) {
      out.poison();
      ws.poison();
      CK(launch_paged_attention_decode(
          q.get(), kc.get(), vc.get(), qi.get(), ki.get(), pg.get(), ll.get(), out.get(),
          d.num_seqs, d.num_tokens, d.max_q_len, Hq, Hk, D, c.page_size, variant, splits, ws.get(),
          ws_bytes, order.get(), c.cascade ? &pass : nullptr, nullptr, {}, counters.get()));
      CK(cudaDeviceSynchronize());
      EXPECT_TRUE(out.download() == merged_by_kernel) << c.name() << ", run " << run;
      const std::vector<unsigned> left = counters.download();
      EXPECT_EQ(std::count(left.begin(), left.end(), 0u), static_cast<ptrdiff_t>(left.size()))
          << c.name() << ": counters left non-zero";
    }
  } else {
    CK(launch_paged_attention_prefill(q.get(), kc.get(), vc.get(), qi.get(), ki.get(), pg.get(),
                                      ll.get(), out.get(), d.num_seqs, d.num_tokens, d.max_q_len,
                                      Hq, Hk, D, c.page_size, variant, nullptr));
    CK(cudaDeviceSynchronize());
  }
  const std::vector<uint16_t> got = out.download();

  ErrStats st;
  for (uint16_t v : got) {
    if (!std::isfinite(bf2f(v))) ++st.non_finite;
  }
  // Reference on contiguous K/V; long sequences check a sample of rows to bound CPU time.
  std::vector<float> kf, vf;
  std::vector<double> acc;
  for (size_t b = 0; b < c.n_new.size(); ++b) {
    const int n_new = c.n_new[b], n_kv = n_new + c.n_ctx[b];
    kf.assign(static_cast<size_t>(n_kv) * Hk * D, 0.f);
    vf.assign(kf.size(), 0.f);
    for (int pos = 0; pos < n_kv; ++pos) {
      const int page = d.pages[d.kv_indptr[b] + pos / c.page_size];
      const size_t src = (static_cast<size_t>(page) * c.page_size + pos % c.page_size) * Hk * D;
      for (size_t i = 0; i < static_cast<size_t>(Hk) * D; ++i) {
        kf[pos * Hk * D + i] = bf2f(d.k_cache[src + i]);
        vf[pos * Hk * D + i] = bf2f(d.v_cache[src + i]);
      }
    }
    const int step = n_new > 64 ? 13 : 1;
    for (int j = 0; j < n_new; ++j) {
      if (j % step != 0 && j < n_new - 3) continue;
      const int token = d.q_indptr[b] + j;
      const int pos = n_kv - n_new + j;
      for (int h = 0; h < Hq; ++h) {
        const int hk = h / G;
        reference_attention(&d.q[(static_cast<size_t>(token) * Hq + h) * D], &kf[hk * D],
                            &vf[hk * D], static_cast<size_t>(Hk) * D, D,
                            first_visible_key(variant, pos), pos + 1, variant, acc);
        for (int i = 0; i < D; ++i) {
          st.add(bf2f(got[(static_cast<size_t>(token) * Hq + h) * D + i]), acc[i]);
        }
      }
    }
  }
  return st;
}

void expect_attention(const AttnCase& c, uint32_t seed = 1) {
  const ErrStats st = run_attention(c, seed);
  EXPECT_EQ(st.non_finite, 0) << c.name();
  EXPECT_LE(st.rel(), 1e-2) << c.name();
  std::printf("  %-60s rel_err=%.2e\n", c.name().c_str(), st.rel());
}

std::vector<int> repeat(int n, int v) { return std::vector<int>(n, v); }

// The split-count heuristic on this device's real multiprocessor count (tests/backend_ops_test.cc
// asks it about a fixed count): 300 sequences of random lengths, and a few up to 4096 keys.
TEST(CudaAttention, DecodeSplitHeuristic) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(3);
  AttnCase c;
  c.decode = true;
  for (int b = 0; b < 300; ++b) {
    c.n_new.push_back(1);
    c.n_ctx.push_back(static_cast<int>(rng() % 2000));
  }
  c.num_q_heads = 9;
  c.num_kv_heads = 3;
  c.head_dim = 64;
  c.num_splits = 0;
  expect_attention(c);
  c.n_new = repeat(5, 1);
  c.n_ctx = {0, 6, 32, 999, 4096};
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_size = 32;
  expect_attention(c);
}

// A few new tokens per sequence through the decode kernel (max_q_len > 1, e.g. speculative
// tokens), which AttentionPlan's decode steps never ask for: plain, and with per-row windows.
TEST(CudaAttention, DecodeSeveralTokensPerSequence) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.decode = true;
  c.n_new = {1, 2, 3, 1};
  c.n_ctx = {100, 7, 4000, 0};
  c.num_q_heads = 4;
  c.num_kv_heads = 1;
  c.head_dim = 128;
  c.num_splits = 5;
  expect_attention(c);
  c.head_dim = 256;
  c.softcap = 1.5f;
  for (int window : {2, 600}) {
    c.window = window;
    expect_attention(c, window);
  }
}

// The decode launch is captured once and replayed after the page table changes on the device:
// the launch shape must not depend on the lengths (nor, with a window, on where windows start).
// merge_in_blocks: with merge counters, which each replay must leave zero for the next.
void expect_graph_replay(const AttentionVariant& variant, bool merge_in_blocks) {
  const int B = 4, Hq = 8, Hk = 2, D = 128, ps = 16, splits = 8, num_pages = 64;
  std::mt19937 rng(11);
  auto kc_h = random_bf16(static_cast<size_t>(num_pages) * ps * Hk * D, rng);
  auto vc_h = random_bf16(kc_h.size(), rng);
  auto q_h = random_bf16(static_cast<size_t>(B) * Hq * D, rng);
  DevBuf<uint16_t> kc(kc_h), vc(vc_h), q(q_h), out(static_cast<size_t>(B) * Hq * D);
  std::vector<int32_t> qi_h = {0, 1, 2, 3, 4};
  DevBuf<int32_t> qi(qi_h), ki(B + 1), pg(num_pages), ll(B);
  const size_t ws_bytes = paged_attention_workspace_bytes(B, Hq, D, splits);
  DevBuf<char> ws(ws_bytes);
  DevBuf<unsigned> counters(std::vector<unsigned>(B * Hk, 0u));

  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  CK(launch_paged_attention_decode(q.get(), kc.get(), vc.get(), qi.get(), ki.get(), pg.get(),
                                   ll.get(), out.get(), B, B, 1, Hq, Hk, D, ps, variant, splits,
                                   ws.get(), ws_bytes, nullptr, nullptr, stream, {},
                                   merge_in_blocks ? counters.get() : nullptr));
  CK(cudaStreamEndCapture(stream, &graph));
  CK(cudaGraphInstantiate(&exec, graph, 0));

  for (int round = 0; round < 2; ++round) {
    // Round 0: lengths {1, 17, 300, 600}; round 1: {900, 1, 0 rows (padding), 33}.
    std::vector<int> n_kv =
        round == 0 ? std::vector<int>{1, 17, 300, 600} : std::vector<int>{900, 1, 0, 33};
    std::vector<int32_t> ki_h = {0}, pg_h, ll_h;
    std::vector<int32_t> qi_round = {0};
    int next = 0;
    for (int b = 0; b < B; ++b) {
      const int np = (n_kv[b] + ps - 1) / ps;
      for (int i = 0; i < np; ++i) pg_h.push_back((next++ * 7 + round) % num_pages);
      ki_h.push_back(static_cast<int32_t>(pg_h.size()));
      ll_h.push_back(n_kv[b] - (np > 0 ? (np - 1) * ps : 0));
      qi_round.push_back(qi_round.back() + (n_kv[b] > 0 ? 1 : 0));
    }
    pg_h.resize(num_pages, 0);
    ki.upload(ki_h);
    pg.upload(pg_h);
    ll.upload(ll_h);
    qi.upload(qi_round);
    out.poison();
    CK(cudaGraphLaunch(exec, stream));
    CK(cudaStreamSynchronize(stream));
    const auto got = out.download();
    ErrStats st;
    std::vector<float> kf, vf;
    std::vector<double> acc;
    for (int b = 0; b < B; ++b) {
      if (n_kv[b] == 0) continue;
      kf.resize(static_cast<size_t>(n_kv[b]) * Hk * D);
      vf.resize(kf.size());
      for (int s = 0; s < n_kv[b]; ++s) {
        const size_t slot = static_cast<size_t>(pg_h[ki_h[b] + s / ps]) * ps + s % ps;
        for (int i = 0; i < Hk * D; ++i) {
          kf[s * Hk * D + i] = bf2f(kc_h[slot * Hk * D + i]);
          vf[s * Hk * D + i] = bf2f(vc_h[slot * Hk * D + i]);
        }
      }
      const int token = qi_round[b], pos = n_kv[b] - 1;
      for (int h = 0; h < Hq; ++h) {
        const int hk = h / (Hq / Hk);
        reference_attention(&q_h[(token * Hq + h) * D], &kf[hk * D], &vf[hk * D], Hk * D, D,
                            first_visible_key(variant, pos), pos + 1, variant, acc);
        for (int i = 0; i < D; ++i) st.add(bf2f(got[(token * Hq + h) * D + i]), acc[i]);
      }
    }
    EXPECT_EQ(st.non_finite, 0) << "round " << round;
    EXPECT_LE(st.rel(), 1e-2) << "round " << round;
    for (unsigned v : counters.download()) ASSERT_EQ(v, 0u) << "round " << round;
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(stream));
}

TEST(CudaAttention, DecodeGraphReplay) {
  SKIP_WITHOUT_GPU();
  for (const bool merge_in_blocks : {false, true}) {
    SCOPED_TRACE(merge_in_blocks ? "merge in the decode blocks" : "merge kernel");
    expect_graph_replay(AttentionVariant{1.f / std::sqrt(128.f)}, merge_in_blocks);
  }
}

// A window shorter than some lengths and longer than others, with a soft-cap.
TEST(CudaAttention, DecodeGraphReplayWindow) {
  SKIP_WITHOUT_GPU();
  for (const bool merge_in_blocks : {false, true}) {
    SCOPED_TRACE(merge_in_blocks ? "merge in the decode blocks" : "merge kernel");
    expect_graph_replay(AttentionVariant{1.f / std::sqrt(128.f), 100, 2.f}, merge_in_blocks);
  }
}

// Arguments the kernels do not take are refused before anything is launched: attention's
// head_dim 72 and 112 (the kernels take 64, 80, 96, 128, 256), a soft-cap of 0.
TEST(CudaAttention, UnsupportedShapesRefused) {
  SKIP_WITHOUT_GPU();
  DevBuf<int32_t> idx(8);
  DevBuf<uint16_t> buf(1 << 16);
  auto prefill = [&](int d, const AttentionVariant& v) {
    return launch_paged_attention_prefill(buf.get(), buf.get(), buf.get(), idx.get(), idx.get(),
                                          idx.get(), idx.get(), buf.get(), 1, 1, 1, 2, 1, d, 16, v,
                                          nullptr);
  };
  auto decode = [&](int d, const AttentionVariant& v) {
    return launch_paged_attention_decode(buf.get(), buf.get(), buf.get(), idx.get(), idx.get(),
                                         idx.get(), idx.get(), buf.get(), 1, 1, 1, 2, 1, d, 16, v,
                                         1, nullptr, 0, nullptr, nullptr, nullptr);
  };
  for (int d : {72, 112}) {
    EXPECT_EQ(prefill(d, AttentionVariant{0.1f}), cudaErrorInvalidValue) << d;
    EXPECT_EQ(decode(d, AttentionVariant{0.1f}), cudaErrorInvalidValue) << d;
  }
  DevBuf<float> logits(16);
  EXPECT_EQ(launch_softcap(logits.get(), true, 16, 0.f, nullptr), cudaErrorInvalidValue)
      << "a soft-cap needs cap > 0";
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// ------------------------------------------------------------------------------------------
// GEMM.
// ------------------------------------------------------------------------------------------

// With tuning on, a new prefill-sized shape's first call times candidate algorithms on a
// scratch input and overwrites y before the real product: the results must be the same.
TEST(CudaGemm, MatchesReference) {
  SKIP_WITHOUT_GPU();
  for (const bool tuning : {false, true}) {
    SCOPED_TRACE(tuning ? "tuned plans" : "first choice");
    GemmHandle* h = nullptr;
    CK(gemm_create(&h, 32 << 20));
    gemm_set_tuning(h, tuning);
    std::mt19937 rng(12);
    struct Shape {
      int m, n, k;
      bool bias, y_f32;
    };
    // The repeated shapes reuse a cached plan; the f32 ones are the logits' GEMM; tuning times
    // only the 4096-row ones.
    for (const Shape s : {Shape{37, 300, 576, false, false}, Shape{1, 1536, 576, true, false},
                          Shape{256, 960, 320, true, false}, Shape{37, 300, 576, false, false},
                          Shape{37, 300, 576, false, true}, Shape{5, 49152, 576, false, true},
                          Shape{4096, 96, 128, false, false}, Shape{4096, 64, 192, true, false},
                          Shape{4096, 96, 128, false, false}}) {
      auto x_h = random_bf16(static_cast<size_t>(s.m) * s.k, rng);
      auto w_h = random_bf16(static_cast<size_t>(s.n) * s.k, rng);
      auto b_h = random_bf16(s.n, rng);
      DevBuf<uint16_t> x(x_h), w(w_h), b(b_h), y(static_cast<size_t>(s.m) * s.n);
      DevBuf<float> yf(static_cast<size_t>(s.m) * s.n);
      y.poison();
      yf.poison();
      void* out = s.y_f32 ? static_cast<void*>(yf.get()) : static_cast<void*>(y.get());
      const cudaError_t err = launch_gemm_bf16(h, x.get(), w.get(), s.bias ? b.get() : nullptr, out,
                                               s.y_f32, s.m, s.n, s.k, nullptr);
      ASSERT_EQ(err, cudaSuccess) << "cublas status " << gemm_last_status(h);
      std::vector<float> got(static_cast<size_t>(s.m) * s.n);
      if (s.y_f32) {
        got = yf.download();
      } else {
        const auto got_bf = y.download();
        for (size_t i = 0; i < got.size(); ++i) got[i] = bf2f(got_bf[i]);
      }
      ErrStats st;
      for (int i = 0; i < s.m; ++i) {
        for (int j = 0; j < s.n; ++j) {
          double acc = s.bias ? bf2f(b_h[j]) : 0.0;
          for (int kk = 0; kk < s.k; ++kk) {
            acc += static_cast<double>(bf2f(x_h[static_cast<size_t>(i) * s.k + kk])) *
                   bf2f(w_h[static_cast<size_t>(j) * s.k + kk]);
          }
          st.add(got[static_cast<size_t>(i) * s.n + j], acc);
        }
      }
      EXPECT_EQ(st.non_finite, 0);
      // f32 output: only the fp32 accumulation differs from the double reference.
      EXPECT_LE(st.rel(), s.y_f32 ? 1e-5 : 1e-2) << s.m << "x" << s.n << "x" << s.k;
    }
    DevBuf<uint16_t> x(8), w(64), b(8);
    DevBuf<float> y(8);
    EXPECT_EQ(launch_gemm_bf16(h, x.get(), w.get(), b.get(), y.get(), true, 1, 8, 8, nullptr),
              cudaErrorNotSupported)
        << "an f32 output takes no bias";
    gemm_destroy(h);
  }
}

}  // namespace pagedlm::cuda::kernels_test
