#include "offload/training/overlap_updates.h"

#include <cstring>

#include "memory/chunk_layout.h"
#include "src/base/alignment.h"
#include "src/base/half.h"

namespace strata::offload {

// Note [Overlapped updates]
// A step's updates need the global gradient norm (clipping), the loss
// scaler's verdict and the inf/NaN check, none of which is known before
// backward ends. An update begun in backward (Begin: the adapter calls it
// once a group's gradients are final) therefore runs speculatively, on the
// pipeline's host lane (Pipeline::RunOverlapped): it copies the group's chunks
// (gradients, parameters, master, optimizer states) into a buffer of its
// own, takes the gradients' statistics, and updates the group with
// Optimizer::PlanAhead, the plan for finite gradients that need no clip. A
// group whose gradients are not finite is left as it is. RunTrainStep then
// makes the real plan from every group's statistics (those the updates
// took and those it reads), and when it updates as the plan ahead did, and
// the hyperparameters are the ones the updates ran with, their work stands;
// else (a clip, an overflow, a scheduler's change in between) each such
// group is put back from its copy and updated again in a host moment of the
// step. So a step's result is the same bit for bit whichever way it ran
// (but for the two limits below), and a step that redoes costs its updates
// twice. The copies take optimizer.overlap bytes of host memory at most; a
// group whose copy does not fit is updated after backward, as without
// overlap. The groups backward makes final last (in its last pass, or
// its last moment) are not begun: nothing of backward is left to hide
// their update behind, and the step, whose norm then waits only for their
// statistics, updates them as without overlap, at the kernel's full width
// and with no copy. Begun, each would run speculatively, its copy besides,
// while the step waits for it: a Llama's embedding, a fifth of a 21M
// model's parameters, took 8-9 ms so against about 4 ms in the step
// (docs/benchmarks.md, "The step phase against its parts"). A gradient
// that comes into a group after its update began (Late) makes the step add
// the kept gradients back into the grad chunk before it reads the statistics
// (the sum autograd would have made: one addition, in the grad's dtype) and
// update that group again from its copy. A forward before the step (a
// second backward before it) would read parameters already updated: Undo
// puts every group back first, and its updates begin again in that backward.
// Two limits to "bit for bit": a gradient that comes late in three parts or
// more is summed in another order ((b + c) + a); and on a GPU, where the
// step alone would sum some groups' gradients on the device in one pass, an
// overlapped update sums its group's on the host, so the norm (and a
// clip) may differ in the last bits.

// Note [Overlapped updates, data parallel]
// Each rank submits a group's gradients to the GradReducer as soon as they
// are final (in the fixed order every rank keeps); Begin then holds that
// reduction (GradReducer::HoldReduction), and the update, on the pipeline's
// host lane, waits for it and runs on this rank's reduced shard: its range
// of the master and state shards, with the statistics of the shard. The
// grad chunk is left as it is (the reducer has read it), so a late gradient
// adds into it and is reduced again as without overlap. The step takes
// every group's reduction as before, sums the statistics in group order
// (those the updates took and the others'), all-reduces that once, and with
// the plan and hyperparameters unchanged on every rank (the plan comes from
// the all-reduced sum, so all ranks agree) confirms each update: it zeroes
// the grad chunk and all-gathers the updated param chunk, in group order
// as without overlap. Otherwise (a clip, an overflow on any rank, a late
// gradient on any rank: the adapter's vote marks it Late everywhere) the
// group is put back and updated from the step's reduction. So the ranks'
// collectives stay in one order, and the result is that of the run without
// overlap bit for bit.

Result<std::unique_ptr<OverlapUpdates>> OverlapUpdates::Create(Engine& engine, Pipeline& pipeline,
                                                               optim::Optimizer& optimizer,
                                                               const OverlapOptions& options) {
  if (engine.world_size() > 1 && options.reducer == nullptr) {
    return InvalidArgument(
        "overlapped updates (optimizer.overlap): the engine is rank {} of {}, and data-parallel updates run on "
        "the reduced gradients: give the GradReducer backward submits them to",
        engine.rank(), engine.world_size());
  }
  return std::unique_ptr<OverlapUpdates>(new OverlapUpdates(engine, pipeline, optimizer, options));
}

OverlapUpdates::OverlapUpdates(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                               const OverlapOptions& options)
    : engine_(engine),
      pipeline_(pipeline),
      optimizer_(optimizer),
      options_(options),
      groups_(TrainableGroups(engine)),
      kept_(groups_.size()),
      begun_(groups_.size(), false) {
  for (size_t k = 0; k < groups_.size(); ++k) group_of_grad_.emplace(groups_[k][ChunkKind::kGrad].id.value(), k);
}

OverlapUpdates::~OverlapUpdates() { (void)Wait(); }

uint64_t OverlapUpdates::kept_size(size_t group) const {
  uint64_t bytes = 0;
  for (ChunkKind kind : UpdatedKinds(groups_[group], optimizer_.num_states())) bytes += groups_[group][kind].used_bytes;
  return bytes;
}

Result<bool> OverlapUpdates::Begin(ChunkId grad) {
  const auto found = group_of_grad_.find(grad.value());
  if (found == group_of_grad_.end()) {
    return InvalidArgument("overlapped updates: chunk {} is no trainable group's grad chunk", grad.value());
  }
  const size_t group = found->second;
  if (begun_[group]) {
    return InvalidArgument("overlapped updates: the update of chunk {}'s group has begun already this step",
                           grad.value());
  }
  const uint64_t size = kept_size(group);
  const bool fits = kept_in_use_ + size <= options_.kept_bytes;
  if (options_.kept_bytes == 0) return false;
  std::optional<GradReducer::Hold> reduced;
  if (options_.reducer != nullptr) {
    reduced = options_.reducer->HoldReduction(grad);
    if (!reduced) return false;  // not submitted yet (the reducer takes them in a fixed order): the step updates it
  }
  if (updates_.empty()) {  // the step's first: what the updates run with
    plan_ = optimizer_.PlanAhead();
    hyperparams_.clear();
    for (uint32_t i = 0; i < optimizer_.num_groups(); ++i) hyperparams_.push_back(optimizer_.group(i));
  }
  if (fits && !kept_[group]) {
    // Within kept_bytes: the buffers of groups that began in earlier steps but not in this one go first.
    for (size_t k = 0; k < groups_.size() && allocated_ + size > options_.kept_bytes; ++k) {
      if (!kept_[k] || begun_[k]) continue;
      allocated_ -= kept_[k].size_bytes();
      kept_[k] = Buffer();
    }
    kept_[group] = AllocateAlignedHost(std::max<uint64_t>(size, 1), kIoAlignmentBytes);
    allocated_ += kept_[group].size_bytes();
  }
  // Its copy does not fit: its gradients' statistics alone (Note [Statistics taken in backward]).
  std::vector<ChunkId> chunks;
  for (ChunkKind kind : UpdatedKinds(groups_[group], optimizer_.num_states())) {
    if (fits || kind == ChunkKind::kGrad) chunks.push_back(groups_[group][kind].id);
  }
  auto update = std::make_unique<Update>();
  update->group = group;
  update->reduced = std::move(reduced);
  Update* const u = update.get();
  STRATA_ASSIGN_OR_RETURN(update->done,
                          pipeline_.RunOverlapped(chunks,
                                              fits ? DeviceUpdateSeconds(groups_[group], optimizer_.config())
                                                   : std::optional(DeviceStatsSeconds(groups_[group])),
                                              [this, group, u, fits](Tier where, auto& held) {
                            return Compute(group, *u, where, held, fits);
                          }));
  updates_.push_back(std::move(update));
  begun_[group] = true;
  if (fits) kept_in_use_ += size;
  return true;
}

// Note [Statistics taken in backward]
// A group whose copy does not fit in what optimizer.overlap has left is not
// updated beside backward, but its gradients' statistics are still taken
// there, on the pipeline's host lane once its
// grad chunk is in host memory: the step's norm then reads only the groups
// whose gradients came late, and a gradient on the device comes down to the
// host while backward goes on, not at the step. The step adds the groups'
// sums in group order, so its norm is the same bit for bit. With
// optimizer.overlap 0 nothing begins beside backward: the plan's choice of
// where each update runs (Note [Where updates run] in planner.cc) weighs
// the step's own moments alone.

// On the pipeline's host lane, with the group's chunks pinned in `held`
// (UpdatedKinds order; with `update_it` false, the grad chunk alone): the
// statistics, then the update, its copy kept as it reads.
Status OverlapUpdates::Compute(size_t group, Update& update, Tier where, std::vector<ChunkAccess>& held,
                              bool update_it) {
  // Where the plan runs it on a GPU, the step updates it there (its stream's order is the step's).
  if (!engine_.device().host_accessible() && where != Tier::kHost) return Status::Ok();
  const Group& g = groups_[group];
  const std::vector<ChunkKind> kinds = UpdatedKinds(g, optimizer_.num_states());
  HeldChunks by_kind;
  for (size_t i = 0; i < held.size(); ++i) by_kind[static_cast<int>(kinds[i])] = std::move(held[i]);
  const ChunkInfo& grad = g[ChunkKind::kGrad];
  const size_t n = UsedElems(g[ChunkKind::kParam]);
  memory::ShardRange range{.begin = 0, .end = n};
  const float* reduced = nullptr;
  if (update.reduced) {  // data parallel: this rank's shard of the mean gradients
    STRATA_RETURN_IF_ERROR(update.reduced->done.get().WithContext("the reduction an overlapped update needs"));
    range = memory::ShardOf(n, engine_.rank(), engine_.world_size());
    reduced = update.reduced->shard->data();
    update.stats.Add(reduced, DType::kFloat32, range.end - range.begin);
  } else {
    update.stats.Add(by_kind[static_cast<int>(ChunkKind::kGrad)].data(), grad.dtype, UsedElems(grad));
  }
  update.stats_taken = true;
  if (!update_it || !update.stats.finite()) return Status::Ok();  // the step updates it (or skips)
  static const std::vector<bool> kNoneSkipped;  // its gradients are all in
  // The copy is taken block by block as the update reads them (Note [One pass over a group] in group_update.cc);
  // data parallel, the grad chunk is left for a late gradient to add into and the step to zero.
  STRATA_RETURN_IF_ERROR(
      GroupUpdate(engine_, optimizer_, plan_, kNoneSkipped)
          .Run(g, range.begin, range.end, reduced, by_kind,
               {.keep = kept_[group].bytes(),
                .zero_grads = update.reduced == std::nullopt,
                .where = where,
                .overlapped = true}));
  update.updated = true;
  return Status::Ok();
}

void OverlapUpdates::PutBack(size_t group, HeldChunks& held, Grads grads) const {
  const Group& g = groups_[group];
  const std::byte* kept = kept_[group].bytes();
  for (ChunkKind kind : UpdatedKinds(g, optimizer_.num_states())) {
    std::byte* const data = held[static_cast<int>(kind)].data();
    if (kind != ChunkKind::kGrad || grads == Grads::kCopy) {
      std::memcpy(data, kept, g[kind].used_bytes);
    } else if (grads == Grads::kAdd) {
      AddKeptGrads(group, data);
    }
    kept += g[kind].used_bytes;
  }
}

void OverlapUpdates::AddKeptGrads(size_t group, std::byte* grads) const {
  const ChunkInfo& grad = groups_[group][ChunkKind::kGrad];
  const std::byte* kept = kept_[group].bytes();  // the grad chunk comes first (UpdatedKinds)
  for (size_t i = 0; i < UsedElems(grad); ++i) {
    optim::StoreFloat(grads, grad.dtype, i, optim::FloatAt(grads, grad.dtype, i) + optim::FloatAt(kept, grad.dtype, i));
  }
}

Status OverlapUpdates::Undo() {
  const std::vector<Update> taken = Take();
  for (const Update& u : taken) {
    if (!u.updated) continue;
    STRATA_RETURN_IF_ERROR(pipeline_.BeginHostMoment().status());
    HeldChunks held;
    const Status accessed = AccessGroup(pipeline_, groups_[u.group], optimizer_.num_states(), held);
    // Gradients that came late, after the update zeroed the chunk, are kept: added to those of before.
    // (Data parallel, the update left the grad chunk as it was.)
    if (accessed.ok()) PutBack(u.group, held, options_.reducer ? Grads::kLeave : u.late ? Grads::kAdd : Grads::kCopy);
    for (ChunkAccess& a : held) a.Release();
    const Status ended = pipeline_.EndMoment();
    STRATA_RETURN_IF_ERROR(accessed.WithContext("putting a chunk group back as it was before its update"));
    STRATA_RETURN_IF_ERROR(ended);
  }
  return Status::Ok();
}

bool OverlapUpdates::Late(ChunkId grad) {
  for (std::unique_ptr<Update>& u : updates_) {
    if (groups_[u->group][ChunkKind::kGrad].id != grad) continue;
    u->late = true;
    return true;
  }
  return false;
}

Status OverlapUpdates::Wait() {
  Status first;
  for (const std::unique_ptr<Update>& u : updates_) {
    const Status s = u->done.get();
    if (first.ok() && !s.ok()) first = s.WithContext("an overlapped update (optimizer.overlap)");
  }
  return first;
}

std::vector<OverlapUpdates::Update> OverlapUpdates::Take() {
  (void)Wait();
  std::vector<Update> taken;
  for (std::unique_ptr<Update>& u : updates_) taken.push_back(std::move(*u));
  updates_.clear();
  begun_.assign(groups_.size(), false);
  kept_in_use_ = 0;
  return taken;
}

}  // namespace strata::offload
