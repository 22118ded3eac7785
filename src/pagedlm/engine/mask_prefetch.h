// Structured output: the next step's token masks, filled on a worker thread as soon as this
// step's tokens are sampled.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "pagedlm/grammar/grammar.h"

namespace pagedlm {

// A sequence's mask for step N + 1 depends only on its grammar after step N's token. Filled in
// step N + 1 it can hide only behind that step's forward pass; started when step N's tokens are
// sampled (the worker accepts them first) it also runs while the engine finishes step N, the server
// streams its tokens, and step N + 1 is planned, staged and launched. On the H200 (2026-12-02,
// b4a1b73, xgrammar 0.2.9) a 256-sequence SmolLM2 step's masks take 0.33-0.40 ms on 8 host
// threads, a sixth of its 2.2 ms forward pass; prefetched, they were ready before the forward pass
// ended on 86-90% of masked steps. The masks go straight into the rows the step reads (on the
// GPU, the pinned rows its upload starts from): nothing is copied.
class MaskPrefetch {
 public:
  struct Item {
    int64_t request_id = 0;
    // The request's output length when its grammar reached the state the mask is for: a mask is
    // used only by a step that samples the request's next token at that length.
    int64_t num_tokens = 0;
    std::shared_ptr<grammar::Matcher> matcher;  // held until the next start()
    // A token to accept first (the last of the output, allowed by the mask it was sampled
    // under), or -1: the matcher is already there.
    int32_t token = -1;
  };

  // rows: where the masks go, max_rows rows of mask_words words (item i's mask in row i; on the
  // GPU pinned memory the runner uploads from); num_threads: the worker's OpenMP threads.
  MaskPrefetch(int32_t* rows, int32_t max_rows, int32_t mask_words, int num_threads);
  ~MaskPrefetch();
  MaskPrefetch(const MaskPrefetch&) = delete;
  MaskPrefetch& operator=(const MaskPrefetch&) = delete;

  // Waits for the job before, then fills the items' masks on the worker. The caller leaves these
  // matchers and rows [0, items.size()) alone until wait() has returned.
  void start(std::vector<Item> items);
  // Blocks until the job is done. Safe from several threads.
  void wait();
  // The row that holds (once the job is done: wait()) the mask for request_id at num_tokens,
  // every word -1 where the grammar allows all tokens or the item was refused; -1 if none was
  // started for it. Call on the thread that calls start().
  int32_t row_of(int64_t request_id, int64_t num_tokens) const;
  // The requests whose item could not accept its token or fill its mask (the grammar engine
  // refused a token its mask allowed, or threw). Call after wait().
  std::vector<int64_t> refused_requests() const;
  // Host time the last finished job took (0 when the last start() had no items).
  double last_job_ms() const;

 private:
  void run_worker(int num_threads);

  int32_t* const rows_;  // [max_rows_, mask_words_]
  const int32_t max_rows_;
  const int32_t mask_words_;
  std::vector<Item> items_;
  std::unordered_map<int64_t, size_t> index_;  // request id -> position in items_
  std::vector<uint8_t> refused_;               // per item: its token was refused
  mutable std::mutex mu_;
  std::condition_variable cv_;
  bool pending_ = false;  // a job was started and is not finished
  bool stop_ = false;
  double last_job_ms_ = 0;
  std::thread worker_;  // last: it starts once the members above exist
};

}  // namespace pagedlm
