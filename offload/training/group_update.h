// One trainable chunk group's update, shared by the step after backward
// (train_step.cc) and the updates beside it (overlap_updates.cc): its chunks
// by kind, which of them an update touches, and the fused pass over them.
//
// Thread-safety: a GroupUpdate is immutable once made; Run may be called
// from any thread for chunks its caller has pinned.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include "offload/schedule/pipeline.h"
#include "optim/optimizer.h"
#include "strata/access.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::offload {

// The chunks of one trainable group, by kind.
struct Group {
  std::array<std::optional<ChunkInfo>, kNumChunkKinds> of_kind;
  const ChunkInfo& operator[](ChunkKind kind) const { return *of_kind[static_cast<int>(kind)]; }
  bool has(ChunkKind kind) const { return of_kind[static_cast<int>(kind)].has_value(); }
};

// The engine's groups that have a grad chunk, in layout order.
std::vector<Group> TrainableGroups(const Engine& engine);

// The kinds of `g`'s chunks its update reads or writes, in one host moment.
// A transient param chunk (parameters sharded) is not written: the master
// shard is the parameters, gathered again when compute needs them.
std::vector<ChunkKind> UpdatedKinds(const Group& g, int num_states);

size_t UsedElems(const ChunkInfo& chunk);

// How long `g`'s update would take on a GPU, for the plan to weigh (Note
// [Updates on the device] in train_step.cc): the bytes it reads and writes
// at a GPU memory's rate, conservatively. None where it runs on the host
// only: moments other than fp32, and every group under int8 states (the
// small tensors' fp32 moments update with torchao's arithmetic: Note [8-bit
// states in chunks]), until the CUDA kernel's bf16 and 8-bit paths have run
// on a GPU (cuda_kernels_test's Bf16States... and Int8States... cases).
std::optional<double> DeviceUpdateSeconds(const Group& g, const optim::OptimizerConfig& config);
// The same for reading its gradients' statistics alone.
double DeviceStatsSeconds(const Group& g);

using HeldChunks = std::array<ChunkAccess, kNumChunkKinds>;

// Pins the chunks of `g` an update reads or writes (UpdatedKinds) into
// `held`, in `pipeline`'s open moment; the first error, `held` keeping what
// was pinned before it.
Status AccessGroup(Pipeline& pipeline, const Group& g, int num_states, HeldChunks& held);

// What GroupUpdate::Run does besides the update (see there).
struct UpdateExtras {
  // On a GPU: the update and the zeroing are queued on `stream` (a
  // cudaStream_t, where 0 is the legacy default stream: hence the flag).
  bool on_device = false;
  void* stream = nullptr;
  std::byte* keep = nullptr;
  bool zero_grads = true;
  Tier where = Tier::kHost;  // where the plan runs it (on the emulated device, on_device is false)
  bool overlapped = false;   // begun beside backward (OverlapUpdates)
};

// A step's update of one group at a time, with the plan the step made.
class GroupUpdate {
 public:
  // skip[tensor id]: tensors the step leaves as they are (no gradient reached them).
  GroupUpdate(const Engine& engine, const optim::Optimizer& optimizer, const optim::StepPlan& plan,
              const std::vector<bool>& skip)
      : engine_(engine), optimizer_(optimizer), plan_(plan), skip_(skip) {}

  // Updates elements [lo, hi) of group `g` (pinned in `held` by kind) but
  // the skipped tensors' (this rank's sharded chunks hold that range), and
  // zeroes the grad chunk. `reduced`: null to read the grad chunk (one
  // rank); else this rank's reduced fp32 gradients of [lo, hi) (data
  // parallel). `on_device`: the chunks are on a GPU, and the update and the
  // zeroing are queued on `stream` (Note [Updates on the device] in
  // train_step.cc); else they run on the host. `keep` (on the host): the group's
  // chunks as they were before are copied there, in UpdatedKinds order,
  // each chunk's used bytes one after another (OverlapUpdates's copy; a
  // sharded chunk's, its shard's). `zero_grads` false: the grad chunk is
  // left as it is. See Note [One pass over a group]. With the engine's
  // ComputeSeam, that runs instead; a step the plan skips zeroes the
  // gradients as ever.
  Status Run(const Group& g, size_t lo, size_t hi, const float* reduced, const HeldChunks& held,
             const UpdateExtras& extras = {}) const;

  const optim::StepPlan& plan() const { return plan_; }

 private:
  // Elements [begin, end) of a group, updated as step `step` of their tensors.
  struct Range {
    size_t begin = 0, end = 0;
    int64_t step = 0;
  };
  bool Skipped(TensorId id) const { return id.value() < skip_.size() && skip_[id.value()]; }
  std::vector<Range> RangesToUpdate(const ChunkInfo& param, size_t lo, size_t hi) const;
  optim::ChunkTensors TensorsOf(const Group& g, const HeldChunks& held, size_t lo, size_t a, size_t b,
                                const float* reduced) const;
  Status RunOnHost(const Group& g, size_t lo, size_t hi, const float* reduced, const HeldChunks& held,
                   const UpdateExtras& extras) const;
  // Elements [a, b) of every chunk of `g` the update touches, into `keep`
  // (Run's layout).
  void Keep(const Group& g, const HeldChunks& held, std::byte* keep, size_t a, size_t b) const;

  const Engine& engine_;
  const optim::Optimizer& optimizer_;
  const optim::StepPlan plan_;
  const std::vector<bool>& skip_;
};

}  // namespace strata::offload
