// StepPlan: the one contract between the scheduler and the kernels, built on the host once
// per step (FlashInfer's CSR page table). All index arrays are int32.
#pragma once

#include <cstdint>
#include <vector>

namespace pagedlm {

struct StepPlan {
  int32_t page_size = 16;

  // The packed stream: L tokens of B sequences back to back.
  std::vector<int32_t> token_ids;  // [L]
  std::vector<int32_t> positions;  // [L] position of each token within its sequence
  std::vector<int32_t> q_indptr;   // [B+1] tokens of sequence b: rows q_indptr[b]..q_indptr[b+1]

  // KV pages of sequence b after this step's tokens are appended:
  // kv_page_indices[kv_indptr[b] .. kv_indptr[b+1]], the last one holding kv_last_page_len[b]
  // tokens, so its KV length is (num_pages - 1) * page_size + kv_last_page_len[b].
  std::vector<int32_t> kv_indptr;         // [B+1]
  std::vector<int32_t> kv_page_indices;   // [kv_indptr[B]]
  std::vector<int32_t> kv_last_page_len;  // [B]
  std::vector<int32_t> slot_mapping;      // [L] page * page_size + offset where each K/V goes
  // The page that entries of kv_page_indices no longer backed by a page point to (-1: none):
  // when every layer slides, pages wholly behind all of a sequence's queries' windows go back
  // to the pool, and the table keeps its length so keys are still indexed by position. Such
  // entries form a leading run of the sequence's pages; the null page holds zeroed K/V on the
  // GPU (finite values that the window mask drops), no slot ever maps into it, and equal null
  // entries never mean shared content.
  int32_t null_page = -1;

  // Partial-page prefix hits: (src_page, dst_page, num_tokens) triples, [3 * C]. Before any
  // attention of the step reads them (after each layer's cache write, so a source page filled
  // in this very step is ready), slots 0 .. num_tokens-1 of src_page are copied to the same
  // slots of dst_page, in every layer's K and V cache. dst_page is a fresh page of the
  // sequence that hit, whose own tokens start at slot num_tokens; src_page is never written and
  // no page is both a source and a destination in one step.
  std::vector<int32_t> kv_copies;

  // Rows of the stream that produce logits. Sequence b's rows are
  // logits_rows[logits_indptr[b] .. logits_indptr[b+1]]; if samples[b], the last of them
  // is sampled to extend the sequence.
  std::vector<int32_t> logits_rows;    // [S]
  std::vector<int32_t> logits_indptr;  // [B+1]

  // Host-side bookkeeping, never read by kernels.
  std::vector<int64_t> request_ids;  // [B]
  std::vector<uint8_t> samples;      // [B] 1 if this step ends the sequence's pending tokens

  int32_t num_tokens() const { return static_cast<int32_t>(token_ids.size()); }
  int32_t num_kv_copies() const { return static_cast<int32_t>(kv_copies.size() / 3); }
  int32_t num_seqs() const { return static_cast<int32_t>(request_ids.size()); }
  bool empty() const { return token_ids.empty(); }
};

}  // namespace pagedlm
