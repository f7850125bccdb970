// One whole optimizer step over several micro-batches, for a C++ trainer
// whose model is a sequence of blocks: strata runs the pipeline's moments in
// the order asked and pins each block's chunks on the device; the caller
// computes each block's forward and backward of one micro-batch. The layered
// order runs each block for every micro-batch in a row, so that its chunks
// move once a step. See Note [Accumulated steps] in accumulated_step.cc.
//
// Thread-safety: the pipeline's thread (the training loop).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "offload/schedule/pipeline.h"
#include "offload/training/train_step.h"
#include "optim/optimizer.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::offload {

enum class AccumulationOrder {
  kStandard,  // each micro-batch's forward, then its backward, in turn
  kLayered,   // each block for every micro-batch, forward then backward block by block
};

// One block's forward or backward of one micro-batch, its chunks pinned on
// the device (in the order of their first tensor in the block).
struct BlockPass {
  uint32_t block = 0;
  uint32_t micro_batch = 0;
  bool backward = false;
  const std::vector<ChunkAccess>* params = nullptr;
  const std::vector<ChunkAccess>* grads = nullptr;  // backward only (else empty)
};

struct AccumulatedStep {
  // The model's blocks in forward order, each the tensors its compute reads
  // (their param chunks are pinned, and in backward the trainable ones' grad
  // chunks). A chunk may hold tensors of several blocks.
  std::vector<std::vector<TensorId>> blocks;
  uint32_t micro_batches = 1;
  AccumulationOrder order = AccumulationOrder::kLayered;
  // Device memory a pass needs besides its chunks (its activations), which
  // the plan keeps free for it (Pipeline::BeginMoment); null: none.
  std::function<uint64_t(const BlockPass&)> activation_bytes;
};

// Needs no open pipeline iteration; runs one, forward and backward of every
// micro-batch, then RunTrainStep with `options` (each grad chunk is
// submitted to options.reducer and begun in options.overlap as soon as its
// last backward pass is done), and ends the iteration. InvalidArgument,
// before anything runs, for no blocks, no micro-batches or a tensor the
// engine does not have. An error from `compute` or a move ends the
// iteration and is returned, the step not run: the groups whose update began
// beside backward are put back (OverlapUpdates::Undo; its error instead, if
// that fails), and the grad chunks keep the partial gradients, which the next
// step would add to: the caller decides whether training goes on.
Result<TrainStepReport> RunAccumulatedStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                           const AccumulatedStep& step,
                                           const std::function<Status(const BlockPass&)>& compute,
                                           const TrainStepOptions& options = {});

}  // namespace strata::offload
