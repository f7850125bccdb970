#include "offload/training/group_update.h"

#include <algorithm>
#include <cstring>
#include <map>

namespace strata::offload {

std::vector<Group> TrainableGroups(const Engine& engine) {
  std::map<uint32_t, Group> groups;
  for (const ChunkInfo& chunk : engine.chunks()) groups[chunk.group].of_kind[static_cast<int>(chunk.kind)] = chunk;
  std::vector<Group> trainable;
  for (auto& [index, group] : groups) {
    if (group.has(ChunkKind::kGrad)) trainable.push_back(std::move(group));
  }
  return trainable;
}

std::vector<ChunkKind> UpdatedKinds(const Group& g, int num_states) {
  std::vector<ChunkKind> kinds;
  for (ChunkKind kind :
       {ChunkKind::kGrad, ChunkKind::kParam, ChunkKind::kMaster, ChunkKind::kExpAvg, ChunkKind::kExpAvgSq}) {
    const bool used = kind == ChunkKind::kExpAvg     ? num_states >= 1
                      : kind == ChunkKind::kExpAvgSq ? num_states >= 2
                      : kind == ChunkKind::kParam    ? !g[kind].transient
                                                     : g.has(kind);
    if (used) kinds.push_back(kind);
  }
  return kinds;
}

size_t UsedElems(const ChunkInfo& chunk) { return ChunkElems(chunk.dtype, chunk.used_bytes); }

namespace {
constexpr double kDeviceBytesPerSecond = 1e12;
}  // namespace

std::optional<double> DeviceUpdateSeconds(const Group& g, const optim::OptimizerConfig& config) {
  const int num_states = optim::NumStates(config);
  if (config.int8_states || (num_states > 0 && g[ChunkKind::kExpAvg].dtype != DType::kFloat32)) return std::nullopt;
  uint64_t bytes = 0;
  for (ChunkKind kind : UpdatedKinds(g, num_states)) bytes += 2 * g[kind].used_bytes;  // read, write
  return static_cast<double>(bytes) / kDeviceBytesPerSecond;
}

double DeviceStatsSeconds(const Group& g) {
  return static_cast<double>(g[ChunkKind::kGrad].used_bytes) / kDeviceBytesPerSecond;
}

Status GroupUpdate::Run(const Group& g, size_t lo, size_t hi, const float* reduced, const HeldChunks& held,
                        const UpdateExtras& extras) const {
  ComputeSeam* const seam = engine_.compute_seam();
  if (seam != nullptr && !plan_.skip) {
    return seam->RunUpdate(
        {.group = g[ChunkKind::kParam].group, .elems = hi - lo, .where = extras.where, .overlapped = extras.overlapped});
  }
  if (!extras.on_device) return RunOnHost(g, lo, hi, reduced, held, extras);
  void* const stream = extras.stream;
  for (const Range& r : RangesToUpdate(g[ChunkKind::kParam], lo, hi)) {
    STRATA_RETURN_IF_ERROR(
        optimizer_.UpdateChunkOnDevice(plan_, TensorsOf(g, held, lo, r.begin, r.end, reduced), r.step, stream));
  }
  return optim::Optimizer::ZeroOnDevice(held[static_cast<int>(ChunkKind::kGrad)].data(),
                                        g[ChunkKind::kGrad].used_bytes, stream);
}

// Note [One pass over a group]
// On the host an update is bound by memory bandwidth, so what else touches
// the group's bytes rides on its pass: each block of elements is copied into
// `keep` just before the kernel updates it, and its gradients are zeroed just
// after the kernel read them, by the core that updates it, while the block is
// in that core's cache (optim::BlockWork). Elements no range covers (skipped
// tensors, padding between ranges of different step counts, a skipped step)
// get the same after the update. Data parallel, the kernel reads the reduced
// gradients, and the grad chunk is zeroed in a pass of its own.
Status GroupUpdate::RunOnHost(const Group& g, size_t lo, size_t hi, const float* reduced, const HeldChunks& held,
                              const UpdateExtras& extras) const {
  const ChunkInfo& grad = g[ChunkKind::kGrad];
  std::byte* const grads = held[static_cast<int>(ChunkKind::kGrad)].data();
  std::byte* const keep = extras.keep;
  const size_t width = DTypeSizeBytes(grad.dtype);
  const bool zero_as_read = reduced == nullptr && extras.zero_grads;
  const auto zero = [&](size_t a, size_t b) { std::memset(grads + a * width, 0, (b - a) * width); };
  std::vector<Range> ranges;
  if (!plan_.skip) ranges = RangesToUpdate(g[ChunkKind::kParam], lo, hi);
  for (const Range& r : ranges) {
    optim::BlockWork work;
    if (keep != nullptr) work.before = [&](size_t a, size_t b) { Keep(g, held, keep, r.begin + a, r.begin + b); };
    if (zero_as_read) work.after = [&](size_t a, size_t b) { zero(r.begin + a, r.begin + b); };
    STRATA_RETURN_IF_ERROR(
        optimizer_.UpdateChunk(plan_, TensorsOf(g, held, lo, r.begin, r.end, reduced), r.step, work));
  }
  size_t at = 0;  // the elements between the ranges, and after the last
  const auto between = [&](size_t end) {
    if (at >= end) return;
    if (keep != nullptr) Keep(g, held, keep, at, end);
    if (zero_as_read) zero(at, end);
  };
  for (const Range& r : ranges) {
    between(r.begin);
    at = r.end;
  }
  between(UsedElems(grad));
  if (reduced != nullptr && extras.zero_grads) optim::Optimizer::ZeroOnHost(grads, grad.used_bytes);
  return Status::Ok();
}

void GroupUpdate::Keep(const Group& g, const HeldChunks& held, std::byte* keep, size_t a, size_t b) const {
  for (ChunkKind kind : UpdatedKinds(g, optimizer_.num_states())) {
    const ChunkInfo& chunk = g[kind];
    // A sharded chunk holds elements [first, first + its used elements) of the group's.
    const size_t first = ChunkElems(chunk.dtype, chunk.shard_offset_bytes);
    const size_t begin = std::max(a, first), end = std::min(b, first + UsedElems(chunk));
    if (begin < end) {  // whole blocks of int8 states: a range's ends are on blocks
      const size_t at = ChunkBytes(chunk.dtype, begin - first);
      std::memcpy(keep + at, held[static_cast<int>(kind)].data() + at, ChunkBytes(chunk.dtype, end - first) - at);
    }
    keep += chunk.used_bytes;
  }
}

// The element ranges to update: [lo, hi), less the skipped tensors, split
// where the tensors' step counts differ (consecutive tensors of the same
// count share a range, the padding between them included).
std::vector<GroupUpdate::Range> GroupUpdate::RangesToUpdate(const ChunkInfo& param, size_t lo, size_t hi) const {
  const std::vector<TensorId>& tensors = param.tensors;
  const auto step = [&](TensorId id) { return optimizer_.TensorStep(plan_, id); };
  const bool uniform = std::all_of(tensors.begin(), tensors.end(), [&](TensorId id) {
    return !Skipped(id) && step(id) == step(tensors.front());
  });
  if (tensors.empty() || uniform) return {Range{lo, hi, tensors.empty() ? 0 : step(tensors.front())}};
  std::vector<Range> ranges;
  bool extends = false;  // whether the last range ends at the tensor before this one
  for (size_t i = 0; i < tensors.size(); ++i) {
    const size_t at = param.tensor_offsets_bytes[i] / DTypeSizeBytes(param.dtype);
    const size_t end = at + static_cast<size_t>(engine_.tensors()[tensors[i].value()].num_elements());
    const size_t a = std::max(at, lo), b = std::min(end, hi);
    if (Skipped(tensors[i]) || a >= b) {
      extends = false;
      continue;
    }
    if (extends && ranges.back().step == step(tensors[i])) {
      ranges.back().end = b;
    } else {
      ranges.push_back(Range{a, b, step(tensors[i])});
    }
    extends = true;
  }
  return ranges;
}

// The arrays of elements [a, b) of group `g` (pinned in `held`; `reduced`
// as for Run, starting at element `lo`).
optim::ChunkTensors GroupUpdate::TensorsOf(const Group& g, const HeldChunks& held, size_t lo, size_t a, size_t b,
                                           const float* reduced) const {
  // Element `i` of the group's whole chunk in `kind`'s chunk (a sharded
  // chunk holds only this rank's range, which covers [lo, hi)).
  const auto element = [&](ChunkKind kind, size_t i) {
    const ChunkInfo& chunk = g[kind];
    return held[static_cast<int>(kind)].data() + (ChunkBytes(chunk.dtype, i) - chunk.shard_offset_bytes);
  };
  const ChunkInfo& param = g[ChunkKind::kParam];
  optim::ChunkTensors part;
  part.n = b - a;
  part.param_group = param.param_group;
  // A transient param chunk gets no compute copy: the update is the master's alone.
  part.param_dtype = param.transient ? DType::kFloat32 : param.dtype;
  if (g.has(ChunkKind::kMaster)) {
    part.master = reinterpret_cast<float*>(element(ChunkKind::kMaster, a));
    part.param = param.transient ? nullptr : element(ChunkKind::kParam, a);
  } else {
    part.master = reinterpret_cast<float*>(element(ChunkKind::kParam, a));
  }
  if (reduced != nullptr) {
    part.grad = reduced + (a - lo);
    part.grad_dtype = DType::kFloat32;
  } else {
    part.grad = element(ChunkKind::kGrad, a);
    part.grad_dtype = g[ChunkKind::kGrad].dtype;
  }
  const ChunkKind state_kinds[] = {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq};
  for (int k = 0; k < optimizer_.num_states(); ++k) {
    // bf16 arrays or int8 blocks where state_dtype says
    part.state[k] = reinterpret_cast<float*>(element(state_kinds[k], a));
    part.state_dtype = g[state_kinds[k]].dtype;
  }
  return part;
}

Status AccessGroup(Pipeline& pipeline, const Group& g, int num_states, HeldChunks& held) {
  for (ChunkKind kind : UpdatedKinds(g, num_states)) {
    STRATA_ASSIGN_OR_RETURN(held[static_cast<int>(kind)], pipeline.Access(g[kind].id));
  }
  return Status::Ok();
}

}  // namespace strata::offload
