#include "offload/training/accumulated_step.h"

#include <algorithm>
#include <optional>
#include <unordered_map>

// Note [Accumulated steps]
// ~~~~~~~~~~~~~~~~~~~~~~~~
// Gradient accumulation over M micro-batches is usually run micro-batch by
// micro-batch: every block's chunks are fetched M times in forward and M
// times in backward. The layered order (Lamy-Poirier, 2021) runs block b for
// all M micro-batches before block b+1, and in backward the last block for
// all of them first: each block's chunks are pinned in M consecutive moments,
// so the plan keeps them on the device between them and they move once a
// step. The caller holds each block's inputs of every micro-batch until its
// backward (checkpointed, they are the block boundaries only).
//
// Each pass is a moment of its own, as the Python adapter's module calls
// are, so the warm-up trace and the plan see the same moments in either
// order. Standard runs each micro-batch's forward then its backward; layered
// every block's forward passes, then the backward ones from the last block.
// A grad chunk is final once the last backward pass of the lowest
// block holding one of its tensors is done (the last micro-batch's, in
// either order): only then is it handed to the reducer and to the updates
// beside backward. Gradients are the caller's to add, in micro-batch order
// for each block in both orders, so a caller that adds them into the grad
// chunks gets the same sums either way.

namespace strata::offload {
namespace {

// A block's chunks: its tensors' param chunks, and the trainable ones' grad chunks.
struct BlockChunks {
  std::vector<ChunkId> params;
  std::vector<ChunkId> grads;
};

void AddOnce(std::vector<ChunkId>& chunks, ChunkId chunk) {
  if (std::find(chunks.begin(), chunks.end(), chunk) == chunks.end()) chunks.push_back(chunk);
}

Result<std::vector<BlockChunks>> ChunksOf(const Engine& engine, const AccumulatedStep& step) {
  if (step.blocks.empty()) return InvalidArgument("accumulated step: no blocks; give the model's blocks");
  if (step.micro_batches == 0) {
    return InvalidArgument("accumulated step: micro_batches is 0; give at least 1");
  }
  std::vector<BlockChunks> out(step.blocks.size());
  for (size_t b = 0; b < step.blocks.size(); ++b) {
    for (TensorId tensor : step.blocks[b]) {
      std::optional<ChunkId> param = engine.ChunkOf(tensor, ChunkKind::kParam);
      if (tensor.value() >= engine.tensors().size() || !param) {
        return InvalidArgument("accumulated step: block {} names tensor {}, which the engine does not have "
                                       "({} tensors are registered)",
                                       b, tensor.value(), engine.tensors().size());
      }
      AddOnce(out[b].params, *param);
      if (std::optional<ChunkId> grad = engine.ChunkOf(tensor, ChunkKind::kGrad)) AddOnce(out[b].grads, *grad);
    }
  }
  return out;
}

// One pass: a moment with the block's chunks pinned on the device, `compute` run in it.
Status RunPass(Pipeline& pipeline, const BlockChunks& chunks, BlockPass pass, const AccumulatedStep& step,
               const std::function<Status(const BlockPass&)>& compute) {
  STRATA_RETURN_IF_ERROR(pipeline.BeginMoment(step.activation_bytes ? step.activation_bytes(pass) : 0));
  Status status = Status::Ok();
  {
    std::vector<ChunkAccess> params, grads;
    for (ChunkId chunk : chunks.params) {
      if (!status.ok()) break;
      Result<ChunkAccess> access = pipeline.Access(chunk);
      status = access.status();
      if (status.ok()) params.push_back(std::move(access).value());
    }
    for (ChunkId chunk : pass.backward ? chunks.grads : std::vector<ChunkId>{}) {
      if (!status.ok()) break;
      Result<ChunkAccess> access = pipeline.Access(chunk);
      status = access.status();
      if (status.ok()) grads.push_back(std::move(access).value());
    }
    pass.params = &params;
    pass.grads = &grads;
    if (status.ok()) status = compute(pass);
  }  // the accesses released before the moment ends
  const Status ended = pipeline.EndMoment();
  STRATA_RETURN_IF_ERROR(status);
  return ended;
}

// Every pass in `order`: standard, each micro-batch's forward then its backward; layered, each block's forward
// for every micro-batch, then the same backward from the last block.
std::vector<BlockPass> PassOrder(uint32_t blocks, uint32_t micro_batches, AccumulationOrder order) {
  const bool layered = order == AccumulationOrder::kLayered;
  std::vector<BlockPass> passes;
  auto add_phase = [&](bool backward, uint32_t micro_batch) {  // micro_batch: one, or all (layered)
    for (uint32_t i = 0; i < blocks; ++i) {
      const uint32_t block = backward ? blocks - 1 - i : i;
      for (uint32_t m = layered ? 0 : micro_batch; m < (layered ? micro_batches : micro_batch + 1); ++m) {
        passes.push_back({.block = block, .micro_batch = m, .backward = backward});
      }
    }
  };
  for (uint32_t m = 0; m < (layered ? 1 : micro_batches); ++m) {
    add_phase(false, m);
    add_phase(true, m);
  }
  return passes;
}

}  // namespace

Result<TrainStepReport> RunAccumulatedStep(Engine& engine, Pipeline& pipeline, optim::Optimizer& optimizer,
                                           const AccumulatedStep& step,
                                           const std::function<Status(const BlockPass&)>& compute,
                                           const TrainStepOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::vector<BlockChunks> chunks, ChunksOf(engine, step));
  const auto blocks = static_cast<uint32_t>(chunks.size());
  const uint32_t micro_batches = step.micro_batches;
  // Grad chunk -> the lowest block holding one of its tensors: its last backward pass makes the chunk final.
  std::unordered_map<uint32_t, uint32_t> final_after;
  for (uint32_t b = blocks; b-- > 0;) {
    for (ChunkId grad : chunks[b].grads) final_after[grad.value()] = b;
  }
  const std::vector<BlockPass> passes = PassOrder(blocks, micro_batches, step.order);
  STRATA_RETURN_IF_ERROR(pipeline.BeginIteration());
  Status status = Status::Ok();
  for (const BlockPass& pass : passes) {
    status = RunPass(pipeline, chunks[pass.block], pass, step, compute);
    if (!status.ok()) break;
    if (!pass.backward || pass.micro_batch + 1 != micro_batches) continue;
    // What the last pass makes final the step updates (Note [Overlapped updates]: the groups backward completes last).
    const bool last = &pass == &passes.back();
    for (ChunkId grad : chunks[pass.block].grads) {
      if (!status.ok() || final_after[grad.value()] != pass.block) continue;
      if (options.reducer != nullptr) status = options.reducer->Submit(grad);
      if (status.ok() && options.overlap != nullptr && !last) status = options.overlap->Begin(grad).status();
    }
    if (!status.ok()) break;
  }
  if (!status.ok() && options.overlap != nullptr) {
    // The groups whose update began are put back as they were; if that fails they stay updated, the worse error.
    const Status undone = options.overlap->Undo();
    if (!undone.ok()) status = undone;
  }
  Result<TrainStepReport> report =
      status.ok() ? RunTrainStep(engine, pipeline, optimizer, options) : Result<TrainStepReport>(status);
  const Status ended = pipeline.EndIteration();
  if (!report.ok()) return report;
  STRATA_RETURN_IF_ERROR(ended);
  return report;
}

}  // namespace strata::offload
