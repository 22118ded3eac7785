// Raw CUDA kernels of pagedlm: bf16 storage, fp32 accumulation, and an fp32 residual stream
// (bf16 there would round the running sum at every layer's two adds). Every launcher takes device
// pointers, sizes and a stream, enqueues its work and returns the launch error (never
// synchronizes, never allocates), so all of them can be captured in a CUDA graph.
// This header includes no engine header on purpose: the ops layer wraps these launchers.
// All index arrays are int32 and live on the device. "bf16" pointers hold __nv_bfloat16 values;
// they are typed void* here so this header stays plain C++.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "pagedlm/core/attention_variant.h"

namespace pagedlm::cuda {

// ---------------------------------------------------------------------------------------------
// The device, asked once per device: every kernel that sizes itself by the device (the
// attention's stage counts and key tiles, the split heuristics) reads these.
// PAGEDLM_CUDA_SMEM_CAP_KB=N caps the shared memory the kernels may use at N KB per block (and
// N + the per-block reservation per SM), so that one GPU runs the configurations of a smaller
// one: 99 (RTX 30xx / 40xx / 50xx), 163 (A100).
// ---------------------------------------------------------------------------------------------
struct DeviceLimits {
  int device;
  char name[256];
  int cc_major, cc_minor;
  int num_sms;
  size_t smem_per_block;  // dynamic + static shared memory one block may have (the opt-in limit)
  size_t smem_per_sm;
  size_t smem_reserved_per_block;  // the runtime's own share of each resident block's
  int smem_cap_kb;                 // PAGEDLM_CUDA_SMEM_CAP_KB, 0 when unset
};
// The kernels need sm_80 (bf16 mma.sync, cp.async).
constexpr int kMinComputeCapability = 80;
// Fills *limits for `device` (cached after the first call). cudaErrorInvalidValue when
// PAGEDLM_CUDA_SMEM_CAP_KB is not a whole number from 99 to 1024 (smem_cap_error says so).
cudaError_t device_limits(int device, const DeviceLimits** limits);
// The current device's.
cudaError_t current_device_limits(const DeviceLimits** limits);
const char* smem_cap_error();
// Lets kernel `fn` launch with `bytes` of dynamic shared memory on the current device (past the
// default 48 KB, a device-wide opt-in per kernel): the attribute is set once per device, kernel
// and larger size asked for, not on every launch (a host call and a lock in the driver).
cudaError_t allow_dynamic_smem(const void* fn, size_t bytes);
// Whether kernel launches may overlap the kernel before them in the stream (programmatic
// dependent launch, common.cuh's launch_overlapped): on sm_90 and later, unless PAGEDLM_PDL=0
// (which gives plain launches, for comparisons). Of the current device.
bool overlapped_launches();

// ---------------------------------------------------------------------------------------------
// Paged attention over the packed token stream (FlashInfer CSR page table, see StepPlan).
//
// q:          [num_tokens, num_q_heads, head_dim] bf16
// k/v_cache:  [num_pages, page_size, num_kv_heads, head_dim] bf16, or e4m3 (KvCacheFormat)
// q_indptr:   [num_seqs + 1]  rows of sequence b are q_indptr[b] .. q_indptr[b+1]
// kv_indptr:  [num_seqs + 1]  pages of b are kv_page_indices[kv_indptr[b] .. kv_indptr[b+1]]
// kv_last_page_len: [num_seqs]
// out:        [num_tokens, num_q_heads, head_dim] bf16
// Sequence b holds n_kv = (pages - 1) * page_size + last_len keys (0 when it has no page); its
// n_new query rows are its last n_new positions: query j sees keys 0 .. n_kv - n_new + j.
// Sequences with no query rows (padding) are skipped; rows outside every sequence are not
// written. head_dim is 64, 80, 96, 128 or 256, num_q_heads / num_kv_heads is 1..8 (Hq % Hk == 0),
// any page_size >= 1 works (16/32/64 are the tuned ones). `variant`: the layer's scale, sliding
// window and soft-cap (core/attention_variant.h): with window w > 0, the query at position p sees
// keys max(0, p - w + 1) .. p, and key tiles outside every row's window are not read; with
// softcap c > 0, score = c * tanh(scale * q.k / c) (hardware tanh, relative error 2^-11), before
// the mask. Every head size has both. The kernels' shared memory fits the device's
// (device_limits): at head_dim 256 an H200 takes 165 KB per block for prefill and the
// shared-prefix pass and 206 KB for decode (one block per SM each), a device with 163 KB per
// block (A100) 132 KB and 140 KB, one with 99 KB (consumer GPUs) 82 KB and 74 KB.
// ---------------------------------------------------------------------------------------------

// The element type of a paged KV cache: bf16, or OCP e4m3 with one scale per tensor (a key is
// its stored e4m3 value times k_scale, a value times v_scale). Writes divide by the scale and
// saturate to +-448; reads convert exactly to bf16 and apply the scales in f32. Every GPU the
// kernels run on (sm_80 on) takes e4m3: cuda_fp8.h converts in software below sm_89.
struct KvCacheFormat {
  bool e4m3 = false;
  float k_scale = 1.f;
  float v_scale = 1.f;
};

// Prefill / mixed batches: tiles of 64 (token, q head) rows per (sequence, kv head).
// max_q_len bounds q_indptr[b+1] - q_indptr[b] over b (the grid is sized from it).
cudaError_t launch_paged_attention_prefill(const void* q, const void* k_cache, const void* v_cache,
                                           const int32_t* q_indptr, const int32_t* kv_indptr,
                                           const int32_t* kv_page_indices,
                                           const int32_t* kv_last_page_len, void* out, int num_seqs,
                                           int num_tokens, int max_q_len, int num_q_heads,
                                           int num_kv_heads, int head_dim, int page_size,
                                           const AttentionVariant& variant, cudaStream_t stream,
                                           const KvCacheFormat& kv = {});

// Cascade attention for sequences whose page tables begin with the same pages (a prefix held
// once in the cache and shared): their shared keys are read once per group of members, not once
// per sequence. Items group up to shared_prefix_members_per_item() members of one shared run;
// all arrays are on the device:
//   kv_skip:   [num_seqs] leading keys of sequence b that its item covers (0: not a member)
//   num_items: [1] items in use, at most max_items
//   items:     [max_items][4] first member (index into members), member count, offset of the
//              shared pages in kv_page_indices, shared keys (whole pages, all before any of
//              the members' new tokens)
//   members:   sequence indices, each item's members contiguous
// num_splits: key splits of the shared pass (shared_prefix_num_splits).
struct SharedPrefixPass {
  const int32_t* kv_skip = nullptr;
  const int32_t* num_items = nullptr;
  const int32_t* items = nullptr;
  const int32_t* members = nullptr;
  int max_items = 0;
  int num_splits = 1;
};
int shared_prefix_members_per_item(int num_q_heads, int num_kv_heads);
// Splits that fill the GPU when `num_items` items are in use.
int shared_prefix_num_splits(int num_items, int num_kv_heads, const DeviceLimits& device);

// Decode (flash-decoding): each sequence's keys are cut into num_splits parts handled by
// different blocks, then merged. Launch shapes depend only on (num_seqs, num_tokens,
// max_q_len, num_splits), so a graph captured for a batch bucket replays for any lengths.
// max_q_len is 1 for plain decode (small values, e.g. speculative tokens, also work).
// The first call for each head_dim and variant on a device sets the kernel's shared-memory limit
// (a host-side attribute); make it once outside stream capture, e.g. in the warm-up before
// capturing. A sliding window cuts each sequence's keys to its window before they are split.
// seq_order: null, or a permutation of 0 .. num_seqs-1: the blocks of seq_order[0] start first
// (longest first shortens the last wave's tail). shared: null, or the cascade's shared-prefix pass
// (decode only: every member has one new token; with a window, members whose window starts
// after the shared keys take nothing from it). workspace: at least
// paged_attention_workspace_bytes(num_tokens, num_q_heads, head_dim, num_splits + shared splits)
// bytes (may be null when that sum is 1). merge_counters: null, or [num_seqs * num_kv_heads]
// counters that are zero (cudaMemset once) and that the launch leaves zero: then, without a
// shared pass and with max_q_len * (num_q_heads / num_kv_heads) <= 16, the last block of each
// sequence's splits merges them and no merge kernel follows (one launch less, same bits).
cudaError_t launch_paged_attention_decode(
    const void* q, const void* k_cache, const void* v_cache, const int32_t* q_indptr,
    const int32_t* kv_indptr, const int32_t* kv_page_indices, const int32_t* kv_last_page_len,
    void* out, int num_seqs, int num_tokens, int max_q_len, int num_q_heads, int num_kv_heads,
    int head_dim, int page_size, const AttentionVariant& variant, int num_splits, void* workspace,
    size_t workspace_bytes, const int32_t* seq_order, const SharedPrefixPass* shared,
    cudaStream_t stream, const KvCacheFormat& kv = {}, unsigned* merge_counters = nullptr);

// Bytes of split-KV partial results (fp32 outputs + log-sum-exp) for the decode launcher.
size_t paged_attention_workspace_bytes(int max_num_tokens, int num_q_heads, int head_dim,
                                       int max_num_splits);

// A split count that fills the GPU: (sequence, kv head, split) blocks in full waves (none split
// once there are two waves or more), no split shorter than 256 keys, from the device's SM count
// and the blocks of the decode kernel it runs that fit one SM (`device` is the current one). The
// kernel also caps each sequence's splits by its own
// length, so a count chosen for the longest possible context (max_kv_len = the model's limit)
// serves every step of a graph bucket.
int paged_attention_decode_num_splits(int num_seqs, int num_kv_heads, int head_dim, int max_kv_len,
                                      const DeviceLimits& device);

// ---------------------------------------------------------------------------------------------
// Small fused kernels.
// ---------------------------------------------------------------------------------------------

// table: [vocab, dim] bf16, token_ids: [num_tokens], out: [num_tokens, dim] f32 (the residual
// stream starts at the embedding). out = table[id] * scale in f32 (Gemma scales by
// sqrt(hidden_size); 1 elsewhere). vocab_begin >= 0: the table is a tensor-parallel rank's rows
// [vocab_begin, vocab_begin + vocab) of the vocabulary and other ids give zero rows.
cudaError_t launch_embedding(const void* table, const int32_t* token_ids, float* out,
                             int num_tokens, int dim, float scale, cudaStream_t stream,
                             int vocab_begin = -1, int vocab = 0);

// The norms below scale by (weight_offset + weight) computed in f32: 0 for Llama-style norms,
// 1 for Gemma's (1 + w), which bf16 weights could not hold without rounding.

// RMSNorm over rows (t, h): x row at x + t * x_token_stride + h * dim (elements), same for out
// with out_token_stride (out may alias x). Plain norm: num_heads = 1, strides = dim. Qwen3's
// per-head q/k norm: num_heads = heads, dim = head_dim, strides = the fused qkv row length.
// out = x * rsqrt(mean(x^2) + eps) * (weight_offset + weight); weight: [dim] bf16.
cudaError_t launch_rms_norm(const void* x, int64_t x_token_stride, const void* weight, void* out,
                            int64_t out_token_stride, int num_tokens, int num_heads, int dim,
                            float eps, float weight_offset, cudaStream_t stream);

// FP8 projections beside the kernels around them. The norms and the gated product may write their
// output a second time as the e4m3 input of the FP8 projection that reads it next (Fp8RowsOut:
// launch_quantize_fp8_rows' codes and scales of the bf16 output, so the projection quantizes
// nothing), and may read their input as an FP8 GEMM's unscaled sums (Fp8Unscaled: each value
// scaled as launch_fp8_scale_epilogue scales it, without a bias, so that kernel does not run).
// Both take the kernels' row-per-block forms (kernel_fuses_fp8); the scales of one row may be
// the same memory in and out (the block reads its row's before its first barrier and writes the
// new one after its last).
struct Fp8RowsOut {
  void* values = nullptr;                                     // [rows, dim] e4m3; null: off
  float* scales = nullptr;                                    // [rows]
  float static_scale = 0.f, scale_ub = 0.f, min_scale = 0.f;  // launch_quantize_fp8_rows'
};
struct Fp8Unscaled {
  const float* x_scales = nullptr;  // [rows]; null: off
  const float* w_scales = nullptr;  // [the input's width]
};
// Whether rows of `dim` values take those forms: the norms' (dim % 8 == 0, dim <= 8192) or the
// gated product's (dim % 8 == 0, dim <= 32768).
bool norm_fuses_fp8(int dim);
bool gated_mul_fuses_fp8(int dim);

// x: [rows, dim] f32 (the residual stream), weight: [dim] bf16, out: [rows, dim] bf16.
// out = x * rsqrt(mean(x^2) + eps) * (weight_offset + weight): the first layer's input norm.
cudaError_t launch_rms_norm_f32(const float* x, const void* weight, void* out, int rows, int dim,
                                float eps, float weight_offset, cudaStream_t stream,
                                const Fp8RowsOut& fp8_out = {});

// residual: [rows, dim] f32 in/out, x: [rows, dim] bf16 (a sublayer's output), weight: [dim]
// bf16, out: [rows, dim] bf16 (the next GEMM's input).
// residual += x in fp32; out = rms_norm(residual) * (weight_offset + weight).
cudaError_t launch_add_rms_norm(float* residual, const void* x, const void* weight, void* out,
                                int rows, int dim, float eps, float weight_offset,
                                cudaStream_t stream, const Fp8Unscaled& x_unscaled = {},
                                const Fp8RowsOut& fp8_out = {});

// Rotary embedding (NEOX rotate_half: pair i with i + d/2, angle = float(pos) * inv_freq[i] in
// fp32) on q, written to q_out (q_out == q: in place), and on k in place, then k and v are
// written into the paged cache at slot_mapping (slot = page * page_size + offset; -1 skips the
// token: padding). q, k and v may be parts of one fused projection row (strides = its length).
// q: [num_tokens, num_q_heads, head_dim] at q + t * q_token_stride (+ h * head_dim), q_out
// likewise with q_out_token_stride
// k, v: [num_tokens, num_kv_heads, head_dim] with k_token_stride / v_token_stride
// positions, slot_mapping: [num_tokens]; inv_freq: [head_dim / 2] f32
// k_cache, v_cache: [num_slots, num_kv_heads, head_dim] bf16 (num_slots = num_pages*page_size),
// or e4m3 (kv.e4m3): the e4m3 of each bf16 value (k: rotated, as written back to k) divided by
// its tensor's scale (detail::to_e4m3: correctly rounded quotient, nearest even, saturated).
cudaError_t launch_rope_kv_write(const void* q, int64_t q_token_stride, void* q_out,
                                 int64_t q_out_token_stride, void* k, int64_t k_token_stride,
                                 const void* v, int64_t v_token_stride, const int32_t* positions,
                                 const float* inv_freq, const int32_t* slot_mapping, void* k_cache,
                                 void* v_cache, int num_tokens, int num_q_heads, int num_kv_heads,
                                 int head_dim, cudaStream_t stream, const KvCacheFormat& kv = {});

// Gated MLP activations, one kernel for both (templated on the activation), in f32:
// gate_up: [rows, 2 * dim] bf16 (gate first), out: [rows, dim] bf16 = act(gate) * up.
// SwiGLU: act = silu(g) = g / (1 + exp(-g)).
// gate_up_unscaled and fp8_out: as the norms' (w_scales [2 * dim], gate's then up's).
cudaError_t launch_silu_mul(const void* gate_up, void* out, int rows, int dim, cudaStream_t stream,
                            const Fp8Unscaled& gate_up_unscaled = {},
                            const Fp8RowsOut& fp8_out = {});
// GeGLU (Gemma): act = HF's gelu_pytorch_tanh, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))).
cudaError_t launch_gelu_tanh_mul(const void* gate_up, void* out, int rows, int dim,
                                 cudaStream_t stream, const Fp8Unscaled& gate_up_unscaled = {},
                                 const Fp8RowsOut& fp8_out = {});

// x: [n] in place, f32 (f32 true: the logits) or bf16: x = cap * tanh(x / cap) in f32 (Gemma 2's
// final logit soft-cap). cap > 0, else cudaErrorInvalidValue.
cudaError_t launch_softcap(void* x, bool f32, int64_t n, float cap, cudaStream_t stream);

// Partial-page prefix hits (ops/copy_kv.h): copies: [num_copies][3] (src_page, dst_page,
// num_tokens) on the device; slots 0 .. num_tokens-1 of src_page go to the same slots of
// dst_page in k_cache and v_cache, each [num_pages, page_size] slots of row_bytes bytes (any
// dtype: bytes are moved as they are). No page may be both a source and a destination of one
// launch. Rows are not range-checked on the device.
cudaError_t launch_copy_kv_slots(void* k_cache, void* v_cache, const int32_t* copies,
                                 int num_copies, int page_size, int64_t row_bytes,
                                 cudaStream_t stream);

// in: [*, row_bytes], rows: [num_rows], out: [num_rows, row_bytes] = in[rows[i]]. Rows are
// copied as bytes, so one kernel serves the bf16 activations and the f32 residual stream;
// row_bytes must be even (any 2- or 4-byte dtype).
cudaError_t launch_gather_rows(const void* in, const int32_t* rows, void* out, int num_rows,
                               int64_t row_bytes, cudaStream_t stream);

// ---------------------------------------------------------------------------------------------
// Sampling, one row of logits per request.
// logits: [num_rows, vocab] f32; per-row parameters (device arrays of num_rows):
// temperature, top_k, top_p, min_p, seed, step; out_tokens: [num_rows].
// Semantics (a CPU implementation must follow the same order to match):
//  1. temperature <= 0 or top_k == 1: argmax, lowest index on ties.
//  2. x = logits / temperature; p = softmax(x).
//  3. top_k > 0: keep tokens with x >= the k-th largest x (ties at the cut are all kept).
//  4. top_p < 1: among kept tokens, keep those with x >= T where T is the largest value such
//     that the kept mass with x >= T is >= top_p * (kept mass).
//  5. min_p > 0: keep tokens with p >= min_p * max(p).
//  6. u = splitmix64(seed ^ (step * 0x9E3779B97F4A7C15)) >> 11, times 2^-53 (a double in
//     [0, 1)); return the first kept index i (ascending) where the running kept mass exceeds
//     u * (total kept mass).
// A -inf logit is never kept. Token bitmasks (structured output): when mask_slot is given and
// mask_slot[r] >= 0, row r's tokens whose bit is clear in mask + mask_slot[r] * mask_words
// (bit id % 32 of word id / 32) count as -inf before step 1.
// ---------------------------------------------------------------------------------------------
// Logit adjustments, applied before step 1 (after the mask: a masked token stays -inf), in
// vLLM's order:
//  a. bias (bias_indptr given): row r adds bias_values[j] to logit bias_tokens[j] for j in
//     [bias_indptr[r], bias_indptr[r + 1]), in order. launch_sample makes the additions in the
//     logits in place (one thread per row, in list order, keeping each replaced value in
//     bias_saved[j]) and undoes them after the draw, so the logits read the same afterwards.
//  b. penalties (penalty_slot given, penalty_slot[r] >= 0): with c = counts[slot * vocab + i]
//     and s = c > 0 or bit i of prompt_seen + slot * ceil(vocab / 32): where s, x = x > 0 ?
//     x / repetition : x * repetition; where c > 0, x -= fmaf(frequency, c, presence). Applied
//     as the sampler reads each logit: the logits are not written.
struct SampleAdjust {
  const int32_t* bias_indptr = nullptr;  // [num_rows + 1]
  const int32_t* bias_tokens = nullptr;
  const float* bias_values = nullptr;
  float* bias_saved = nullptr;
  const int32_t* penalty_slot = nullptr;  // [num_rows]
  const float* repetition = nullptr;      // [num_rows]
  const float* presence = nullptr;        // [num_rows]
  const float* frequency = nullptr;       // [num_rows]
  const int32_t* counts = nullptr;        // [slots, vocab]
  const int32_t* prompt_seen = nullptr;   // [slots, ceil(vocab / 32)]
};
cudaError_t launch_sample(const float* logits, int num_rows, int vocab, const float* temperature,
                          const int32_t* top_k, const float* top_p, const float* min_p,
                          const uint64_t* seed, const int64_t* step, int32_t* out_tokens,
                          cudaStream_t stream, const int32_t* mask = nullptr,
                          const int32_t* mask_slot = nullptr, int mask_words = 0,
                          const SampleAdjust& adjust = {});

// For every i < n with slots[i] in [0, num_slots) and tokens[i] in [0, vocab): prompt ? set bit
// tokens[i] of prompt_seen + slots[i] * ceil(vocab / 32) : counts[slots[i] * vocab +
// tokens[i]] += 1 (atomically: a token may repeat).
cudaError_t launch_count_tokens(int32_t* counts, int32_t* prompt_seen, int vocab, int num_slots,
                                const int32_t* tokens, const int32_t* slots, int n, bool prompt,
                                cudaStream_t stream);

// Logprobs of sampled tokens, one block per row of logits [num_rows, vocab] f32; rows with
// top_k[r] < 0 are skipped. log_z = max + log(sum exp(x - max)); top_ids/top_logprobs[r *
// max_top + j], j < max(top_k[r], 1) <= max_top: the tokens in descending logit order, ties
// toward the lower index, with x - log_z; logprob[r]: that number for tokens[r] where it is
// among them, else x[tokens[r]] - log_z.
cudaError_t launch_sampled_logprobs(const float* logits, int num_rows, int vocab,
                                    const int32_t* tokens, const int32_t* top_k, int max_top,
                                    float* logprob, int32_t* top_ids, float* top_logprobs,
                                    cudaStream_t stream);

// The counter-based uniform of step 6, for host code and tests.
double sampling_uniform(uint64_t seed, int64_t step);

// ---------------------------------------------------------------------------------------------
// GEMM through cuBLASLt: y[M, N] = x[M, K] . W[N, K]^T (+ bias[N]); bf16 in, bf16 or f32 out,
// fp32 accumulation. A handle owns the cuBLASLt context, a fixed workspace and a per-shape cache of
// algorithms, so calls allocate nothing (capturable once a shape has been seen). A handle is
// not thread safe.
// ---------------------------------------------------------------------------------------------
struct GemmHandle;
cudaError_t gemm_create(GemmHandle** handle, size_t workspace_bytes);
void gemm_destroy(GemmHandle* handle);
// bias may be null. y_f32: y holds f32 (the logits, which need no bf16 rounding), else bf16;
// an f32 y takes no bias (cudaErrorNotSupported).
cudaError_t launch_gemm_bf16(GemmHandle* handle, const void* x, const void* w, const void* bias,
                             void* y, bool y_f32, int m, int n, int k, cudaStream_t stream);
// While on, each shape of 4096 rows or more met for the first time (outside graph capture)
// times cuBLASLt's first eight candidates and keeps the fastest; off (the default), and for
// fewer rows: its first choice, untimed. Start-up only: a new shape then costs a few
// milliseconds per candidate and synchronizes.
void gemm_set_tuning(GemmHandle* handle, bool on);
// The cuBLAS status of the handle's last failed call (0 when none), for error messages.
int gemm_last_status(const GemmHandle* handle);

// ---------------------------------------------------------------------------------------------
// FP8 (e4m3) W8A8 GEMMs, on devices with FP8 tensor cores (compute capability 8.9 and up).
// "e4m3" pointers hold OCP E4M3 bytes (__nv_fp8_e4m3).
// ---------------------------------------------------------------------------------------------
// Rows of x [rows, cols] bf16 quantized to e4m3: q[r, c] = e4m3(x[r, c] / scales[r]), rounded to
// nearest even and saturated at +-448. static_scale > 0: every row's scale is static_scale (a
// checkpoint's calibrated input_scale). Else each row's own: scales[r] = max(a / 448, min_scale)
// with a = max |x[r, :]|, or min(a, scale_ub) where scale_ub > 0 (fbgemm's activation_scale_ub:
// outliers saturate instead of coarsening the row). One block per row.
cudaError_t launch_quantize_fp8_rows(const void* x, void* q, float* scales, int rows, int cols,
                                     float static_scale, float scale_ub, float min_scale,
                                     cudaStream_t stream);
// y[M, N] = (x_scales[m] * w_scales[n]) * sum_k xq[m, k] * wq[n, k] (+ bias[n]): xq [M, K] and
// wq [N, K] e4m3, x_scales [M] and w_scales [N] f32, bias [N] bf16 (may be null), y [M, N] bf16,
// f32 accumulation. K and N multiples of 16. cuBLASLt applies the two scale vectors itself
// (CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F) where the device's cuBLASLt has a kernel for
// them; else (or with gemm_fp8_set_epilogue_scaling) the GEMM writes the unscaled sums in bf16
// and one more kernel scales them and adds the bias in place.
// `unscaled` (may be null): where the scales would take the epilogue kernel and there is no
// bias, the kernel is left out and *unscaled set: y holds the unscaled sums, for the next kernel
// to scale as it reads them (Fp8Unscaled); else *unscaled is false and y is scaled.
cudaError_t launch_gemm_fp8(GemmHandle* handle, const void* xq, const float* x_scales,
                            const void* wq, const float* w_scales, const void* bias, void* y, int m,
                            int n, int k, cudaStream_t stream, bool* unscaled = nullptr);
// On: every FP8 shape met from now on takes the epilogue kernel's scaling (tests hold both ways
// to the same reference). Plans already made keep theirs.
void gemm_fp8_set_epilogue_scaling(GemmHandle* handle, bool on);
// Whether the plan of this FP8 shape (made by a call) scales in the epilogue kernel; false when
// no call has made it.
bool gemm_fp8_scales_in_epilogue(const GemmHandle* handle, int m, int n, int k, bool has_bias);
// The epilogue kernel alone: y[m, n] = y[m, n] * x_scales[m] * w_scales[n] (+ bias[n]), bf16 y.
cudaError_t launch_fp8_scale_epilogue(void* y, const float* x_scales, const float* w_scales,
                                      const void* bias, int m, int n, cudaStream_t stream);

}  // namespace pagedlm::cuda
