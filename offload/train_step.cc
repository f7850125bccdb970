#include "offload/train_step.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <vector>

#include "strata/buffer.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// The chunks of one trainable group, by kind.
struct Group {
  std::array<std::optional<ChunkInfo>, kNumChunkKinds> of_kind;
  const ChunkInfo& operator[](ChunkKind kind) const { return *of_kind[static_cast<int>(kind)]; }
  bool has(ChunkKind kind) const { return of_kind[static_cast<int>(kind)].has_value(); }
};

std::vector<Group> TrainableGroups(const Engine& engine) {
  std::map<uint32_t, Group> groups;
  for (const ChunkInfo& chunk : engine.chunks()) groups[chunk.group].of_kind[static_cast<int>(chunk.kind)] = chunk;
  std::vector<Group> trainable;
  for (auto& [index, group] : groups) {
    if (group.has(ChunkKind::kGrad)) trainable.push_back(std::move(group));
  }
  return trainable;
}

Result<optim::GradStats> ReadGradStats(Engine& engine, const std::vector<Group>& groups) {
  uint64_t largest = 0;
  for (const Group& g : groups) largest = std::max(largest, g[ChunkKind::kGrad].size_bytes);
  optim::GradStats stats;
  if (groups.empty()) return stats;
  Buffer scratch = AllocateAlignedHost(largest, 4096);
  for (const Group& g : groups) {
    const ChunkInfo& grad = g[ChunkKind::kGrad];
    STRATA_RETURN_IF_ERROR(engine.ReadChunk(grad.id, scratch.data()).WithContext("reading gradients for their norm"));
    stats.Add(scratch.data(), grad.dtype, grad.used_bytes / DTypeSizeBytes(grad.dtype));
  }
  return stats;
}

// Accesses group `g`'s chunks in the open host moment (into `held`),
// updates them and zeroes the grad chunk.
Status UpdateGroup(const Engine& engine, Pipeline& pipeline, const optim::Optimizer& optimizer,
                   const optim::StepPlan& plan, const Group& g, const std::vector<bool>& skip,
                   std::array<ChunkAccess, kNumChunkKinds>& held) {
  const auto access = [&](ChunkKind kind) -> Result<std::byte*> {
    STRATA_ASSIGN_OR_RETURN(held[static_cast<int>(kind)], pipeline.Access(g[kind].id));
    return held[static_cast<int>(kind)].data();
  };
  const ChunkInfo& param = g[ChunkKind::kParam];
  const ChunkInfo& grad = g[ChunkKind::kGrad];
  optim::ChunkTensors t;
  t.n = param.used_bytes / DTypeSizeBytes(param.dtype);
  t.param_dtype = param.dtype;
  t.grad_dtype = grad.dtype;
  STRATA_ASSIGN_OR_RETURN(std::byte* grad_data, access(ChunkKind::kGrad));
  t.grad = grad_data;
  STRATA_ASSIGN_OR_RETURN(std::byte* param_data, access(ChunkKind::kParam));
  if (g.has(ChunkKind::kMaster)) {
    STRATA_ASSIGN_OR_RETURN(std::byte* master, access(ChunkKind::kMaster));
    t.master = reinterpret_cast<float*>(master);
    t.param = param_data;
  } else {
    t.master = reinterpret_cast<float*>(param_data);
  }
  const ChunkKind state_kinds[] = {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq};
  for (int s = 0; s < optimizer.num_states(); ++s) {
    STRATA_ASSIGN_OR_RETURN(std::byte* state, access(state_kinds[s]));
    t.state[s] = reinterpret_cast<float*>(state);
  }
  const auto skipped = [&](TensorId id) { return id.value() < skip.size() && skip[id.value()]; };
  if (std::none_of(param.tensors.begin(), param.tensors.end(), skipped)) {
    STRATA_RETURN_IF_ERROR(optimizer.UpdateChunk(plan, t));
  } else {  // each tensor that is not skipped on its own
    for (size_t i = 0; i < param.tensors.size(); ++i) {
      if (skipped(param.tensors[i])) continue;
      const uint64_t at = param.tensor_offsets_bytes[i] / DTypeSizeBytes(param.dtype);
      optim::ChunkTensors part = t;
      part.n = static_cast<size_t>(engine.tensors()[param.tensors[i].value()].num_elements());
      part.master = t.master + at;
      if (t.param != nullptr) part.param = static_cast<std::byte*>(t.param) + at * DTypeSizeBytes(t.param_dtype);
      part.grad = static_cast<const std::byte*>(t.grad) + at * DTypeSizeBytes(t.grad_dtype);
      for (float*& state : part.state) {
        if (state != nullptr) state += at;
      }
      STRATA_RETURN_IF_ERROR(optimizer.UpdateChunk(plan, part));
    }
  }
  std::memset(grad_data, 0, grad.used_bytes);
  return Status::Ok();
}

}  // namespace

Result<TrainStepReport> RunTrainStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                     const std::vector<bool>& skip) {
  TrainStepReport report;
  const std::vector<Group> groups = TrainableGroups(engine);
  Clock::time_point start = Clock::now();
  STRATA_ASSIGN_OR_RETURN(optim::GradStats stats, ReadGradStats(engine, groups));
  STRATA_ASSIGN_OR_RETURN(report.plan, optimizer.PlanStep(stats));
  report.stats_seconds = SecondsSince(start);

  start = Clock::now();
  for (const Group& g : groups) {
    STRATA_RETURN_IF_ERROR(pipeline.BeginHostMoment().status());
    // Released before EndMoment, so the plan's write-backs may take them.
    std::array<ChunkAccess, kNumChunkKinds> held;
    const Status updated = UpdateGroup(engine, pipeline, optimizer, report.plan, g, skip, held);
    for (ChunkAccess& a : held) a.Release();
    const Status ended = pipeline.EndMoment();
    STRATA_RETURN_IF_ERROR(updated);
    STRATA_RETURN_IF_ERROR(ended);
    report.groups++;
  }
  report.update_seconds = SecondsSince(start);
  STRATA_RETURN_IF_ERROR(optimizer.FinishStep(report.plan));
  return report;
}

}  // namespace strata::offload
