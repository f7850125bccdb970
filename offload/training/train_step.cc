#include "offload/training/train_step.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <vector>

#include <fmt/format.h>

#include "memory/chunk_layout.h"
#include "offload/training/group_update.h"
#include "src/base/alignment.h"
#include "src/base/half.h"
#include "src/base/logging.h"
#include "strata/buffer.h"
#include "strata/device.h"

namespace strata::offload {

// Note [The train step]
// RunTrainStep runs three phases:
//   1. gradient statistics: every grad chunk is read where it lives (a copy
//      into one host buffer; nothing moves), for the global norm, clipping
//      and the inf/NaN skip (Optimizer::PlanStep);
//   2. one host moment per trainable chunk group, in layout order: its grad,
//      master (bf16/fp16 only), optimizer states and param chunk are
//      accessed through the pipeline (so the plan reads NVMe-homed states
//      ahead and writes them back after), updated in one fused pass, and the
//      grad chunk is zeroed for the next accumulation;
//   3. Optimizer::FinishStep.
// A step the plan skips (inf/NaN) still zeroes the grads. A skipped tensor is
// left as torch.optim leaves a parameter whose .grad is None: its weight
// decay, moments and step count included; the others of its chunk are
// updated, each run of tensors with the same step count in one range (Note
// [Step counts per tensor] in optim/optimizer.cc). An error (a failed or
// corrupt NVMe read of a state chunk) ends the step with it; groups updated
// before it keep their update, the step is not counted, and the engine keeps
// every chunk (nothing is freed).
//
// Note [Data-parallel step]
// With a communicator (more than one rank; every rank steps with the same
// layout), each group's gradients are reduce-scattered (summed, then divided
// by the number of ranks: the mean), the norm's sum of squares all-reduced
// (the optimizer's all-reduce hook), each rank updates its 1/W range of every
// group, and the updated param chunk is all-gathered. So every rank ends with
// the same parameters as one rank stepping the mean gradient. Each rank's
// master and state chunks hold just its range (memory::ShardOf).
//
// With a reducer, the gradients of groups submitted to it during backward
// are taken from it (their reduction overlapped backward), the others
// submitted now; without, every group is reduced here by a reducer of the
// step's own. A communicator of one rank takes this path when a reducer
// comes with it (comm.backend nccl on a single GPU: its collectives are
// copies, but they run); without one, the single-rank path, which holds no
// reduction buffers.
//
// Parameters sharded (comm.shard_params): only the master shard is updated,
// and the reducer's kept gathers are let go; the param chunks are gathered
// again when compute needs them (GradReducer::Gather), so the reducer that
// gathered them is required. Frozen groups' master shards never change: the
// next forward's gathers of their param chunks are queued as soon as the
// step's own collective (the norm's all-reduce) is done, and a trainable
// group's as soon as its update is. The step's own collectives are counted
// as they run; parameters gathered ahead overlap the updates and are the
// next step's.
//
// Note [Updates on the device]
// A group's host moment says how long its update would take on the device
// (bytes touched at a GPU memory's rate: DeviceUpdateSeconds; on the emulated device,
// where the host's kernel runs, the pipeline records the host's time
// instead), and the plan runs it there when its states fit
// beside everything else and that makes the step shorter (Note [Where
// updates run] in offload/schedule/planner.cc): the moment's chunks are
// pinned on the device, and nothing crosses a link for the update. On a GPU
// the update (optim/cuda/cuda_kernels.cu, the CPU kernels' arithmetic) and
// the gradients' zeroing are queued on the framework's stream, after its
// backward and before its next forward, and the chunks are let go after a
// fence recorded behind them (Note [Fences] in memory/residency.cc): the
// host never waits for them. The emulated device's memory is the host's: the
// CPU kernel updates it in place. Gradients on a GPU are summed there for
// the norm, in one pass over every group's. Data parallel, updates stay on
// the host, where the reduced gradients are.
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// Adds the seconds from its making to its end into `into`.
class Timed {
 public:
  explicit Timed(double& into) : into_(into), start_(Clock::now()) {}
  ~Timed() { into_ += SecondsSince(start_); }
  Timed(const Timed&) = delete;
  Timed& operator=(const Timed&) = delete;

 private:
  double& into_;
  const Clock::time_point start_;
};

// The gradients' statistics, each grad chunk read where it lies: those on the
// device pinned there (read in place on the emulated device, whose memory is
// the host's; summed on a GPU in one pass: Note [Updates on the device]),
// those in host memory pinned there and summed in place by every core, and
// only the others (on NVMe, or moving) copied into host memory first; their
// bytes are `copied_bytes`.
// Each group's sum of squares is its own, added to the total in group order:
// `known[k]`, where set, is group k's taken beforehand (an update beside
// backward took it), so the norm is the same bit for bit whichever took it.
Result<optim::GradStats> ReadGradStats(Engine& engine, const std::vector<Group>& groups, uintptr_t stream,
                                       const std::vector<std::optional<double>>& known, uint64_t& copied_bytes) {
  uint64_t largest = 0;
  for (const Group& g : groups) largest = std::max(largest, g[ChunkKind::kGrad].size_bytes);
  optim::GradStats stats;
  if (groups.empty()) return stats;
  const bool in_place = engine.device().host_accessible();
  std::vector<ChunkAccess> on_device;
  std::vector<optim::ChunkTensors> device_grads;
  Buffer scratch;
  const auto add = [&](const void* data, const ChunkInfo& grad, size_t n) {
    optim::GradStats one;
    one.Add(data, grad.dtype, n);
    stats.sum_squares += one.sum_squares;
  };
  for (size_t k = 0; k < groups.size(); ++k) {
    if (known[k]) {
      stats.sum_squares += *known[k];
      continue;
    }
    const Group& g = groups[k];
    const ChunkInfo& grad = g[ChunkKind::kGrad];
    const size_t n = grad.used_bytes / DTypeSizeBytes(grad.dtype);
    // Pinned only where it lies and not moving: a planned move runs as planned.
    STRATA_ASSIGN_OR_RETURN(std::optional<ChunkAccess> access, engine.AccessChunkIfOn(grad.id, Tier::kDevice));
    if (access && !in_place) {
      device_grads.push_back({.n = n, .grad = access->data(), .grad_dtype = grad.dtype});
      on_device.push_back(std::move(*access));
      continue;
    }
    if (!access) {
      STRATA_ASSIGN_OR_RETURN(access, engine.AccessChunkIfOn(grad.id, Tier::kHost));
    }
    if (access) {
      add(access->data(), grad, n);
      continue;
    }
    if (!scratch) scratch = AllocateAlignedHost(largest, kIoAlignmentBytes);
    STRATA_RETURN_IF_ERROR(engine.ReadChunk(grad.id, scratch.data()).WithContext("reading gradients for their norm"));
    copied_bytes += grad.size_bytes;
    add(scratch.data(), grad, n);
  }
  if (!device_grads.empty()) {
    STRATA_ASSIGN_OR_RETURN(const double sum,
                            optim::Optimizer::SumSquaresOnDevice(device_grads, reinterpret_cast<void*>(stream)));
    stats.sum_squares += sum;
  }
  return stats;
}

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
// Each group's sum of squares is its own, added in group order; `known[k]`,
// where set, is group k's taken beforehand (an overlapped update).
Result<std::vector<std::vector<float>>> ReduceScatterGrads(GradReducer& reducer, const Communicator& comm,
                                                           const std::vector<Group>& groups,
                                                           const std::vector<std::optional<double>>& known,
                                                           optim::GradStats& stats, uint64_t& bytes) {
  std::vector<std::vector<float>> shards;
  for (size_t k = 0; k < groups.size(); ++k) {
    const ChunkInfo& grad = groups[k][ChunkKind::kGrad];
    STRATA_ASSIGN_OR_RETURN(GradReducer::Reduced reduced, reducer.Take(grad.id));
    const memory::ShardRange range = RankShard(UsedElems(grad), comm);
    optim::GradStats one;
    if (!known[k]) one.Add(reduced.shard.data(), DType::kFloat32, range.end - range.begin);
    stats.sum_squares += known[k].value_or(one.sum_squares);
    bytes += reduced.bytes;
    shards.push_back(std::move(reduced.shard));
  }
  STRATA_RETURN_IF_ERROR(reducer.Drain());  // the communicator is the step's again
  return shards;
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

// One RunTrainStep: its inputs, and what its phases share.
class TrainStep {
 public:
  TrainStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer, const TrainStepOptions& options)
      : engine_(engine),
        pipeline_(pipeline),
        optimizer_(optimizer),
        options_(options),
        groups_(TrainableGroups(engine)),
        // See Note [Data-parallel step] for a communicator of one rank.
        parallel_(options.comm != nullptr && (options.comm->world_size() > 1 || options.reducer != nullptr)),
        comm_(parallel_ ? options.comm : nullptr),
        reducer_(options.reducer) {}

  Result<TrainStepReport> Run() {
    const Clock::time_point start = Clock::now();
    STRATA_RETURN_IF_ERROR(TakeOverlapUpdates());  // first: whatever follows, the next step begins its own
    STRATA_RETURN_IF_ERROR(CheckSeams());
    STRATA_RETURN_IF_ERROR(CheckStepRoom(engine_, optimizer_));
    STRATA_RETURN_IF_ERROR(PlanFromGradients());
    if (parallel_) GatherFrozenAhead();

    const bool overlap_stands = OverlapUpdatesStand();
    for (size_t k = 0; k < groups_.size(); ++k) {
      const OverlapUpdates::Update* early = overlap_of_[k];
      if (early == nullptr || !early->updated) {
        STRATA_RETURN_IF_ERROR(UpdateInMoment(k));
      } else if (overlap_stands && !early->late) {
        if (parallel_) STRATA_RETURN_IF_ERROR(ConfirmInMoment(k));
        report_.groups++;
        report_.overlap_groups++;
      } else {
        STRATA_RETURN_IF_ERROR(RedoInMoment(k));
        report_.redone_groups++;
      }
    }
    for (std::vector<float>& shard : reduced_) reducer_->Recycle(std::move(shard));
    {
      Timed timed(report_.seconds.finish);
      STRATA_RETURN_IF_ERROR(optimizer_.FinishStep(report_.plan, LeftOut()));
    }
    report_.seconds.total = SecondsSince(start);
    return std::move(report_);
  }

 private:
  Status CheckSeams() const {
    const Communicator* comm = options_.comm;
    const int world = parallel_ ? comm->world_size() : 1;
    if (world != engine_.world_size() || (parallel_ && comm->rank() != engine_.rank())) {
      return InvalidArgument(
          "train step: the engine is rank {} of {} (its states are sharded that way) but the step was given {}: pass "
          "the communicator the engine was created with (EngineSeams::comm)",
          engine_.rank(), engine_.world_size(),
          parallel_ ? fmt::format("rank {} of {}", comm->rank(), comm->world_size()) : std::string("no communicator"));
    }
    if (parallel_ && options_.overlap != nullptr && options_.overlap->reducer() != reducer_) {
      return InvalidArgument(
          "train step: overlapped updates (optimizer.overlap) with a communicator run on the reducer's "
          "reductions: give the step the GradReducer the OverlapUpdates were made with");
    }
    if (parallel_ && reducer_ == nullptr) {
      for (const Group& g : groups_) {
        if (g[ChunkKind::kParam].transient) {
          return InvalidArgument(
              "train step: parameters are sharded (comm.shard_params) but no GradReducer was given: pass the one "
              "that gathered the param chunks, whose kept gathers the update makes stale");
        }
      }
    }
    return Status::Ok();
  }

  // The overlapped updates (Note [Overlapped updates] in
  // overlap_updates.cc), once done; the first error of one.
  Status TakeOverlapUpdates() {
    overlap_of_.assign(groups_.size(), nullptr);
    if (options_.overlap == nullptr) return Status::Ok();
    if (options_.overlap->groups().size() != groups_.size()) {
      return InvalidArgument("train step: the overlapped updates were made for another engine");
    }
    Status waited;
    {
      Timed timed(report_.seconds.overlap_wait);
      waited = options_.overlap->Wait();
      overlap_ = options_.overlap->Take();
    }
    for (const OverlapUpdates::Update& u : overlap_) overlap_of_[u.group] = &u;
    STRATA_RETURN_IF_ERROR(waited);
    for (const OverlapUpdates::Update& u : overlap_) {
      // Else never zeroed (data parallel, never: Note [Overlapped updates, data parallel]).
      if (u.late && u.updated && !parallel_) STRATA_RETURN_IF_ERROR(MergeLateInMoment(u.group));
    }
    return Status::Ok();
  }

  // Group k's gradients came in part after its overlapped update
  // began: the grad chunk (the late part) gets the kept part added back,
  // in a host moment of its own, so that it holds what autograd's sum
  // would have; the step reads it as any other.
  Status MergeLateInMoment(size_t k) {
    Timed timed(report_.seconds.merge);
    const ChunkInfo& grad = groups_[k][ChunkKind::kGrad];
    STRATA_RETURN_IF_ERROR(pipeline_.BeginHostMoment().status());
    Result<ChunkAccess> access = pipeline_.Access(grad.id);
    if (access.ok()) {
      options_.overlap->AddKeptGrads(k, access->data());
      access->Release();
    }
    const Status ended = pipeline_.EndMoment();
    STRATA_RETURN_IF_ERROR(access.status().WithContext("adding a late gradient's chunk group together"));
    return ended;
  }

  // Whether the overlapped updates did what this step's plan
  // does: the same plan, hyperparameters and tensors.
  bool OverlapUpdatesStand() const {
    if (overlap_.empty()) return false;
    if (!optim::Optimizer::SameUpdate(options_.overlap->plan_ahead(), report_.plan)) return false;
    for (uint32_t i = 0; i < optimizer_.num_groups(); ++i) {
      if (!(optimizer_.group(i) == options_.overlap->hyperparams()[i])) return false;
    }
    for (const OverlapUpdates::Update& u : overlap_) {
      for (TensorId id : groups_[u.group][ChunkKind::kParam].tensors) {
        if (id.value() < options_.skip.size() && options_.skip[id.value()]) return false;
      }
    }
    return true;
  }

  // Group k, updated beside backward when the step's plan differs: put back
  // as it was from the copy the update kept, and updated again, in a host
  // moment of its own (UpdateInMoment's).
  Status RedoInMoment(size_t k) {
    // A late group's grad chunk holds its whole gradients already (MergeLateInMoment); data parallel, the update
    // left it as it was.
    const bool grads_kept = overlap_of_[k]->late || parallel_;
    return UpdateInMoment(k, [&](HeldChunks& held) {
      Timed timed(report_.seconds.put_back);
      options_.overlap->PutBack(k, held, grads_kept ? OverlapUpdates::Grads::kLeave : OverlapUpdates::Grads::kCopy);
    });
  }

  // Data parallel, group k's overlapped update confirmed: its grad
  // chunk zeroed and its param chunk gathered from every rank, in a host
  // moment of its own, as UpdateInMoment's.
  Status ConfirmInMoment(size_t k) {
    const Group& g = groups_[k];
    const ChunkInfo& param = g[ChunkKind::kParam];
    HeldChunks held;
    Status done;
    {
      Timed timed(report_.seconds.access);
      STRATA_RETURN_IF_ERROR(pipeline_.BeginHostMoment().status());
      for (ChunkKind kind : {ChunkKind::kGrad, ChunkKind::kParam}) {
        if (kind == ChunkKind::kParam && param.transient) continue;
        Result<ChunkAccess> access = pipeline_.Access(g[kind].id);
        if (!access.ok()) {
          done = access.status();
          break;
        }
        held[static_cast<int>(kind)] = std::move(*access);
      }
    }
    if (done.ok()) {
      Timed timed(report_.seconds.kernel);
      optim::Optimizer::ZeroOnHost(held[static_cast<int>(ChunkKind::kGrad)].data(), g[ChunkKind::kGrad].used_bytes);
    }
    if (done.ok() && !param.transient) done = GatherInMoment(param, held);
    const Status ended = LetGo(false, held);
    STRATA_RETURN_IF_ERROR(done);
    STRATA_RETURN_IF_ERROR(ended);
    if (param.transient) reducer_->Updated(param.id);
    return Status::Ok();
  }

  Status GatherInMoment(const ChunkInfo& param, HeldChunks& held) {
    Timed timed(report_.seconds.gather);
    sent_before_ = comm_->stats().total_bytes();
    const Status gathered = GatherParams(*comm_, param, held[static_cast<int>(ChunkKind::kParam)].data());
    CountSent();
    return gathered;
  }

  // Group `g`'s update (GroupUpdate::Run's arguments), its seconds and
  // elements into the report.
  Status UpdateAndZero(const Group& g, size_t lo, size_t hi, const float* reduced, const HeldChunks& held,
                       Tier where) {
    Timed timed(report_.seconds.kernel);
    report_.kernel_elems += hi - lo;
    const bool on_gpu = where == Tier::kDevice && !engine_.device().host_accessible();
    return GroupUpdate(engine_, optimizer_, report_.plan, options_.skip)
        .Run(g, lo, hi, reduced, held,
             {.on_device = on_gpu, .stream = reinterpret_cast<void*>(options_.compute_stream), .where = where});
  }

  // Phase 1: the gradients' statistics (data parallel: their reduction, into
  // reduced_), and the step's plan.
  Status PlanFromGradients() {
    optim::GradStats stats;
    if (parallel_) {
      if (reducer_ == nullptr) reducer_ = (own_reducer_ = std::make_unique<GradReducer>(engine_, *comm_)).get();
      const double waited = reducer_->wait_seconds();
      {
        Timed timed(report_.seconds.stats);
        STRATA_ASSIGN_OR_RETURN(reduced_,
                                ReduceScatterGrads(*reducer_, *comm_, groups_, KnownStats(), stats, report_.comm_bytes));
      }
      report_.comm_wait_seconds = reducer_->wait_seconds() - waited;
      reducer_->ReleaseGathered();  // gathered from the masters this step updates
      sent_before_ = comm_->stats().total_bytes();
      optimizer_.SetAllReduceHook(
          [comm = comm_](optim::GradStats& s) { return comm->AllReduceSum(std::span<double>(&s.sum_squares, 1)); });
    } else {
      // Those an overlapped update took, and the rest read now.
      const std::vector<std::optional<double>> known = KnownStats();
      Timed timed(report_.seconds.stats);
      STRATA_ASSIGN_OR_RETURN(
          stats, ReadGradStats(engine_, groups_, options_.compute_stream, known, report_.stats_copied_bytes));
      report_.stats_read_groups = static_cast<uint32_t>(std::count(known.begin(), known.end(), std::nullopt));
      optimizer_.SetAllReduceHook(nullptr);
    }
    Timed timed(report_.seconds.plan);
    STRATA_ASSIGN_OR_RETURN(report_.plan, optimizer_.PlanStep(stats));
    CountSent();  // the norm's all-reduce
    return Status::Ok();
  }

  // By group: the sum of squares an overlapped update took, if one did.
  std::vector<std::optional<double>> KnownStats() const {
    std::vector<std::optional<double>> known(groups_.size());
    for (const OverlapUpdates::Update& u : overlap_) {
      if (u.stats_taken && !u.late) known[u.group] = u.stats.sum_squares;
    }
    return known;
  }

  // Queues the next forward's gathers of the frozen groups' param chunks
  // (Note [Data-parallel step]).
  void GatherFrozenAhead() {
    std::set<uint32_t> trainable;
    for (const Group& g : groups_) trainable.insert(g[ChunkKind::kParam].group);
    for (const ChunkInfo& c : engine_.chunks()) {
      if (c.kind == ChunkKind::kParam && c.transient && !trainable.contains(c.group)) reducer_->Updated(c.id);
    }
  }

  // Phase 2 for group k: its update in a host moment of its own; data
  // parallel, its updated param chunk to every rank. `first`, if given,
  // runs on the chunks pinned in host memory before the update.
  Status UpdateInMoment(size_t k, const std::function<void(HeldChunks&)>& first = nullptr) {
    const Group& g = groups_[k];
    const ChunkInfo& param = g[ChunkKind::kParam];
    const size_t n = UsedElems(param);
    const memory::ShardRange range = parallel_ ? RankShard(n, *comm_) : memory::ShardRange{.begin = 0, .end = n};
    if (options_.fence != nullptr) STRATA_RETURN_IF_ERROR(options_.fence->BeforeUpdate(param.group));
    // Released before EndMoment, so the plan's write-backs may take them.
    HeldChunks held;
    Status updated;
    Tier where = Tier::kHost;
    {
      Timed timed(report_.seconds.access);
      // A redo's moment stays on the host, where its copy is put back.
      STRATA_ASSIGN_OR_RETURN(where, pipeline_.BeginHostMoment(first ? std::nullopt : DeviceSeconds(g)));
      updated = AccessGroup(pipeline_, g, optimizer_.num_states(), held);
    }
    const bool on_gpu = where == Tier::kDevice && !engine_.device().host_accessible();
    if (updated.ok() && first) first(held);
    if (updated.ok()) {
      updated = UpdateAndZero(g, range.begin, range.end, parallel_ ? reduced_[k].data() : nullptr, held, where);
    }
    if (updated.ok() && parallel_ && !param.transient) updated = GatherInMoment(param, held);
    const Status ended = LetGo(on_gpu, held);
    STRATA_RETURN_IF_ERROR(updated);
    STRATA_RETURN_IF_ERROR(ended);
    report_.groups++;
    if (parallel_ && param.transient) reducer_->Updated(param.id);  // the next forward's first chunks gather ahead
    return Status::Ok();
  }

  // Lets the group's chunks go (on a GPU, after a fence behind the update
  // queued on the framework's stream), then ends the host moment: the
  // first error.
  Status LetGo(bool on_gpu, HeldChunks& held) {
    Timed timed(report_.seconds.release);
    const Status released = Release(on_gpu, held);
    const Status ended = pipeline_.EndMoment();
    return released.ok() ? ended : released;
  }

  Status Release(bool on_gpu, HeldChunks& held) {
    if (!on_gpu) {
      for (ChunkAccess& a : held) a.Release();
      return Status::Ok();
    }
    Result<std::shared_ptr<Event>> fence = engine_.device().RecordFence(options_.compute_stream);
    if (!fence.ok()) {
      // Without a fence the chunks go only once the stream has run what was queued on them.
      const Status drained = engine_.device().SynchronizeStream(options_.compute_stream,
                                                                engine_.options().device.copy_timeout_ms);
      if (!drained.ok()) STRATA_LOG_ERROR("after a failed fence: {}", drained.ToString());
    }
    for (ChunkAccess& a : held) a.ReleaseAfter(fence.ok() ? *fence : nullptr);
    return fence.status().WithContext("recording the fence behind a chunk group's update on the GPU");
  }

  // How long group `g`'s update would take on the device, for the plan to
  // weigh (Note [Updates on the device]); none where it must run on the host.
  std::optional<double> DeviceSeconds(const Group& g) const {
    if (parallel_) return std::nullopt;
    return DeviceUpdateSeconds(g, optimizer_.config());
  }

  // The tensors the step leaves out, for their step counts.
  std::vector<TensorId> LeftOut() const {
    std::vector<TensorId> ids;
    for (uint32_t id = 0; id < options_.skip.size(); ++id) {
      if (options_.skip[id]) ids.emplace_back(id);
    }
    return ids;
  }

  // Adds what the communicator sent since sent_before_ to the report.
  void CountSent() {
    if (!parallel_) return;
    const uint64_t now = comm_->stats().total_bytes();
    report_.comm_bytes += now - sent_before_;
    sent_before_ = now;
  }

  Engine& engine_;
  Pipeline& pipeline_;
  optim::Optimizer& optimizer_;
  const TrainStepOptions& options_;
  const std::vector<Group> groups_;
  const bool parallel_;
  Communicator* const comm_;  // set when parallel_
  GradReducer* reducer_;      // set when parallel_, once phase 1 begins
  std::unique_ptr<GradReducer> own_reducer_;  // data parallel without one given
  std::vector<std::vector<float>> reduced_;  // data parallel: this rank's reduced gradients, by group
  std::vector<OverlapUpdates::Update> overlap_;  // the overlapped updates
  std::vector<const OverlapUpdates::Update*> overlap_of_;  // by group: its overlapped update, or null
  uint64_t sent_before_ = 0;                 // the communicator's total when last counted
  TrainStepReport report_;
};

}  // namespace

// Note [Room for a step]
// A step's host moment pins a group's gradients, parameters, master and
// optimizer states in host memory at once (UpdatedKinds), and the
// pipeline's next chunks arrive while it computes: chunks in flight, which
// can be neither moved nor evicted, and a tier of exactly one group's
// update found its room in pieces in about 1 run in 20. So the host must
// hold the largest group's update and one of its chunks besides.
Status CheckStepRoom(const Engine& engine, const optim::Optimizer& optimizer) {
  const MemoryStats stats = engine.stats();
  const uint64_t host_bytes = stats.tiers[static_cast<int>(Tier::kHost)].capacity_bytes;
  uint64_t needed = 0;
  std::optional<uint32_t> largest_group;
  for (const Group& g : TrainableGroups(engine)) {
    uint64_t bytes = 0, largest_chunk = 0;
    for (ChunkKind kind : UpdatedKinds(g, optimizer.num_states())) {
      bytes += g[kind].size_bytes;
      largest_chunk = std::max(largest_chunk, g[kind].size_bytes);
    }
    if (bytes + largest_chunk > needed) {
      needed = bytes + largest_chunk;
      largest_group = g[ChunkKind::kGrad].group;
    }
  }
  if (!largest_group || needed <= host_bytes) return Status::Ok();
  return OutOfMemory(
      "host tier: a step updates each chunk group's gradients, parameters and optimizer states together in host "
      "memory while the next group's arrive, and chunk group {} needs {} so but host.budget gives the tier {}: "
      "raise host.budget to at least {} or lower chunk.size_elems",
      *largest_group, FormatSize(needed), FormatSize(host_bytes), FormatSize(needed));
}

Result<TrainStepReport> RunTrainStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                     const TrainStepOptions& options) {
  return TrainStep(engine, pipeline, optimizer, options).Run();
}

}  // namespace strata::offload
