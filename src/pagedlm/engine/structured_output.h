// Structured output's manager: every request's grammar matcher, the token masks of each step
// and their prefetch. The engine asks it for a step's MaskBatch when it launches the step and
// hands it the step's sampled tokens when it collects it; the worker only reads the rows the
// step's batch names. Who owns what:
// - a matcher is the manager's, touched by its prefetch thread between start and wait
//   (MaskPrefetch) and by the engine thread otherwise;
// - the mask rows are the manager's one block (MaskRows), rows [0, max_num_seqs) the prefetch's
//   (its item i in row i) and rows [max_num_seqs, 2 max_num_seqs) those filled during a step;
//   a GPU worker pins the block in place for its uploads.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <unordered_map>
#include <vector>

#include "pagedlm/engine/worker.h"
#include "pagedlm/sched/request.h"
#include "pagedlm/sched/step_plan.h"

namespace pagedlm {

class MaskPrefetch;
namespace grammar {
class CompiledGrammar;
class Matcher;
}  // namespace grammar

class StructuredOutput {
 public:
  // vocab: the model's logits width; eos_token_ids: the tokens that end an output (a grammar's
  // stop tokens); prefetch_threads: OpenMP threads that fill the next step's masks as soon as a
  // step's tokens are known, 0: masks are filled inside the step that uses them.
  StructuredOutput(int64_t vocab, int32_t max_num_seqs, std::vector<int32_t> eos_token_ids,
                   int prefetch_threads);
  ~StructuredOutput();
  StructuredOutput(const StructuredOutput&) = delete;
  StructuredOutput& operator=(const StructuredOutput&) = delete;

  // Holds the request's output to the grammar from its next token; tokens: the request's (the
  // scheduler's), read for its output length. Fails if the grammar's vocabulary is not the
  // model's.
  void add(int64_t request_id, std::shared_ptr<const grammar::CompiledGrammar> compiled,
           std::shared_ptr<const RequestTokens> tokens);
  // Forgets the request (its output was taken). A prefetch still filling its mask keeps the
  // matcher alive until it is done.
  void remove(int64_t request_id);
  bool has(int64_t request_id) const { return requests_.count(request_id) != 0; }

  // The masks of a step about to launch: sets sampling[b].mask_row of every sequence the plan
  // samples under a grammar that has not terminated (the prefetched row where the prefetch
  // filled it for this output length, else a row of those filled in the step) and returns the
  // batch, whose finish waits for the prefetch and fills the others. `mask_rows` receives each
  // sequence's row (-1: unmasked), which collect() needs. The batch's rows are null when no
  // sequence is masked.
  MaskBatch launch(const StepPlan& plan, std::vector<SeqSampling>& sampling,
                   std::vector<int32_t>& mask_rows);

  // Advances the grammars of a collected step by its sampled tokens (mask_rows: launch()'s).
  // A token the grammar refuses is a defect (its mask allowed it); the output ends there:
  // its token in `sampled` becomes the first EOS id. A token the mask allowed that is not a stop
  // token is accepted by the next prefetch, just before it fills the mask after it, so that the
  // device does not wait for it; a refusal met there ends the output a token later. Call before
  // the scheduler takes the tokens.
  void collect(const StepPlan& plan, const std::vector<int32_t>& mask_rows,
               std::vector<int32_t>& sampled);
  // Starts filling the next masks of the collected step's sequences that go on (goes_on(b): the
  // plan's sequence b neither finished nor was taken away), from their output lengths after the
  // scheduler took the step's tokens. No-op without a prefetch.
  void prefetch(const StepPlan& plan, const std::vector<int32_t>& sampled,
                const std::function<bool(int32_t)>& goes_on);
  // Waits for a prefetch in progress (a step left midway: its requests' matchers are about to
  // go).
  void wait();

  // Host time the prefetch spent filling the masks started after the last collected step (0:
  // none started), and how many of the last launched step's masks came from it.
  double last_prefetch_ms() const { return last_prefetch_ms_; }
  int32_t last_prefetched_masks() const { return last_prefetched_masks_; }

 private:
  struct Entry {
    std::shared_ptr<grammar::Matcher> matcher;
    std::shared_ptr<const RequestTokens> tokens;
    // matcher->terminated() as of the last accept, read here while a prefetch may use matcher.
    bool terminated = false;
    // The prefetch's accept of a token refused it: the output ends at the next token.
    bool refused = false;
  };

  const int64_t vocab_;
  const int32_t max_num_seqs_;
  const std::vector<int32_t> eos_;
  std::shared_ptr<MaskRows> rows_;  // [2 max_num_seqs, bitmask_words(vocab)]
  std::unordered_map<int64_t, Entry> requests_;
  // The last collected step's sequences whose grammars advance now (`advancing`, accepted in
  // collect) or in the next prefetch (`deferred`: its item accepts the token first).
  std::vector<int32_t> advancing_, deferred_;
  double last_prefetch_ms_ = 0;
  int32_t last_prefetched_masks_ = 0;
  // Last, so that its thread stops before anything it could read goes.
  std::unique_ptr<MaskPrefetch> prefetch_;
};

}  // namespace pagedlm
