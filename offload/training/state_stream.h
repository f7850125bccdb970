// Streaming of NVMe-resident optimizer states through a bounded ring of host
// buffers: the update of a model whose fp32 master weights and optimizer
// states do not fit in host memory. Reads, the update and writes overlap
// (Note [Three stages at once] in state_stream.cc); a failed step leaves the
// states on NVMe as they were (Note [Copy on write]), so the NVMe tier needs
// room for a second copy of every group during a step.
//
// Ownership: borrows the NvmeTierPool (which must outlive it); owns the
// slots of its groups and the ring. Thread-safety: one caller at a time; the
// two workers live only inside Step (Run).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "memory/tier_pool.h"
#include "optim/optimizer.h"
#include "strata/buffer.h"
#include "strata/options.h"
#include "strata/status.h"
#include "strata/types.h"

namespace strata::offload {

struct StateStreamOptions {
  // Host memory for groups in flight. It must hold two of the largest group
  // (one updating, one reading or writing); more lets reads run further ahead.
  uint64_t ring_bytes = uint64_t{512} << 20;
  // The longest the update waits for a read (beyond the storage's own
  // deadlines): a stuck drive becomes Timeout, not a hang.
  uint32_t wait_timeout_ms = 120000;
  // Threads of the update; 0: every core but one, left to the reader's and
  // writer's CRCs and submissions (the drive, not the update, sets the pace).
  uint32_t update_threads = 0;
  // The states' dtype (optimizer.states): fp32, bf16, or int8 blocks
  // (groups of whole blocks of kInt8BlockElems).
  DType state_dtype = DType::kFloat32;
};

// optimizer.stream_ring, and nvme.io_timeout_ms (twice, for a read that
// waits behind a write) as the wait timeout.
StateStreamOptions StateStreamOptionsOf(const Options& options);

using GroupId = Id<struct StreamGroupTag>;

// What a step needs from the caller for one group, in host memory.
struct GroupIo {
  const void* grad = nullptr;
  DType grad_dtype = DType::kFloat32;
  void* param = nullptr;  // the compute copy (bf16/fp16) the update writes; null for fp32
  DType param_dtype = DType::kFloat32;
};

struct StreamStepReport {
  optim::StepPlan plan;
  double seconds = 0;             // the whole step
  double update_seconds = 0;      // inside the update function
  double read_wait_seconds = 0;   // the update waiting for a read
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

class StateStream {
 public:
  static Result<std::unique_ptr<StateStream>> Create(memory::NvmeTierPool& pool, int num_states,
                                                     const StateStreamOptions& options);
  ~StateStream();
  StateStream(const StateStream&) = delete;
  StateStream& operator=(const StateStream&) = delete;

  // A group whose master starts as `initial_master` and whose states start
  // at zero, written to NVMe now. Ids count up from 0 in the order added.
  Result<GroupId> AddGroup(std::span<const float> initial_master);
  // Reads a group back: `master` and `states` (num_states spans) of the
  // group's size each; states only where they are fp32 (else none).
  Status ReadGroup(GroupId id, std::span<float> master, std::span<const std::span<float>> states);

  // One optimizer step over every group: io[i] belongs to group i. A plan
  // that skips reads and writes nothing. On success the caller finishes the
  // step (Optimizer::FinishStep); on an error nothing on NVMe has changed and
  // the same step is planned again.
  Result<StreamStepReport> Step(const optim::Optimizer& optimizer, const optim::StepPlan& plan,
                                std::span<const GroupIo> io);
  // The same pipeline with any update: `update(group, tensors)` gets the
  // group's arrays in the ring buffer (the benchmark times a no-op update to
  // measure the I/O alone). An error from it ends the step as a failed read does.
  using UpdateFn = std::function<Status(size_t group, const optim::ChunkTensors& tensors)>;
  Result<StreamStepReport> Run(std::span<const GroupIo> io, const UpdateFn& update);

  size_t num_groups() const { return groups_.size(); }
  // Threads the update runs on inside a step (options.update_threads, or
  // every core but one).
  uint32_t update_threads() const;
  int num_states() const { return num_states_; }
  // Buffers in the ring and their size (0 before the first step).
  uint32_t ring_slots() const { return ring_slots_; }
  uint64_t ring_slot_bytes() const { return ring_slot_bytes_; }

 private:
  struct Group {
    size_t n = 0;
    memory::Extent slot;
  };
  StateStream(memory::NvmeTierPool& pool, int num_states, const StateStreamOptions& options);
  uint64_t ArrayBytes(size_t n) const;  // one array, padded to the slot alignment
  uint64_t StateBytes(size_t n) const;  // one state array of n elements, padded
  uint64_t GroupBytes(size_t n) const { return ArrayBytes(n) + num_states_ * StateBytes(n); }
  optim::ChunkTensors TensorsIn(std::byte* buffer, const Group& group, const GroupIo& io) const;
  Status PrepareRing();
  std::byte* RingBuffer(size_t group) const;  // the ring buffer group `group` goes through
  // The stages of Run (Note [Three stages at once]), sharing a Progress.
  struct Progress;
  Status CheckIo(std::span<const GroupIo> io) const;
  Status AllocateFresh(std::vector<memory::Extent>& fresh);  // a fresh slot per group, in order
  void ReadStage(Progress& progress);
  void WriteStage(Progress& progress, const std::vector<memory::Extent>& fresh);
  // Returns how many groups it ran the update on (their compute copies may have changed).
  size_t UpdateStage(Progress& progress, std::span<const GroupIo> io, const UpdateFn& update,
                     StreamStepReport& report);
  // After a failed step: the compute copies of groups [0, count) from the
  // masters on NVMe, which the step did not change.
  Status RestoreComputeCopies(std::span<const GroupIo> io, size_t count);

  memory::NvmeTierPool& pool_;
  const int num_states_;
  const StateStreamOptions options_;
  std::vector<Group> groups_;
  Buffer ring_;
  uint32_t ring_slots_ = 0;
  uint64_t ring_slot_bytes_ = 0;
};

}  // namespace strata::offload
