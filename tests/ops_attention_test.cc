// write_kv and paged_attention against the same computation on contiguous K/V, sweeping page
// sizes, odd lengths, batch sizes, GQA ratios, head dims and attention variants (sliding window,
// soft-cap), with pages in random order.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "ops_test_util.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/write_kv.h"

namespace pagedlm {
namespace {

using testing::expect_close;
using testing::expect_error;
using testing::poisoned_f32;
using testing::random_f32;

TEST(WriteKv, WritesMappedSlotsOnly) {
  std::mt19937 rng(20);
  const int64_t num_pages = 6, page_size = 4, n_kv_heads = 2, head_dim = 8, n_tokens = 9;
  const int64_t row = n_kv_heads * head_dim;
  Tensor k_cache = random_f32({num_pages, page_size, n_kv_heads, head_dim}, rng);
  Tensor v_cache = random_f32({num_pages, page_size, n_kv_heads, head_dim}, rng);
  const std::vector<float> k_before(k_cache.data<float>(), k_cache.data<float>() + k_cache.numel());
  const std::vector<float> v_before(v_cache.data<float>(), v_cache.data<float>() + v_cache.numel());
  Tensor k = random_f32({n_tokens, n_kv_heads, head_dim}, rng);
  Tensor v = random_f32({n_tokens, n_kv_heads, head_dim}, rng);
  std::vector<int32_t> slots(num_pages * page_size);
  std::iota(slots.begin(), slots.end(), 0);
  std::shuffle(slots.begin(), slots.end(), rng);
  slots.resize(n_tokens);
  slots[3] = -1;
  slots[8] = -1;
  ops::write_kv(k, v, Tensor::from_i32(slots, {n_tokens}), k_cache, v_cache);

  std::vector<int> source(num_pages * page_size, -1);
  for (int64_t t = 0; t < n_tokens; ++t) {
    if (slots[t] >= 0) source[slots[t]] = static_cast<int>(t);
  }
  for (int64_t s = 0; s < num_pages * page_size; ++s) {
    const float* k_want = source[s] >= 0 ? k.data<float>() + source[s] * row : &k_before[s * row];
    const float* v_want = source[s] >= 0 ? v.data<float>() + source[s] * row : &v_before[s * row];
    EXPECT_EQ(std::memcmp(k_cache.data<float>() + s * row, k_want, row * sizeof(float)), 0) << s;
    EXPECT_EQ(std::memcmp(v_cache.data<float>() + s * row, v_want, row * sizeof(float)), 0) << s;
  }
  slots[0] = num_pages * page_size;
  expect_error([&] { ops::write_kv(k, v, Tensor::from_i32(slots, {n_tokens}), k_cache, v_cache); },
               {"write_kv", "slot 24", "token 0"});
  expect_error(
      [&] {
        ops::write_kv(k, random_f32({n_tokens, 1, head_dim}, rng),
                      Tensor::from_i32(slots, {n_tokens}), k_cache, v_cache);
      },
      {"write_kv", "v"});
}

struct SeqSpec {
  int64_t cached;  // kv positions already in the cache before this step
  int64_t n_new;   // tokens of this step (the last n_new kv positions)
};

// A batch laid out as a StepPlan would: packed q, CSR page table over randomly permuted pages,
// and the contiguous K/V each sequence's pages hold.
struct PagedBatch {
  int64_t page_size, n_q_heads, n_kv_heads, head_dim;
  std::vector<SeqSpec> seqs;
  std::vector<int32_t> q_indptr{0}, kv_indptr{0}, kv_page_indices, kv_last_page_len;
  std::vector<std::vector<float>> keys, values;  // per sequence: [n_kv, n_kv_heads, head_dim]
  Tensor q, k_cache, v_cache;
};

PagedBatch make_batch(int64_t page_size, int64_t n_q_heads, int64_t n_kv_heads, int64_t head_dim,
                      std::vector<SeqSpec> seqs, std::mt19937& rng) {
  PagedBatch b{page_size, n_q_heads, n_kv_heads, head_dim, std::move(seqs)};
  int64_t total_pages = 0;
  for (const SeqSpec& s : b.seqs) total_pages += (s.cached + s.n_new + page_size - 1) / page_size;
  // Spare pages of garbage that no sequence owns.
  const int64_t num_pages = total_pages + 3;
  std::vector<int32_t> perm(num_pages);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  b.k_cache = random_f32({num_pages, page_size, n_kv_heads, head_dim}, rng);
  b.v_cache = random_f32({num_pages, page_size, n_kv_heads, head_dim}, rng);
  const int64_t row = n_kv_heads * head_dim;
  int64_t next_page = 0;
  for (const SeqSpec& s : b.seqs) {
    const int64_t n_kv = s.cached + s.n_new;
    const int64_t pages = (n_kv + page_size - 1) / page_size;
    b.q_indptr.push_back(static_cast<int32_t>(b.q_indptr.back() + s.n_new));
    b.kv_indptr.push_back(static_cast<int32_t>(b.kv_indptr.back() + pages));
    b.kv_last_page_len.push_back(static_cast<int32_t>(n_kv - (pages - 1) * page_size));
    Tensor keys = random_f32({n_kv, n_kv_heads, head_dim}, rng);
    Tensor values = random_f32({n_kv, n_kv_heads, head_dim}, rng);
    b.keys.emplace_back(keys.data<float>(), keys.data<float>() + keys.numel());
    b.values.emplace_back(values.data<float>(), values.data<float>() + values.numel());
    for (int64_t p = 0; p < pages; ++p) b.kv_page_indices.push_back(perm[next_page++]);
    const int32_t* my_pages = b.kv_page_indices.data() + b.kv_indptr[b.kv_indptr.size() - 2];
    for (int64_t pos = 0; pos < n_kv; ++pos) {
      const int64_t slot = my_pages[pos / page_size] * page_size + pos % page_size;
      std::memcpy(b.k_cache.data<float>() + slot * row, &b.keys.back()[pos * row],
                  row * sizeof(float));
      std::memcpy(b.v_cache.data<float>() + slot * row, &b.values.back()[pos * row],
                  row * sizeof(float));
    }
  }
  b.q = random_f32({b.q_indptr.back(), n_q_heads, head_dim}, rng);
  return b;
}

// The batch's page table as the engine binds it on the CPU.
ops::AttentionPlan plan_of(const PagedBatch& b) {
  const int64_t num_seqs = static_cast<int64_t>(b.seqs.size());
  ops::AttentionPlan plan;
  plan.q_indptr = Tensor::from_i32(b.q_indptr, {num_seqs + 1});
  plan.kv_indptr = Tensor::from_i32(b.kv_indptr, {num_seqs + 1});
  plan.kv_page_indices =
      Tensor::from_i32(b.kv_page_indices, {static_cast<int64_t>(b.kv_page_indices.size())});
  plan.kv_last_page_len = Tensor::from_i32(b.kv_last_page_len, {num_seqs});
  return plan;
}

Tensor run_paged(const PagedBatch& b, const AttentionVariant& variant) {
  Tensor out = poisoned_f32({b.q.dim(0), b.n_q_heads, b.head_dim});
  ops::paged_attention(b.q, b.k_cache, b.v_cache, plan_of(b), variant, out);
  return out;
}

// The first kv position any of sequence s's rows attends to under `window` (its first new token
// sees the earliest keys).
int64_t first_attended(const SeqSpec& s, int32_t window) {
  return window > 0 ? std::max<int64_t>(0, s.cached - window + 1) : 0;
}

// Naive attention on contiguous K/V in double: a dense score vector over the row's window
// (HF: kv_idx > q_idx - sliding_window), soft-capped after the scale, softmax, weighted sum.
std::vector<double> reference(const PagedBatch& b, const AttentionVariant& variant) {
  const int64_t d = b.head_dim, group = b.n_q_heads / b.n_kv_heads;
  const double scale = variant.scale, softcap = variant.softcap;
  std::vector<double> out(b.q.numel());
  for (size_t s = 0; s < b.seqs.size(); ++s) {
    for (int64_t j = 0; j < b.seqs[s].n_new; ++j) {
      const int64_t t = b.q_indptr[s] + j;
      const int64_t pos = b.seqs[s].cached + j;
      const int64_t first = variant.window > 0 ? std::max<int64_t>(0, pos - variant.window + 1) : 0;
      for (int64_t h = 0; h < b.n_q_heads; ++h) {
        const float* q = b.q.data<float>() + (t * b.n_q_heads + h) * d;
        const int64_t kv_head = h / group;
        std::vector<double> scores;
        for (int64_t p = first; p <= pos; ++p) {
          const float* key = &b.keys[s][(p * b.n_kv_heads + kv_head) * d];
          double dot = 0;
          for (int64_t i = 0; i < d; ++i) dot += double(q[i]) * key[i];
          const double score = dot * scale;
          scores.push_back(softcap > 0 ? softcap * std::tanh(score / softcap) : score);
        }
        const double max_score = *std::max_element(scores.begin(), scores.end());
        double sum = 0;
        for (double& x : scores) sum += (x = std::exp(x - max_score));
        double* o = &out[(t * b.n_q_heads + h) * d];
        for (int64_t p = first; p <= pos; ++p) {
          const float* value = &b.values[s][(p * b.n_kv_heads + kv_head) * d];
          for (int64_t i = 0; i < d; ++i) o[i] += scores[p - first] / sum * value[i];
        }
      }
    }
  }
  return out;
}

// ||a - b|| / ||b||: how far a variant's reference is from the plain one, so that a test of the
// variant cannot pass by ignoring it.
double relative_distance(const std::vector<double>& a, const std::vector<double>& b) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (a[i] - b[i]) * (a[i] - b[i]);
    norm += b[i] * b[i];
  }
  return std::sqrt(diff / norm);
}

// Random mix of decode (one new token after a cached context), plain prefill and prefill after a
// cached prefix, with the odd lengths that stress page boundaries.
std::vector<SeqSpec> random_seqs(int64_t num_seqs, std::mt19937& rng) {
  const int64_t lengths[] = {1, 7, 33, 130};
  std::uniform_int_distribution<int> pick(0, 3);
  std::vector<SeqSpec> seqs;
  for (int64_t i = 0; i < num_seqs; ++i) {
    switch (std::uniform_int_distribution<int>(0, 2)(rng)) {
      case 0:
        seqs.push_back({lengths[pick(rng)], 1});
        break;
      case 1:
        seqs.push_back({0, lengths[pick(rng)]});
        break;
      default:
        seqs.push_back({lengths[pick(rng)], lengths[pick(rng)]});
    }
  }
  return seqs;
}

TEST(PagedAttention, MatchesContiguousReferenceSweep) {
  std::mt19937 rng(21);
  const int64_t n_kv_heads = 2;
  for (int64_t page_size : {1, 16, 64}) {
    for (int64_t gqa : {1, 2, 4}) {
      for (int64_t head_dim : {64, 128}) {
        for (int64_t num_seqs = 1; num_seqs <= 9; ++num_seqs) {
          PagedBatch b = make_batch(page_size, n_kv_heads * gqa, n_kv_heads, head_dim,
                                    random_seqs(num_seqs, rng), rng);
          const AttentionVariant plain{1.f / std::sqrt(static_cast<float>(head_dim))};
          expect_close(run_paged(b, plain), reference(b, plain), 1e-5,
                       cat("page_size ", page_size, " gqa ", gqa, " head_dim ", head_dim, " seqs ",
                           num_seqs));
        }
      }
    }
  }
}

// The lengths the fixtures use (1, 7, 40, 130, 300) on a single sequence, as prefill and with
// part of them cached, at the engine's page size.
TEST(PagedAttention, LongSingleSequences) {
  std::mt19937 rng(22);
  for (SeqSpec s : {SeqSpec{0, 300}, SeqSpec{33, 7}, SeqSpec{299, 1}, SeqSpec{257, 40}}) {
    PagedBatch b = make_batch(16, 4, 2, 64, {s}, rng);
    expect_close(run_paged(b, {0.125f}), reference(b, {0.125f}), 1e-5,
                 cat("cached ", s.cached, " new ", s.n_new));
  }
}

// Decode rows, short chunks (decode-like blocks), chunked prefill after a cached prefix (16-row
// blocks) and a whole prompt, with lengths off every page and tile boundary.
const std::vector<SeqSpec> kVariantSeqs = {{130, 1}, {7, 1}, {33, 7}, {100, 40}, {0, 75}, {60, 1}};

// Sliding windows smaller than a page (16), crossing pages, crossing key tiles (32), larger than
// every context, and 1 (each row sees itself only), each with and without a soft-cap, on head
// sizes that are a multiple of the vector width or not (72) and the largest supported (256).
TEST(PagedAttention, SlidingWindowAndSoftcap) {
  std::mt19937 rng(25);
  for (int64_t head_dim : {72, 256}) {
    for (int64_t page_size : {16, 64}) {
      const PagedBatch b = make_batch(page_size, 4, 2, head_dim, kVariantSeqs, rng);
      const float scale = 1.f / std::sqrt(static_cast<float>(head_dim));
      const std::vector<double> plain = reference(b, {scale});
      for (int32_t window : {0, 1, 5, 23, 40, 1000}) {
        for (float softcap : {0.f, 0.5f}) {
          const AttentionVariant variant{scale, window, softcap};
          const std::string what = cat("head_dim ", head_dim, " page_size ", page_size, " window ",
                                       window, " softcap ", softcap);
          const std::vector<double> want = reference(b, variant);
          // The variant must change the result wherever it can (a window past every context
          // cannot).
          if (softcap > 0.f || (window > 0 && window < 100)) {
            EXPECT_GT(relative_distance(want, plain), 1e-2) << what;
          }
          expect_close(run_paged(b, variant), want, 1e-5, what);
        }
      }
    }
  }
}

// Keys before every row's window are never scored: pages holding only such keys may hold
// anything (NaN here) without touching the result.
TEST(PagedAttention, WindowIgnoresKeysBeforeIt) {
  std::mt19937 rng(26);
  const int32_t window = 20;
  PagedBatch b = make_batch(16, 4, 2, 64, kVariantSeqs, rng);
  const int64_t row = b.n_kv_heads * b.head_dim;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  int64_t poisoned = 0;
  for (size_t s = 0; s < b.seqs.size(); ++s) {
    const int32_t* pages = b.kv_page_indices.data() + b.kv_indptr[s];
    for (int64_t pos = 0; pos < first_attended(b.seqs[s], window); ++pos) {
      const int64_t slot = pages[pos / b.page_size] * b.page_size + pos % b.page_size;
      std::fill_n(b.k_cache.data<float>() + slot * row, row, nan);
      std::fill_n(b.v_cache.data<float>() + slot * row, row, nan);
      ++poisoned;
    }
  }
  ASSERT_GT(poisoned, 0);
  const AttentionVariant variant{0.125f, window, 0.f};
  expect_close(run_paged(b, variant), reference(b, variant), 1e-5, "window 20");
}

// A sequence's output rows are bitwise the same alone as inside a batch, with and without a
// window and soft-cap.
TEST(PagedAttention, BatchInvariant) {
  std::mt19937 rng(23);
  PagedBatch batch = make_batch(16, 8, 2, 64, random_seqs(7, rng), rng);
  for (const AttentionVariant& variant :
       {AttentionVariant{0.125f}, AttentionVariant{0.125f, 21, 0.5f}}) {
    const Tensor together = run_paged(batch, variant);
    const int64_t row = batch.n_q_heads * batch.head_dim;
    for (size_t s = 0; s < batch.seqs.size(); ++s) {
      PagedBatch alone = batch;
      alone.seqs = {batch.seqs[s]};
      alone.q = batch.q.rows(batch.q_indptr[s], batch.q_indptr[s + 1]);
      alone.q_indptr = {0, batch.q_indptr[s + 1] - batch.q_indptr[s]};
      alone.kv_indptr = {0, batch.kv_indptr[s + 1] - batch.kv_indptr[s]};
      alone.kv_page_indices.assign(batch.kv_page_indices.begin() + batch.kv_indptr[s],
                                   batch.kv_page_indices.begin() + batch.kv_indptr[s + 1]);
      alone.kv_last_page_len = {batch.kv_last_page_len[s]};
      const Tensor out = run_paged(alone, variant);
      EXPECT_EQ(std::memcmp(out.data<float>(), together.data<float>() + batch.q_indptr[s] * row,
                            out.nbytes()),
                0)
          << "sequence " << s << " window " << variant.window;
    }
  }
}

TEST(PagedAttention, RejectsInconsistentPlans) {
  std::mt19937 rng(24);
  const PagedBatch good = make_batch(16, 4, 2, 64, {{20, 3}, {0, 5}}, rng);
  PagedBatch bad = good;
  bad.kv_page_indices[1] = static_cast<int32_t>(good.k_cache.dim(0));
  expect_error([&] { run_paged(bad, {1.f}); }, {"paged_attention", "sequence 0", "page"});
  bad = good;
  bad.kv_last_page_len[1] = 0;
  expect_error([&] { run_paged(bad, {1.f}); }, {"paged_attention", "sequence 1", "last page"});
  bad = good;
  bad.kv_last_page_len[1] = 17;
  expect_error([&] { run_paged(bad, {1.f}); }, {"paged_attention", "sequence 1"});
  bad = good;
  bad.q_indptr = {0, 3, 7};
  expect_error([&] { run_paged(bad, {1.f}); }, {"paged_attention", "q_indptr"});
  bad = good;
  bad.kv_last_page_len[1] = 2;
  bad.q_indptr = {0, 3, 8};
  bad.seqs[1].n_new = 5;
  expect_error([&] { run_paged(bad, {1.f}); }, {"paged_attention", "sequence 1", "5 new tokens"});
  bad = good;
  bad.q = random_f32({8, 3, 64}, rng);
  bad.n_q_heads = 3;
  expect_error([&] { run_paged(bad, {1.f}); }, {"paged_attention", "3 q heads"});
  expect_error([&] { run_paged(good, {1.f, -1}); }, {"paged_attention", "window -1"});
  expect_error([&] { run_paged(good, {1.f, 0, -2.f}); }, {"paged_attention", "softcap -2"});
}

}  // namespace
}  // namespace pagedlm
