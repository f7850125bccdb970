// Optimizer updates begun in backward, beside the rest of it: each
// trainable chunk group's update starts as soon as its gradients are final,
// from a plan made before the step's norm is known, with a copy of the
// group's chunks kept; the step then confirms it, or restores the copy and
// updates again (Note [Overlapped updates] in overlap_updates.cc).
//
//   OverlapUpdates overlap(engine, pipeline, optimizer, {.kept_bytes = ...});
//   ... the last backward before a step, between two of its moments:
//   overlap.Begin(grad_chunk);  // its group's gradients are final
//   ...
//   RunTrainStep(engine, pipeline, optimizer, {.overlap = &overlap});
//
// Ownership: borrows the engine, the pipeline and the optimizer, which must
// outlive it. Thread-safety: the pipeline's thread; the updates run on the
// pipeline's own.
#pragma once

#include <cstdint>
#include <future>
#include <optional>
#include <unordered_map>
#include <vector>

#include "offload/schedule/pipeline.h"
#include "offload/training/grad_reducer.h"
#include "offload/training/group_update.h"
#include "optim/optimizer.h"
#include "strata/buffer.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::offload {

struct OverlapOptions {
  // Host memory for the copies the updates keep until the step confirms
  // them (option optimizer.overlap). A group whose copy does not fit in
  // what is left is updated by the step, after backward.
  uint64_t kept_bytes = 0;
  // Data parallel (required then): the reducer backward submits the
  // gradients to, the one the step takes them from. Each update runs on
  // this rank's reduced shard once its reduction is done (Note [Overlapped
  // updates, data parallel]).
  GradReducer* reducer = nullptr;
};

class OverlapUpdates {
 public:
  // One update begun this step.
  struct Update {
    size_t group = 0;  // index into TrainableGroups(engine)
    std::shared_future<Status> done;
    // Set by the update (read once `done` is ready):
    bool stats_taken = false;  // `stats` holds the group's gradients' statistics
    bool updated = false;      // it updated the group (its gradients were finite), with `kept` holding the chunks before
    optim::GradStats stats;
    // Set by Late: gradients came in after it began (the grad chunk holds
    // them alone: the update zeroed it); the step adds the kept ones back
    // and updates the group again.
    bool late = false;
    // Data parallel: the reduction the update ran on.
    std::optional<GradReducer::Hold> reduced;
  };

  // InvalidArgument for a data-parallel engine without options.reducer.
  static Result<std::unique_ptr<OverlapUpdates>> Create(Engine& engine, Pipeline& pipeline,
                                                       optim::Optimizer& optimizer, const OverlapOptions& options);
  ~OverlapUpdates();  // waits for the updates in flight
  OverlapUpdates(const OverlapUpdates&) = delete;
  OverlapUpdates& operator=(const OverlapUpdates&) = delete;

  // The gradients of grad chunk `grad`'s group are final for this step: its
  // update begins beside what follows when its copy fits in what kept_bytes
  // has left, else its gradients' statistics alone (Note [Statistics taken
  // in backward]); whether either began (not with kept_bytes 0). Needs an
  // open pipeline iteration and no open moment.
  // InvalidArgument for a chunk that is no trainable group's grad chunk, or
  // one begun already this step.
  Result<bool> Begin(ChunkId grad);
  // Gradients were added into grad chunk `grad` after its group's update
  // began (a parameter whose gradient autograd accumulates twice, as
  // reentrant checkpointing can make happen): the step redoes that update
  // from the whole gradients. Returns whether its update had begun.
  bool Late(ChunkId grad);
  // Waits for the updates in flight; the first error.
  Status Wait();

  // For RunTrainStep: this step's updates, once done (waits), and the plan
  // and hyperparameters they ran with; the next Begin starts the next step.
  std::vector<Update> Take();
  // Forgets this step's updates once done (after a backward or step that
  // failed: their copies are of a state no longer there).
  void Discard() { (void)Take(); }
  // Puts every group this step's updates changed back as it was before
  // them, each in a host moment, and forgets them: a forward is to run
  // before the step (another backward before it), on the parameters of
  // before the step. Needs no open moment.
  Status Undo();
  // What PutBack does with the grad chunk: copies the kept gradients back,
  // adds them to those there (which came late, into the chunk the update
  // zeroed), or leaves it.
  enum class Grads { kCopy, kAdd, kLeave };
  // Group `group`'s kept chunks into `held` (pinned by kind).
  void PutBack(size_t group, HeldChunks& held, Grads grads) const;
  // Adds group `group`'s kept gradients into `grads`, its grad chunk's
  // bytes (one addition in the grad's dtype, as autograd's sum).
  void AddKeptGrads(size_t group, std::byte* grads) const;
  const optim::StepPlan& plan_ahead() const { return plan_; }
  const std::vector<optim::GroupHyperparams>& hyperparams() const { return hyperparams_; }
  const std::vector<Group>& groups() const { return groups_; }
  uint64_t kept_bytes() const { return options_.kept_bytes; }
  GradReducer* reducer() const { return options_.reducer; }
  // Group `group`'s chunks as they were before its update (UpdatedKinds
  // order, each chunk's used bytes one after another).
  const std::byte* kept(size_t group) const { return kept_[group].bytes(); }
  uint64_t kept_size(size_t group) const;

 private:
  OverlapUpdates(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer, const OverlapOptions& options);
  Status Compute(size_t group, Update& update, Tier where, std::vector<ChunkAccess>& held, bool update_it);

  Engine& engine_;
  Pipeline& pipeline_;
  optim::Optimizer& optimizer_;
  const OverlapOptions options_;
  const std::vector<Group> groups_;
  std::unordered_map<uint32_t, size_t> group_of_grad_;  // grad chunk -> index into groups_
  std::vector<Buffer> kept_;  // by group, allocated on first use and kept while kept_bytes allows
  uint64_t allocated_ = 0;    // bytes of kept_
  // This step's:
  std::vector<std::unique_ptr<Update>> updates_;
  std::vector<bool> begun_;  // by group
  uint64_t kept_in_use_ = 0;
  optim::StepPlan plan_;
  std::vector<optim::GroupHyperparams> hyperparams_;
};

}  // namespace strata::offload
