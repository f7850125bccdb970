// The optimizer: updates model states chunk by chunk, so that a chunk can be
// updated as soon as it is where the update runs. A step has three phases:
// PlanStep from the gradients' statistics, UpdateChunk for every chunk, then
// FinishStep (Note [A step in three phases] in optimizer.cc). Kinds: AdamW,
// Adam (L2) and SGD with momentum, each the formula of the torch.optim class
// of the same name (Note [Optimizer kinds]).
//
// Step counts are per tensor, as torch.optim keeps state['step'] per
// parameter: a tensor a step leaves out keeps its count (Note [Step counts
// per tensor]). Hyperparameters are per param group, as torch.optim's
// param_groups, and may change between steps (Note [Param groups]).
//
// Ownership: the optimizer owns no model memory; ChunkTensors point at the
// caller's arrays (host memory for the CPU kernels) for the duration of a
// call. Thread-safety: PlanStep, FinishStep and Step are called from one
// thread at a time; UpdateChunk(s) may run concurrently on disjoint chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string_view>
#include <vector>

#include "optim/loss_scaler.h"
#include "strata/options.h"
#include "strata/status.h"
#include "strata/types.h"

namespace strata::optim {

using strata::OptimizerKind;
std::string_view OptimizerKindName(OptimizerKind kind);
// "adamw", "adam", "sgd".
Result<OptimizerKind> ParseOptimizerKind(std::string_view name);

// Hyperparameters in double, as torch.optim holds them (Python floats): the
// per-step constants (1 - beta, lr / (1 - beta^t), lr * wd, ...) are
// computed in double and rounded to fp32 once, as torch rounds its scalars.
struct OptimizerConfig {
  OptimizerKind kind = OptimizerKind::kAdamW;
  double lr = 1e-3;
  double beta1 = 0.9;  // Adam
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // AdamW: decoupled; Adam and SGD: L2, added to the gradient
  double momentum = 0.0;      // SGD; 0 keeps no state
  double dampening = 0.0;     // SGD
  bool nesterov = false;      // SGD; needs momentum > 0 and dampening 0
  double max_grad_norm = 0.0;  // clip the global norm of the unscaled gradients to this; 0: no clipping
  // optimizer.states int8 (Adam): every tensor updated with torchao's 8-bit
  // Adam's arithmetic, its fp32 moments too (Note [8-bit states in chunks]).
  bool int8_states = false;
};

// InvalidArgument naming the field, its value and the allowed range.
Status ValidateOptimizerConfig(const OptimizerConfig& config);

// One param group's hyperparameters (the keys of a torch.optim param group);
// the kind and max_grad_norm are the whole optimizer's.
struct GroupHyperparams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
  double momentum = 0.0;
  double dampening = 0.0;
  bool nesterov = false;
  bool operator==(const GroupHyperparams&) const = default;
};
GroupHyperparams HyperparamsOf(const OptimizerConfig& config);
// `config` with `group`'s hyperparameters.
OptimizerConfig WithHyperparams(OptimizerConfig config, const GroupHyperparams& group);
// The optimizer.* keys of `options`, validated (InvalidArgument naming the key).
Result<OptimizerConfig> OptimizerConfigFromOptions(const Options& options);
// The loss_scale.* keys: nullopt when scaling is off (mode off, or auto with
// a compute precision other than fp16). Not validated here.
std::optional<LossScalerConfig> LossScalerConfigFromOptions(const Options& options);
// The loss_scale.* keys whatever the mode (for validation).
LossScalerConfig LossScalerConfigOf(const Options& options);

// fp32 state arrays per parameter: Adam 2 (exp_avg, exp_avg_sq), SGD 1 with
// momentum (momentum_buffer, kept in the exp_avg chunk), else 0.
int NumStates(const OptimizerConfig& config);

// One chunk's arrays for one update: n elements each.
struct ChunkTensors {
  size_t n = 0;
  float* master = nullptr;  // fp32 weights; the parameter itself when param_dtype is fp32
  void* param = nullptr;    // the compute copy (bf16/fp16), written after the update; null for fp32
  DType param_dtype = DType::kFloat32;
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  float* state[2] = {nullptr, nullptr};  // exp_avg, exp_avg_sq (Adam); momentum_buffer (SGD)
  // kBFloat16: `state` points at bf16 arrays (Note [bf16 states] in
  // cpu/cpu_kernels.cc); fp32 or bf16.
  DType state_dtype = DType::kFloat32;
  uint32_t param_group = 0;              // whose hyperparameters update them
};

// Work done on each block of a chunk's elements beside its update, by the
// thread that updates it, while the block's bytes are in that core's cache:
// `before` (a copy of what the update overwrites) and `after` (the
// gradients it read, zeroed), given the block's elements [begin, end) of
// the chunk. Either may be empty.
struct BlockWork {
  std::function<void(size_t begin, size_t end)> before, after;
};

// The sum of squares of gradients as stored (still scaled by the loss
// scale), in fp64: large enough that no finite fp32 gradient overflows it,
// so the sum is non-finite exactly when some gradient is inf or NaN.
struct GradStats {
  double sum_squares = 0;
  // Adds one chunk's gradients (parallel over oneTBB's threads).
  void Add(const void* grad, DType grad_dtype, size_t n);
  void Add(const ChunkTensors& chunk) { Add(chunk.grad, chunk.grad_dtype, chunk.n); }
  bool finite() const;
};

// What one step does, decided once from the global gradient statistics.
struct StepPlan {
  bool skip = false;            // inf/NaN gradients: nothing is updated
  int64_t step = 0;             // the 1-based global step; a tensor's update uses its own (Optimizer::TensorStep)
  float loss_scale = 1.0f;      // the scale the gradients carry
  double grad_norm = 0;         // global L2 norm of the unscaled gradients (inf/NaN when skipped)
  float clip_coefficient = 1.0f;
  float grad_multiplier = 1.0f;  // clip_coefficient / loss_scale, applied in the update pass
};

class Optimizer {
 public:
  // Sums GradStats across ranks in place; an error fails PlanStep and
  // changes nothing.
  using AllReduceHook = std::function<Status(GradStats&)>;

  // `scaler` is optional: without it gradients are taken as unscaled, and
  // inf/NaN gradients still skip the step. `num_groups` param groups (>= 1),
  // each starting with `config`'s hyperparameters.
  static Result<std::unique_ptr<Optimizer>> Create(const OptimizerConfig& config,
                                                   std::optional<LossScalerConfig> scaler = std::nullopt,
                                                   uint32_t num_groups = 1);

  void SetAllReduceHook(AllReduceHook hook) { all_reduce_ = std::move(hook); }
  const OptimizerConfig& config() const { return config_; }
  int num_states() const { return NumStates(config_); }
  uint32_t num_groups() const { return static_cast<uint32_t>(groups_.size()); }
  // Param group `group`'s hyperparameters now (group < num_groups()).
  GroupHyperparams group(uint32_t group) const { return HyperparamsOf(groups_.at(group)); }
  // Sets param group `group`'s hyperparameters, used from the next update on.
  // InvalidArgument naming the group, the field and the allowed values (a
  // group out of range; a value ValidateOptimizerConfig refuses; SGD momentum
  // > 0 in an optimizer that keeps no momentum buffers), changing nothing.
  Status SetGroup(uint32_t group, const GroupHyperparams& values);
  // Completed (not skipped) steps so far.
  int64_t steps_taken() const { return steps_taken_; }
  // Of them, those that updated tensor `id` (torch.optim's state['step'] of
  // a parameter): fewer when steps left it out (FinishStep's `left_out`).
  int64_t tensor_steps(TensorId id) const;
  // The step number tensor `id`'s update in `plan` uses: tensor_steps + 1.
  int64_t TensorStep(const StepPlan& plan, TensorId id) const;
  // tensor_steps of ids 0 .. n-1 (a checkpoint's).
  std::vector<int64_t> AllTensorSteps(size_t n) const;
  // The scale the next backward pass multiplies the loss by (1 without a scaler).
  float loss_scale() const { return scaler_ ? scaler_->scale() : 1.0f; }
  const LossScaler* scaler() const { return scaler_ ? &*scaler_ : nullptr; }

  // Phase 1: the all-reduce, the norm, the clip coefficient and the skip
  // decision, for step steps_taken() + 1. Changes nothing.
  Result<StepPlan> PlanStep(GradStats local) const;
  // The plan PlanStep makes for gradients that are finite and need no
  // clipping, made before they are known: what an update begun in backward
  // runs on until the step confirms it (Note [Overlapped updates] in
  // offload/training/overlap_updates.cc). Whether `plan` updates as it does.
  StepPlan PlanAhead() const;
  static bool SameUpdate(const StepPlan& a, const StepPlan& b) {
    return a.skip == b.skip && a.step == b.step && a.grad_multiplier == b.grad_multiplier;
  }
  // Phase 2: one chunk, in one fused pass (no-op when the plan skips), as
  // update number `step` of its tensors (their TensorStep; 0: plan.step).
  // InvalidArgument when the chunk's arrays do not fit this optimizer (a
  // missing state, a null grad) or the plan is not one (a step below 1, a
  // non-finite multiplier), or `step` is above plan.step.
  // `work`: done beside each block of the update (BlockWork), unless the
  // plan skips.
  Status UpdateChunk(const StepPlan& plan, const ChunkTensors& chunk, int64_t step = 0,
                     const BlockWork& work = {}) const;
  // The same for many chunks at once, spread over oneTBB's threads across
  // and within chunks; every chunk is checked before any is changed.
  Status UpdateChunks(const StepPlan& plan, std::span<const ChunkTensors> chunks) const;
  // UpdateChunk for a chunk whose arrays are CUDA device memory: the same
  // arithmetic (optim/cuda/cuda_kernels.cu), enqueued on `cuda_stream` (a
  // cudaStream_t; null: the legacy default stream) without waiting. The same
  // errors, and NotSupported in a build without CUDA.
  Status UpdateChunkOnDevice(const StepPlan& plan, const ChunkTensors& chunk, int64_t step, void* cuda_stream) const;
  // Enqueues zeroing `size_bytes` of device memory (a grad chunk after its
  // update) on `cuda_stream`; NotSupported without CUDA.
  static Status ZeroOnDevice(void* device_dst, size_t size_bytes, void* cuda_stream);
  // Zeroes `size_bytes` of host memory (a grad chunk after its update) on
  // every core.
  static void ZeroOnHost(void* host_dst, size_t size_bytes);
  // The sum of squares of gradients in CUDA device memory (only each chunk's
  // n, grad and grad_dtype are read), in fp64 and non-finite when one is;
  // waits for `cuda_stream`. NotSupported without CUDA.
  static Result<double> SumSquaresOnDevice(std::span<const ChunkTensors> grads, void* cuda_stream);
  // Phase 3: the plan's chunks are all updated (or it skips): count the step
  // for every tensor but those in `left_out` (its update left them as they
  // were) and update the loss scaler (back off on a skip, else count a good
  // step). A skipped plan counts no tensor's step. InvalidArgument for a plan
  // of another step than steps_taken() + 1.
  Status FinishStep(const StepPlan& plan, std::span<const TensorId> left_out = {});
  // A saved step count and loss-scaler state back; `tensor_steps[id]`: tensor
  // id's count, each in [0, steps_taken] (tensors past its end: steps_taken,
  // as a checkpoint saved before counts were per tensor means); `groups`:
  // every param group's hyperparameters (empty: each group gets the config's,
  // as a checkpoint saved before param groups means). InvalidArgument for a
  // negative count, a tensor count out of range, a scaler state this
  // optimizer has no scaler for (or lacks one it has), or groups SetGroup
  // refuses or not num_groups() of them, changing nothing.
  struct ScalerState {
    float scale = 1.0f;
    int64_t good_steps = 0;
    int64_t overflows = 0;
  };
  Status Restore(int64_t steps_taken, std::optional<ScalerState> scaler,
                 std::span<const int64_t> tensor_steps = {}, std::span<const GroupHyperparams> groups = {});
  // All three phases over all chunks.
  Result<StepPlan> Step(std::span<const ChunkTensors> chunks);

 private:
  Optimizer(const OptimizerConfig& config, std::optional<LossScalerConfig> scaler, uint32_t num_groups);
  // `values` as group `group`'s config, validated (SetGroup's errors).
  Result<OptimizerConfig> GroupConfig(uint32_t group, const GroupHyperparams& values) const;
  // `chunk` with the arrays its group's update uses (SGD: no momentum
  // buffer for a group of momentum 0).
  ChunkTensors ForGroup(ChunkTensors chunk) const;

  OptimizerConfig config_;
  // groups_[g]: config_ with param group g's hyperparameters.
  std::vector<OptimizerConfig> groups_;
  std::optional<LossScaler> scaler_;
  AllReduceHook all_reduce_;
  int64_t steps_taken_ = 0;
  // steps_missed_[id]: the finished steps tensor `id` was left out of; ids
  // past the end missed none. See Note [Step counts per tensor].
  std::vector<int64_t> steps_missed_;
};

}  // namespace strata::optim
