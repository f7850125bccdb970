// The prefetch pipeline: runs training iterations over the engine's chunks
// with a plan, so that chunks arrive on the device before they are needed.
//
//   pipeline->BeginIteration();
//   for each module, forward and backward:
//     pipeline->BeginMoment(activation_bytes);
//     ChunkAccess w = pipeline->Access(chunk);  // on the device; waits only for this chunk
//     ... compute ...
//     pipeline->EndMoment();
//   pipeline->EndIteration();
//
// The first iteration records the trace, later ones replay the plan made
// from it on queues of the pipeline's own; an iteration that departs from
// the trace runs on demand and is recorded again (Notes [Recording and
// replaying], [Host moments in the pipeline] and [Divergence] in pipeline.cc).
//
// Ownership: borrows the engine (which must outlive it). Thread-safety: the
// Begin/Access/End calls come from one thread (the training loop); the
// queues are the pipeline's own threads.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "offload/schedule/planner.h"
#include "strata/access.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::offload {

// adaptive: record, plan, replay. static: no plan; a fixed share of the param
// and grad chunks stays on the device, the rest moves on demand. on demand:
// every chunk on demand, LRU eviction (the baseline). See Note [Policies].
enum class Policy : uint8_t { kAdaptive, kStatic, kOnDemand };
std::string_view PolicyName(Policy policy);

struct PipelineOptions {
  Policy policy = Policy::kAdaptive;
  double static_device_params = 0.5;  // kStatic: share of param and grad chunk bytes kept on the device
  // Link bandwidths for the plan; a link with 0 is measured in the warm-up
  // iteration (the engine's link statistics), or assumed if nothing moved
  // over it (25 GB/s for host<->device, 3 GB/s read and 2 GB/s write for NVMe).
  LinkBandwidths links{.bytes_per_second = {0, 0, 0, 0}};
  // Device memory the plan may fill, chunks and non-model memory together;
  // chunks take at most the engine's device.budget of it (Note [The device
  // model] in planner.cc). 0 = device.budget (the emulated device's
  // framework keeps its activations in host memory). On a GPU the adapter
  // gives the budget and the memory free beside it.
  uint64_t device_bytes = 0;
  // Any wait for a queued move (an access for its chunk's, a moment for its
  // room, a move for its chunk's last): a Timeout past it.
  uint32_t wait_timeout_ms = 60'000;
  // Host memory the plan may fill with NVMe-homed chunks read ahead of a
  // host moment, beside the host slots of the chunks on the device (Note
  // [Room for reads ahead] in planner.cc): 0 = what the engine keeps free
  // for it (Engine::host_staging_bytes).
  uint64_t host_staging_bytes = 0;
};

struct PipelineStats {
  uint64_t iterations = 0;
  uint64_t planned_iterations = 0;  // replayed with a plan to the end
  uint64_t recordings = 0;          // iterations that recorded a trace
  uint64_t divergences = 0;
  uint64_t plan_failures = 0;       // a trace the planner refused (the iteration after runs on demand)
  uint64_t replans = 0;             // plans made again because a link's measured bandwidth drifted
  std::string plan_error;           // why the planner refused the last trace (empty: it did not)
  double planning_seconds = 0;      // the last plan
  // The last iteration:
  double step_seconds = 0;
  double stall_seconds = 0;  // accesses waiting for their chunk
  uint64_t demand_fetches = 0;  // accesses whose chunk was neither on the device nor on its way
  uint64_t prefetch_retries = 0;  // planned moves that found no room and were made again at the access
  uint64_t reconciled = 0;      // chunks moved at the iteration's start to match the plan
  uint64_t forced_evictions = 0;  // made by the residency manager itself (LRU) to find room
  std::vector<double> stall_per_moment;
  // Stall by the link whose transfer an access waited for (a planned fetch:
  // host->device; a read for a host moment: NVMe read; room or a chunk
  // leaving the device: device->host; a move on demand: the link it came
  // over last).
  std::array<double, kNumLinks> stall_per_link = {};
  std::array<uint64_t, kNumLinks> bytes = {};  // moved over each link
  double stall_fraction() const { return step_seconds > 0 ? stall_seconds / step_seconds : 0; }
};

// The policy and share from placement.policy and placement.device_params;
// the rest as PipelineOptions' defaults.
PipelineOptions PipelineOptionsOf(const Options& options);

class Pipeline {
 public:
  // InvalidArgument for bad options, or (static) when the share kept on the
  // device leaves it less than two chunks to move others through.
  static Result<std::unique_ptr<Pipeline>> Create(Engine& engine, const PipelineOptions& options);
  ~Pipeline();
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;

  Status BeginIteration();
  // A moment computing on the device. `non_model_bytes`: device memory the
  // moment uses besides chunks. When the plan makes room for it, this
  // returns once that room is free: Timeout, and no moment begun, when it is
  // not within wait_timeout_ms.
  Status BeginMoment(uint64_t non_model_bytes = 0);
  // A moment computing on the host: a CPU optimizer update. With
  // `device_compute_seconds` (how long it would take on the device) the
  // plan may move it to the device. Returns where to run it: the host while
  // recording or on demand, else where the plan put it.
  Result<Tier> BeginHostMoment(std::optional<double> device_compute_seconds = std::nullopt);
  // Pins `chunk` where the moment computes for the caller (release it before
  // EndMoment: a move of a chunk in use is skipped). Waits for its planned
  // transfer, or moves it now.
  Result<ChunkAccess> Access(ChunkId chunk);
  Status EndMoment();
  // A host moment that computes beside the moments after it (an optimizer
  // update begun in backward); needs no open moment and leaves none open.
  // Where the plan runs it on the host (adaptive policy), `compute` runs on
  // the pipeline's update thread once `chunks` are in host memory, pinned
  // there in that order, while the caller goes on; the chunks' next moves (a
  // fetch, a write-back to NVMe) wait for it. Anywhere else (the device, or
  // another policy) it runs now, on the caller's thread, as a host moment.
  // Returns its outcome, which the caller waits for before it reads what
  // `compute` wrote, and before EndIteration (Note [Overlapped updates]
  // in pipeline.cc).
  using OverlapCompute = std::function<Status(Tier where, std::vector<ChunkAccess>& chunks)>;
  Result<std::shared_future<Status>> RunOverlapped(const std::vector<ChunkId>& chunks,
                                                   std::optional<double> device_compute_seconds,
                                                   OverlapCompute compute);
  // Also returns the first error of a planned eviction (a failed NVMe
  // write) that finished during the iteration.
  Status EndIteration();
  // Waits for every move and update the pipeline has queued to end (each
  // queue within the wait timeout): before the engine under it closes.
  Status Drain();

  const Plan* plan() const;
  const Trace* trace() const;  // the last recorded trace
  const LinkBandwidths& links() const;
  PipelineStats stats() const;
  std::string StatsJson() const;
  // Each tier's bytes in use (MemoryStats::tiers, by Tier) as each device
  // moment of the last ended iteration began, once its room was made, and
  // as the iteration ended: the memory timeline the adapter reports.
  using TierBytes = std::array<uint64_t, kNumTiers>;
  const std::vector<TierBytes>& last_timeline() const;

 private:
  struct Impl;
  explicit Pipeline(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata::offload
