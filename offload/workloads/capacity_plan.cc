#include "offload/workloads/capacity_plan.h"

#include <algorithm>

#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "memory/placement.h"
#include "offload/workloads/gpt_model.h"
#include "strata/options.h"

namespace strata::offload {

// Note [The GPT step estimate]
// The model's tensors are those of the self-check's GPT (GptTensorSpecs),
// bf16 with fp32 master weights and Adam moments, packed by the same chunk
// layout the engine uses. Activations per layer are estimated as
// s*b*h*(34 + 5*a*s/h) bytes (bf16, no recomputation; Korthikanti et al.,
// "Reducing Activation Recomputation in Large Transformer Models"), kept from
// a layer's forward to its backward. Compute per moment is its matmul FLOPs
// (forward 24*b*s*h^2 + 4*b*s^2*h per layer and 2*b*s*h*V for the logits;
// backward twice that) at --gpu-tflops.
//
// The step: forward over the embedding, each layer and the head (param
// chunks; activations alive as non-model memory), backward in reverse (with
// the grad chunks), then each trainable chunk group's optimizer update (a
// host moment over all of the group's chunks): on the CPU at
// --cpu-adam-gparams, or on the GPU at --gpu-adam-gparams where the planner
// places it there (Note [Where updates run] in planner.cc). The whole step
// goes to the planner with the links' bandwidths and homes as the engine
// gives them (states beyond DRAM on NVMe, read ahead of their update and
// written back), so the prediction is the plan's: compute, stalls and every
// link.
//
// Note [Layered accumulation]
// With gradient accumulation over M micro-batches, the standard step runs
// forward and backward M times, so every chunk a moment needs moves M times
// a step where it does not stay on the device. The layered step (Lamy-
// Poirier, 2021) runs each module for all M micro-batches before the next:
// one moment per module and direction whatever M, its compute M times a
// micro-batch's, so its chunks move once a step. Its blocks run
// checkpointed: forward keeps each block's input of every micro-batch (the
// boundary, s*b*h bf16 values) and one micro-batch's working set at a time;
// backward recomputes a block's forward for each micro-batch before its
// backward (half a pass more: its FLOPs are not the model's). The
// boundaries of all M micro-batches are non-model memory on the device
// here; a device that cannot hold them fails the plan with the figures.
namespace {

Status Validate(const ModelShape& m, const MachineSpec& x) {
  if (m.layers == 0 || m.hidden == 0 || m.vocab == 0 || m.sequence == 0 || m.batch == 0) {
    return InvalidArgument("plan: --layers, --hidden, --vocab, --seq and --batch must all be > 0");
  }
  if (x.hbm_bytes == 0 || x.dram_bytes == 0) return InvalidArgument("plan: --hbm and --dram must be > 0");
  if (!(x.hbm_reserve_fraction >= 0 && x.hbm_reserve_fraction < 1)) {
    return InvalidArgument("plan: the HBM reserve {} must be in [0, 1)", x.hbm_reserve_fraction);
  }
  for (double rate : {x.pcie_gbps, x.nvme_read_gbps, x.nvme_write_gbps, x.gpu_tflops, x.cpu_adam_gparams,
                      x.gpu_adam_gparams}) {
    if (!(rate > 0)) return InvalidArgument("plan: every bandwidth and rate must be > 0 (got {})", rate);
  }
  return Status::Ok();
}

// Bytes and FLOPs of one micro-batch through each module (Note [The GPT step
// estimate]).
struct GptCosts {
  explicit GptCosts(const ModelShape& model) {
    const double s = model.sequence, b = model.batch, h = model.hidden, v = model.vocab;
    const double heads = model.heads > 0 ? model.heads : std::max(1.0, h / 64);
    layer_activations = static_cast<uint64_t>(s * b * h * 34 + 5 * heads * s * s * b);
    embed_activations = static_cast<uint64_t>(2 * s * b * h);
    logits = static_cast<uint64_t>(2 * s * b * v);
    boundary = static_cast<uint64_t>(2 * s * b * h);
    layer_flops = 24 * b * s * h * h + 4 * b * s * s * h;
    head_flops = 2 * b * s * h * v;
  }
  uint64_t layer_activations = 0;
  uint64_t embed_activations = 0;
  uint64_t logits = 0;
  uint64_t boundary = 0;  // a layer's input, bf16: what a checkpoint keeps
  double layer_flops = 0;
  double head_flops = 0;
};

// The step's forward and backward moments, once per micro-batch or layered
// (Note [Layered accumulation]), with the step's FLOPs, activation peak and
// passes.
class ForwardBackwardTrace {
 public:
  ForwardBackwardTrace(const std::vector<TensorSpec>& specs, const memory::ChunkLayout& layout,
                       const ModelShape& model, const MachineSpec& machine, const Accumulation& accumulation)
      : layout_(layout),
        model_(model),
        machine_(machine),
        micro_batches_(std::max<uint32_t>(accumulation.micro_batches, 1)),
        layered_(accumulation.layered),
        costs_(model),
        groups_(GptForwardGroups(specs, model.layers)) {}

  GptStep Run() && {
    for (uint32_t pass = 0; pass < (layered_ ? 1 : micro_batches_); ++pass) {
      for (uint32_t g = 0; g < groups_.size(); ++g) step_.trace.moments.push_back(Moment(g, false));
      for (uint32_t g = static_cast<uint32_t>(groups_.size()); g-- > 0;) {
        step_.trace.moments.push_back(Moment(g, true));
      }
    }
    return std::move(step_);
  }

 private:
  TraceMoment Moment(uint32_t g, bool backward) {
    TraceMoment m;
    m.chunks = ChunksOf(g, backward);
    double passes = 1;  // of one micro-batch
    const uint32_t layers_alive = std::min(g, model_.layers);
    const uint64_t own = g == 0 ? costs_.embed_activations
                                : g <= model_.layers ? costs_.layer_activations : costs_.logits;
    const double flops = g == 0 ? 0 : g <= model_.layers ? costs_.layer_flops : costs_.head_flops;
    double work = (backward ? 2 : 1) * flops;
    if (!layered_) {
      // Activations alive: every layer up to this one (kept for backward).
      m.non_model_bytes = costs_.embed_activations + layers_alive * costs_.layer_activations +
                          (g == model_.layers + 1 ? costs_.logits : 0);
    } else {
      // Every micro-batch's layer inputs up to this one, and one micro-batch's working set (Note [Layered
      // accumulation]); its backward recomputes its forward first.
      const uint64_t held = micro_batches_ * (costs_.embed_activations + layers_alive * costs_.boundary);
      m.non_model_bytes = held + (g == 0 ? 0 : own);
      step_.boundary_bytes = std::max(step_.boundary_bytes, held);
      step_.model_flops += (micro_batches_ - 1) * work;
      passes = micro_batches_ * (backward ? 2.0 : 1.0);  // a backward pass, and the forward's again
      work = micro_batches_ * (work + (backward ? flops : 0));
    }
    m.compute_seconds = work / (machine_.gpu_tflops * 1e12);
    step_.model_flops += (backward ? 2 : 1) * flops;
    step_.activation_peak_bytes = std::max(step_.activation_peak_bytes, m.non_model_bytes);
    step_.passes.push_back(passes);
    return m;
  }

  // The param chunks of group g's tensors, and in backward their grad chunks.
  std::vector<ChunkId> ChunksOf(uint32_t g, bool backward) const {
    std::vector<ChunkId> chunks;
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad}) {
      if (kind == ChunkKind::kGrad && !backward) continue;
      for (uint32_t t : groups_[g]) {
        std::optional<ChunkId> c = layout_.ChunkOf(TensorId(t), kind);
        if (c && std::find(chunks.begin(), chunks.end(), *c) == chunks.end()) chunks.push_back(*c);
      }
    }
    return chunks;
  }

  const memory::ChunkLayout& layout_;
  const ModelShape& model_;
  const MachineSpec& machine_;
  const uint32_t micro_batches_;
  const bool layered_;
  const GptCosts costs_;
  const std::vector<std::vector<uint32_t>> groups_;
  GptStep step_;
};

// The update of each trainable chunk group: every chunk of the group, in
// layout order, as offload::RunTrainStep runs them.
void AppendUpdates(const std::vector<TensorSpec>& specs, const memory::ChunkLayout& layout,
                   const MachineSpec& machine, GptStep& step) {
  // Under int8 states every update runs on the host, the small tensors' fp32 moments' too (torchao's arithmetic:
  // Note [8-bit states in chunks] in optim/cpu/cpu_kernels.cc).
  const bool host_only = layout.moment_dtype() == DType::kInt8Block;
  for (uint32_t g = 0; g < layout.groups().size(); ++g) {
    const memory::ChunkGroup& group = layout.groups()[g];
    if (!group.trainable) continue;
    TraceMoment m{.tier = Tier::kHost};
    uint64_t params = 0;
    for (TensorId t : group.tensors) params += static_cast<uint64_t>(specs[t.value()].num_elements());
    for (const std::optional<ChunkId>& c : group.chunk_of_kind) {
      if (c) m.chunks.push_back(*c);
    }
    const DType moment = layout.chunk(*group.chunk_of_kind[static_cast<int>(ChunkKind::kExpAvg)]).dtype;
    m.compute_seconds = UpdateSeconds(params, moment, Tier::kHost, machine);
    if (moment == DType::kFloat32 && !host_only) {
      m.device_compute_seconds = UpdateSeconds(params, moment, Tier::kDevice, machine);
    }
    step.trace.moments.push_back(std::move(m));
    step.passes.push_back(0);
  }
}

}  // namespace

// The tensors of each forward group: the embedding (0), each layer, the head.
std::vector<std::vector<uint32_t>> GptForwardGroups(const std::vector<TensorSpec>& specs, uint32_t layers) {
  std::vector<std::vector<uint32_t>> groups(layers + 2);
  for (uint32_t t = 0; t < specs.size(); ++t) groups[GptForwardGroup(specs[t].name, layers)].push_back(t);
  // The output head is tied to the token embedding: the logits need it again.
  for (uint32_t t = 0; t < specs.size(); ++t) {
    if (specs[t].name == "embed.tokens.weight") groups.back().push_back(t);
  }
  return groups;
}

// The CPU rate is fp32 moments' (28 bytes a bf16 parameter: its gradient and
// copy, the master both ways, the moments both ways); bf16 moments move fewer
// bytes; int8 ones fewer still, but their kernel is bound by its arithmetic
// (five divisions a parameter against two): it ran at 0.31-0.52 of the fp32
// kernel's rate where that was memory-bound (docs/benchmarks.md), so the plan
// counts it at 0.45. Both update on the host as the engine runs them
// (DeviceUpdateSeconds in offload/training/group_update.h).
double UpdateSeconds(uint64_t params, DType moment, Tier where, const MachineSpec& machine) {
  if (where == Tier::kDevice) return static_cast<double>(params) / (machine.gpu_adam_gparams * 1e9);
  constexpr double kInt8RelativeRate = 0.45;
  const double cost = moment == DType::kInt8Block ? 1.0 / kInt8RelativeRate
                                                  : (12.0 + 4.0 * static_cast<double>(DTypeSizeBytes(moment))) / 28.0;
  return cost * static_cast<double>(params) / (machine.cpu_adam_gparams * 1e9);
}

GptStep GptStepTrace(const std::vector<TensorSpec>& specs, const memory::ChunkLayout& layout, const ModelShape& model,
                     const MachineSpec& machine, const Accumulation& accumulation) {
  GptStep step = ForwardBackwardTrace(specs, layout, model, machine, accumulation).Run();
  AppendUpdates(specs, layout, machine, step);
  return step;
}

namespace {

// The planner's input but the trace, with homes as the engine gives them
// (memory::AssignHomes, with the same room kept for staging NVMe reads); the
// model states' sizes and homes into `plan`.
Result<PlannerInput> HomesOf(const memory::ChunkLayout& layout, const MachineSpec& machine, CapacityPlan& plan) {
  const Options defaults;
  PlannerInput input;
  const uint64_t total = layout.report().total_bytes;
  const memory::HostReserve reserve =
      memory::HostReserveFor(layout, machine.dram_bytes, machine.nvme_bytes, defaults.optimizer.stream_ring_bytes);
  input.host_staging_bytes = reserve.staging_bytes;
  const uint64_t dram_for_homes = machine.dram_bytes - reserve.reserved_bytes;
  const std::vector<std::optional<Tier>> homes =
      memory::AssignHomes(layout.chunks(), dram_for_homes, machine.nvme_bytes);
  for (size_t i = 0; i < homes.size(); ++i) {
    const memory::ChunkDesc& chunk = layout.chunks()[i];
    const uint64_t size = chunk.size_bytes();
    const bool state = memory::IsStateChunk(chunk);
    (chunk.kind == ChunkKind::kParam ? plan.param_bytes : chunk.kind == ChunkKind::kGrad ? plan.grad_bytes
                                                                                          : plan.state_bytes) += size;
    input.chunk_bytes.push_back(size);
    if (!homes[i]) {
      return OutOfMemory("plan: the model states need {} but DRAM ({}, {} of it kept for staging NVMe reads) and "
                         "NVMe ({}) hold {} ({} short): raise --dram or give --nvme directories with more space",
                         FormatSize(total), FormatSize(machine.dram_bytes), FormatSize(reserve.reserved_bytes),
                         FormatSize(machine.nvme_bytes), FormatSize(dram_for_homes + machine.nvme_bytes),
                         FormatSize(total - std::min(total, dram_for_homes + machine.nvme_bytes)));
    }
    input.home.push_back(*homes[i]);
    (*homes[i] == Tier::kHost ? plan.host_chunk_bytes : plan.nvme_chunk_bytes) += size;
    if (*homes[i] == Tier::kNvme && state) plan.nvme_state_bytes += size;
  }
  return input;
}

// Forward and backward against the updates (the moments of no pass), as
// `built` places them; and how long each resource is busy in a step, the
// longest being the bottleneck.
void SummarizeStep(const Trace& trace, const std::vector<double>& passes, const Plan& built,
                   const MachineSpec& machine, CapacityPlan& plan) {
  double gpu_busy = 0, cpu_busy = 0;
  for (size_t k = 0; k < trace.moments.size(); ++k) {
    const TraceMoment& m = trace.moments[k];
    const double stall = plan.prediction.stall_per_moment[k];
    const bool update = passes[k] == 0;
    if (!update) {
      plan.compute_seconds += m.compute_seconds;
      plan.forward_backward_seconds += m.compute_seconds + stall;
      gpu_busy += m.compute_seconds;
    } else if (built.compute_tier[k] == Tier::kDevice) {
      plan.updates_on_device++;
      plan.optimizer_seconds += *m.device_compute_seconds + stall;
      plan.update_compute_seconds += *m.device_compute_seconds;
      gpu_busy += *m.device_compute_seconds;
    } else {
      plan.optimizer_seconds += m.compute_seconds + stall;
      plan.update_compute_seconds += m.compute_seconds;
      cpu_busy += m.compute_seconds;
    }
    if (update) plan.updates++;
  }
  const auto& bytes = plan.prediction.bytes;
  const double pcie_seconds = static_cast<double>(std::max(bytes[0], bytes[1])) / (machine.pcie_gbps * 1e9);
  const double nvme_seconds = static_cast<double>(bytes[2]) / (machine.nvme_read_gbps * 1e9) +
                              static_cast<double>(bytes[3]) / (machine.nvme_write_gbps * 1e9);
  const std::pair<double, const char*> busy[] = {
      {gpu_busy, "compute"}, {pcie_seconds, "pcie"}, {nvme_seconds, "nvme"}, {cpu_busy, "cpu optimizer"}};
  plan.bottleneck = std::max_element(std::begin(busy), std::end(busy))->second;
}

}  // namespace

Result<CapacityPlan> PlanCapacity(const ModelShape& model, const MachineSpec& machine,
                                  const Accumulation& accumulation, DType moment_dtype) {
  STRATA_RETURN_IF_ERROR(Validate(model, machine));
  if (accumulation.micro_batches == 0) return InvalidArgument("plan: --micro-batches must be >= 1");
  CapacityPlan plan;
  plan.model = model;
  plan.machine = machine;
  plan.accumulation = accumulation;
  plan.moment_dtype = moment_dtype;
  const std::vector<TensorSpec> specs = GptTensorSpecs(model, DType::kBFloat16);
  STRATA_ASSIGN_OR_RETURN(memory::ChunkLayout layout,
                          memory::ChunkLayout::Build(specs, 0, memory::kWidestSearchMinElems,
                                                     memory::kWidestSearchMaxElems, {}, moment_dtype));
  for (const TensorSpec& spec : specs) {
    if (spec.trainable) plan.params += static_cast<uint64_t>(spec.num_elements());
  }
  STRATA_ASSIGN_OR_RETURN(PlannerInput input, HomesOf(layout, machine, plan));
  GptStep step = GptStepTrace(specs, layout, model, machine, accumulation);
  input.trace = std::move(step.trace);
  plan.model_flops = step.model_flops;
  plan.activation_peak_bytes = step.activation_peak_bytes;
  plan.boundary_bytes = step.boundary_bytes;
  plan.device_bytes = static_cast<uint64_t>(static_cast<double>(machine.hbm_bytes) * (1 - machine.hbm_reserve_fraction));
  input.device_bytes = plan.device_bytes;
  input.links.bytes_per_second = {machine.pcie_gbps * 1e9, machine.pcie_gbps * 1e9, machine.nvme_read_gbps * 1e9,
                                  machine.nvme_write_gbps * 1e9};
  Result<Plan> built = BuildPlan(input);
  if (!built.ok() && built.status().code() != StatusCode::kOutOfMemory) return built.status().WithContext("plan");
  if (!built.ok()) {
    return Status(built.status().code(),
                  fmt::format("plan: the GPU ({} of HBM, {} usable) cannot run this model at batch {}{}: {}",
                              FormatSize(machine.hbm_bytes), FormatSize(plan.device_bytes), model.batch,
                              accumulation.layered
                                  ? fmt::format(" with layered accumulation over {} micro-batches ({} of their "
                                                "layer inputs held)",
                                                accumulation.micro_batches, FormatSize(step.boundary_bytes))
                                  : std::string(),
                              built.status().message()));
  }
  plan.prediction = built->prediction;
  plan.step_seconds = plan.prediction.step_seconds;
  SummarizeStep(input.trace, step.passes, *built, machine, plan);
  return plan;
}

namespace {

// Layered accumulation's held inputs, and the other accumulation's step beside this one's.
std::string AccumulationLines(const CapacityPlan& p) {
  std::string out;
  if (p.accumulation.layered) {
    out += fmt::format("  layer inputs of the {} micro-batches held on the GPU: {} (checkpointed blocks)\n",
                       p.accumulation.micro_batches, FormatSize(p.boundary_bytes));
  }
  const char* other = p.accumulation.layered ? "standard" : "layered";
  if (!p.other_error.empty()) {
    out += fmt::format("  {} accumulation: does not fit ({})\n", other, p.other_error);
  } else if (p.other_step_seconds > 0) {
    out += fmt::format("  {} accumulation: step {:.3f} s ({:.2f}x this one), moving {} a step (this one {})\n", other,
                       p.other_step_seconds, p.other_step_seconds / p.step_seconds,
                       FormatSize(p.other_bytes_moved), FormatSize(p.prediction.bytes_moved()));
  }
  return out;
}

}  // namespace

std::string FormatCapacityPlan(const CapacityPlan& p) {
  const auto gib = [](uint64_t bytes) { return FormatSize(bytes); };
  const std::string accumulation =
      p.accumulation.micro_batches <= 1
          ? std::string()
          : fmt::format(" x {} micro-batches, {} accumulation", p.accumulation.micro_batches,
                        p.accumulation.order_name());
  return fmt::format(
      "strata plan: GPT, {} layers, hidden {}, vocab {}, seq {}, batch {}{}: {:.2f} B parameters\n"
      "  params (bf16) {}   grads (bf16) {}   optimizer states (fp32 master, {} exp_avg and exp_avg_sq) {}\n"
      "  bytes a parameter: {:.1f} in all, {:.1f} of optimizer states; homed in DRAM {:.1f}, on NVMe {:.1f}\n"
      "  activations, peak (estimate) {}\n"
      "where it lives:\n"
      "  HBM   {} usable of {}: the chunks each moment needs, streamed, and the activations\n"
      "  DRAM  {} of chunks (of {})\n"
      "  NVMe  {} of chunks ({} of them optimizer states){}\n"
      "step (predicted):\n"
      "  forward + backward {:.3f} s (compute {:.3f} s, the rest waiting for chunks); optimizer step {:.3f} s "
      "({} of {} chunk-group updates on the GPU, the rest on the CPU)\n"
      "  step {:.3f} s, {:.1f} TFLOPS; bottleneck: {}\n"
      "  moved per step: host->device {}, device->host {}, nvme read {}, nvme write {}\n",
      p.model.layers, p.model.hidden, p.model.vocab, p.model.sequence, p.model.batch, accumulation,
      static_cast<double>(p.params) / 1e9, gib(p.param_bytes), gib(p.grad_bytes), DTypeName(p.moment_dtype),
      gib(p.state_bytes), p.per_param(p.param_bytes + p.grad_bytes + p.state_bytes), p.per_param(p.state_bytes),
      p.per_param(p.host_chunk_bytes), p.per_param(p.nvme_chunk_bytes), gib(p.activation_peak_bytes), gib(p.device_bytes), gib(p.machine.hbm_bytes), gib(p.host_chunk_bytes),
      gib(p.machine.dram_bytes), gib(p.nvme_chunk_bytes), gib(p.nvme_state_bytes),
      p.machine.nvme_bytes == 0 ? " (no NVMe given)" : "", p.forward_backward_seconds, p.compute_seconds,
      p.optimizer_seconds, p.updates_on_device, p.updates, p.step_seconds, p.tflops(), p.bottleneck,
      gib(p.prediction.bytes[0]), gib(p.prediction.bytes[1]), gib(p.prediction.bytes[2]), gib(p.prediction.bytes[3])) +
         AccumulationLines(p);
}

std::string CapacityPlanJson(const CapacityPlan& p) {
  nlohmann::json j;
  j["model"] = {{"layers", p.model.layers}, {"hidden", p.model.hidden}, {"vocab", p.model.vocab},
                {"seq", p.model.sequence},  {"batch", p.model.batch}};
  j["micro_batches"] = p.accumulation.micro_batches;
  j["accumulation"] = p.accumulation.order_name();
  j["boundary_bytes"] = p.boundary_bytes;
  if (p.other_step_seconds > 0) {
    j["other_accumulation"] = {{"step_seconds", p.other_step_seconds}, {"bytes_moved", p.other_bytes_moved}};
  } else if (!p.other_error.empty()) {
    j["other_accumulation"] = {{"error", p.other_error}};
  }
  j["params"] = p.params;
  j["states"] = DTypeName(p.moment_dtype);
  j["bytes_per_param"] = {{"all", p.per_param(p.param_bytes + p.grad_bytes + p.state_bytes)},
                          {"optimizer_states", p.per_param(p.state_bytes)},
                          {"host", p.per_param(p.host_chunk_bytes)},
                          {"nvme", p.per_param(p.nvme_chunk_bytes)}};
  j["param_bytes"] = p.param_bytes;
  j["grad_bytes"] = p.grad_bytes;
  j["state_bytes"] = p.state_bytes;
  j["activation_peak_bytes"] = p.activation_peak_bytes;
  j["device_bytes"] = p.device_bytes;
  j["host_chunk_bytes"] = p.host_chunk_bytes;
  j["nvme_chunk_bytes"] = p.nvme_chunk_bytes;
  j["nvme_state_bytes"] = p.nvme_state_bytes;
  j["compute_seconds"] = p.compute_seconds;
  j["forward_backward_seconds"] = p.forward_backward_seconds;
  j["updates"] = p.updates;
  j["updates_on_device"] = p.updates_on_device;
  j["stall_seconds"] = p.prediction.stall_seconds;
  j["optimizer_seconds"] = p.optimizer_seconds;
  j["update_compute_seconds"] = p.update_compute_seconds;
  j["step_seconds"] = p.step_seconds;
  j["tflops"] = p.tflops();
  j["bottleneck"] = p.bottleneck;
  for (int l = 0; l < kNumLinks; ++l) j["bytes_moved"][std::string(LinkName(static_cast<Link>(l)))] = p.prediction.bytes[l];
  return j.dump(2);
}

}  // namespace strata::offload
