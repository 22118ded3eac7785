// The model interface: a causal LM that runs one packed token stream per call.
// Model code knows nothing about pages or caching: attention goes through an Attention
// object supplied by the engine (which writes K/V into its paged cache and reads them back).
#pragma once

#include <atomic>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "pagedlm/core/attention_variant.h"
#include "pagedlm/core/tensor.h"
#include "pagedlm/model/checkpoint.h"
#include "pagedlm/model/model_config.h"
#include "pagedlm/model/tensor_parallel.h"
#include "pagedlm/ops/linear.h"

namespace pagedlm {

// The engine's side of attention for one step: rotary embedding at the stream's positions,
// keeping K/V for later steps, and attention over everything the sequence has seen. Rope sits
// here so a backend can fuse it with the cache write; the model only supplies its frequencies.
class Attention {
 public:
  virtual ~Attention() = default;
  // qkv: [L, (Hq + 2 Hk) * d], each row the q heads, then the k heads, then the v heads, before
  // rope (one fused projection's output; k is rotated in place), q: [L, Hq, d] receives the
  // rotated queries, inv_freq: [d/2] f32 (the layer's rope) -> out: [L, Hq, d]. `variant` is the
  // layer's scale, sliding window and soft-cap.
  virtual void attend(int layer, const AttentionVariant& variant, const Tensor& qkv,
                      const Tensor& q, const Tensor& inv_freq, const Tensor& out) = 0;
};

// Where a forward pass may be left midway (a CPU step that prefills a long prompt runs for
// seconds; Ctrl-C should not wait for it). The pass asks at points between its large operations
// (a few per layer), saying how many of the pass's collectives lie behind it (`joined`; 0 for a
// model alone). Alone it leaves at the first point that finds `requested` holding. The ranks of a
// tensor-parallel group ask the same object, and only rank 0 asks `requested`: once it holds,
// every rank leaves at its first point past the next collective. No rank can be past that
// collective before rank 0 decided (it needs rank 0 in it) and every rank gets through it (rank 0
// goes on to it too), so all leave together and none is left waiting in a collective.
class ForwardStop {
 public:
  explicit ForwardStop(std::function<bool()> requested) : requested_(std::move(requested)) {}

  // Whether rank tp.rank leaves its forward pass at a point with `joined` collectives behind it.
  bool leave_at(TensorParallel tp, int64_t joined) {
    if (tp.rank == 0 && leave_from_.load(std::memory_order_relaxed) == kNever && requested_()) {
      leave_from_.store(tp.size == 1 ? joined : joined + 1, std::memory_order_release);
    }
    return joined >= leave_from_.load(std::memory_order_acquire);
  }

 private:
  static constexpr int64_t kNever = std::numeric_limits<int64_t>::max();
  std::function<bool()> requested_;
  std::atomic<int64_t> leave_from_{kNever};  // the `joined` from which every point leaves
};

namespace ops {
class DeviceState;
}

struct ForwardInputs {
  Tensor token_ids;        // [L] i32
  Tensor logits_rows;      // [S] i32: rows of the stream whose logits are wanted
  void* stream = nullptr;  // CUDA: the cudaStream_t every op of the step is issued on
  // CUDA: the caller's GPU state (ops/device_state.h), which the GEMMs run with.
  ops::DeviceState* device_state = nullptr;
  // Where the pass may be left midway; null: it runs to the end (the GPU's steps, which are short
  // and may be captured as graphs, never pass one).
  ForwardStop* stop = nullptr;
};

class CausalLM {
 public:
  virtual ~CausalLM() = default;
  virtual const ModelConfig& config() const = 0;
  virtual Device device() const = 0;
  // The dtype of activations and weights: f32 on the CPU, bf16 on the GPU.
  virtual DType compute_dtype() const = 0;
  // Which share of the model this is (config() describes the whole model; rank_dims() of these
  // gives this rank's heads, MLP and vocabulary).
  virtual TensorParallel tensor_parallel() const { return {}; }
  // Allocates the activations for steps of up to `rows` stream rows. Forward calls within that
  // size allocate nothing, which a captured CUDA graph requires; larger ones grow the buffers.
  virtual void reserve(int64_t rows) = 0;
  // logits: [S, vocab] f32 on the model's device. False when inputs.stop made the pass leave
  // midway: the logits are not written and the step's K/V only partly (some layers, not others).
  [[nodiscard]] virtual bool forward(const ForwardInputs& inputs, Attention& attention,
                                     const Tensor& logits) = 0;
  // Mixture-of-experts models: the bytes of expert weights the forward calls so far had to read
  // (in each sparse layer of each call, every expert that received a token, read once), as the
  // device's counters hold them now: a step still running may be partly counted. 0 for dense
  // models.
  virtual int64_t expert_bytes_read() const { return 0; }
  // The bytes of the weights every step reads whole, as this rank stores them: every layer's
  // projections but the experts', and the lm_head (a GGUF's quantized matrices on the CPU are
  // their blocks, not float32).
  virtual int64_t step_weight_bytes() const = 0;
  // The same bytes by the format they are kept in (core/quantized.h's format names, or the
  // dtype's name for dense weights).
  virtual std::map<std::string, int64_t> step_weight_bytes_by_format() const = 0;
};

namespace ops {
class Communicator;
}

// Choices about how the model computes that are not in its checkpoint.
// Which projections the GPU runs as FP8 W8A8 GEMMs (ops/linear_fp8.h). Embeddings, the
// lm_head, routers and experts stay bf16 in every mode.
enum class Fp8Weights : uint8_t {
  // An FP8 checkpoint's per-tensor and per-channel weights, where the GPU has FP8 tensor cores
  // (else, and for per-block scales, they are dequantized to bf16); other weights bf16.
  kCheckpoint,
  // Those, and every other projection's bf16 weight quantized at load, one scale per output
  // feature (--quantization fp8). An error on the CPU or a GPU without FP8 tensor cores.
  kAll,
  // Every weight in bf16, FP8 checkpoints dequantized (--quantization none).
  kNone,
};

struct ModelOptions {
  // CPU: how the projections over GGUF blocks take their input rows. Unset: as float32, through
  // the exact block kernels. Else through the integer kernels (ops::linear_q8) as the value says:
  // kInt8, quantized to 8 bits (faster, not exact: --cpu-q8-activations); kFixed32, as 32-bit
  // fixed point in four 8-bit digits, the exact product to float32 rounding as the default
  // kernels (faster single-stream decode, slower prefill: docs/PERF.md;
  // --cpu-fixed32-activations). A model without such blocks is an error.
  std::optional<ops::IntActivations> cpu_int_activations;
  Fp8Weights fp8_weights = Fp8Weights::kCheckpoint;
  // GPU: a GGUF's projections in the formats ops::gpu_computes_blocks names stay in their
  // blocks (ops/linear_blocks.h); off, they are expanded to bf16 at load (the other formats, the
  // embedding and MoE experts always are).
  bool gguf_blocks_on_gpu = false;
  // The dtype of activations and dense weights. Unset: the device's, default_compute_dtype; the
  // kernels take no other yet, and another is an error that says so.
  std::optional<DType> compute_dtype;
};

// f32 on the CPU, bf16 on the GPU.
inline DType default_compute_dtype(Device device) {
  return device == Device::kCpu ? DType::kF32 : DType::kBF16;
}

// The options' compute dtype on `device` (unset: the device's); throws naming the option where
// the device's kernels cannot take what they ask for (another compute dtype, integer activations
// off the CPU). The engine asks before it reads any weight; the model's loader asks again.
DType checked_compute_dtype(const ModelOptions& options, Device device);

// Builds the model for the checkpoint's architecture on `device` (CUDA: weights converted to
// bf16, whatever the checkpoint's dtype, f16 included); throws pagedlm::Error
// naming an unsupported architecture or a missing / mis-shaped tensor.
// With tp.size > 1 it holds rank tp.rank's share only (model/tensor_parallel.h), loaded from the
// checkpoint's tensors share by share, and joins the other ranks' results through `comm` (that
// rank of a group of that size), which must outlive it.
std::unique_ptr<CausalLM> create_model(const Checkpoint& checkpoint, Device device,
                                       TensorParallel tp = {}, ops::Communicator* comm = nullptr,
                                       const ModelOptions& options = {});

}  // namespace pagedlm
