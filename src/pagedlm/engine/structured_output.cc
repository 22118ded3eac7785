#include "pagedlm/engine/structured_output.h"

#include <algorithm>
#include <cstdio>
#include <utility>

#include "pagedlm/core/error.h"
#include "pagedlm/core/parallel.h"
#include "pagedlm/engine/mask_prefetch.h"
#include "pagedlm/grammar/grammar.h"

namespace pagedlm {

StructuredOutput::StructuredOutput(int64_t vocab, int32_t max_num_seqs,
                                   std::vector<int32_t> eos_token_ids, int prefetch_threads)
    : vocab_(vocab),
      max_num_seqs_(max_num_seqs),
      eos_(std::move(eos_token_ids)),
      rows_(std::make_shared<MaskRows>(2 * max_num_seqs, grammar::bitmask_words(vocab))) {
  if (prefetch_threads > 0) {
    prefetch_ = std::make_unique<MaskPrefetch>(rows_->row(0), max_num_seqs, rows_->words(),
                                               prefetch_threads);
  }
}

StructuredOutput::~StructuredOutput() = default;

void StructuredOutput::add(int64_t request_id,
                           std::shared_ptr<const grammar::CompiledGrammar> compiled,
                           std::shared_ptr<const RequestTokens> tokens) {
  PAGEDLM_CHECK(compiled, "set_grammar: no grammar");
  // A grammar's output ends at a stop token, and a refused token becomes one.
  PAGEDLM_CHECK(!eos_.empty(), "structured output needs the model's EOS token ids; this model ",
                "declares none");
  auto matcher = std::make_shared<grammar::Matcher>(std::move(compiled));
  PAGEDLM_CHECK(matcher->vocab_size() == vocab_, "the grammar was compiled for ",
                matcher->vocab_size(), " tokens, the model has ", vocab_);
  Entry& entry = requests_[request_id];
  entry = Entry{};
  entry.matcher = std::move(matcher);
  entry.tokens = std::move(tokens);
}

void StructuredOutput::remove(int64_t request_id) { requests_.erase(request_id); }

MaskBatch StructuredOutput::launch(const StepPlan& plan, std::vector<SeqSampling>& sampling,
                                   std::vector<int32_t>& mask_rows) {
  const int32_t B = plan.num_seqs();
  mask_rows.assign(B, -1);
  std::vector<int32_t> to_fill;
  std::vector<grammar::Matcher*> matchers(B, nullptr);
  int32_t num_prefetched = 0;
  for (int32_t b = 0; b < B; ++b) {
    const auto it = requests_.find(plan.request_ids[b]);
    if (it == requests_.end() || it->second.terminated || !plan.samples[b] ||
        plan.logits_indptr[b + 1] == plan.logits_indptr[b]) {
      continue;
    }
    matchers[b] = it->second.matcher.get();
    const int32_t row =
        prefetch_ ? prefetch_->row_of(plan.request_ids[b], it->second.tokens->num_outputs()) : -1;
    if (row >= 0) {
      mask_rows[b] = row;
      ++num_prefetched;
    } else {
      mask_rows[b] = max_num_seqs_ + static_cast<int32_t>(to_fill.size());
      to_fill.push_back(b);
    }
    sampling[b].mask_row = mask_rows[b];
  }
  last_prefetched_masks_ = num_prefetched;
  if (to_fill.empty() && num_prefetched == 0) return {};
  // Waits for the prefetched masks (and for the prefetch to be done with every matcher) and
  // fills the others, all ones where the grammar allows every token; several sequences at once:
  // each matcher is its own, the compiled grammar read-only. The worker calls it within launch.
  MaskBatch batch;
  batch.rows = rows_;
  batch.finish = [this, to_fill = std::move(to_fill), matchers = std::move(matchers),
                  rows = mask_rows] {
    if (prefetch_) prefetch_->wait();
    parallel_for_each(to_fill, [&](int32_t b) {
      int32_t* words = rows_->row(rows[b]);
      if (!matchers[b]->fill_mask(words)) std::fill(words, words + rows_->words(), -1);
    });
  };
  return batch;
}

void StructuredOutput::collect(const StepPlan& plan, const std::vector<int32_t>& mask_rows,
                               std::vector<int32_t>& sampled) {
  advancing_.clear();
  deferred_.clear();
  // The masks prefetched for this step are done (the step's finish waited for those it used);
  // until the next start the matchers are this thread's.
  if (prefetch_) {
    prefetch_->wait();
    last_prefetch_ms_ = prefetch_->last_job_ms();
    for (const int64_t id : prefetch_->refused_requests()) {
      if (auto it = requests_.find(id); it != requests_.end()) it->second.refused = true;
    }
  }
  if (requests_.empty()) return;
  // A token its mask allowed is one the grammar accepts, so where masks are prefetched the
  // accept goes to the prefetch, just before the next mask (`deferred_`); the others (stop
  // tokens, rows sampled without a mask) are accepted here, several sequences at once.
  std::vector<Entry*> entries(plan.num_seqs(), nullptr);
  for (int32_t b = 0; b < plan.num_seqs(); ++b) {
    const auto it = requests_.find(plan.request_ids[b]);
    if (it == requests_.end() || sampled[b] < 0 || it->second.terminated) continue;
    Entry& entry = it->second;
    entries[b] = &entry;
    if (entry.refused) {
      std::fprintf(stderr,
                   "pagedlm: request %lld: its grammar refused token %d, which its mask allowed; "
                   "ending it\n",
                   static_cast<long long>(plan.request_ids[b]), entry.tokens->all.back());
      sampled[b] = eos_.front();
      entries[b] = nullptr;
      continue;
    }
    const int32_t t = sampled[b];
    const bool allowed = b < static_cast<int32_t>(mask_rows.size()) && mask_rows[b] >= 0 &&
                         grammar::bitmask_allows(rows_->row(mask_rows[b]), t);
    if (prefetch_ && allowed && std::find(eos_.begin(), eos_.end(), t) == eos_.end()) {
      deferred_.push_back(b);  // not a stop token: the grammar does not terminate
    } else {
      advancing_.push_back(b);
    }
  }
  std::vector<uint8_t> refused(plan.num_seqs(), 0);
  parallel_for_each(
      advancing_, [&](int32_t b) { refused[b] = entries[b]->matcher->accept(sampled[b]) ? 0 : 1; });
  for (const int32_t b : advancing_) {
    entries[b]->terminated = entries[b]->matcher->terminated();
    if (refused[b] == 0) continue;
    std::fprintf(stderr, "pagedlm: request %lld: token %d is outside its grammar; ending it\n",
                 static_cast<long long>(plan.request_ids[b]), sampled[b]);
    sampled[b] = eos_.front();
  }
}

void StructuredOutput::prefetch(const StepPlan& plan, const std::vector<int32_t>& sampled,
                                const std::function<bool(int32_t)>& goes_on) {
  if (!prefetch_) return;
  // The next masks of the sequences that go on under a grammar, while the step ends, the
  // caller takes its events and the next step is planned and launched.
  std::vector<MaskPrefetch::Item> next;
  const auto add = [&](int32_t b, int32_t token_to_accept) {
    const auto it = requests_.find(plan.request_ids[b]);
    if (it == requests_.end() || it->second.terminated || !goes_on(b)) return;
    next.push_back({plan.request_ids[b], it->second.tokens->num_outputs(), it->second.matcher,
                    token_to_accept});
  };
  for (const int32_t b : advancing_) add(b, -1);
  for (const int32_t b : deferred_) add(b, sampled[b]);
  prefetch_->start(std::move(next));
}

void StructuredOutput::wait() {
  if (prefetch_) prefetch_->wait();
}

}  // namespace pagedlm
