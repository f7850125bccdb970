#include "offload/training/train_step.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <map>
#include <optional>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "memory/chunk_layout.h"
#include "src/base/alignment.h"
#include "src/base/half.h"
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
  Buffer scratch = AllocateAlignedHost(largest, kIoAlignmentBytes);
  for (const Group& g : groups) {
    const ChunkInfo& grad = g[ChunkKind::kGrad];
    STRATA_RETURN_IF_ERROR(engine.ReadChunk(grad.id, scratch.data()).WithContext("reading gradients for their norm"));
    stats.Add(scratch.data(), grad.dtype, grad.used_bytes / DTypeSizeBytes(grad.dtype));
  }
  return stats;
}

size_t UsedElems(const ChunkInfo& chunk) { return chunk.used_bytes / DTypeSizeBytes(chunk.dtype); }

// This rank's range of a group of n elements: the range its sharded state
// chunks hold.
memory::ShardRange RankShard(size_t n, const Communicator& comm) {
  return memory::ShardOf(n, comm.rank(), comm.world_size());
}

// Data parallel: every group's gradients, summed over the ranks by a
// reduce-scatter and divided by their number (the mean, as DDP takes it),
// this rank's range of each group in fp32 — from `reducer`, which may have
// reduced some during backward. The norm's sum of squares is this rank's
// part: the optimizer's all-reduce hook adds the others'. `bytes`: what
// the reduce-scatters sent.
Result<std::vector<std::vector<float>>> ReduceScatterGrads(GradReducer& reducer, const Communicator& comm,
                                                           const std::vector<Group>& groups, optim::GradStats& stats,
                                                           uint64_t& bytes) {
  std::vector<std::vector<float>> shards;
  for (const Group& g : groups) {
    const ChunkInfo& grad = g[ChunkKind::kGrad];
    STRATA_ASSIGN_OR_RETURN(GradReducer::Reduced reduced, reducer.Take(grad.id));
    const memory::ShardRange range = RankShard(UsedElems(grad), comm);
    stats.Add(reduced.shard.data(), DType::kFloat32, range.end - range.begin);
    bytes += reduced.bytes;
    shards.push_back(std::move(reduced.shard));
  }
  STRATA_RETURN_IF_ERROR(reducer.Drain());  // the communicator is the step's again
  return shards;
}

// Accesses group `g`'s chunks in the open host moment (into `held`),
// updates elements [lo, hi) but the skipped tensors' (this rank's sharded
// chunks hold that range), and zeroes the grad chunk. `reduced`: null to
// read the grad chunk (one rank); else this rank's reduced fp32 gradients
// of [lo, hi) (data parallel).
Status UpdateGroup(const Engine& engine, Pipeline& pipeline, const optim::Optimizer& optimizer,
                   const optim::StepPlan& plan, const Group& g, const std::vector<bool>& skip, size_t lo, size_t hi,
                   const float* reduced, std::array<ChunkAccess, kNumChunkKinds>& held) {
  for (ChunkKind kind : {ChunkKind::kGrad, ChunkKind::kParam, ChunkKind::kMaster, ChunkKind::kExpAvg,
                         ChunkKind::kExpAvgSq}) {
    // A transient param chunk (parameters sharded) is not written: the
    // master shard is the parameters, gathered again when compute needs them.
    const bool used = kind == ChunkKind::kExpAvg     ? optimizer.num_states() >= 1
                      : kind == ChunkKind::kExpAvgSq ? optimizer.num_states() >= 2
                      : kind == ChunkKind::kParam    ? !g[kind].transient
                                                     : g.has(kind);
    if (used) {
      STRATA_ASSIGN_OR_RETURN(held[static_cast<int>(kind)], pipeline.Access(g[kind].id));
    }
  }
  // Element `i` of the group's whole chunk in `kind`'s chunk (a sharded
  // chunk holds only this rank's range, which covers [lo, hi)).
  const auto element = [&](ChunkKind kind, size_t i) {
    const ChunkInfo& chunk = g[kind];
    return held[static_cast<int>(kind)].data() + (i * DTypeSizeBytes(chunk.dtype) - chunk.shard_offset_bytes);
  };
  const ChunkInfo& param = g[ChunkKind::kParam];
  const ChunkInfo& grad = g[ChunkKind::kGrad];
  // The element ranges to update: [lo, hi), less the skipped tensors.
  std::vector<std::pair<size_t, size_t>> ranges;
  const auto skipped = [&](TensorId id) { return id.value() < skip.size() && skip[id.value()]; };
  if (std::none_of(param.tensors.begin(), param.tensors.end(), skipped)) {
    ranges.emplace_back(lo, hi);
  } else {
    for (size_t i = 0; i < param.tensors.size(); ++i) {
      if (skipped(param.tensors[i])) continue;
      const size_t at = param.tensor_offsets_bytes[i] / DTypeSizeBytes(param.dtype);
      const size_t end = at + static_cast<size_t>(engine.tensors()[param.tensors[i].value()].num_elements());
      if (std::max(at, lo) < std::min(end, hi)) ranges.emplace_back(std::max(at, lo), std::min(end, hi));
    }
  }
  const ChunkKind state_kinds[] = {ChunkKind::kExpAvg, ChunkKind::kExpAvgSq};
  for (const auto& [a, b] : ranges) {
    optim::ChunkTensors part;
    part.n = b - a;
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
      part.grad_dtype = grad.dtype;
    }
    for (int k = 0; k < optimizer.num_states(); ++k) {
      part.state[k] = reinterpret_cast<float*>(element(state_kinds[k], a));
    }
    STRATA_RETURN_IF_ERROR(optimizer.UpdateChunk(plan, part));
  }
  std::memset(held[static_cast<int>(ChunkKind::kGrad)].data(), 0, grad.used_bytes);
  return Status::Ok();
}

// Data parallel: every rank's updated range of the param chunk (pinned in
// `param_data`) to every rank.
Status GatherParams(Communicator& comm, const ChunkInfo& param, std::byte* param_data) {
  const size_t n = UsedElems(param), width = DTypeSizeBytes(param.dtype);
  const memory::ShardRange range = RankShard(n, comm);
  std::vector<std::byte> mine(range.elems * width), all(range.elems * width * comm.world_size());
  std::memcpy(mine.data(), param_data + range.begin * width, (range.end - range.begin) * width);
  STRATA_RETURN_IF_ERROR(comm.AllGather(mine.data(), all.data(), range.elems * width)
                             .WithContext(fmt::format("all-gather of the updated chunk {}", param.id.value())));
  std::memcpy(param_data, all.data(), n * width);
  return Status::Ok();
}

}  // namespace

Result<TrainStepReport> RunTrainStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                     const std::vector<bool>& skip, Communicator* comm, GradReducer* reducer,
                                     UpdateFence* fence) {
  TrainStepReport report;
  const std::vector<Group> groups = TrainableGroups(engine);
  // A communicator of one rank takes the data-parallel path when a reducer
  // comes with it (comm.backend nccl on a single GPU: its collectives are
  // copies, but they run); without one, the single-rank path, which holds no
  // reduction buffers.
  const bool parallel = comm != nullptr && (comm->world_size() > 1 || reducer != nullptr);
  const int world = parallel ? comm->world_size() : 1;
  if (world != engine.world_size() || (parallel && comm->rank() != engine.rank())) {
    return InvalidArgument(
        "train step: the engine is rank {} of {} (its states are sharded that way) but the step was given {}: pass "
        "the communicator the engine was created with (EngineSeams::comm)",
        engine.rank(), engine.world_size(),
        parallel ? fmt::format("rank {} of {}", comm->rank(), comm->world_size()) : std::string("no communicator"));
  }
  Clock::time_point start = Clock::now();
  optim::GradStats stats;
  std::vector<std::vector<float>> reduced;
  uint64_t comm_bytes_before = 0;
  std::unique_ptr<GradReducer> own;
  if (parallel && reducer == nullptr) {
    for (const Group& g : groups) {
      if (g[ChunkKind::kParam].transient) {
        return InvalidArgument(
            "train step: parameters are sharded (comm.shard_params) but no GradReducer was given: pass the one that "
            "gathered the param chunks, whose kept gathers the update makes stale");
      }
    }
  }
  if (parallel) {
    if (reducer == nullptr) reducer = (own = std::make_unique<GradReducer>(engine, *comm)).get();
    const double waited = reducer->wait_seconds();
    STRATA_ASSIGN_OR_RETURN(reduced, ReduceScatterGrads(*reducer, *comm, groups, stats, report.comm_bytes));
    report.comm_wait_seconds = reducer->wait_seconds() - waited;
    reducer->ReleaseGathered();  // gathered from the masters this step updates
    comm_bytes_before = comm->stats().total_bytes();
    optimizer.SetAllReduceHook(
        [comm](optim::GradStats& s) { return comm->AllReduceSum(std::span<double>(&s.sum_squares, 1)); });
  } else {
    STRATA_ASSIGN_OR_RETURN(stats, ReadGradStats(engine, groups));
    optimizer.SetAllReduceHook(nullptr);
  }
  STRATA_ASSIGN_OR_RETURN(report.plan, optimizer.PlanStep(stats));
  // The step's own collectives are counted as they run: parameters
  // gathered ahead (parameters sharded) overlap the updates, and are the
  // next step's.
  const auto count_sent = [&] {
    if (!parallel) return;
    const uint64_t now = comm->stats().total_bytes();
    report.comm_bytes += now - comm_bytes_before;
    comm_bytes_before = now;
  };
  count_sent();  // the norm's all-reduce
  report.stats_seconds = SecondsSince(start);
  if (parallel && reducer != nullptr) {
    // Frozen groups' master shards never change: the next forward's gathers
    // of their param chunks may be queued now, after the step's own collective.
    std::set<uint32_t> trainable;
    for (const Group& g : groups) trainable.insert(g[ChunkKind::kParam].group);
    for (const ChunkInfo& c : engine.chunks()) {
      if (c.kind == ChunkKind::kParam && c.transient && !trainable.contains(c.group)) reducer->Updated(c.id);
    }
  }

  start = Clock::now();
  for (size_t k = 0; k < groups.size(); ++k) {
    const Group& g = groups[k];
    const size_t n = UsedElems(g[ChunkKind::kParam]);
    size_t lo = 0, hi = n;
    if (parallel) {
      const memory::ShardRange range = RankShard(n, *comm);
      lo = range.begin;
      hi = range.end;
    }
    if (fence != nullptr) STRATA_RETURN_IF_ERROR(fence->BeforeUpdate(g[ChunkKind::kParam].group));
    STRATA_RETURN_IF_ERROR(pipeline.BeginHostMoment().status());
    // Released before EndMoment, so the plan's write-backs may take them.
    std::array<ChunkAccess, kNumChunkKinds> held;
    Status updated = UpdateGroup(engine, pipeline, optimizer, report.plan, g, skip, lo, hi,
                                 parallel ? reduced[k].data() : nullptr, held);
    if (updated.ok() && parallel && !g[ChunkKind::kParam].transient) {
      comm_bytes_before = comm->stats().total_bytes();
      updated = GatherParams(*comm, g[ChunkKind::kParam], held[static_cast<int>(ChunkKind::kParam)].data());
      count_sent();
    }
    for (ChunkAccess& a : held) a.Release();
    const Status ended = pipeline.EndMoment();
    STRATA_RETURN_IF_ERROR(updated);
    STRATA_RETURN_IF_ERROR(ended);
    report.groups++;
    if (parallel && g[ChunkKind::kParam].transient) {
      reducer->Updated(g[ChunkKind::kParam].id);  // the next forward's first chunks gather ahead
    }
  }
  report.update_seconds = SecondsSince(start);
  for (std::vector<float>& shard : reduced) reducer->Recycle(std::move(shard));
  STRATA_RETURN_IF_ERROR(optimizer.FinishStep(report.plan));
  return report;
}

}  // namespace strata::offload
