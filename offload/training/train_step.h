// The optimizer step of a training loop that runs its forward and backward
// through a Pipeline: every trainable chunk group updated in a host moment of
// its own, its grad chunk zeroed. See Note [The train step] in train_step.cc.
//
// Thread-safety: the pipeline's thread (the training loop).
#pragma once

#include <cstdint>
#include <vector>

#include "offload/training/overlap_updates.h"
#include "offload/training/grad_reducer.h"
#include "offload/schedule/pipeline.h"
#include "optim/optimizer.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/status.h"
#include "strata/update_fence.h"

namespace strata::offload {

// Where a step's time went, phase by phase (RunTrainStep's own time, less
// the bookkeeping between phases).
struct StepSeconds {
  double overlap_wait = 0;  // waiting for the overlapped updates to end
  double merge = 0;        // late gradients added to the part an overlapped update kept
  double stats = 0;        // reading the grads for their norm (data parallel: taking them reduced)
  double plan = 0;         // the plan from the norm (data parallel: the norm's all-reduce)
  double access = 0;       // the groups' host moments begun and their chunks pinned: waits for them to arrive
  double kernel = 0;       // the update kernels, the grads zeroed with them (Note [One pass over a group])
  double put_back = 0;     // groups put back from their copy before they are updated again
  double gather = 0;       // data parallel: the updated param chunks all-gathered
  double release = 0;      // chunks let go and moments ended (write-backs queued)
  double finish = 0;       // Optimizer::FinishStep
  double total = 0;        // RunTrainStep, all of it
  double Sum() const {
    return overlap_wait + merge + stats + plan + access + kernel + put_back + gather + release + finish;
  }
};

struct TrainStepReport {
  optim::StepPlan plan;
  StepSeconds seconds;
  uint64_t kernel_elems = 0;  // elements the update kernels ran over (redone groups' twice)
  uint32_t stats_read_groups = 0;   // groups whose grads the step read for the norm (the others': beside backward)
  uint64_t stats_copied_bytes = 0;  // of the grads read for the norm, those copied first (on NVMe, or moving)
  uint32_t groups = 0;        // updated (or zeroed, when skipped)
  uint64_t comm_bytes = 0;    // data parallel: what this rank sent (Communicator::stats), its reductions included
  double comm_wait_seconds = 0;  // data parallel: waiting for the gradients' reduction (not hidden by backward)
  uint32_t overlap_groups = 0;  // of `groups`: updated in backward (overlapped), their update confirmed
  uint32_t redone_groups = 0;   // of `groups`: updated in backward, then again from their copy (the plan differed)
};

// What a step runs with besides the engine, the pipeline and the optimizer.
struct TrainStepOptions {
  // skip[tensor id]: tensors left as they are this step, weight decay and
  // moments included (no gradient reached them).
  std::vector<bool> skip;
  // Data parallel: the engine's own communicator (EngineSeams::comm), the
  // same layout on every rank. See Note [Data-parallel step].
  Communicator* comm = nullptr;
  // The reducer backward submitted gradients to; required when parameters
  // are sharded (comm.shard_params).
  GradReducer* reducer = nullptr;
  // Each group's update first waits for fence->BeforeUpdate.
  UpdateFence* fence = nullptr;
  // On a GPU: the framework's stream (a cudaStream_t; 0: the legacy default
  // stream), where its kernels wrote the gradients. Updates the plan runs on
  // the device are queued on it, after them and before its next forward's
  // (Note [Updates on the device] in train_step.cc).
  uintptr_t compute_stream = 0;
  // The overlapped updates this step: confirmed, or redone from
  // their copies (Note [Overlapped updates] in overlap_updates.cc).
  OverlapUpdates* overlap = nullptr;
};

// OutOfMemory, naming host.budget and the figures, when the host tier cannot
// hold one trainable chunk group's chunks at once, as its update needs them,
// and one of them besides (Note [Room for a step]).
Status CheckStepRoom(const Engine& engine, const optim::Optimizer& optimizer);

// Needs an open pipeline iteration and no open moment; leaves the iteration
// open. OutOfMemory as CheckStepRoom says, before anything changes. InvalidArgument when `comm` is not the engine's (or missing for a
// sharded engine), or parameters are sharded and no reducer is given. Any
// other error (a failed NVMe read of a state chunk) ends the step with it:
// groups updated before keep their update, the step is not counted.
Result<TrainStepReport> RunTrainStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                     const TrainStepOptions& options = {});

}  // namespace strata::offload
