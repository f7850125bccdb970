#include "offload/training/state_stream.h"

#include <tbb/task_arena.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include <fmt/ranges.h>

#include "optim/cpu/cpu_kernels.h"
#include "src/base/alignment.h"
#include "strata/options.h"

namespace strata::offload {

// Note [Three stages at once]
// Each group (a chunk group: the master and states of one param chunk) lives
// in one NVMe slot: master, then each state, each padded to the slot
// alignment. A step runs three stages at once over the groups in order:
//   reader   (worker thread)  reads group i+k into a free ring buffer (CRC checked)
//   update   (calling thread) updates group i in its buffer (oneTBB inside)
//   writer   (worker thread)  writes group i-j back from its buffer
// so disk reads, the update and disk writes overlap; a buffer is read into
// again only once its group is written. Host memory is the ring and nothing
// else: ring_slots x the largest group. The update runs on every core but
// one: the drive, not the update, sets the pace, and the reader's and
// writer's CRCs and submissions must not queue behind it.
//
// Note [Copy on write]
// Nothing stored is lost on an error. Updated groups are written to fresh
// slots; only when every group is written are the old slots freed and the new
// ones made current. A failed read or write, a corrupt slot or a stuck drive
// ends the step with that error, the fresh slots are freed, the states on
// NVMe are those of before the step, and the compute copies already written
// for the step are put back from the old masters. The NVMe tier therefore
// needs room for a second copy of all groups during a step (OutOfMemory,
// before anything is read, when it has not).
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Runs `fn` when the scope ends, however it ends.
template <typename Fn>
class ScopeExit {
 public:
  explicit ScopeExit(Fn fn) : fn_(std::move(fn)) {}
  ~ScopeExit() { fn_(); }
  ScopeExit(const ScopeExit&) = delete;
  ScopeExit& operator=(const ScopeExit&) = delete;

 private:
  Fn fn_;
};

}  // namespace

StateStreamOptions StateStreamOptionsOf(const Options& options) {
  return StateStreamOptions{.ring_bytes = options.optimizer.stream_ring_bytes,
                            .wait_timeout_ms = 2 * options.nvme.io_timeout_ms};
}

Result<std::unique_ptr<StateStream>> StateStream::Create(memory::NvmeTierPool& pool, int num_states,
                                                         const StateStreamOptions& options) {
  if (num_states < 0 || num_states > 2) {
    return InvalidArgument("state stream: {} optimizer states per group; 0 to 2 are supported", num_states);
  }
  if (options.ring_bytes == 0) return InvalidArgument("state stream: a ring of 0 bytes holds no group");
  if (options.wait_timeout_ms == 0) return InvalidArgument("state stream: wait_timeout_ms must be > 0");
  return std::unique_ptr<StateStream>(new StateStream(pool, num_states, options));
}

StateStream::StateStream(memory::NvmeTierPool& pool, int num_states, const StateStreamOptions& options)
    : pool_(pool), num_states_(num_states), options_(options) {}

StateStream::~StateStream() {
  for (const Group& group : groups_) pool_.Free(group.slot);
}

uint64_t StateStream::ArrayBytes(size_t n) const {
  const uint64_t bytes = n * sizeof(float);
  return RoundUp(bytes, memory::kSlotAlignmentBytes);
}

uint64_t StateStream::StateBytes(size_t n) const {
  return RoundUp(ChunkBytes(options_.state_dtype, n), memory::kSlotAlignmentBytes);
}

optim::ChunkTensors StateStream::TensorsIn(std::byte* buffer, const Group& group, const GroupIo& io) const {
  optim::ChunkTensors t;
  t.n = group.n;
  t.master = reinterpret_cast<float*>(buffer);
  for (int s = 0; s < num_states_; ++s) {
    t.state[s] = reinterpret_cast<float*>(buffer + ArrayBytes(group.n) + s * StateBytes(group.n));
  }
  t.state_dtype = options_.state_dtype;
  t.grad = io.grad;
  t.grad_dtype = io.grad_dtype;
  t.param = io.param;
  t.param_dtype = io.param_dtype;
  return t;
}

Result<GroupId> StateStream::AddGroup(std::span<const float> initial_master) {
  if (initial_master.empty()) return InvalidArgument("state stream: a group needs at least one element");
  if (options_.state_dtype == DType::kInt8Block && initial_master.size() % kInt8BlockElems != 0) {
    return InvalidArgument("state stream: a group of {} elements with int8 states: they come in whole blocks of {}",
                           initial_master.size(), kInt8BlockElems);
  }
  const uint64_t bytes = GroupBytes(initial_master.size());
  std::optional<memory::Extent> slot = pool_.Allocate(bytes);
  if (!slot) return pool_.OutOfMemoryError(bytes, "a group of optimizer states");
  Buffer staging = AllocateAlignedHost(bytes, memory::kSlotAlignmentBytes);
  if (!staging) {
    pool_.Free(*slot);
    return OutOfMemory("state stream: cannot allocate {} of host memory to write a new group", FormatSize(bytes));
  }
  std::memset(staging.data(), 0, bytes);
  std::memcpy(staging.data(), initial_master.data(), initial_master.size_bytes());
  if (Status status = pool_.Write(*slot, staging.bytes(), bytes); !status.ok()) {
    pool_.Free(*slot);
    return status;
  }
  groups_.push_back(Group{.n = initial_master.size(), .slot = *slot});
  return GroupId(static_cast<uint32_t>(groups_.size() - 1));
}

Status StateStream::ReadGroup(GroupId id, std::span<float> master, std::span<const std::span<float>> states) {
  if (id.value() >= groups_.size()) {
    return InvalidArgument("state stream: group {} does not exist ({} groups)", id.value(), groups_.size());
  }
  const Group& group = groups_[id.value()];
  const size_t readable = options_.state_dtype == DType::kFloat32 ? static_cast<size_t>(num_states_) : 0;
  if (master.size() != group.n || states.size() != readable) {
    return InvalidArgument("state stream: group {} holds a master and {} {} states of {} elements ({} read back "
                           "as floats); asked for a master of {} and {} states",
                           id.value(), num_states_, DTypeName(options_.state_dtype), group.n, readable,
                           master.size(), states.size());
  }
  for (std::span<float> state : states) {
    if (state.size() != group.n) {
      return InvalidArgument("state stream: group {} states hold {} elements, not {}", id.value(), group.n,
                             state.size());
    }
  }
  const uint64_t bytes = GroupBytes(group.n);
  Buffer buffer = AllocateAlignedHost(bytes, memory::kSlotAlignmentBytes);
  if (!buffer) return OutOfMemory("state stream: cannot allocate {} to read group {}", FormatSize(bytes), id.value());
  STRATA_RETURN_IF_ERROR(pool_.Read(group.slot, buffer.bytes(), bytes));
  std::memcpy(master.data(), buffer.data(), master.size_bytes());
  for (size_t s = 0; s < states.size(); ++s) {
    std::memcpy(states[s].data(), buffer.bytes() + ArrayBytes(group.n) + s * StateBytes(group.n),
                states[s].size_bytes());
  }
  return Status::Ok();
}

Status StateStream::PrepareRing() {
  uint64_t largest = 0;
  for (const Group& group : groups_) largest = std::max(largest, GroupBytes(group.n));
  const uint64_t fits = options_.ring_bytes / largest;
  const uint64_t wanted = std::min<uint64_t>(groups_.size(), 2);
  if (fits < wanted) {
    return InvalidArgument("state stream: a ring of {} holds {} of the largest group ({}); it needs {}: raise "
                           "optimizer.stream_ring to at least {}, or use smaller chunks",
                           FormatSize(options_.ring_bytes), fits, FormatSize(largest), wanted,
                           FormatSize(wanted * largest));
  }
  // As many buffers as fit, up to one per group: groups added since the last
  // step may allow (or need) a different ring.
  const uint32_t slots = static_cast<uint32_t>(std::min<uint64_t>(fits, groups_.size()));
  if (ring_ && ring_slot_bytes_ == largest && ring_slots_ == slots) return Status::Ok();
  ring_ = Buffer();
  ring_slots_ = 0;
  ring_ = AllocateAlignedHost(slots * largest, memory::kSlotAlignmentBytes);
  if (!ring_) {
    return OutOfMemory("state stream: cannot allocate the ring ({} buffers of {})", slots, FormatSize(largest));
  }
  ring_slots_ = slots;
  ring_slot_bytes_ = largest;
  return Status::Ok();
}

Result<StreamStepReport> StateStream::Step(const optim::Optimizer& optimizer, const optim::StepPlan& plan,
                                           std::span<const GroupIo> io) {
  if (optimizer.num_states() != num_states_) {
    return InvalidArgument("state stream: holds {} states per group; the {} optimizer keeps {}", num_states_,
                           optim::OptimizerKindName(optimizer.config().kind), optimizer.num_states());
  }
  if (io.size() != groups_.size()) {
    return InvalidArgument("state stream: a step over {} groups got gradients for {}", groups_.size(), io.size());
  }
  if (plan.skip) return StreamStepReport{.plan = plan};
  STRATA_ASSIGN_OR_RETURN(StreamStepReport report,
                          Run(io, [&](size_t, const optim::ChunkTensors& t) { return optimizer.UpdateChunk(plan, t); }));
  report.plan = plan;
  return report;
}

// The pipeline's progress: groups read, updated and written so far, shared
// by the reader, the update and the writer (Note [Three stages at once]).
struct StateStream::Progress {
  std::mutex mu;
  std::condition_variable changed;
  size_t read = 0, updated = 0, written = 0;  // guarded by mu
  bool abort = false;                         // guarded by mu
  Status error;                               // guarded by mu: the first failure

  // Keeps the first failure and stops every stage.
  void Fail(Status status) {
    {
      std::lock_guard lock(mu);
      if (error.ok()) error = std::move(status);
      abort = true;
    }
    changed.notify_all();
  }
  // Sets `counter` (read, updated or written) and wakes the other stages.
  void Advance(size_t& counter, size_t value) {
    {
      std::lock_guard lock(mu);
      counter = value;
    }
    changed.notify_all();
  }
  // Waits until `ready()` or an abort; false on an abort.
  template <typename Ready>
  bool WaitUntil(Ready ready) {
    std::unique_lock lock(mu);
    changed.wait(lock, [&] { return abort || ready(); });
    return !abort;
  }
  // Stops the workers, unless the step committed (they are done then).
  void Stop(bool committed) {
    {
      std::lock_guard lock(mu);
      abort = abort || !committed;
    }
    changed.notify_all();
  }
};

Result<StreamStepReport> StateStream::Run(std::span<const GroupIo> io, const UpdateFn& update) {
  STRATA_RETURN_IF_ERROR(CheckIo(io));
  StreamStepReport report;
  if (groups_.empty()) return report;
  const Clock::time_point start = Clock::now();
  STRATA_RETURN_IF_ERROR(PrepareRing());

  // See Note [Copy on write]. On every way out (an exception included) the
  // workers are stopped and joined, and the fresh slots freed unless the
  // step committed.
  Progress progress;
  std::vector<memory::Extent> fresh;
  std::thread reader, writer;
  bool committed = false;
  ScopeExit cleanup([&] {
    progress.Stop(committed);
    if (reader.joinable()) reader.join();
    if (writer.joinable()) writer.join();
    if (!committed) {
      for (const memory::Extent& slot : fresh) pool_.Free(slot);
    }
  });
  STRATA_RETURN_IF_ERROR(AllocateFresh(fresh));

  reader = std::thread([&] { ReadStage(progress); });
  writer = std::thread([&] { WriteStage(progress, fresh); });
  const size_t computed = UpdateStage(progress, io, update, report);
  // The workers finish the groups (or stop at an error) before anything else.
  reader.join();
  writer.join();

  if (const Status& error = progress.error; !error.ok()) {
    Status restored = RestoreComputeCopies(io, computed);
    if (!restored.ok()) {
      return Status(error.code(), fmt::format("{}; and not every compute copy could be put back: {}",
                                              error.message(), restored.ToString()));
    }
    return error;
  }
  for (size_t i = 0; i < groups_.size(); ++i) {
    pool_.Free(groups_[i].slot);
    groups_[i].slot = fresh[i];
    report.bytes_read += GroupBytes(groups_[i].n);
  }
  committed = true;
  report.bytes_written = report.bytes_read;
  report.seconds = SecondsSince(start);
  return report;
}

Status StateStream::CheckIo(std::span<const GroupIo> io) const {
  if (io.size() != groups_.size()) {
    return InvalidArgument("state stream: a step over {} groups got gradients for {}", groups_.size(), io.size());
  }
  // Every group's inputs are checked before anything is read or written.
  for (size_t i = 0; i < io.size(); ++i) {
    if (io[i].grad == nullptr) return InvalidArgument("state stream: group {} has no gradient", i);
    const bool sixteen_bit = io[i].param_dtype == DType::kBFloat16 || io[i].param_dtype == DType::kFloat16;
    if (sixteen_bit != (io[i].param != nullptr)) {
      return InvalidArgument("state stream: group {}: a {} compute copy {}; bf16/fp16 parameters need one, fp32 "
                             "ones have none (the master on NVMe is the parameter)",
                             i, DTypeName(io[i].param_dtype), io[i].param == nullptr ? "is missing" : "was given");
    }
  }
  return Status::Ok();
}

Status StateStream::AllocateFresh(std::vector<memory::Extent>& fresh) {
  for (const Group& group : groups_) {
    std::optional<memory::Extent> slot = pool_.Allocate(GroupBytes(group.n));
    if (!slot) {
      return pool_.OutOfMemoryError(GroupBytes(group.n),
                                    "a second copy of a group written by the optimizer step (copy on write: the "
                                    "NVMe tier holds every group twice during a step)");
    }
    fresh.push_back(*slot);
  }
  return Status::Ok();
}

std::byte* StateStream::RingBuffer(size_t group) const {
  return ring_.bytes() + (group % ring_slots_) * ring_slot_bytes_;
}

void StateStream::ReadStage(Progress& progress) {
  const size_t slots = ring_slots_;
  for (size_t i = 0; i < groups_.size(); ++i) {
    // Buffer i % slots is free once group i - slots is written.
    if (!progress.WaitUntil([&] { return i < slots || progress.written + slots > i; })) return;
    Status status = pool_.Read(groups_[i].slot, RingBuffer(i), GroupBytes(groups_[i].n));
    if (!status.ok()) return progress.Fail(std::move(status));
    progress.Advance(progress.read, i + 1);
  }
}

void StateStream::WriteStage(Progress& progress, const std::vector<memory::Extent>& fresh) {
  for (size_t i = 0; i < groups_.size(); ++i) {
    if (!progress.WaitUntil([&] { return progress.updated > i; })) return;
    Status status = pool_.Write(fresh[i], RingBuffer(i), GroupBytes(groups_[i].n));
    if (!status.ok()) return progress.Fail(std::move(status));
    progress.Advance(progress.written, i + 1);
  }
}

size_t StateStream::UpdateStage(Progress& progress, std::span<const GroupIo> io, const UpdateFn& update,
                                StreamStepReport& report) {
  // On all cores but one: the drive is the bottleneck, and the reader's and
  // writer's CRCs and submissions must not queue behind the update.
  tbb::task_arena update_arena(static_cast<int>(update_threads()));
  size_t computed = 0;
  for (size_t i = 0; i < groups_.size(); ++i) {
    const Clock::time_point wait_start = Clock::now();
    {
      std::unique_lock lock(progress.mu);
      if (!progress.changed.wait_for(lock, std::chrono::milliseconds(options_.wait_timeout_ms),
                                     [&] { return progress.abort || progress.read > i; })) {
        lock.unlock();
        progress.Fail(Timeout("state stream: group {} was not read within {} ms (a read, or the write that frees "
                              "its buffer, is stuck)",
                              i, options_.wait_timeout_ms));
        break;
      }
      if (progress.abort) break;
    }
    report.read_wait_seconds += SecondsSince(wait_start);
    const Clock::time_point update_start = Clock::now();
    Status status;
    try {
      update_arena.execute([&] { status = update(i, TensorsIn(RingBuffer(i), groups_[i], io[i])); });
    } catch (const std::exception& e) {
      status = Internal("state stream: the update of group {} threw: {}", i, e.what());
    }
    report.update_seconds += SecondsSince(update_start);
    computed = i + 1;  // its compute copy may have been written, even on an error
    if (!status.ok()) {
      progress.Fail(std::move(status));
      break;
    }
    progress.Advance(progress.updated, i + 1);
  }
  return computed;
}

Status StateStream::RestoreComputeCopies(std::span<const GroupIo> io, size_t count) {
  // Every group is tried; the first failure is returned, naming them all.
  Status first;
  std::vector<size_t> failed;
  for (size_t i = 0; i < count; ++i) {
    if (io[i].param == nullptr) continue;
    Status status = pool_.Read(groups_[i].slot, ring_.bytes(), GroupBytes(groups_[i].n));
    if (!status.ok()) {
      if (first.ok()) first = std::move(status);
      failed.push_back(i);
      continue;
    }
    const float* master = reinterpret_cast<const float*>(ring_.bytes());
    uint16_t* param = static_cast<uint16_t*>(io[i].param);
    if (io[i].param_dtype == DType::kBFloat16) {
      optim::ConvertToBf16(optim::ActiveCpuIsa(), master, param, groups_[i].n);
    } else {
      optim::ConvertToFp16(optim::ActiveCpuIsa(), master, param, groups_[i].n);
    }
  }
  if (first.ok()) return first;
  return Status(first.code(), fmt::format("groups {} keep the new step's compute copy: {}", fmt::join(failed, ", "),
                                          first.message()));
}

uint32_t StateStream::update_threads() const {
  if (options_.update_threads > 0) return options_.update_threads;
  return static_cast<uint32_t>(std::max(1, tbb::this_task_arena::max_concurrency() - 1));
}

}  // namespace strata::offload
