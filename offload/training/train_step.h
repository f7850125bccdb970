// The optimizer step of a training loop that runs its forward and backward
// through a Pipeline (the PyTorch adapter's engine.step()).
//
//   1. gradient statistics: every grad chunk is read where it lives (a copy
//      into one host buffer; nothing moves), for the global norm, clipping
//      and the inf/NaN skip (Optimizer::PlanStep);
//   2. one host moment per trainable chunk group, in layout order: its grad,
//      master (bf16/fp16 only), optimizer states and param chunk are
//      accessed through the pipeline (so the plan reads NVMe-homed states
//      ahead and writes them back after), updated in one fused pass, and the
//      grad chunk is zeroed for the next accumulation;
//   3. Optimizer::FinishStep.
// A step the plan skips (inf/NaN) still zeroes the grads.
//
// An error (a failed or corrupt NVMe read of a state chunk) ends the step
// with it; groups updated before it keep their update, the step is not
// counted, and the engine keeps every chunk (nothing is freed).
//
// Thread-safety: the pipeline's thread (the training loop).
#pragma once

#include <vector>

#include "offload/training/grad_reducer.h"
#include "offload/schedule/pipeline.h"
#include "optim/optimizer.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::offload {

struct TrainStepReport {
  optim::StepPlan plan;
  double stats_seconds = 0;   // reading the grads for their norm
  double update_seconds = 0;  // the host moments
  uint32_t groups = 0;        // updated (or zeroed, when skipped)
  uint64_t comm_bytes = 0;    // data parallel: what this rank sent (Communicator::stats), its reductions included
  double comm_wait_seconds = 0;  // data parallel: waiting for the gradients' reduction (not hidden by backward)
};

// What an update waits for before it changes a chunk group's chunks (its
// param, master and optimizer states): an asynchronous checkpoint that has
// not yet read them out (offload::PendingCheckpoint).
class UpdateFence {
 public:
  virtual ~UpdateFence() = default;
  // Returns once `group`'s chunks may change.
  virtual Status BeforeUpdate(uint32_t group) = 0;
};

// Needs an open pipeline iteration and no open moment; leaves the iteration
// open (the caller ends it). `skip[tensor id]`: tensors left as they are
// this step (no gradient reached them: torch.optim skips a parameter whose
// .grad is None, its weight decay and moments included).
//
// With `comm` (more than one rank; every rank calls this with the same
// layout): data parallel. Each group's gradients are reduce-scattered
// (summed, then divided by the number of ranks: the mean), the norm's sum of
// squares all-reduced (the optimizer's all-reduce hook), each rank updates
// its 1/W range of every group, and the updated param chunk is all-gathered
// (parameters sharded, option comm.shard_params: only the master shard is
// updated, and the reducer's kept gathers are let go; the param chunks are
// gathered again when compute needs them, GradReducer::Gather).
// So every rank ends with the same parameters as one rank stepping the mean
// gradient. Each rank's master and state chunks hold just its range
// (memory::ShardOf). `comm` must be the engine's own (EngineSeams::comm):
// any other (or none for a sharded engine) is InvalidArgument. With
// `reducer`, the gradients of groups submitted to it during backward are
// taken from it (their reduction overlapped backward), the others submitted
// now; without, every group is reduced here (parameters sharded: the reducer
// that gathered them is required, InvalidArgument without one).
//
// With `fence`, each group's update first waits for fence->BeforeUpdate.
Result<TrainStepReport> RunTrainStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                     const std::vector<bool>& skip = {}, Communicator* comm = nullptr,
                                     GradReducer* reducer = nullptr, UpdateFence* fence = nullptr);

}  // namespace strata::offload
