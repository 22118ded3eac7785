// Every CUDA kernel against a plain double-precision CPU loop on the same bf16 data. Paged
// attention is checked against attention over contiguous K/V gathered from the same pages,
// sweeping page sizes, odd lengths, batch sizes, GQA ratios, head dims, cached prefixes and
// split counts, sliding windows and soft-caps. Outputs are poisoned (NaN) first, so an unwritten
// element fails the test.
// Skips cleanly on machines without a GPU.

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
    if (splits == 0) {
      int sms = 0;
      CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
      splits = paged_attention_decode_num_splits(d.num_seqs, Hk, D, d.max_kv, sms);
    }
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
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    SharedPrefixPass pass;
    pass.max_items = max_items;
    pass.num_splits = c.shared_splits > 0 ? c.shared_splits
                                          : shared_prefix_num_splits(
                                                (d.num_seqs + per_item - 1) / per_item, Hk, sms);
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

TEST(CudaAttention, PrefillSmall) {
  SKIP_WITHOUT_GPU();
  for (int ps : {16, 32, 64}) {
    for (int d : {64, 128}) {
      AttnCase c;
      c.n_new = {1, 7, 33, 5};
      c.n_ctx = {0, 40, 0, 100};
      c.num_q_heads = 8;
      c.num_kv_heads = d == 64 ? 2 : 8;
      c.head_dim = d;
      c.page_size = ps;
      expect_attention(c, ps + d);
    }
  }
  AttnCase c;  // padding sequences at the end of the batch
  c.n_new = {3, 1};
  c.n_ctx = {17, 0};
  c.num_q_heads = 9;
  c.num_kv_heads = 3;
  c.head_dim = 64;
  c.padded_tail = true;
  expect_attention(c);
}

TEST(CudaAttention, PrefillLong) {
  SKIP_WITHOUT_GPU();
  {
    AttnCase c;
    c.n_new = {1000};
    c.n_ctx = {0};
    c.num_q_heads = 8;
    c.num_kv_heads = 1;
    c.head_dim = 64;
    c.page_size = 64;
    expect_attention(c);
  }
  {
    AttnCase c;
    c.n_new = {4097, 33, 7};
    c.n_ctx = {0, 4097, 1000};
    c.num_q_heads = 4;
    c.num_kv_heads = 1;
    c.head_dim = 128;
    c.page_size = 16;
    expect_attention(c);
  }
}

TEST(CudaAttention, PrefillBatch300) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(7);
  AttnCase c;
  for (int b = 0; b < 300; ++b) {
    c.n_new.push_back(static_cast<int>(rng() % 40));  // includes zero-row sequences
    c.n_ctx.push_back(static_cast<int>(rng() % 300));
  }
  c.num_q_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.page_size = 32;
  expect_attention(c);
}

TEST(CudaAttention, PageSize1Small) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.n_new = {7, 33, 1, 5};
  c.n_ctx = {3, 0, 100, 1000};
  c.num_q_heads = 2;
  c.num_kv_heads = 1;
  c.head_dim = 128;
  c.page_size = 1;
  expect_attention(c);
  c.decode = true;
  c.n_new = {1, 1, 1, 1, 1};
  c.n_ctx = {0, 6, 32, 999, 4096};
  c.num_q_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 64;
  c.num_splits = 3;
  expect_attention(c);
}

TEST(CudaAttention, DecodeSmall) {
  SKIP_WITHOUT_GPU();
  for (int splits : {1, 4}) {
    for (int ps : {16, 32, 64}) {
      AttnCase c;
      c.decode = true;
      c.n_new = repeat(7, 1);
      c.n_ctx = {0, 6, 32, 999, 63, 64, 200};
      c.num_q_heads = ps == 32 ? 32 : 9;
      c.num_kv_heads = ps == 32 ? 8 : 3;
      c.head_dim = ps == 32 ? 128 : 64;
      c.page_size = ps;
      c.num_splits = splits;
      c.padded_tail = ps == 16;
      expect_attention(c, splits * 100 + ps);
    }
  }
  AttnCase c;  // a few new tokens per sequence through the decode kernel
  c.decode = true;
  c.n_new = {1, 2, 3, 1};
  c.n_ctx = {100, 7, 4000, 0};
  c.num_q_heads = 4;
  c.num_kv_heads = 1;
  c.head_dim = 128;
  c.num_splits = 5;
  expect_attention(c);
}

TEST(CudaAttention, DecodeLarge) {
  SKIP_WITHOUT_GPU();
  {
    AttnCase c;
    c.decode = true;
    c.n_new = repeat(64, 1);
    c.n_ctx = repeat(64, 4096);
    c.num_q_heads = 8;
    c.num_kv_heads = 1;
    c.head_dim = 128;
    c.page_size = 64;
    c.num_splits = 16;
    expect_attention(c);
  }
  {
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
    c.page_size = 16;
    c.num_splits = 0;
    expect_attention(c);
  }
  {
    AttnCase c;
    c.decode = true;
    c.n_new = repeat(5, 1);
    c.n_ctx = {0, 6, 32, 999, 4096};
    c.num_q_heads = 32;
    c.num_kv_heads = 8;
    c.head_dim = 128;
    c.page_size = 32;
    c.num_splits = 0;
    expect_attention(c);
  }
}

// Cascade: runs of sequences share their leading pages (as prefix-cache hits make them); the
// shared pass reads each run once for all its members and the merge joins it with each
// sequence's own keys. Checked against the same float64 reference as every decode case.
TEST(CudaAttention, DecodeSharedPrefixCascade) {
  SKIP_WITHOUT_GPU();
  for (int splits : {1, 0}) {
    for (int shared_splits : {0, 3}) {
      AttnCase c;  // SmolLM2's heads: 30 sequences behind one 2000-token prefix, 6 behind 3 pages
      c.decode = true;
      c.cascade = true;
      c.num_splits = splits;
      c.shared_splits = shared_splits;
      c.num_q_heads = 9;
      c.num_kv_heads = 3;
      c.head_dim = 64;
      c.page_size = 16;
      for (int b = 0; b < 40; ++b) {
        c.n_new.push_back(1);
        c.n_ctx.push_back(b < 30 ? 2000 + (b * 7) % 64 : 48 + b);
      }
      c.n_ctx[5] = 2000;  // the new token right after the shared run: nothing of its own before it
      c.shared = {{0, 30, 125}, {30, 6, 3}};
      c.padded_tail = true;
      expect_attention(c, 700 + splits * 10 + shared_splits);
    }
  }
  AttnCase c;  // Llama's heads: 4 query heads per kv head, items of 16 members
  c.decode = true;
  c.cascade = true;
  c.num_splits = 0;
  c.num_q_heads = 32;
  c.num_kv_heads = 8;
  c.head_dim = 128;
  c.page_size = 32;
  for (int b = 0; b < 37; ++b) {
    c.n_new.push_back(1);
    c.n_ctx.push_back(320 + b * 11);
  }
  c.shared = {{0, 37, 10}};
  expect_attention(c, 800);
  c.cascade = false;  // the same tables without the pass
  expect_attention(c, 800);
}

// The decode launch is captured once and replayed after the page table changes on the device:
// the launch shape must not depend on the lengths (nor, with a window, on where windows start).
void expect_graph_replay(const AttentionVariant& variant) {
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

  cudaStream_t stream;
  CK(cudaStreamCreate(&stream));
  cudaGraph_t graph;
  cudaGraphExec_t exec;
  CK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
  CK(launch_paged_attention_decode(q.get(), kc.get(), vc.get(), qi.get(), ki.get(), pg.get(),
                                   ll.get(), out.get(), B, B, 1, Hq, Hk, D, ps, variant, splits,
                                   ws.get(), ws_bytes, nullptr, nullptr, stream));
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
  }
  CK(cudaGraphExecDestroy(exec));
  CK(cudaGraphDestroy(graph));
  CK(cudaStreamDestroy(stream));
}

TEST(CudaAttention, DecodeGraphReplay) {
  SKIP_WITHOUT_GPU();
  expect_graph_replay(AttentionVariant{1.f / std::sqrt(128.f)});
}

// A window shorter than some lengths and longer than others, with a soft-cap.
TEST(CudaAttention, DecodeGraphReplayWindow) {
  SKIP_WITHOUT_GPU();
  expect_graph_replay(AttentionVariant{1.f / std::sqrt(128.f), 100, 2.f});
}

// Sliding windows (smaller than a page, crossing pages, longer than the context, 1) and
// soft-caps, alone and together, through prefill (prompts and one-token rows in one launch),
// decode with and without splits, and the cascade.
TEST(CudaAttention, PrefillWindowSoftcap) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (int window : {0, 5, 40, 1, 100000}) {
      for (float cap : {0.f, 1.5f}) {
        if (window == 0 && cap == 0.f) continue;
        AttnCase c;
        c.n_new = {1, 7, 70, 5, 1, 130};
        c.n_ctx = {0, 40, 3, 100, 333, 0};
        c.num_q_heads = 8;
        c.num_kv_heads = d == 128 ? 2 : 4;
        c.head_dim = d;
        c.page_size = 16;
        c.window = window;
        c.softcap = cap;
        expect_attention(c, d + window + static_cast<int>(cap));
      }
    }
  }
  AttnCase c;  // a long prompt behind a long cached context: each 64-row tile reads ~window keys
  c.n_new = {700, 3};
  c.n_ctx = {3000, 2000};
  c.num_q_heads = 8;
  c.num_kv_heads = 2;
  c.head_dim = 128;
  c.page_size = 32;
  c.window = 300;
  expect_attention(c);
  c.scale = 1.f;  // large raw scores: the cap saturates
  c.softcap = 8.f;
  expect_attention(c);
}

TEST(CudaAttention, DecodeWindowSoftcap) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (int splits : {1, 4, 0}) {
      for (int window : {0, 5, 40, 1, 700, 100000}) {
        for (float cap : {0.f, 1.5f}) {
          if ((window == 0 && cap == 0.f) || (window % 2 == 1 && cap > 0.f && splits == 4)) {
            continue;  // the plain variant is covered above; trim a few combinations
          }
          AttnCase c;
          c.decode = true;
          c.n_new = repeat(7, 1);
          c.n_ctx = {0, 6, 32, 999, 63, 64, 4096};
          c.num_q_heads = d == 128 ? 9 : 8;
          c.num_kv_heads = d == 128 ? 3 : 2;
          c.head_dim = d;
          c.page_size = 16;
          c.num_splits = splits;
          c.window = window;
          c.softcap = cap;
          c.padded_tail = splits == 4;
          expect_attention(c, d + 10 * splits + window);
        }
      }
    }
  }
  AttnCase c;  // a few new tokens per sequence through the decode kernel, windows per row
  c.decode = true;
  c.n_new = {1, 2, 3, 1};
  c.n_ctx = {100, 7, 4000, 0};
  c.num_q_heads = 4;
  c.num_kv_heads = 1;
  c.head_dim = 256;
  c.num_splits = 5;
  c.window = 2;
  c.softcap = 1.5f;
  expect_attention(c);
  c.window = 600;
  expect_attention(c);
}

// head_dim 256 (Gemma) on the plain variant: prefill, decode with splits, cascade.
TEST(CudaAttention, HeadDim256) {
  SKIP_WITHOUT_GPU();
  AttnCase c;
  c.n_new = {1, 7, 33, 130};
  c.n_ctx = {0, 40, 1000, 100};
  c.num_q_heads = 8;
  c.num_kv_heads = 4;
  c.head_dim = 256;
  c.page_size = 32;
  expect_attention(c);
  c.decode = true;
  c.n_new = repeat(5, 1);
  c.n_ctx = {0, 6, 32, 999, 4096};
  for (int splits : {1, 3, 0}) {
    c.num_splits = splits;
    expect_attention(c, 10 + splits);
  }
}

// Shapes the kernels do not take are refused before anything is launched: head_dim 96.
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
  EXPECT_EQ(prefill(96, AttentionVariant{0.1f}), cudaErrorInvalidValue);
  EXPECT_EQ(decode(96, AttentionVariant{0.1f}), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
}

// The cascade with windows: members whose window starts after the shared keys take nothing
// from the shared pass (an empty split, lse = -inf), others part of them or all.
TEST(CudaAttention, DecodeSharedPrefixCascadeWindow) {
  SKIP_WITHOUT_GPU();
  for (int d : {64, 128, 256}) {
    for (int window : {16, 50, 100, 5000}) {
      for (float cap : {0.f, 1.5f}) {
        AttnCase c;
        c.decode = true;
        c.cascade = true;
        c.num_splits = window == 50 ? 1 : 0;
        c.shared_splits = window == 100 ? 3 : 0;
        c.num_q_heads = d == 128 ? 9 : 8;
        c.num_kv_heads = d == 128 ? 3 : 4;
        c.head_dim = d;
        c.page_size = 16;
        for (int b = 0; b < 24; ++b) {
          c.n_new.push_back(1);
          c.n_ctx.push_back(b < 20 ? 2000 + (b * 7) % 64 : 48 + b);
        }
        c.n_ctx[5] = 2000;  // right after the shared run: its window lies within it
        c.shared = {{0, 20, 125}, {20, 4, 3}};
        c.window = window;
        c.softcap = cap;
        expect_attention(c, 900 + window + d);
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// Fused kernels.
// ------------------------------------------------------------------------------------------

// The embedding widens bf16 rows into the f32 residual stream (exactly); gather_rows copies f32
// residual rows and bf16 activation rows alike. dim 100: the unvectorized paths.
TEST(CudaFused, EmbeddingAndGatherRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(5);
  for (int dim : {576, 100, 7}) {
    const int vocab = 1000, L = 37;
    auto table_h = random_bf16(static_cast<size_t>(vocab) * dim, rng);
    std::vector<int32_t> ids_h(L);
    for (auto& id : ids_h) id = static_cast<int32_t>(rng() % vocab);
    DevBuf<uint16_t> table(table_h);
    DevBuf<float> out(static_cast<size_t>(L) * dim);
    DevBuf<int32_t> ids(ids_h);
    out.poison();
    CK(launch_embedding(table.get(), ids.get(), out.get(), L, dim, 1.f, nullptr));
    auto got = out.download();
    for (int t = 0; t < L; ++t) {
      for (int i = 0; i < dim; ++i) {
        ASSERT_EQ(got[t * dim + i], bf2f(table_h[static_cast<size_t>(ids_h[t]) * dim + i]))
            << "dim " << dim << " token " << t << " element " << i;
      }
    }
    const int S = 5;
    std::vector<int32_t> rows_h = {36, 0, 5, 5, 17};
    DevBuf<int32_t> rows(rows_h);
    DevBuf<float> gf(static_cast<size_t>(S) * dim);
    DevBuf<uint16_t> gb(static_cast<size_t>(S) * dim);
    gf.poison();
    gb.poison();
    CK(launch_gather_rows(out.get(), rows.get(), gf.get(), S, int64_t{4} * dim, nullptr));
    CK(launch_gather_rows(table.get(), rows.get(), gb.get(), S, int64_t{2} * dim, nullptr));
    auto got_f = gf.download();
    auto got_b = gb.download();
    for (int s = 0; s < S; ++s) {
      for (int i = 0; i < dim; ++i) {
        ASSERT_EQ(got_f[s * dim + i], got[rows_h[s] * dim + i]) << "f32 dim " << dim;
        ASSERT_EQ(got_b[s * dim + i], table_h[rows_h[s] * dim + i]) << "bf16 dim " << dim;
      }
    }
  }
}

// Gemma scales its embeddings by sqrt(hidden_size) in f32: each output is the exact product of the
// bf16 value and the scale, rounded once to f32. dim 100: the unvectorized path.
TEST(CudaFused, EmbeddingScale) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(15);
  const float scale = static_cast<float>(std::sqrt(3072.0));
  for (int dim : {2304, 100}) {
    const int vocab = 300, L = 11;
    auto table_h = random_bf16(static_cast<size_t>(vocab) * dim, rng);
    std::vector<int32_t> ids_h(L);
    for (auto& id : ids_h) id = static_cast<int32_t>(rng() % vocab);
    DevBuf<uint16_t> table(table_h);
    DevBuf<float> out(static_cast<size_t>(L) * dim);
    DevBuf<int32_t> ids(ids_h);
    out.poison();
    CK(launch_embedding(table.get(), ids.get(), out.get(), L, dim, scale, nullptr));
    auto got = out.download();
    for (int t = 0; t < L; ++t) {
      for (int i = 0; i < dim; ++i) {
        const double want =
            static_cast<double>(bf2f(table_h[static_cast<size_t>(ids_h[t]) * dim + i])) * scale;
        ASSERT_EQ(got[static_cast<size_t>(t) * dim + i], static_cast<float>(want))
            << "dim " << dim << " token " << t << " element " << i;
      }
    }
  }
}

TEST(CudaFused, RmsNorm) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(6);
  const float eps = 1e-6f;
  {  // plain, and per head inside a fused qkv row, in place
    const int L = 37, dim = 576;
    auto x_h = random_bf16(static_cast<size_t>(L) * dim, rng, -3, 3);
    auto w_h = random_bf16(dim, rng, 0.5, 1.5);
    DevBuf<uint16_t> x(x_h), w(w_h), out(x_h.size());
    out.poison();
    CK(launch_rms_norm(x.get(), dim, w.get(), out.get(), dim, L, 1, dim, eps, 0.f, nullptr));
    auto got = out.download();
    ErrStats st;
    for (int r = 0; r < L; ++r) {
      double ss = 0;
      for (int i = 0; i < dim; ++i) ss += std::pow(bf2f(x_h[r * dim + i]), 2);
      const double inv = 1.0 / std::sqrt(ss / dim + eps);
      for (int i = 0; i < dim; ++i) {
        st.add(bf2f(got[r * dim + i]), bf2f(x_h[r * dim + i]) * inv * bf2f(w_h[i]));
      }
    }
    EXPECT_EQ(st.non_finite, 0);
    EXPECT_LE(st.rel(), 1e-2);
  }
  {
    const int L = 5, H = 4, d = 128, row = (H + 2 * 2) * d;
    auto qkv_h = random_bf16(static_cast<size_t>(L) * row, rng, -3, 3);
    auto w_h = random_bf16(d, rng, 0.5, 1.5);
    DevBuf<uint16_t> qkv(qkv_h), w(w_h);
    CK(launch_rms_norm(qkv.get(), row, w.get(), qkv.get(), row, L, H, d, eps, 0.f, nullptr));
    auto got = qkv.download();
    ErrStats st;
    for (int t = 0; t < L; ++t) {
      for (int h = 0; h < H; ++h) {
        const size_t base = static_cast<size_t>(t) * row + h * d;
        double ss = 0;
        for (int i = 0; i < d; ++i) ss += std::pow(bf2f(qkv_h[base + i]), 2);
        const double inv = 1.0 / std::sqrt(ss / d + eps);
        for (int i = 0; i < d; ++i) {
          st.add(bf2f(got[base + i]), bf2f(qkv_h[base + i]) * inv * bf2f(w_h[i]));
        }
      }
      for (int i = H * d; i < row; ++i) {  // k and v untouched
        ASSERT_EQ(got[static_cast<size_t>(t) * row + i], qkv_h[static_cast<size_t>(t) * row + i]);
      }
    }
    EXPECT_LE(st.rel(), 1e-2);
  }
}

// The f32 residual stream: the residual gets no bf16 rounding, only the normalized output does.
TEST(CudaFused, RmsNormOfF32Residual) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(13);
  std::uniform_real_distribution<float> dist(-3.f, 3.f);
  const float eps = 1e-6f;
  // 16-byte paths held in registers (960: one chunk per thread, 4096: two, 5120: up to four),
  // and the scalar kernel (100: not a multiple of 8; 8200: too wide to hold).
  for (int dim : {960, 100, 4096, 5120, 8200}) {
    const int L = 19;
    std::vector<float> res_h(static_cast<size_t>(L) * dim);
    for (float& v : res_h) v = dist(rng);  // not bf16-representable: catches a rounded residual
    auto x_h = random_bf16(res_h.size(), rng, -3, 3);
    auto w_h = random_bf16(dim, rng, 0.5, 1.5);
    DevBuf<float> res(res_h);
    DevBuf<uint16_t> x(x_h), w(w_h), out(res_h.size()), plain(res_h.size());
    plain.poison();
    CK(launch_rms_norm_f32(res.get(), w.get(), plain.get(), L, dim, eps, 0.f, nullptr));
    out.poison();
    CK(launch_add_rms_norm(res.get(), x.get(), w.get(), out.get(), L, dim, eps, 0.f, nullptr));
    const auto got_plain = plain.download(), got = out.download();
    const auto got_res = res.download();
    ErrStats st_plain, st_sum, st_out;
    for (int r = 0; r < L; ++r) {
      double ss_in = 0, ss = 0;
      std::vector<double> sum(dim);
      for (int i = 0; i < dim; ++i) {
        const size_t j = static_cast<size_t>(r) * dim + i;
        sum[i] = static_cast<double>(res_h[j]) + bf2f(x_h[j]);
        ss_in += static_cast<double>(res_h[j]) * res_h[j];
        ss += sum[i] * sum[i];
        st_sum.add(got_res[j], sum[i]);
      }
      const double inv_in = 1.0 / std::sqrt(ss_in / dim + eps);
      const double inv = 1.0 / std::sqrt(ss / dim + eps);
      for (int i = 0; i < dim; ++i) {
        const size_t j = static_cast<size_t>(r) * dim + i;
        st_plain.add(bf2f(got_plain[j]), res_h[j] * inv_in * bf2f(w_h[i]));
        st_out.add(bf2f(got[j]), sum[i] * inv * bf2f(w_h[i]));
      }
    }
    EXPECT_EQ(st_plain.non_finite + st_sum.non_finite + st_out.non_finite, 0) << "dim " << dim;
    EXPECT_LE(st_sum.rel(), 1e-6) << "dim " << dim << ": the residual must stay f32";
    EXPECT_LE(st_plain.rel(), 5e-3) << "dim " << dim;
    EXPECT_LE(st_out.rel(), 5e-3) << "dim " << dim;
  }
}

// Gemma's norms scale by (1 + w) computed in f32 from bf16 w near 0, on every norm kernel: the
// per-head one, the f32-residual one and the fused add (vectorized widths and the scalar kernel).
// The reference adds the offset in double.
TEST(CudaFused, RmsNormWeightOffset) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(16);
  std::uniform_real_distribution<float> dist(-3.f, 3.f);
  const float eps = 1e-6f, offset = 1.f;
  auto ref = [&](const double* x, const std::vector<uint16_t>& w, int dim, double* out) {
    double ss = 0;
    for (int i = 0; i < dim; ++i) ss += x[i] * x[i];
    const double inv = 1.0 / std::sqrt(ss / dim + eps);
    for (int i = 0; i < dim; ++i) out[i] = x[i] * inv * (offset + bf2f(w[i]));
  };
  {  // per head: heads 0..H-1 of a fused qkv row, in place
    const int L = 5, H = 4, d = 256, row = (H + 2) * d;
    auto qkv_h = random_bf16(static_cast<size_t>(L) * row, rng, -3, 3);
    auto w_h = random_bf16(d, rng, -0.3f, 0.3f);
    DevBuf<uint16_t> qkv(qkv_h), w(w_h);
    CK(launch_rms_norm(qkv.get(), row, w.get(), qkv.get(), row, L, H, d, eps, offset, nullptr));
    auto got = qkv.download();
    ErrStats st;
    std::vector<double> x(d), want(d);
    for (int t = 0; t < L; ++t) {
      for (int h = 0; h < H; ++h) {
        const size_t base = static_cast<size_t>(t) * row + h * d;
        for (int i = 0; i < d; ++i) x[i] = bf2f(qkv_h[base + i]);
        ref(x.data(), w_h, d, want.data());
        for (int i = 0; i < d; ++i) st.add(bf2f(got[base + i]), want[i]);
      }
    }
    EXPECT_EQ(st.non_finite, 0);
    EXPECT_LE(st.rel(), 5e-3);
  }
  for (int dim : {2304, 3840, 100}) {
    const int L = 7;
    std::vector<float> res_h(static_cast<size_t>(L) * dim);
    for (float& v : res_h) v = dist(rng);
    auto x_h = random_bf16(res_h.size(), rng, -3, 3);
    auto w_h = random_bf16(dim, rng, -0.3f, 0.3f);
    DevBuf<float> res(res_h);
    DevBuf<uint16_t> x(x_h), w(w_h), out(res_h.size()), plain(res_h.size());
    plain.poison();
    out.poison();
    CK(launch_rms_norm_f32(res.get(), w.get(), plain.get(), L, dim, eps, offset, nullptr));
    CK(launch_add_rms_norm(res.get(), x.get(), w.get(), out.get(), L, dim, eps, offset, nullptr));
    const auto got_plain = plain.download(), got = out.download();
    ErrStats st_plain, st_out;
    std::vector<double> in(dim), sum(dim), want(dim);
    for (int r = 0; r < L; ++r) {
      for (int i = 0; i < dim; ++i) {
        const size_t j = static_cast<size_t>(r) * dim + i;
        in[i] = res_h[j];
        sum[i] = static_cast<double>(res_h[j]) + bf2f(x_h[j]);
      }
      ref(in.data(), w_h, dim, want.data());
      for (int i = 0; i < dim; ++i) st_plain.add(bf2f(got_plain[r * dim + i]), want[i]);
      ref(sum.data(), w_h, dim, want.data());
      for (int i = 0; i < dim; ++i) st_out.add(bf2f(got[r * dim + i]), want[i]);
    }
    EXPECT_EQ(st_plain.non_finite + st_out.non_finite, 0) << "dim " << dim;
    EXPECT_LE(st_plain.rel(), 5e-3) << "dim " << dim;
    EXPECT_LE(st_out.rel(), 5e-3) << "dim " << dim;
  }
}

TEST(CudaFused, RopeKvWrite) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(8);
  // d = 64: bf16x2 rotation and 16-byte v copies; d = 6: the scalar paths.
  for (const int d : {64, 6}) {
    const int L = 13, Hq = 4, Hk = 2, row = (Hq + 2 * Hk) * d, num_slots = 64;
    auto qkv_h = random_bf16(static_cast<size_t>(L) * row, rng, -2, 2);
    std::vector<int32_t> pos_h(L), slot_h(L);
    for (int t = 0; t < L; ++t) {
      pos_h[t] = static_cast<int32_t>(rng() % 5000);
      slot_h[t] = t % 4 == 3 ? -1 : (t * 5) % num_slots;
    }
    std::vector<float> inv_freq_h(d / 2);
    for (int i = 0; i < d / 2; ++i) {
      inv_freq_h[i] = 1.f / std::pow(10000.f, 2.f * i / d);
    }
    DevBuf<uint16_t> qkv(qkv_h), kc(static_cast<size_t>(num_slots) * Hk * d),
        vc(kc.download().size());
    DevBuf<int32_t> pos(pos_h), slot(slot_h);
    DevBuf<float> inv_freq(inv_freq_h);
    kc.poison();
    vc.poison();
    uint16_t* base = qkv.get();
    CK(launch_rope_kv_write(base, row, base, row, base + Hq * d, row, base + (Hq + Hk) * d, row,
                            pos.get(), inv_freq.get(), slot.get(), kc.get(), vc.get(), L, Hq, Hk, d,
                            nullptr));
    auto got = qkv.download();
    auto kc_got = kc.download();
    auto vc_got = vc.download();
    ErrStats st;
    for (int t = 0; t < L; ++t) {
      for (int h = 0; h < Hq + Hk; ++h) {
        const size_t off = static_cast<size_t>(t) * row + h * d;
        for (int i = 0; i < d / 2; ++i) {
          const double ang = static_cast<double>(static_cast<float>(pos_h[t]) * inv_freq_h[i]);
          const double x1 = bf2f(qkv_h[off + i]), x2 = bf2f(qkv_h[off + i + d / 2]);
          st.add(bf2f(got[off + i]), x1 * std::cos(ang) - x2 * std::sin(ang));
          st.add(bf2f(got[off + i + d / 2]), x2 * std::cos(ang) + x1 * std::sin(ang));
        }
      }
      if (slot_h[t] < 0) continue;
      for (int i = 0; i < Hk * d; ++i) {
        ASSERT_EQ(kc_got[static_cast<size_t>(slot_h[t]) * Hk * d + i],
                  got[static_cast<size_t>(t) * row + Hq * d + i]);
        ASSERT_EQ(vc_got[static_cast<size_t>(slot_h[t]) * Hk * d + i],
                  qkv_h[static_cast<size_t>(t) * row + (Hq + Hk) * d + i]);
      }
    }
    EXPECT_EQ(st.non_finite, 0);
    EXPECT_LE(st.rel(), 1e-2);
    // Slots no token maps to stay untouched (poisoned).
    std::vector<bool> used(num_slots, false);
    for (int s : slot_h) {
      if (s >= 0) used[s] = true;
    }
    for (int s = 0; s < num_slots; ++s) {
      if (!used[s]) ASSERT_EQ(kc_got[static_cast<size_t>(s) * Hk * d], 0xFFFF);
    }
  }
}

TEST(CudaFused, SiluMul) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(9);
  for (int dim : {1536, 100}) {
    const int L = 9;
    auto gu_h = random_bf16(static_cast<size_t>(L) * 2 * dim, rng, -4, 4);
    DevBuf<uint16_t> gu(gu_h), out(static_cast<size_t>(L) * dim);
    out.poison();
    CK(launch_silu_mul(gu.get(), out.get(), L, dim, nullptr));
    auto got = out.download();
    ErrStats st;
    for (int r = 0; r < L; ++r) {
      for (int i = 0; i < dim; ++i) {
        const double g = bf2f(gu_h[r * 2 * dim + i]), u = bf2f(gu_h[r * 2 * dim + dim + i]);
        st.add(bf2f(got[r * dim + i]), g / (1 + std::exp(-g)) * u);
      }
    }
    EXPECT_EQ(st.non_finite, 0);
    EXPECT_LE(st.rel(), 1e-2);
  }
}

// HF's gelu_pytorch_tanh in double: 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
double gelu_tanh_ref(double g) {
  return 0.5 * g * (1.0 + std::tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)));
}

// GeGLU shares the gated kernels with SwiGLU. Gates up to |g| = 12 with random up; then a
// sweep of gates with up = 1 including |g| where g^3 overflows f32 (no NaN, and each element
// within bf16 rounding of the reference or, in the negative tail, of 0 next to g).
TEST(CudaFused, GeluTanhMul) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(17);
  for (int dim : {2048, 100}) {
    const int L = 9;
    auto gu_h = random_bf16(static_cast<size_t>(L) * 2 * dim, rng, -12, 12);
    DevBuf<uint16_t> gu(gu_h), out(static_cast<size_t>(L) * dim);
    out.poison();
    CK(launch_gelu_tanh_mul(gu.get(), out.get(), L, dim, nullptr));
    auto got = out.download();
    ErrStats st;
    for (int r = 0; r < L; ++r) {
      for (int i = 0; i < dim; ++i) {
        const double g = bf2f(gu_h[r * 2 * dim + i]), u = bf2f(gu_h[r * 2 * dim + dim + i]);
        st.add(bf2f(got[r * dim + i]), gelu_tanh_ref(g) * u);
      }
    }
    EXPECT_EQ(st.non_finite, 0);
    EXPECT_LE(st.rel(), 1e-2);
  }
  std::vector<float> gates;  // the largest first, so that both kernels below see them
  for (float g : {50.f, 1e3f, 1e6f, 1e13f, 3e38f}) {
    gates.push_back(g);
    gates.push_back(-g);
  }
  for (float g = -20.f; g <= 20.f; g += 0.01f) gates.push_back(g);
  const int n = static_cast<int>(gates.size());
  for (int dim : {n - n % 8, n}) {  // the vectorized and the scalar kernel
    std::vector<uint16_t> gu_h(2 * static_cast<size_t>(dim));
    for (int i = 0; i < dim; ++i) {
      gu_h[i] = f2bf(gates[i]);
      gu_h[dim + i] = f2bf(1.f);
    }
    DevBuf<uint16_t> gu(gu_h), out(dim);
    out.poison();
    CK(launch_gelu_tanh_mul(gu.get(), out.get(), 1, dim, nullptr));
    auto got = out.download();
    for (int i = 0; i < dim; ++i) {
      const double g = bf2f(gu_h[i]), want = gelu_tanh_ref(g), y = bf2f(got[i]);
      ASSERT_TRUE(std::isfinite(y)) << "g " << g;
      // bf16 keeps 8 significant bits: within 2^-8 of the value, or 1e-6 |g| where it is ~0.
      ASSERT_LE(std::abs(y - want), std::abs(want) / 256 + 1e-6 * std::abs(g)) << "g " << g;
    }
  }
}

// Gemma 2's final logit soft-cap, in place on f32 logits (the sampler's input) and on bf16.
TEST(CudaFused, Softcap) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(18);
  std::uniform_real_distribution<float> dist(-400.f, 400.f);
  const float cap = 30.f;
  const int n = 3 * 100003;  // odd: the grid-stride tail
  std::vector<float> x_h(n);
  for (float& v : x_h) v = dist(rng);
  for (int i = 0; i < n / 3; ++i) x_h[i] *= 1e-4f;  // small logits, where tanh(z) ~ z
  x_h[0] = 0.f;
  DevBuf<float> x(x_h);
  CK(launch_softcap(x.get(), true, n, cap, nullptr));
  auto got = x.download();
  for (int i = 0; i < n; ++i) {
    const double want = cap * std::tanh(static_cast<double>(x_h[i]) / cap);
    // tanhf is within 2 ulp; the division and the product round once each.
    ASSERT_LE(std::abs(got[i] - want), 5e-7 * std::abs(want)) << "x " << x_h[i];
  }
  auto b_h = random_bf16(1000, rng, -200, 200);
  DevBuf<uint16_t> b(b_h);
  CK(launch_softcap(b.get(), false, static_cast<int64_t>(b_h.size()), cap, nullptr));
  auto got_b = b.download();
  ErrStats st;
  for (size_t i = 0; i < b_h.size(); ++i) {
    st.add(bf2f(got_b[i]), cap * std::tanh(bf2f(b_h[i]) / cap));
  }
  EXPECT_EQ(st.non_finite, 0);
  EXPECT_LE(st.rel(), 5e-3);
  EXPECT_EQ(launch_softcap(x.get(), true, n, 0.f, nullptr), cudaErrorInvalidValue);
}

// ------------------------------------------------------------------------------------------
// Sampling.
// ------------------------------------------------------------------------------------------

struct SampleRow {
  float temperature;
  int32_t top_k;
  float top_p, min_p;
  uint64_t seed;
  int64_t step;
};

// The documented semantics, in double where it matters.
int cpu_sample(const float* logits, int vocab, const SampleRow& r, double* margin) {
  *margin = 1.0;
  if (r.temperature <= 0.f || r.top_k == 1) {
    return static_cast<int>(std::max_element(logits, logits + vocab) - logits);
  }
  const float inv_t = 1.f / r.temperature;
  std::vector<float> x(vocab);
  for (int i = 0; i < vocab; ++i) x[i] = logits[i] * inv_t;
  const float mx = *std::max_element(x.begin(), x.end());
  float thresh = -INFINITY;
  if (r.top_k > 0 && r.top_k < vocab) {
    std::vector<float> s = x;
    std::nth_element(s.begin(), s.begin() + (r.top_k - 1), s.end(), std::greater<float>());
    thresh = s[r.top_k - 1];
  }
  if (r.top_p < 1.f) {
    std::vector<float> kept;
    double total = 0;
    for (float v : x) {
      if (v >= thresh) {
        kept.push_back(v);
        total += std::exp(static_cast<double>(v) - mx);
      }
    }
    std::sort(kept.begin(), kept.end(), std::greater<float>());
    double cum = 0;
    for (float v : kept) {
      cum += std::exp(static_cast<double>(v) - mx);
      if (cum >= r.top_p * total) {
        thresh = std::max(thresh, v);
        break;
      }
    }
  }
  std::vector<double> e(vocab, 0.0);
  double total = 0;
  for (int i = 0; i < vocab; ++i) {
    const double ei = std::exp(static_cast<double>(x[i]) - mx);
    if (x[i] >= thresh && ei >= r.min_p) total += (e[i] = ei);
  }
  const double target = sampling_uniform(r.seed, r.step) * total;
  double run = 0;
  int last = 0;
  for (int i = 0; i < vocab; ++i) {
    if (e[i] == 0.0) continue;
    last = i;
    if (run + e[i] > target) {
      *margin = std::min(target - run, run + e[i] - target) / total;
      return i;
    }
    run += e[i];
  }
  return last;
}

TEST(CudaSampling, MatchesCpuSemantics) {
  SKIP_WITHOUT_GPU();
  std::mt19937 rng(10);
  const int vocab = 50000;
  std::vector<SampleRow> rows = {
      {0.f, 0, 1.f, 0.f, 1, 0},      {0.7f, 1, 1.f, 0.f, 2, 0},     {1.f, 0, 1.f, 0.f, 3, 5},
      {0.8f, 50, 1.f, 0.f, 4, 9},    {1.2f, 0, 0.9f, 0.f, 5, 1},    {1.f, 0, 1.f, 0.05f, 6, 2},
      {0.9f, 40, 0.8f, 0.02f, 7, 3}, {2.f, 1000, 0.95f, 0.f, 8, 4}, {1.f, 0, 0.5f, 0.f, 9, 7},
      {0.5f, 5, 0.3f, 0.f, 10, 8},
  };
  const int R = static_cast<int>(rows.size());
  std::normal_distribution<float> nd(0.f, 3.f);
  std::vector<float> logits_h(static_cast<size_t>(R) * vocab);
  for (auto& v : logits_h) v = nd(rng);
  // A tie at the maximum: greedy must return the lower index.
  logits_h[1234] = logits_h[777] = 100.f;
  std::vector<float> temp_h, top_p_h, min_p_h;
  std::vector<int32_t> top_k_h;
  std::vector<uint64_t> seed_h;
  std::vector<int64_t> step_h;
  for (const auto& r : rows) {
    temp_h.push_back(r.temperature);
    top_k_h.push_back(r.top_k);
    top_p_h.push_back(r.top_p);
    min_p_h.push_back(r.min_p);
    seed_h.push_back(r.seed);
    step_h.push_back(r.step);
  }
  DevBuf<float> logits(logits_h), temp(temp_h), top_p(top_p_h), min_p(min_p_h);
  DevBuf<int32_t> top_k(top_k_h), out(R);
  DevBuf<uint64_t> seed(seed_h);
  DevBuf<int64_t> step(step_h);
  out.poison();
  CK(launch_sample(logits.get(), R, vocab, temp.get(), top_k.get(), top_p.get(), min_p.get(),
                   seed.get(), step.get(), out.get(), nullptr));
  auto got = out.download();
  for (int r = 0; r < R; ++r) {
    double margin = 0;
    const int want = cpu_sample(&logits_h[static_cast<size_t>(r) * vocab], vocab, rows[r], &margin);
    // Float vs double sums may disagree only when the draw lands within rounding of a boundary.
    if (margin > 1e-5) EXPECT_EQ(got[r], want) << "row " << r;
  }
  EXPECT_EQ(got[0], 777);
  // Different steps of one seed give different draws over a flat distribution.
  std::vector<float> flat(vocab, 0.f);
  DevBuf<float> flat_d(flat);
  std::vector<int64_t> steps2 = {0, 1};
  std::vector<uint64_t> seeds2 = {42, 42};
  std::vector<float> t2 = {1.f, 1.f}, p2 = {1.f, 1.f}, m2 = {0.f, 0.f};
  std::vector<int32_t> k2 = {0, 0};
  DevBuf<int64_t> s2(steps2);
  DevBuf<uint64_t> sd2(seeds2);
  DevBuf<float> td2(t2), pd2(p2), md2(m2);
  DevBuf<int32_t> kd2(k2), o2(2);
  std::vector<float> two_rows(2 * vocab, 0.f);
  DevBuf<float> lg2(two_rows);
  CK(launch_sample(lg2.get(), 2, vocab, td2.get(), kd2.get(), pd2.get(), md2.get(), sd2.get(),
                   s2.get(), o2.get(), nullptr));
  auto g2 = o2.download();
  EXPECT_EQ(g2[0], static_cast<int>(sampling_uniform(42, 0) * vocab));
  EXPECT_EQ(g2[1], static_cast<int>(sampling_uniform(42, 1) * vocab));
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
