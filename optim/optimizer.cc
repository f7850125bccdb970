#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>

#include "optim/cpu/cpu_kernels.h"
#ifdef STRATA_OPTIM_CUDA
#include "optim/cuda/cuda_kernels.h"
#endif

namespace strata::optim {

// Note [A step in three phases]
// So that a chunk can be updated as soon as it is where the update runs,
// without the whole model in one place:
//   1. gradient statistics: GradStats::Add over every grad chunk (or over
//      each grad chunk as it completes), then PlanStep. PlanStep passes the
//      local sum to the all-reduce hook (ranks sum it), computes the global
//      norm of the unscaled gradients and the clip coefficient, and decides
//      whether the step is skipped: an inf or NaN anywhere makes the sum
//      non-finite, and nothing is updated. It changes nothing itself.
//   2. UpdateChunk for every chunk, in any order and from any thread, with
//      the plan: one fused pass reads the gradient (fp32, bf16 or fp16),
//      multiplies it by 1 / loss_scale * clip_coefficient, updates the fp32
//      master weights and the optimizer states, and writes the compute copy
//      (bf16 or fp16, round to nearest even) when there is one.
//   3. FinishStep once every chunk is updated (or the plan skips): counts
//      the step and updates the loss scaler. A step that failed part way is
//      not finished: once its states are back (their holder puts them
//      back), it is planned again with the same step number.
// Step() does all three over a list of chunks.
//
// Note [Optimizer kinds]
// AdamW (decoupled weight decay), Adam (L2 weight decay in the gradient), SGD
// with momentum (optionally Nesterov, dampening); each is the formula of the
// torch.optim class of the same name, step counts included (Note [Step counts
// per tensor]). A new optimizer adds a kind, its per-element update
// in optim/cpu/cpu_kernels_impl.h and the scalar reference in
// optim/cpu/cpu_reference.cc, and says how many fp32 states it keeps.
//
// Note [Step counts per tensor]
// torch.optim keeps state['step'] per parameter and leaves a parameter whose
// .grad is None out of a step entirely: no moment decay, no weight decay, no
// count. Its later updates use its own count: Adam's bias corrections
// 1 - beta^t, and SGD's momentum buffer starting as the gradient on the
// parameter's own first update. So the optimizer counts steps per tensor:
// FinishStep counts the step for every tensor but those the caller left out,
// and an update of a tensor's range uses TensorStep (its count + 1), so a
// chunk whose tensors have different counts is updated in one range per run
// of equal counts. The counts are kept as the steps each tensor missed, so
// that a tensor no step left out (every one, usually) costs nothing and
// reads as the global count, as does every tensor of arrays updated without
// tensors (Step, UpdateChunk without a step). A plan skipped for inf/NaN
// gradients counts no one's step. Data parallel, every rank must leave out
// the same tensors (the caller agrees on them), so the counts stay the same.
//
// Note [Param groups]
// As torch.optim's param_groups: every tensor belongs to one param group
// (TensorSpec::param_group), and each group has its own lr, betas, eps,
// weight decay and SGD momentum, dampening and nesterov, which may change
// between steps (a learning-rate schedule). The chunk layout keeps groups in
// separate chunks (memory/chunk_layout.h), so a chunk's fused update reads
// one group's values: UpdateChunk turns them into the kernels' per-call
// constants (MakeUpdateConstants) as it runs, and a value set before a step
// is the one that step uses, as torch reads param_groups in step(). SetGroup
// validates as the config is validated, naming the group. The number of
// state arrays stays the optimizer's: an SGD group may have momentum only
// when optimizer.momentum > 0 made the engine keep momentum buffers; a group
// of momentum 0 is updated without its buffer (plain SGD, as torch), which
// keeps what it held. The kind and max_grad_norm are the whole optimizer's.

std::string_view OptimizerKindName(OptimizerKind kind) {
  switch (kind) {
    case OptimizerKind::kAdamW: return "adamw";
    case OptimizerKind::kAdam: return "adam";
    case OptimizerKind::kSgd: return "sgd";
  }
  return "?";
}

Result<OptimizerKind> ParseOptimizerKind(std::string_view name) {
  for (OptimizerKind kind : {OptimizerKind::kAdamW, OptimizerKind::kAdam, OptimizerKind::kSgd}) {
    if (name == OptimizerKindName(kind)) return kind;
  }
  return InvalidArgument("optimizer '{}': expected one of adamw, adam, sgd", name);
}

Status ValidateOptimizerConfig(const OptimizerConfig& c) {
  const auto finite_at_least_zero = [](double x) { return std::isfinite(x) && x >= 0; };
  if (!finite_at_least_zero(c.lr)) return InvalidArgument("optimizer: lr {} must be a finite number >= 0", c.lr);
  if (!finite_at_least_zero(c.weight_decay)) {
    return InvalidArgument("optimizer: weight_decay {} must be a finite number >= 0", c.weight_decay);
  }
  if (!finite_at_least_zero(c.max_grad_norm)) {
    return InvalidArgument("optimizer: max_grad_norm {} must be >= 0 (0: no clipping)", c.max_grad_norm);
  }
  if (c.kind == OptimizerKind::kSgd) {
    if (!finite_at_least_zero(c.momentum)) return InvalidArgument("optimizer: momentum {} must be >= 0", c.momentum);
    if (!(c.dampening >= 0 && c.dampening <= 1)) {
      return InvalidArgument("optimizer: dampening {} must be in [0, 1]", c.dampening);
    }
    if (c.nesterov && (c.momentum <= 0 || c.dampening != 0)) {
      return InvalidArgument("optimizer: nesterov needs momentum > 0 (got {}) and dampening 0 (got {})", c.momentum,
                             c.dampening);
    }
    return Status::Ok();
  }
  if (!(c.beta1 >= 0 && c.beta1 < 1)) return InvalidArgument("optimizer: beta1 {} must be in [0, 1)", c.beta1);
  if (!(c.beta2 >= 0 && c.beta2 < 1)) return InvalidArgument("optimizer: beta2 {} must be in [0, 1)", c.beta2);
  if (!(std::isfinite(c.eps) && c.eps > 0)) return InvalidArgument("optimizer: eps {} must be > 0", c.eps);
  return Status::Ok();
}

GroupHyperparams HyperparamsOf(const OptimizerConfig& c) {
  return GroupHyperparams{.lr = c.lr,
                          .beta1 = c.beta1,
                          .beta2 = c.beta2,
                          .eps = c.eps,
                          .weight_decay = c.weight_decay,
                          .momentum = c.momentum,
                          .dampening = c.dampening,
                          .nesterov = c.nesterov};
}

OptimizerConfig WithHyperparams(OptimizerConfig config, const GroupHyperparams& group) {
  config.lr = group.lr;
  config.beta1 = group.beta1;
  config.beta2 = group.beta2;
  config.eps = group.eps;
  config.weight_decay = group.weight_decay;
  config.momentum = group.momentum;
  config.dampening = group.dampening;
  config.nesterov = group.nesterov;
  return config;
}

Result<OptimizerConfig> OptimizerConfigFromOptions(const Options& options) {
  OptimizerConfig config;
  config.kind = options.optimizer.kind;
  config.lr = options.optimizer.lr;
  config.beta1 = options.optimizer.beta1;
  config.beta2 = options.optimizer.beta2;
  config.eps = options.optimizer.eps;
  config.weight_decay = options.optimizer.weight_decay;
  config.momentum = options.optimizer.momentum;
  config.dampening = options.optimizer.dampening;
  config.nesterov = options.optimizer.nesterov;
  config.max_grad_norm = options.optimizer.max_grad_norm;
  config.int8_states = options.optimizer.state_dtype == DType::kInt8Block;
  if (Status status = ValidateOptimizerConfig(config); !status.ok()) {
    // "optimizer: beta1 ..." names the field; say it is the option optimizer.beta1.
    return InvalidArgument("option {}", status.message());
  }
  return config;
}

std::optional<LossScalerConfig> LossScalerConfigFromOptions(const Options& options) {
  const bool dynamic = options.loss_scale.mode == LossScaleMode::kDynamic ||
                       (options.loss_scale.mode == LossScaleMode::kAuto && options.compute_dtype == DType::kFloat16);
  if (!dynamic) return std::nullopt;
  return LossScalerConfigOf(options);
}

LossScalerConfig LossScalerConfigOf(const Options& options) {
  return LossScalerConfig{.init_scale = static_cast<float>(options.loss_scale.init),
                          .growth_factor = static_cast<float>(options.loss_scale.growth_factor),
                          .backoff_factor = static_cast<float>(options.loss_scale.backoff_factor),
                          .growth_interval = options.loss_scale.growth_interval,
                          .min_scale = static_cast<float>(options.loss_scale.min),
                          .max_scale = static_cast<float>(options.loss_scale.max)};
}

int NumStates(const OptimizerConfig& config) {
  if (config.kind == OptimizerKind::kSgd) return config.momentum > 0 ? 1 : 0;
  return 2;
}

Result<std::unique_ptr<Optimizer>> Optimizer::Create(const OptimizerConfig& config,
                                                     std::optional<LossScalerConfig> scaler, uint32_t num_groups) {
  STRATA_RETURN_IF_ERROR(ValidateOptimizerConfig(config));
  STRATA_RETURN_IF_ERROR(CpuIsaFromSetting(std::getenv(kCpuIsaVariable)).status());
  if (scaler) STRATA_RETURN_IF_ERROR(ValidateLossScalerConfig(*scaler));
  if (num_groups == 0) return InvalidArgument("optimizer: 0 param groups: every tensor needs one, so at least 1");
  return std::unique_ptr<Optimizer>(new Optimizer(config, scaler, num_groups));
}

Optimizer::Optimizer(const OptimizerConfig& config, std::optional<LossScalerConfig> scaler, uint32_t num_groups)
    : config_(config), groups_(num_groups, config) {
  if (scaler) scaler_.emplace(*scaler);
}

Result<OptimizerConfig> Optimizer::GroupConfig(uint32_t group, const GroupHyperparams& values) const {
  if (group >= groups_.size()) {
    return InvalidArgument("optimizer: param group {} does not exist: this optimizer has {} (0 to {})", group,
                           groups_.size(), groups_.size() - 1);
  }
  const OptimizerConfig config = WithHyperparams(config_, values);
  if (Status status = ValidateOptimizerConfig(config); !status.ok()) {
    // "optimizer: lr -1 must be ..." names the field; say which group's.
    std::string_view message = status.message();
    if (message.starts_with("optimizer: ")) message.remove_prefix(11);
    return InvalidArgument("optimizer param group {}: {}", group, message);
  }
  if (NumStates(config) > num_states()) {
    return InvalidArgument("optimizer param group {}: momentum {} needs momentum buffers, kept only when the "
                           "optimizer's momentum (option optimizer.momentum) is > 0: set it > 0 and give the groups "
                           "without momentum 0",
                           group, values.momentum);
  }
  return config;
}

Status Optimizer::SetGroup(uint32_t group, const GroupHyperparams& values) {
  STRATA_ASSIGN_OR_RETURN(groups_[group], GroupConfig(group, values));
  return Status::Ok();
}

Result<StepPlan> Optimizer::PlanStep(GradStats local) const {
  if (all_reduce_) STRATA_RETURN_IF_ERROR(all_reduce_(local));
  StepPlan plan;
  plan.loss_scale = loss_scale();
  plan.grad_norm = std::sqrt(local.sum_squares) / plan.loss_scale;
  if (!local.finite()) {
    plan.skip = true;
    plan.step = steps_taken_;
    return plan;
  }
  if (config_.max_grad_norm > 0) {
    // torch.nn.utils.clip_grad_norm_: max_norm / (norm + 1e-6), never above 1.
    const double coefficient = config_.max_grad_norm / (plan.grad_norm + 1e-6);
    if (coefficient < 1.0) plan.clip_coefficient = static_cast<float>(coefficient);
  }
  plan.grad_multiplier = static_cast<float>(static_cast<double>(plan.clip_coefficient) / plan.loss_scale);
  plan.step = steps_taken_ + 1;
  return plan;
}

StepPlan Optimizer::PlanAhead() const {
  StepPlan plan;
  plan.loss_scale = loss_scale();
  plan.grad_multiplier = static_cast<float>(1.0 / plan.loss_scale);
  plan.step = steps_taken_ + 1;
  return plan;
}

int64_t Optimizer::tensor_steps(TensorId id) const {
  return steps_taken_ - (id.value() < steps_missed_.size() ? steps_missed_[id.value()] : 0);
}

int64_t Optimizer::TensorStep(const StepPlan& plan, TensorId id) const {
  return plan.step - (id.value() < steps_missed_.size() ? steps_missed_[id.value()] : 0);
}

std::vector<int64_t> Optimizer::AllTensorSteps(size_t n) const {
  std::vector<int64_t> counts(n);
  for (size_t id = 0; id < n; ++id) counts[id] = tensor_steps(TensorId(static_cast<uint32_t>(id)));
  return counts;
}

Status Optimizer::Restore(int64_t steps_taken, std::optional<ScalerState> scaler,
                          std::span<const int64_t> tensor_steps, std::span<const GroupHyperparams> groups) {
  if (steps_taken < 0) return InvalidArgument("optimizer: cannot restore {} steps taken", steps_taken);
  for (size_t id = 0; id < tensor_steps.size(); ++id) {
    if (tensor_steps[id] < 0 || tensor_steps[id] > steps_taken) {
      return InvalidArgument("optimizer: tensor {} has taken {} steps: a count in [0, {}] (the steps taken) was "
                             "expected",
                             id, tensor_steps[id], steps_taken);
    }
  }
  if (scaler.has_value() != scaler_.has_value()) {
    return InvalidArgument("optimizer: the state to restore {} a loss scaler and this optimizer {} (loss_scale.mode "
                           "must match the saved run's)",
                           scaler ? "has" : "has no", scaler_ ? "has one" : "has none");
  }
  if (!groups.empty() && groups.size() != groups_.size()) {
    return InvalidArgument("optimizer: the state to restore has {} param groups and this optimizer {}: the groups "
                           "must be those of the saved run",
                           groups.size(), groups_.size());
  }
  std::vector<OptimizerConfig> restored(groups_.size(), config_);  // no groups saved: the config's
  for (uint32_t g = 0; g < groups.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(restored[g], GroupConfig(g, groups[g]));
  }
  if (scaler) STRATA_RETURN_IF_ERROR(scaler_->Restore(scaler->scale, scaler->good_steps, scaler->overflows));
  groups_ = std::move(restored);
  steps_taken_ = steps_taken;
  steps_missed_.assign(tensor_steps.size(), 0);
  for (size_t id = 0; id < tensor_steps.size(); ++id) steps_missed_[id] = steps_taken - tensor_steps[id];
  return Status::Ok();
}

Status Optimizer::FinishStep(const StepPlan& plan, std::span<const TensorId> left_out) {
  if (plan.skip) {
    if (scaler_) scaler_->Update(/*found_non_finite=*/true);
    return Status::Ok();
  }
  if (plan.step != steps_taken_ + 1) {
    return InvalidArgument("optimizer: finishing a plan for step {} after {} steps: plan each step after the last "
                           "one finished",
                           plan.step, steps_taken_);
  }
  steps_taken_ = plan.step;
  std::vector<TensorId> missed(left_out.begin(), left_out.end());
  std::sort(missed.begin(), missed.end());
  missed.erase(std::unique(missed.begin(), missed.end()), missed.end());  // listed twice, missed once
  if (!missed.empty() && missed.back().value() >= steps_missed_.size()) {
    steps_missed_.resize(missed.back().value() + 1, 0);
  }
  for (TensorId id : missed) steps_missed_[id.value()]++;
  if (scaler_) scaler_->Update(/*found_non_finite=*/false);
  return Status::Ok();
}

namespace {

Status CheckChunk(const OptimizerConfig& config, size_t num_groups, const ChunkTensors& t) {
  if (t.param_group >= num_groups) {
    return InvalidArgument("optimizer: a chunk of param group {}, and this optimizer has {} (Optimizer::Create's "
                           "num_groups: one more than the largest TensorSpec::param_group)",
                           t.param_group, num_groups);
  }
  if (t.n == 0) return Status::Ok();
  if (t.master == nullptr || t.grad == nullptr) {
    return InvalidArgument("optimizer: a chunk of {} elements without {} array", t.n,
                           t.master == nullptr ? "a master (fp32 weight)" : "a gradient");
  }
  if ((t.param_dtype == DType::kFloat32) != (t.param == nullptr)) {
    return InvalidArgument("optimizer: param dtype {} with {} compute copy: fp32 parameters are updated in place "
                           "in `master` (param null); bf16/fp16 ones need the copy",
                           DTypeName(t.param_dtype), t.param == nullptr ? "no" : "a");
  }
  if (t.state_dtype == DType::kInt8Block) {
    if (config.kind == OptimizerKind::kSgd) {
      return InvalidArgument("optimizer: int8 states for sgd: 8-bit states are Adam's and AdamW's moments");
    }
    if (t.n % kInt8BlockElems != 0) {
      return InvalidArgument("optimizer: {} elements with int8 states: they update in whole blocks of {}", t.n,
                             kInt8BlockElems);
    }
  } else if (t.state_dtype != DType::kFloat32 && t.state_dtype != DType::kBFloat16) {
    return InvalidArgument("optimizer: states of dtype {}: they are fp32, bf16 or int8", DTypeName(t.state_dtype));
  }
  for (int s = 0; s < NumStates(config); ++s) {
    if (t.state[s] == nullptr) {
      return InvalidArgument("optimizer: {} keeps {} state array(s) per chunk; state[{}] is missing",
                             OptimizerKindName(config.kind), NumStates(config), s);
    }
  }
  return Status::Ok();
}

Status CheckPlan(const StepPlan& plan, int64_t step = 0) {
  if (plan.skip) return Status::Ok();
  if (plan.step < 1 || !std::isfinite(plan.grad_multiplier)) {
    return InvalidArgument("optimizer: a plan for step {} with gradient multiplier {}: steps count from 1 and the "
                           "multiplier is finite (PlanStep makes plans)",
                           plan.step, plan.grad_multiplier);
  }
  if (step < 0 || step > plan.step) {
    return InvalidArgument("optimizer: an update as step {} in a plan for step {}: a tensor's step is in [1, the "
                           "plan's] (Optimizer::TensorStep), or 0 for the plan's",
                           step, plan.step);
  }
  return Status::Ok();
}

}  // namespace

ChunkTensors Optimizer::ForGroup(ChunkTensors chunk) const {
  if (NumStates(groups_[chunk.param_group]) == 0) chunk.state[0] = nullptr;  // See Note [Param groups].
  return chunk;
}

Status Optimizer::UpdateChunkOnDevice(const StepPlan& plan, const ChunkTensors& chunk, int64_t step,
                                      void* cuda_stream) const {
  STRATA_RETURN_IF_ERROR(CheckPlan(plan, step));
  STRATA_RETURN_IF_ERROR(CheckChunk(config_, groups_.size(), chunk));
  if (plan.skip || chunk.n == 0) return Status::Ok();
#ifdef STRATA_OPTIM_CUDA
  const ChunkTensors of_group = ForGroup(chunk);
  return UpdateChunksCuda(
      MakeUpdateConstants(groups_[chunk.param_group], step == 0 ? plan.step : step, plan.grad_multiplier),
      std::span<const ChunkTensors>(&of_group, 1), cuda_stream);
#else
  static_cast<void>(cuda_stream);
  return NotSupported("optimizer: an update on a GPU, but strata was built without CUDA");
#endif
}

void Optimizer::ZeroOnHost(void* host_dst, size_t size_bytes) { ZeroParallel(host_dst, size_bytes); }

Status Optimizer::ZeroOnDevice(void* device_dst, size_t size_bytes, void* cuda_stream) {
#ifdef STRATA_OPTIM_CUDA
  return ZeroCuda(device_dst, size_bytes, cuda_stream);
#else
  static_cast<void>(device_dst);
  static_cast<void>(size_bytes);
  static_cast<void>(cuda_stream);
  return NotSupported("optimizer: zeroing GPU memory, but strata was built without CUDA");
#endif
}

Result<double> Optimizer::SumSquaresOnDevice(std::span<const ChunkTensors> grads, void* cuda_stream) {
#ifdef STRATA_OPTIM_CUDA
  return SumSquaresCuda(grads, cuda_stream);
#else
  static_cast<void>(grads);
  static_cast<void>(cuda_stream);
  return NotSupported("optimizer: gradients on a GPU, but strata was built without CUDA");
#endif
}

Status Optimizer::UpdateChunk(const StepPlan& plan, const ChunkTensors& chunk, int64_t step,
                              const BlockWork& work) const {
  STRATA_RETURN_IF_ERROR(CheckPlan(plan, step));
  STRATA_RETURN_IF_ERROR(CheckChunk(config_, groups_.size(), chunk));
  if (plan.skip || chunk.n == 0) return Status::Ok();
  const OptimizerConfig& group = groups_[chunk.param_group];
  UpdateParallel(MakeUpdateConstants(group, step == 0 ? plan.step : step, plan.grad_multiplier), ForGroup(chunk),
                 work);
  return Status::Ok();
}

Status Optimizer::UpdateChunks(const StepPlan& plan, std::span<const ChunkTensors> chunks) const {
  STRATA_RETURN_IF_ERROR(CheckPlan(plan));
  for (const ChunkTensors& chunk : chunks) STRATA_RETURN_IF_ERROR(CheckChunk(config_, groups_.size(), chunk));
  if (plan.skip) return Status::Ok();
  for (uint32_t g = 0; g < groups_.size(); ++g) {  // each group's chunks with its constants
    std::vector<ChunkTensors> of_group;
    for (const ChunkTensors& chunk : chunks) {
      if (chunk.param_group == g) of_group.push_back(ForGroup(chunk));
    }
    if (!of_group.empty()) UpdateParallel(MakeUpdateConstants(groups_[g], plan.step, plan.grad_multiplier), of_group);
  }
  return Status::Ok();
}

Result<StepPlan> Optimizer::Step(std::span<const ChunkTensors> chunks) {
  // Every chunk is checked before any is changed.
  GradStats stats;
  for (const ChunkTensors& chunk : chunks) {
    STRATA_RETURN_IF_ERROR(CheckChunk(config_, groups_.size(), chunk));
    stats.Add(chunk);
  }
  STRATA_ASSIGN_OR_RETURN(StepPlan plan, PlanStep(stats));
  STRATA_RETURN_IF_ERROR(UpdateChunks(plan, chunks));
  STRATA_RETURN_IF_ERROR(FinishStep(plan));
  return plan;
}

}  // namespace strata::optim
