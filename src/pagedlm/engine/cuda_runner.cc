#include "pagedlm/engine/cuda_runner.h"

#include "pagedlm/core/error.h"

#ifdef PAGEDLM_HAS_CUDA
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <tuple>
#include <utility>

#include "pagedlm/core/parallel.h"
#include "pagedlm/engine/engine.h"
#include "pagedlm/engine/paged_kv_cache.h"
#include "pagedlm/model/model.h"
#include "pagedlm/ops/attention_planner.h"
#include "pagedlm/ops/cuda/check.h"
#include "pagedlm/ops/device_state.h"
#include "pagedlm/ops/linear.h"
#include "pagedlm/ops/paged_attention.h"
#include "pagedlm/ops/sampling.h"
#include "pagedlm/sched/shared_prefix.h"
#endif

namespace pagedlm {

#ifdef PAGEDLM_HAS_CUDA

namespace {

int32_t next_pow2(int32_t n) {
  int32_t p = 1;
  while (p < n) p *= 2;
  return p;
}

size_t align16(size_t n) { return (n + 15) / 16 * 16; }

// A pinned host array and its device mirror, grown (never shrunk) on demand between steps, for
// what varies in size from step to step (logit bias lists, tokens filling penalty slots).
template <typename T>
class StagedArray {
 public:
  StagedArray() = default;
  StagedArray(const StagedArray&) = delete;
  StagedArray& operator=(const StagedArray&) = delete;
  ~StagedArray() { release(); }

  // Room for n elements; the contents are lost when it grows, after the stream's work in flight
  // (which may read them) is done.
  void reserve(size_t n, cudaStream_t stream) {
    if (n <= capacity_) return;
    cuda::check(cudaStreamSynchronize(stream), "step (before growing the sampling arrays)");
    release();
    capacity_ = std::max<size_t>(n, 2 * capacity_);
    cuda::check(cudaMallocHost(&host_, sizeof(T) * capacity_), "cudaMallocHost (sampling)");
    cuda::check(cudaMalloc(&dev_, sizeof(T) * capacity_), "cudaMalloc (sampling)");
  }
  void upload(size_t n, cudaStream_t stream) {
    if (n == 0) return;
    cuda::check(cudaMemcpyAsync(dev_, host_, sizeof(T) * n, cudaMemcpyHostToDevice, stream),
                "sampling upload");
  }
  T* host() { return host_; }
  T* dev() { return dev_; }

 private:
  void release() {
    if (host_) cudaFreeHost(host_);
    if (dev_) cudaFree(dev_);
    host_ = dev_ = nullptr;
    capacity_ = 0;
  }
  T* host_ = nullptr;
  T* dev_ = nullptr;
  size_t capacity_ = 0;
};

bool uses_penalties(const SamplingParams& p) {
  return p.repetition_penalty != 1.f || p.presence_penalty != 0.f || p.frequency_penalty != 0.f;
}

}  // namespace

// Staging layout: every array at a fixed offset of one pinned host block mirrored by one device
// block, kv_page_indices last so that a step copies one prefix of the block. Capacities: T
// stream rows (also logits rows), B sequences (padded decode buckets included), P page indices.
struct CudaStepRunner::Impl {
  CausalLM& model;
  PagedKvCache* kv_cache = nullptr;
  bool use_graphs;
  bool use_cascade;
  bool tune_gemms;
  int32_t page_size;
  int32_t num_q_heads, num_kv_heads, head_dim;
  int64_t vocab;
  int64_t max_model_len;
  int64_t cascade_steps = 0;
  // What each step in flight keeps apart from the others, in a ring of kSlots (at most two
  // steps are in flight; the third slot keeps the last collected step's end event for the gap
  // to the next): its pinned download buffers, its events, and what collect reads of its plan.
  static constexpr int kSlots = 3;
  struct Slot {
    cudaEvent_t begin = nullptr, end = nullptr;  // device time: plan upload .. downloads
    cudaEvent_t forward_done = nullptr, masks_sent = nullptr;  // masked steps
    int32_t* host_tokens = nullptr;                            // [T] sampled ids, pinned
    float* host_logprob = nullptr;                             // [T]
    int32_t* host_top_ids = nullptr;                           // [T, kMaxTopLogprobs]
    float* host_top_logprobs = nullptr;
    // The step: per sequence its sampled logits row (-1: none), logprobs asked, penalty slot
    // and that slot's count after this step's draw.
    std::vector<int32_t> sampled_row, logprobs_k, penalty_slot;
    std::vector<int64_t> penalty_counted;
    bool masked = false, logprobs = false, decode = false;
    Tensor logits;  // [S, vocab] f32 on the host when asked for
    double mask_ms = 0;
    bool mask_hidden = false;
  };
  Slot slots[kSlots];
  int64_t launched = 0, collected = 0;  // steps; step k uses slots[k % kSlots]
  // The last collected step was a decode (its end event is in slots[(collected - 1) % kSlots]).
  bool last_collected_decode = false;
  // Recorded after each step's uploads from pinned memory: the next step's staging waits for it
  // before writing the staging block and arrays (the uploads run first in the step, so by then
  // they are done, or nearly).
  cudaEvent_t uploads_done = nullptr;
  // The GPU current when the runner was made (a tensor-parallel rank's own): steps may run on
  // another thread than the one that made it (the server's engine thread), and the current
  // device is per thread.
  int device = 0;
  cudaStream_t stream = nullptr;
  // This runner's own GEMM state (cuBLASLt handle, workspace, plans): another engine in the
  // process, on this GPU or another, has its own.
  std::unique_ptr<ops::DeviceState> device_state;

  int32_t max_tokens = 0;  // T
  int32_t max_bucket = 0;  // largest decode bucket (B = max_bucket)
  int64_t max_pages = 0;   // P
  size_t off_token_ids = 0, off_positions = 0, off_slots = 0, off_logits_rows = 0, off_top_k = 0,
         off_temperature = 0, off_top_p = 0, off_min_p = 0, off_seed = 0, off_step = 0,
         off_mask_slot = 0, off_penalty_slot = 0, off_repetition = 0, off_presence = 0,
         off_frequency = 0, off_bias_indptr = 0, off_logprobs_k = 0, off_q_indptr = 0,
         off_kv_indptr = 0, off_last_len = 0, off_kv_skip = 0, off_num_items = 0, off_items = 0,
         off_members = 0, off_seq_order = 0, off_copies = 0, off_pages = 0, total_bytes = 0;
  char* host = nullptr;
  char* dev = nullptr;
  int32_t* dev_tokens = nullptr;  // [T]: the last step's sampled ids, which pending rows read
  Tensor logits;                  // [T, vocab] f32
  // The attention's launch shapes and a step's attention arrays (split counts, the cascade's
  // items, the decode order); the split-KV workspace and the merge's counters it sizes are
  // allocated here.
  std::optional<ops::AttentionPlanner> attention;
  void* workspace = nullptr;
  void* merge_counters = nullptr;
  // Token bitmasks (structured output): rows written on the host (a step's MaskBatch), the
  // step's used rows uploaded to the same rows of one fixed device buffer that the sampler
  // reads through each logits row's slot (off_mask_slot, -1: unmasked). Two rows per sequence:
  // the structured-output manager keeps masks filled ahead of a step apart from those filled in
  // it. The host block is the manager's, pinned here in place (cudaHostRegister) while the
  // runner holds it.
  int32_t mask_words = 0, max_masks = 0;
  std::shared_ptr<MaskRows> host_masks;  // [<= max_masks, mask_words], pinned
  int32_t* dev_masks = nullptr;
  // The upload runs on its own stream from the moment the masks are done, beside the forward
  // pass; the sampler waits for it (masks_uploaded).
  cudaStream_t upload_stream = nullptr;
  cudaEvent_t masks_uploaded = nullptr;
  // Penalties' token state (cuda_runner.h): one slot per possible sequence of a step, with a
  // host record of which request holds it and how many of its outputs the device has counted
  // (and the last one, as downloaded), to tell when a slot must be filled again.
  struct PenaltySlot {
    int64_t request_id = -1;
    int64_t counted = 0;
    int32_t last_token = -1;
    int64_t last_used = -1;  // the run that last sampled with it
  };
  ops::TokenState token_state;
  std::vector<PenaltySlot> penalty_slots;
  std::map<int64_t, int32_t> slot_of_request;
  int64_t run_count = 0, slot_fills = 0;
  std::vector<int32_t> step_penalty_slot;  // per sequence of the current run, -1: none
  std::vector<int32_t> slots_to_fill;      // the current run's sequences whose slot is filled
  // Tokens filling slots this step: prompt tokens then output tokens, and each one's slot.
  StagedArray<int32_t> fill_tokens, fill_slots;
  // The step's logit bias lists (tokens, values) and the device scratch the sampler keeps the
  // replaced logits in.
  StagedArray<int32_t> bias_tokens;
  StagedArray<float> bias_values;
  float* bias_saved = nullptr;
  size_t bias_saved_capacity = 0;
  // Logprobs of sampled tokens: per logits row, the token's and the top kMaxTopLogprobs.
  float* dev_logprob = nullptr;
  int32_t* dev_top_ids = nullptr;
  float* dev_top_logprobs = nullptr;
  int64_t logits_downloads = 0;
  // What the current step samples with beyond temperature and filters.
  bool step_biased = false, step_penalized = false, step_logprobs = false;

  // (decode bucket, cascade, forward only): forward-only graphs serve decode steps whose sampler
  // runs eagerly: masked ones (after the masks' upload) and those with bias, penalties or
  // logprobs.
  std::map<std::tuple<int32_t, bool, bool>, cudaGraphExec_t> graphs;

  Impl(CausalLM& m, const EngineOptions& o, int64_t max_len)
      : model(m),
        use_graphs(o.use_cuda_graphs),
        use_cascade(o.use_cascade_attention),
        tune_gemms(o.tune_gemms),
        page_size(o.page_size),
        max_model_len(max_len) {
    const ModelConfig& c = m.config();
    // This rank's heads (all of them without tensor parallelism): the attention it runs.
    const RankDims dims = rank_dims(c, m.tensor_parallel());
    num_q_heads = static_cast<int32_t>(dims.q_heads);
    num_kv_heads = static_cast<int32_t>(dims.kv_heads);
    head_dim = static_cast<int32_t>(c.head_dim);
    PAGEDLM_CHECK(ops::cuda_attention_runs_head_dim(c.head_dim), "head_dim ", c.head_dim,
                  " is not supported on the GPU: its attention runs head sizes ",
                  ops::cuda_attention_head_dims_text(), " (the CPU runs any even head size)");
    vocab = c.vocab_size;
    cuda::check(cudaGetDevice(&device), "cudaGetDevice");
    ops::cuda::require_supported_device(device);
    device_state = std::make_unique<ops::DeviceState>();
    cuda::check(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "cudaStreamCreate");
    cuda::check(cudaEventCreateWithFlags(&uploads_done, cudaEventDisableTiming), "cudaEventCreate");
    cuda::check(cudaStreamCreateWithFlags(&upload_stream, cudaStreamNonBlocking),
                "cudaStreamCreate");
    cuda::check(cudaEventCreateWithFlags(&masks_uploaded, cudaEventDisableTiming),
                "cudaEventCreate");
    // A decode step holds at most min(max_num_seqs, token budget) sequences.
    max_bucket = next_pow2(std::min(o.max_num_seqs, o.max_num_batched_tokens));
    max_tokens = std::max(o.max_num_batched_tokens, max_bucket);
    const int64_t pages_per_seq = (max_model_len + page_size - 1) / page_size + 1;
    layout(int64_t{o.max_num_seqs} * pages_per_seq);
    cuda::check(cudaMalloc(&dev_tokens, sizeof(int32_t) * max_tokens), "cudaMalloc");
    logits = Tensor::empty(DType::kF32, {max_tokens, vocab}, Device::kCuda);
    mask_words = static_cast<int32_t>((vocab + 31) / 32);
    max_masks = 2 * o.max_num_seqs;
    const size_t mask_bytes = sizeof(int32_t) * mask_words * max_masks;
    cuda::check(cudaMalloc(&dev_masks, mask_bytes), "cudaMalloc (token masks)");
    token_state.vocab = vocab;
    token_state.num_slots = o.max_num_seqs;
    token_state.device = Device::kCuda;
    const size_t count_bytes = sizeof(int32_t) * vocab * o.max_num_seqs;
    const size_t seen_bytes = sizeof(int32_t) * mask_words * o.max_num_seqs;
    cuda::check(cudaMalloc(&token_state.counts, count_bytes), "cudaMalloc (penalty counts)");
    cuda::check(cudaMalloc(&token_state.prompt_seen, seen_bytes), "cudaMalloc (penalty counts)");
    penalty_slots.resize(o.max_num_seqs);
    const size_t top_entries = static_cast<size_t>(max_tokens) * ops::kMaxTopLogprobs;
    cuda::check(cudaMalloc(&dev_logprob, sizeof(float) * max_tokens), "cudaMalloc (logprobs)");
    cuda::check(cudaMalloc(&dev_top_ids, sizeof(int32_t) * top_entries), "cudaMalloc (logprobs)");
    cuda::check(cudaMalloc(&dev_top_logprobs, sizeof(float) * top_entries),
                "cudaMalloc (logprobs)");
    for (Slot& slot : slots) {
      cuda::check(cudaEventCreate(&slot.begin), "cudaEventCreate");
      cuda::check(cudaEventCreate(&slot.end), "cudaEventCreate");
      cuda::check(cudaEventCreate(&slot.forward_done), "cudaEventCreate");
      cuda::check(cudaEventCreate(&slot.masks_sent), "cudaEventCreate");
      cuda::check(cudaMallocHost(&slot.host_tokens, sizeof(int32_t) * max_tokens),
                  "cudaMallocHost");
      cuda::check(cudaMallocHost(&slot.host_logprob, sizeof(float) * max_tokens), "cudaMallocHost");
      cuda::check(cudaMallocHost(&slot.host_top_ids, sizeof(int32_t) * top_entries),
                  "cudaMallocHost");
      cuda::check(cudaMallocHost(&slot.host_top_logprobs, sizeof(float) * top_entries),
                  "cudaMallocHost");
    }
    m.reserve(max_tokens);
    ops::AttentionShape shape;
    shape.num_q_heads = num_q_heads;
    shape.num_kv_heads = num_kv_heads;
    shape.head_dim = head_dim;
    shape.max_model_len = max_model_len;
    shape.max_bucket = max_bucket;
    shape.page_size = page_size;
    shape.cascade = use_cascade;
    attention.emplace(shape, ops::cuda::attention_launch_rules(device));
    const size_t workspace_bytes = attention->workspace_bytes();
    if (workspace_bytes > 0) cuda::check(cudaMalloc(&workspace, workspace_bytes), "cudaMalloc");
    const size_t counter_bytes = attention->merge_counter_bytes();
    if (counter_bytes > 0) {
      cuda::check(cudaMalloc(&merge_counters, counter_bytes), "cudaMalloc");
      cuda::check(cudaMemset(merge_counters, 0, counter_bytes), "cudaMemset");
    }
  }

  ~Impl() {
    drop_graphs();
    if (host) cudaFreeHost(host);
    if (dev) cudaFree(dev);
    if (dev_tokens) cudaFree(dev_tokens);
    if (workspace) cudaFree(workspace);
    if (merge_counters) cudaFree(merge_counters);
    if (stream) cudaStreamSynchronize(stream);  // a step still in flight
    for (Slot& slot : slots) {
      if (slot.begin) cudaEventDestroy(slot.begin);
      if (slot.end) cudaEventDestroy(slot.end);
      if (slot.forward_done) cudaEventDestroy(slot.forward_done);
      if (slot.masks_sent) cudaEventDestroy(slot.masks_sent);
      if (slot.host_tokens) cudaFreeHost(slot.host_tokens);
      if (slot.host_logprob) cudaFreeHost(slot.host_logprob);
      if (slot.host_top_ids) cudaFreeHost(slot.host_top_ids);
      if (slot.host_top_logprobs) cudaFreeHost(slot.host_top_logprobs);
    }
    if (uploads_done) cudaEventDestroy(uploads_done);
    if (masks_uploaded) cudaEventDestroy(masks_uploaded);
    unpin_masks();
    if (upload_stream) cudaStreamDestroy(upload_stream);
    if (dev_masks) cudaFree(dev_masks);
    if (token_state.counts) cudaFree(token_state.counts);
    if (token_state.prompt_seen) cudaFree(token_state.prompt_seen);
    if (bias_saved) cudaFree(bias_saved);
    if (dev_logprob) cudaFree(dev_logprob);
    if (dev_top_ids) cudaFree(dev_top_ids);
    if (dev_top_logprobs) cudaFree(dev_top_logprobs);
    if (stream) cudaStreamDestroy(stream);
  }

  void drop_graphs() {
    for (auto& [key, exec] : graphs) cudaGraphExecDestroy(exec);
    graphs.clear();
  }

  // (Re)allocates the staging blocks for `pages` page indices. Captured graphs hold the old
  // device pointers, so they are dropped.
  void layout(int64_t pages) {
    if (stream) cuda::check(cudaStreamSynchronize(stream), "step (before growing the plan block)");
    drop_graphs();
    if (host) cudaFreeHost(host);
    if (dev) cudaFree(dev);
    host = dev = nullptr;
    max_pages = pages;
    const size_t T = static_cast<size_t>(max_tokens), B = static_cast<size_t>(max_bucket);
    size_t off = 0;
    auto take = [&](size_t bytes) {
      const size_t at = off;
      off = align16(off + bytes);
      return at;
    };
    off_token_ids = take(4 * T);
    off_positions = take(4 * T);
    off_slots = take(4 * T);
    off_logits_rows = take(4 * T);
    off_top_k = take(4 * T);
    off_temperature = take(4 * T);
    off_top_p = take(4 * T);
    off_min_p = take(4 * T);
    off_seed = take(8 * T);
    off_step = take(8 * T);
    off_mask_slot = take(4 * T);
    off_penalty_slot = take(4 * T);
    off_repetition = take(4 * T);
    off_presence = take(4 * T);
    off_frequency = take(4 * T);
    off_bias_indptr = take(4 * (T + 1));
    off_logprobs_k = take(4 * T);
    off_q_indptr = take(4 * (B + 1));
    off_kv_indptr = take(4 * (B + 1));
    off_last_len = take(4 * B);
    off_kv_skip = take(4 * B);
    off_num_items = take(4);
    off_items = take(16 * B);
    off_members = take(4 * B);
    off_seq_order = take(4 * B);
    // Partial-page copies: at most one per sequence admitted in the step, which takes at least
    // one token of the budget and a place under max_num_seqs.
    off_copies = take(4 * 3 * B);
    off_pages = take(4 * static_cast<size_t>(pages));
    total_bytes = off;
    cuda::check(cudaMallocHost(&host, total_bytes), "cudaMallocHost (step plan)");
    cuda::check(cudaMalloc(&dev, total_bytes), "cudaMalloc (step plan)");
  }

  template <typename T>
  T* h(size_t off) {
    return reinterpret_cast<T*>(host + off);
  }
  template <typename T>
  T* d(size_t off) {
    return reinterpret_cast<T*>(dev + off);
  }

  // The model and the sampler for a staged step of `rows` stream rows and `logit_rows` logits.
  void forward_and_sample(int32_t rows, int32_t logit_rows) {
    forward(rows, logit_rows);
    sample(logit_rows, /*masked=*/false, /*extras=*/false);
  }

  void forward(int32_t rows, int32_t logit_rows) {
    ForwardInputs in;
    in.token_ids = Tensor::wrap(d<int32_t>(off_token_ids), DType::kI32, {rows}, Device::kCuda, {});
    in.logits_rows =
        Tensor::wrap(d<int32_t>(off_logits_rows), DType::kI32, {logit_rows}, Device::kCuda, {});
    in.stream = stream;
    in.device_state = device_state.get();
    const Tensor step_logits = logits.rows(0, logit_rows);
    // No ForwardStop: a GPU step takes milliseconds and always runs to the end.
    static_cast<void>(model.forward(in, *kv_cache, step_logits));
  }

  // masked: some rows have token masks (uploaded into dev_masks); otherwise the sampler takes
  // its unmasked kernel, which never looks at a mask. extras: the step's bias, penalties and
  // logprobs (step_biased, step_penalized, step_logprobs) are applied; never in a graph's
  // capture (captured steps sample with neither).
  void sample(int32_t logit_rows, bool masked, bool extras) {
    const Tensor step_logits = logits.rows(0, logit_rows);
    ops::SamplerRows params;
    params.temperature = d<float>(off_temperature);
    params.top_k = d<int32_t>(off_top_k);
    params.top_p = d<float>(off_top_p);
    params.min_p = d<float>(off_min_p);
    params.seed = d<uint64_t>(off_seed);
    params.step = d<int64_t>(off_step);
    if (masked) {
      params.mask = dev_masks;
      params.mask_slot = d<int32_t>(off_mask_slot);
      params.mask_words = mask_words;
    }
    if (extras && step_biased) {
      params.bias_indptr = d<int32_t>(off_bias_indptr);
      params.bias_tokens = bias_tokens.dev();
      params.bias_values = bias_values.dev();
      params.bias_saved = bias_saved;
    }
    if (extras && step_penalized) {
      params.penalty_slot = d<int32_t>(off_penalty_slot);
      params.repetition_penalty = d<float>(off_repetition);
      params.presence_penalty = d<float>(off_presence);
      params.frequency_penalty = d<float>(off_frequency);
      params.token_counts = token_state.counts;
      params.prompt_seen = token_state.prompt_seen;
    }
    ops::sample_tokens(step_logits, params,
                       Tensor::wrap(dev_tokens, DType::kI32, {logit_rows}, Device::kCuda, {}),
                       stream);
    if (extras && step_penalized) {
      // Each penalized row's sampled token joins its slot's counts, before the next step reads.
      ops::count_tokens(token_state, dev_tokens, d<int32_t>(off_penalty_slot), logit_rows,
                        /*prompt=*/false, stream);
    }
    if (extras && step_logprobs) {
      ops::LogprobRows rows;
      rows.tokens = dev_tokens;
      rows.top_k = d<int32_t>(off_logprobs_k);
      rows.logprob = dev_logprob;
      rows.top_ids = dev_top_ids;
      rows.top_logprobs = dev_top_logprobs;
      ops::sampled_logprobs(step_logits, rows, stream);
    }
  }

  // The penalty slot of every penalized sequence the step samples (step_penalty_slot): the one
  // its request holds, else the least recently used slot no sequence of this step holds. A slot
  // taken now, or whose record disagrees with the request's outputs (a token the engine
  // replaced after the draw), is queued to be filled from the request's tokens.
  void assign_penalty_slots(const StepPlan& plan, const std::vector<SeqSampling>& sampling) {
    const int32_t B = plan.num_seqs();
    ++run_count;
    step_penalty_slot.assign(B, -1);
    slots_to_fill.clear();
    std::vector<int32_t> waiting;
    for (int32_t b = 0; b < B; ++b) {
      const SeqSampling& s = sampling[b];
      if (!plan.samples[b] || plan.logits_indptr[b + 1] == plan.logits_indptr[b] ||
          !uses_penalties(*s.params)) {
        continue;
      }
      PAGEDLM_CHECK(s.tokens != nullptr && s.request_id >= 0,
                    "a penalized sequence needs its request's tokens");
      auto it = slot_of_request.find(s.request_id);
      if (it == slot_of_request.end()) {
        waiting.push_back(b);
        continue;
      }
      step_penalty_slot[b] = it->second;
      penalty_slots[it->second].last_used = run_count;
    }
    for (const int32_t b : waiting) {
      int32_t best = -1;
      for (int32_t slot = 0; slot < static_cast<int32_t>(penalty_slots.size()); ++slot) {
        if (penalty_slots[slot].last_used == run_count) continue;
        if (best < 0 || penalty_slots[slot].last_used < penalty_slots[best].last_used) best = slot;
      }
      PAGEDLM_CHECK(best >= 0, "more penalized sequences in a step than penalty slots (",
                    penalty_slots.size(), ")");
      PenaltySlot& slot = penalty_slots[best];
      if (slot.request_id >= 0) slot_of_request.erase(slot.request_id);
      slot = PenaltySlot{sampling[b].request_id, -1, -1, run_count};
      slot_of_request[sampling[b].request_id] = best;
      step_penalty_slot[b] = best;
    }
    for (int32_t b = 0; b < B; ++b) {
      const int32_t slot = step_penalty_slot[b];
      if (slot < 0) continue;
      const std::span<const int32_t> out = sampling[b].tokens->outputs();
      const PenaltySlot& rec = penalty_slots[slot];
      const bool current = rec.counted == static_cast<int64_t>(out.size()) &&
                           (out.empty() || rec.last_token == out.back());
      if (!current) slots_to_fill.push_back(b);
    }
  }

  // Enqueues the filling of slots_to_fill's slots from their requests' tokens.
  void fill_penalty_slots(const std::vector<SeqSampling>& sampling) {
    if (slots_to_fill.empty()) return;
    size_t num_prompt = 0, num_out = 0;
    for (const int32_t b : slots_to_fill) {
      num_prompt += sampling[b].tokens->prompt().size();
      num_out += sampling[b].tokens->outputs().size();
    }
    // Zero the slots, then mark the prompts' tokens and count the outputs' on the device.
    const size_t total = num_prompt + num_out;
    fill_tokens.reserve(total, stream);
    fill_slots.reserve(total, stream);
    size_t at_prompt = 0, at_out = num_prompt;
    for (const int32_t b : slots_to_fill) {
      const int32_t slot = step_penalty_slot[b];
      const RequestTokens& t = *sampling[b].tokens;
      // A pending token's value is on the device only; its request held this slot when the
      // step that samples it was launched (every sequence of a step keeps its slot).
      PAGEDLM_CHECK(t.size() == 0 || t.all.back() != kPendingToken, "request ",
                    sampling[b].request_id, "'s penalty slot must be filled from its tokens ",
                    "while one is pending");
      for (const int32_t token : t.prompt()) {
        fill_tokens.host()[at_prompt] = token;
        fill_slots.host()[at_prompt++] = slot;
      }
      for (const int32_t token : t.outputs()) {
        fill_tokens.host()[at_out] = token;
        fill_slots.host()[at_out++] = slot;
      }
      cuda::check(cudaMemsetAsync(token_state.counts + static_cast<size_t>(slot) * vocab, 0,
                                  sizeof(int32_t) * vocab, stream),
                  "penalty slot reset");
      cuda::check(cudaMemsetAsync(token_state.prompt_seen + static_cast<size_t>(slot) * mask_words,
                                  0, sizeof(int32_t) * mask_words, stream),
                  "penalty slot reset");
      PenaltySlot& rec = penalty_slots[slot];
      rec.counted = static_cast<int64_t>(t.outputs().size());
      rec.last_token = t.outputs().empty() ? -1 : t.outputs().back();
      ++slot_fills;
    }
    fill_tokens.upload(total, stream);
    fill_slots.upload(total, stream);
    ops::count_tokens(token_state, fill_tokens.dev(), fill_slots.dev(),
                      static_cast<int64_t>(num_prompt), /*prompt=*/true, stream);
    ops::count_tokens(token_state, fill_tokens.dev() + num_prompt, fill_slots.dev() + num_prompt,
                      static_cast<int64_t>(num_out), /*prompt=*/false, stream);
  }

  void capture(std::tuple<int32_t, bool, bool> key, int32_t rows) {
    cudaGraph_t graph = nullptr;
    cuda::check(cudaStreamBeginCapture(stream, cudaStreamCaptureModeThreadLocal),
                "cudaStreamBeginCapture");
    try {
      if (std::get<2>(key)) {
        forward(rows, rows);
      } else {
        forward_and_sample(rows, rows);
      }
    } catch (...) {
      cudaStreamEndCapture(stream, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    cuda::check(cudaStreamEndCapture(stream, &graph), "cudaStreamEndCapture");
    cudaGraphExec_t exec = nullptr;
    const cudaError_t err = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    cuda::check(err, "cudaGraphInstantiate");
    graphs.emplace(key, exec);
  }

  // Copies the plan into the staging block, padded to `rows` stream rows, `num_seqs` sequences
  // and `logit_rows` logits rows: padding rows have slot -1, padding sequences no tokens or
  // pages, padding logits rows point at row 0 and are sampled greedily and ignored. Then one
  // asynchronous upload on the step's stream. `shared` lists the cascade's groups (may be
  // empty): the planner makes them items of at most members_per_item() members. Decode steps
  // also get the order in which attention starts the sequences.
  void stage(const StepPlan& plan, const std::vector<SeqSampling>& sampling, int32_t rows,
             int32_t num_seqs, int32_t logit_rows, bool decode,
             std::span<const ops::SharedPrefixRun> shared, cudaEvent_t begin) {
    const int32_t B = plan.num_seqs(), L = plan.num_tokens();
    const int64_t num_pages = static_cast<int64_t>(plan.kv_page_indices.size());
    if (num_pages > max_pages) layout(std::max(num_pages, 2 * max_pages));
    auto fill = [](int32_t* dst, const std::vector<int32_t>& src, int32_t n, int32_t pad) {
      std::memcpy(dst, src.data(), src.size() * sizeof(int32_t));
      std::fill(dst + src.size(), dst + n, pad);
    };
    fill(h<int32_t>(off_token_ids), plan.token_ids, rows, 0);
    fill(h<int32_t>(off_positions), plan.positions, rows, 0);
    fill(h<int32_t>(off_slots), plan.slot_mapping, rows, -1);
    fill(h<int32_t>(off_logits_rows), plan.logits_rows, logit_rows, 0);
    fill(h<int32_t>(off_q_indptr), plan.q_indptr, num_seqs + 1, L);
    fill(h<int32_t>(off_kv_indptr), plan.kv_indptr, num_seqs + 1, plan.kv_indptr[B]);
    fill(h<int32_t>(off_last_len), plan.kv_last_page_len, num_seqs, 0);
    std::memcpy(h<int32_t>(off_pages), plan.kv_page_indices.data(), num_pages * sizeof(int32_t));
    PAGEDLM_CHECK(plan.num_kv_copies() <= max_bucket, "step of ", plan.num_kv_copies(),
                  " partial-page copies exceeds the GPU buffers (", max_bucket, ")");
    if (!plan.kv_copies.empty()) {
      std::memcpy(h<int32_t>(off_copies), plan.kv_copies.data(),
                  plan.kv_copies.size() * sizeof(int32_t));
    }
    std::fill(h<float>(off_temperature), h<float>(off_temperature) + logit_rows, 0.f);
    std::fill(h<int32_t>(off_top_k), h<int32_t>(off_top_k) + logit_rows, 0);
    std::fill(h<float>(off_top_p), h<float>(off_top_p) + logit_rows, 1.f);
    std::fill(h<float>(off_min_p), h<float>(off_min_p) + logit_rows, 0.f);
    std::fill(h<uint64_t>(off_seed), h<uint64_t>(off_seed) + logit_rows, 0);
    std::fill(h<int64_t>(off_step), h<int64_t>(off_step) + logit_rows, 0);
    std::fill(h<int32_t>(off_mask_slot), h<int32_t>(off_mask_slot) + logit_rows, -1);
    std::fill(h<int32_t>(off_penalty_slot), h<int32_t>(off_penalty_slot) + logit_rows, -1);
    std::fill(h<float>(off_repetition), h<float>(off_repetition) + logit_rows, 1.f);
    std::fill(h<float>(off_presence), h<float>(off_presence) + logit_rows, 0.f);
    std::fill(h<float>(off_frequency), h<float>(off_frequency) + logit_rows, 0.f);
    std::fill(h<int32_t>(off_logprobs_k), h<int32_t>(off_logprobs_k) + logit_rows, -1);
    // Bias lists in logits-row order (bias_indptr), so every row's entries are contiguous.
    size_t num_bias = 0;
    for (int32_t b = 0; b < B; ++b) {
      if (plan.samples[b] && plan.logits_indptr[b + 1] > plan.logits_indptr[b]) {
        num_bias += sampling[b].params->logit_bias.size();
      }
    }
    step_biased = num_bias > 0;
    step_penalized = step_logprobs = false;
    if (step_biased) {
      bias_tokens.reserve(num_bias, stream);
      bias_values.reserve(num_bias, stream);
      if (num_bias > bias_saved_capacity) {
        cuda::check(cudaStreamSynchronize(stream), "step (before growing the bias scratch)");
        if (bias_saved) cudaFree(bias_saved);
        bias_saved = nullptr;
        bias_saved_capacity = std::max(num_bias, 2 * bias_saved_capacity);
        cuda::check(cudaMalloc(&bias_saved, sizeof(float) * bias_saved_capacity),
                    "cudaMalloc (logit bias)");
      }
    }
    int32_t* bias_indptr = h<int32_t>(off_bias_indptr);
    std::fill(bias_indptr, bias_indptr + logit_rows + 1, 0);
    for (int32_t b = 0; b < B; ++b) {
      const int32_t last = plan.logits_indptr[b + 1];
      if (!plan.samples[b] || last == plan.logits_indptr[b]) continue;
      const SeqSampling& s = sampling[b];
      h<float>(off_temperature)[last - 1] = s.params->temperature;
      h<int32_t>(off_top_k)[last - 1] = s.params->top_k;
      h<float>(off_top_p)[last - 1] = s.params->top_p;
      h<float>(off_min_p)[last - 1] = s.params->min_p;
      h<uint64_t>(off_seed)[last - 1] = s.seed;
      h<int64_t>(off_step)[last - 1] = s.step;
      if (s.mask_row >= 0) {
        PAGEDLM_CHECK(s.mask_row < max_masks, "mask row ", s.mask_row, " out of range");
        h<int32_t>(off_mask_slot)[last - 1] = s.mask_row;
      }
      if (b < static_cast<int32_t>(step_penalty_slot.size()) && step_penalty_slot[b] >= 0) {
        step_penalized = true;
        h<int32_t>(off_penalty_slot)[last - 1] = step_penalty_slot[b];
        h<float>(off_repetition)[last - 1] = s.params->repetition_penalty;
        h<float>(off_presence)[last - 1] = s.params->presence_penalty;
        h<float>(off_frequency)[last - 1] = s.params->frequency_penalty;
      }
      if (s.logprobs_top_k >= 0) {
        PAGEDLM_CHECK(s.logprobs_top_k <= ops::kMaxTopLogprobs, "top logprobs must be at most ",
                      ops::kMaxTopLogprobs, " on the GPU, got ", s.logprobs_top_k);
        step_logprobs = true;
        h<int32_t>(off_logprobs_k)[last - 1] = s.logprobs_top_k;
      }
    }
    // Row r's bias entries: [bias_indptr[r], bias_indptr[r + 1]); only last rows have any.
    for (int32_t b = 0; b < B; ++b) {
      const int32_t last = plan.logits_indptr[b + 1];
      if (!plan.samples[b] || last == plan.logits_indptr[b]) continue;
      bias_indptr[last] = static_cast<int32_t>(sampling[b].params->logit_bias.size());
    }
    size_t at = 0;
    for (int32_t r = 0; r < logit_rows; ++r) {
      const int32_t n = bias_indptr[r + 1];
      bias_indptr[r + 1] = bias_indptr[r] + n;
    }
    for (int32_t b = 0; b < B && step_biased; ++b) {
      const int32_t last = plan.logits_indptr[b + 1];
      if (!plan.samples[b] || last == plan.logits_indptr[b]) continue;
      for (const auto& [token, value] : sampling[b].params->logit_bias) {
        bias_tokens.host()[at] = token;
        bias_values.host()[at++] = value;
      }
    }
    ops::AttentionStepArrays arrays;
    arrays.kv_skip = h<int32_t>(off_kv_skip);
    arrays.num_items = h<int32_t>(off_num_items);
    arrays.items = h<int32_t>(off_items);
    arrays.members = h<int32_t>(off_members);
    arrays.seq_order = h<int32_t>(off_seq_order);
    attention->plan_step(plan.kv_indptr, num_seqs, decode, shared, arrays);
    cuda::check(cudaEventRecord(begin, stream), "cudaEventRecord");  // host work done
    cuda::check(cudaMemcpyAsync(dev, host, off_pages + num_pages * sizeof(int32_t),
                                cudaMemcpyHostToDevice, stream),
                "step plan upload");
    if (step_biased) {
      bias_tokens.upload(num_bias, stream);
      bias_values.upload(num_bias, stream);
    }
  }

  // Points the KV cache's attention at the staged plan (leading_decodes: see
  // ops::AttentionPlan). The tensors view the fixed device block, sized by its capacity where
  // the step's length varies (stream rows, page indices).
  void bind(int32_t num_seqs, int32_t max_q_len, bool decode, bool cascade,
            int32_t leading_decodes = 0, int32_t num_copies = 0) {
    auto view = [&](size_t off, Shape shape) {
      return Tensor::wrap(dev + off, DType::kI32, std::move(shape), Device::kCuda, {});
    };
    ops::AttentionPlan p;
    p.positions = view(off_positions, {max_tokens});
    p.slot_mapping = view(off_slots, {max_tokens});
    p.q_indptr = view(off_q_indptr, {num_seqs + 1});
    p.kv_indptr = view(off_kv_indptr, {num_seqs + 1});
    p.kv_page_indices = view(off_pages, {max_pages});
    p.kv_last_page_len = view(off_last_len, {num_seqs});
    p.max_q_len = max_q_len;
    p.decode = decode;
    p.num_leading_decodes = decode ? 0 : leading_decodes;
    if (decode) p.seq_order = view(off_seq_order, {num_seqs});
    if (decode && cascade) {
      p.kv_skip = view(off_kv_skip, {num_seqs});
      p.shared_num_items = view(off_num_items, {1});
      p.shared_items = view(off_items, {num_seqs, 4});
      p.shared_members = view(off_members, {num_seqs});
      p.shared_max_items = num_seqs;
    }
    attention->plan_launch(p, num_seqs, cascade, workspace, merge_counters);
    kv_cache->bind(p, stream, num_copies > 0 ? view(off_copies, {num_copies, 3}) : Tensor());
  }

  // Replays the bucket's graph, capturing it first if this is the bucket's first step (the
  // eager run before the capture is its warm-up: it sets the attention kernel's shared-memory
  // limit and builds the cuBLASLt plans for this shape, so the capture only records launches).
  void run_decode_graph(int32_t bucket, bool cascade, bool forward_only = false) {
    const std::tuple<int32_t, bool, bool> key{bucket, cascade, forward_only};
    auto it = graphs.find(key);
    if (it != graphs.end()) {
      cuda::check(cudaGraphLaunch(it->second, stream), "cudaGraphLaunch");
      return;
    }
    // A step still in flight on the stream ends first: the capture records this one alone.
    cuda::check(cudaStreamSynchronize(stream), "step (before a graph capture)");
    if (forward_only) {
      forward(bucket, bucket);
    } else {
      forward_and_sample(bucket, bucket);
    }
    capture(key, bucket);
  }

  // Start-up work that would otherwise land on the first steps: one eager step at the full
  // token budget (cuBLASLt context and plans, tuned when tune_gemms is on, kernel modules) and
  // one step per decode bucket, captured as its graph with graphs on (two with cascade
  // attention: with and without the shared pass). Every row and sequence is padding, so the KV
  // cache is not touched.
  void warm_up() {
    cuda::check(cudaSetDevice(device), "cudaSetDevice");
    struct Tuning {  // on for the warm-up's new GEMM shapes only, even if a step throws
      Tuning(ops::DeviceState& state, bool on) : state(state) { state.set_linear_tuning(on); }
      ~Tuning() { state.set_linear_tuning(false); }
      Tuning(const Tuning&) = delete;
      Tuning& operator=(const Tuning&) = delete;
      ops::DeviceState& state;
    } tuning(*device_state, tune_gemms);
    StepPlan empty;
    empty.q_indptr = empty.kv_indptr = empty.logits_indptr = {0};
    stage(empty, {}, max_tokens, 1, 1, /*decode=*/false, {}, slots[0].begin);
    bind(1, 1, false, false);
    forward_and_sample(max_tokens, 1);
    for (int32_t bucket = 1; bucket <= max_bucket; bucket *= 2) {
      for (const bool cascade : {false, true}) {
        if (cascade && !use_cascade) continue;
        stage(empty, {}, bucket, bucket, bucket, /*decode=*/true, {}, slots[0].begin);
        bind(bucket, 1, true, cascade);
        if (use_graphs) {
          run_decode_graph(bucket, cascade);
        } else {
          forward_and_sample(bucket, bucket);
        }
      }
    }
    cuda::check(cudaStreamSynchronize(stream), "warm-up");
  }

  // Pins a step's mask block in place, unless it is the one pinned already (a manager keeps one
  // block for its life): its uploads are then DMAs from the block itself.
  void pin_masks(const std::shared_ptr<MaskRows>& rows) {
    if (rows == host_masks) return;
    PAGEDLM_CHECK(rows->words() == mask_words && rows->num_rows() <= max_masks,
                  "token mask rows of ", rows->num_rows(), " x ", rows->words(),
                  " words do not fit the GPU's ", max_masks, " x ", mask_words);
    unpin_masks();
    cuda::check(cudaHostRegister(rows->data(), rows->bytes(), cudaHostRegisterDefault),
                "cudaHostRegister (token masks)");
    host_masks = rows;
  }

  void unpin_masks() {
    if (!host_masks) return;
    // An upload from the block may still be running.
    if (upload_stream) cudaStreamSynchronize(upload_stream);
    cudaHostUnregister(host_masks->data());
    host_masks.reset();
  }

  // Copies the given rows of host_masks to the same rows of dev_masks on upload_stream, one copy
  // per run of consecutive rows, and records masks_uploaded.
  void upload_mask_rows(std::vector<int32_t> used) {
    std::sort(used.begin(), used.end());
    used.erase(std::unique(used.begin(), used.end()), used.end());
    const size_t row_bytes = sizeof(int32_t) * mask_words;
    for (size_t i = 0; i < used.size();) {
      size_t j = i + 1;
      while (j < used.size() && used[j] == used[j - 1] + 1) ++j;
      const size_t first = used[i];
      cuda::check(cudaMemcpyAsync(dev_masks + first * mask_words, host_masks->row(used[i]),
                                  (j - i) * row_bytes, cudaMemcpyHostToDevice, upload_stream),
                  "token masks upload");
      i = j;
    }
    cuda::check(cudaEventRecord(masks_uploaded, upload_stream), "cudaEventRecord");
  }

  // Copies each pending row's token from the last step's sampled ids (dev_tokens, by logits
  // row) over its kPendingToken in the uploaded plan: one device copy per run of consecutive
  // rows whose sources are consecutive too (a decode batch that keeps its order is one copy).
  void copy_pending_rows(const std::vector<PendingRow>& pending_rows, int32_t rows) {
    for (size_t i = 0; i < pending_rows.size();) {
      size_t j = i + 1;
      while (j < pending_rows.size() && pending_rows[j].row == pending_rows[j - 1].row + 1 &&
             pending_rows[j].source_row == pending_rows[j - 1].source_row + 1) {
        ++j;
      }
      const PendingRow& first = pending_rows[i];
      PAGEDLM_CHECK(first.row >= 0 && first.row + static_cast<int32_t>(j - i) <= rows &&
                        first.source_row >= 0 && first.source_row < max_tokens,
                    "pending row ", first.row, " (source ", first.source_row, ") out of range");
      cuda::check(
          cudaMemcpyAsync(d<int32_t>(off_token_ids) + first.row, dev_tokens + first.source_row,
                          sizeof(int32_t) * (j - i), cudaMemcpyDeviceToDevice, stream),
          "pending tokens copy");
      i = j;
    }
  }

  // How a step runs: the decode kernel or not, padded to a bucket or not, a graph or eager.
  struct StepForm {
    int32_t max_q_len = 0, leading_decodes = 0;
    bool decode = false, bucketed = false, graph = false;
  };
  StepForm form_of(const StepPlan& plan, bool want_logits) const {
    StepForm f;
    const int32_t B = plan.num_seqs();
    const auto S = static_cast<int32_t>(plan.logits_rows.size());
    for (int32_t b = 0; b < B; ++b) {
      const int32_t q_len = plan.q_indptr[b + 1] - plan.q_indptr[b];
      if (q_len == 1 && f.leading_decodes == b) ++f.leading_decodes;
      f.max_q_len = std::max(f.max_q_len, q_len);
    }
    f.decode = f.max_q_len == 1 && B <= max_bucket;
    // Decode steps whose logits rows are exactly the sequences' tokens run padded to a bucket,
    // with or without graphs, so that a replayed graph computes exactly what the eager step does.
    f.bucketed = f.decode && S == B && !want_logits;
    for (int32_t j = 0; f.bucketed && j < S; ++j) f.bucketed = plan.logits_rows[j] == j;
    // The graphs hold no copies: a step with some (an admission whose whole prompt but the last
    // token was cached can look like a decode) runs eagerly.
    f.graph = use_graphs && f.bucketed && plan.kv_copies.empty();
    return f;
  }

  void launch(const StepPlan& plan, const std::vector<SeqSampling>& sampling, bool want_logits,
              const MaskBatch& masks, const std::vector<PendingRow>& pending_rows) {
    cuda::check(cudaSetDevice(device), "cudaSetDevice");
    PAGEDLM_CHECK(launched - collected < 2, "two steps are in flight: collect one first");
    const int32_t B = plan.num_seqs(), L = plan.num_tokens();
    const int32_t S = static_cast<int32_t>(plan.logits_rows.size());
    PAGEDLM_CHECK(L <= max_tokens && S <= max_tokens && B <= max_tokens, "step of ", L,
                  " tokens exceeds the GPU buffers (", max_tokens, ")");
    const StepForm form = form_of(plan, want_logits);
    const int32_t max_q_len = form.max_q_len, leading_decodes = form.leading_decodes;
    const bool decode = form.decode, bucketed = form.bucketed;
    const int32_t num_seqs = bucketed ? next_pow2(B) : B;
    const int32_t rows = bucketed ? num_seqs : L, logit_rows = bucketed ? num_seqs : S;
    std::vector<SharedPrefixGroup> groups;
    std::vector<ops::SharedPrefixRun> shared;  // views of groups' sequences
    if (decode && use_cascade) {
      groups = find_shared_prefixes(plan, 1);
      for (const SharedPrefixGroup& g : groups) shared.push_back({g.seqs, g.num_pages});
      if (!attention->takes_cascade(shared)) shared.clear();
      cascade_steps += shared.empty() ? 0 : 1;
    }
    // The step before this one may still be running: its uploads from the staging block and
    // arrays, the first thing it did, must be done before they are written again.
    if (launched > collected) {
      cuda::check(cudaEventSynchronize(uploads_done), "step (its uploads)");
    }
    Slot& slot = slots[launched % kSlots];
    assign_penalty_slots(plan, sampling);
    stage(plan, sampling, rows, num_seqs, logit_rows, decode, shared, slot.begin);
    fill_penalty_slots(sampling);
    cuda::check(cudaEventRecord(uploads_done, stream), "cudaEventRecord");
    copy_pending_rows(pending_rows, L);
    bind(num_seqs, max_q_len, decode, !shared.empty(), leading_decodes, plan.num_kv_copies());
    // Masked sequences: the forward pass is enqueued first, the host finishes the masks while
    // the device runs it, and the sampler follows their upload.
    std::vector<int32_t> mask_rows;
    for (int32_t b = 0; b < B; ++b) {
      if (sampling[b].mask_row >= 0) mask_rows.push_back(sampling[b].mask_row);
    }
    const bool masked = !mask_rows.empty();
    PAGEDLM_CHECK(!masked || (masks.rows && masks.finish), "masked sequences need their masks");
    if (masked) pin_masks(masks.rows);
    // Bias, penalties and logprobs sample eagerly after the forward pass (a graph's when the
    // step is one): the graphs hold the plain sampler only.
    const bool extras = step_biased || step_penalized || step_logprobs;
    if (form.graph) {
      run_decode_graph(num_seqs, !shared.empty(), masked || extras);
    } else if (!masked && !extras) {
      forward_and_sample(rows, logit_rows);
    } else {
      forward(rows, logit_rows);
    }
    slot.mask_hidden = false;
    slot.mask_ms = 0;
    if (masked) {
      cuda::check(cudaEventRecord(slot.forward_done, stream), "cudaEventRecord");
      const auto t0 = std::chrono::steady_clock::now();
      masks.finish();
      slot.mask_ms =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      slot.mask_hidden = cudaEventQuery(slot.forward_done) == cudaErrorNotReady;
      upload_mask_rows(std::move(mask_rows));
      cuda::check(cudaEventRecord(slot.masks_sent, stream), "cudaEventRecord");
      cuda::check(cudaStreamWaitEvent(stream, masks_uploaded, 0), "cudaStreamWaitEvent");
      sample(logit_rows, /*masked=*/true, extras);
    } else if (extras) {
      sample(logit_rows, /*masked=*/false, /*extras=*/true);
    }
    cuda::check(cudaMemcpyAsync(slot.host_tokens, dev_tokens, sizeof(int32_t) * logit_rows,
                                cudaMemcpyDeviceToHost, stream),
                "sampled tokens download");
    if (step_logprobs) {
      const size_t top = static_cast<size_t>(logit_rows) * ops::kMaxTopLogprobs;
      cuda::check(cudaMemcpyAsync(slot.host_logprob, dev_logprob, sizeof(float) * logit_rows,
                                  cudaMemcpyDeviceToHost, stream),
                  "logprobs download");
      cuda::check(cudaMemcpyAsync(slot.host_top_ids, dev_top_ids, sizeof(int32_t) * top,
                                  cudaMemcpyDeviceToHost, stream),
                  "logprobs download");
      cuda::check(cudaMemcpyAsync(slot.host_top_logprobs, dev_top_logprobs, sizeof(float) * top,
                                  cudaMemcpyDeviceToHost, stream),
                  "logprobs download");
    }
    slot.logits = Tensor();
    if (want_logits) {
      ++logits_downloads;
      slot.logits = Tensor::empty(DType::kF32, {S, vocab});
      cuda::check(cudaMemcpyAsync(slot.logits.raw(), logits.raw(), slot.logits.nbytes(),
                                  cudaMemcpyDeviceToHost, stream),
                  "logits download");
    }
    cuda::check(cudaEventRecord(slot.end, stream), "cudaEventRecord");
    // What collect reads of the step. A penalized sequence's slot counts the step's draw from
    // now on (the device counts it in stream order); its last token is kPendingToken until the
    // step is collected, which matches the pending token the next step's sequence ends with.
    slot.masked = masked;
    slot.logprobs = step_logprobs;
    slot.decode = decode;
    slot.sampled_row.assign(B, -1);
    slot.logprobs_k.assign(B, -1);
    slot.penalty_slot.assign(B, -1);
    slot.penalty_counted.assign(B, 0);
    for (int32_t b = 0; b < B; ++b) {
      const int32_t last = plan.logits_indptr[b + 1];
      if (!plan.samples[b] || last == plan.logits_indptr[b]) continue;
      slot.sampled_row[b] = last - 1;
      slot.logprobs_k[b] = sampling[b].logprobs_top_k;
      if (step_penalty_slot[b] >= 0) {
        PenaltySlot& rec = penalty_slots[step_penalty_slot[b]];
        ++rec.counted;
        rec.last_token = kPendingToken;
        slot.penalty_slot[b] = step_penalty_slot[b];
        slot.penalty_counted[b] = rec.counted;
      }
    }
    ++launched;
  }

  StepResult collect() {
    cuda::check(cudaSetDevice(device), "cudaSetDevice");
    PAGEDLM_CHECK(collected < launched, "collect: no step in flight");
    Slot& slot = slots[collected % kSlots];
    StepResult result;
    StepTimings& t = result.timings;
    t.wait_begin = std::chrono::steady_clock::now();
    cuda::check(cudaEventSynchronize(slot.end), "step");
    t.wait_end = std::chrono::steady_clock::now();
    float gpu_ms = 0;
    cuda::check(cudaEventElapsedTime(&gpu_ms, slot.begin, slot.end), "cudaEventElapsedTime");
    t.gpu_ms = gpu_ms;
    if (slot.masked) {
      float forward_ms = 0, sampler_ms = 0;
      cuda::check(cudaEventElapsedTime(&forward_ms, slot.begin, slot.forward_done),
                  "cudaEventElapsedTime");
      cuda::check(cudaEventElapsedTime(&sampler_ms, slot.masks_sent, slot.end),
                  "cudaEventElapsedTime");
      t.masked_forward_gpu_ms = forward_ms;
      t.masked_sampler_gpu_ms = sampler_ms;
    }
    t.mask_ms = slot.mask_ms;
    t.mask_hidden = slot.mask_hidden;
    // The device's idle time since the step before ended: from its end event to this step's
    // begin event, which the stream reaches once it has this step to run.
    if (slot.decode && last_collected_decode) {
      float gap_ms = 0;
      cuda::check(cudaEventElapsedTime(&gap_ms, slots[(collected - 1) % kSlots].end, slot.begin),
                  "cudaEventElapsedTime");
      t.gap_gpu_ms = gap_ms;
    }
    last_collected_decode = slot.decode;
    const auto B = static_cast<int32_t>(slot.sampled_row.size());
    result.sampled.assign(B, -1);
    if (slot.logprobs) result.logprobs.assign(B, SampledLogprobs{});
    for (int32_t b = 0; b < B; ++b) {
      const int32_t row = slot.sampled_row[b];
      if (row < 0) continue;
      result.sampled[b] = slot.host_tokens[row];
      if (slot.penalty_slot[b] >= 0) {
        PenaltySlot& rec = penalty_slots[slot.penalty_slot[b]];
        // Unless a later step has counted another draw into the slot since.
        if (rec.counted == slot.penalty_counted[b]) rec.last_token = result.sampled[b];
      }
      const int32_t k = slot.logprobs_k[b];
      if (k < 0 || !slot.logprobs) continue;
      const size_t at = static_cast<size_t>(row) * ops::kMaxTopLogprobs;
      SampledLogprobs& lp = result.logprobs[b];
      lp.logprob = slot.host_logprob[row];
      for (int64_t j = 0; j < std::min<int64_t>(k, vocab); ++j) {
        lp.top.emplace_back(slot.host_top_ids[at + j], slot.host_top_logprobs[at + j]);
      }
    }
    result.logits = std::move(slot.logits);
    ++collected;
    return result;
  }
};

CudaStepRunner::CudaStepRunner(CausalLM& model, const EngineOptions& options, int64_t max_model_len)
    : impl_(std::make_unique<Impl>(model, options, max_model_len)) {}

CudaStepRunner::~CudaStepRunner() = default;

int CudaStepRunner::device_count() {
  int count = 0;
  return cudaGetDeviceCount(&count) == cudaSuccess ? count : 0;
}

void CudaStepRunner::require_supported_devices() {
  for (int device = 0, n = device_count(); device < n; ++device) {
    ops::cuda::require_supported_device(device);
  }
}

int64_t CudaStepRunner::free_memory_bytes() {
  size_t free_bytes = 0, total_bytes = 0;
  cuda::check(cudaMemGetInfo(&free_bytes, &total_bytes), "cudaMemGetInfo");
  return static_cast<int64_t>(free_bytes);
}

void CudaStepRunner::set_kv_cache(PagedKvCache* kv_cache) { impl_->kv_cache = kv_cache; }

void CudaStepRunner::warm_up() { impl_->warm_up(); }

void CudaStepRunner::launch(const StepPlan& plan, const std::vector<SeqSampling>& sampling,
                            bool want_logits, const MaskBatch& masks,
                            const std::vector<PendingRow>& pending_rows) {
  impl_->launch(plan, sampling, want_logits, masks, pending_rows);
}

StepResult CudaStepRunner::collect() { return impl_->collect(); }

bool CudaStepRunner::replays_graph(const StepPlan& plan, bool want_logits) const {
  return impl_->form_of(plan, want_logits).graph;
}

void CudaStepRunner::make_current() const {
  cuda::check(cudaSetDevice(impl_->device), "cudaSetDevice");
}

int64_t CudaStepRunner::cascade_steps() const { return impl_->cascade_steps; }

int64_t CudaStepRunner::logits_downloads() const { return impl_->logits_downloads; }

int64_t CudaStepRunner::penalty_slot_fills() const { return impl_->slot_fills; }

#else  // !PAGEDLM_HAS_CUDA

struct CudaStepRunner::Impl {};

CudaStepRunner::CudaStepRunner(CausalLM&, const EngineOptions&, int64_t) {
  fail("this build of pagedlm has no CUDA support");
}

CudaStepRunner::~CudaStepRunner() = default;

int CudaStepRunner::device_count() { return 0; }

void CudaStepRunner::require_supported_devices() {}

int64_t CudaStepRunner::free_memory_bytes() { return 0; }

void CudaStepRunner::set_kv_cache(PagedKvCache*) {}

void CudaStepRunner::make_current() const {}

void CudaStepRunner::warm_up() {}

void CudaStepRunner::launch(const StepPlan&, const std::vector<SeqSampling>&, bool,
                            const MaskBatch&, const std::vector<PendingRow>&) {
  fail("this build of pagedlm has no CUDA support");
}

StepResult CudaStepRunner::collect() { fail("this build of pagedlm has no CUDA support"); }

bool CudaStepRunner::replays_graph(const StepPlan&, bool) const { return false; }

int64_t CudaStepRunner::cascade_steps() const { return 0; }

int64_t CudaStepRunner::logits_downloads() const { return 0; }

int64_t CudaStepRunner::penalty_slot_fills() const { return 0; }

#endif  // PAGEDLM_HAS_CUDA

}  // namespace pagedlm
