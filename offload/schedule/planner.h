// The placement planner: from one recorded iteration (the trace), which
// chunk to fetch to the device before which moment, which to evict, and what
// step time and stalls to expect.
//
// A trace is a sequence of moments; a moment names the chunks the compute of
// that moment needs on the device, the device memory in use besides chunks
// (activations, workspace), and how long its compute takes once they are
// there. Training repeats the iteration, so the plan is for the steady state:
// it plans three iterations back to back and keeps the middle one.
//
// Two stages (Note [Planning in two stages] in planner.cc):
//   1. which bytes move: demand paging, evicting first the chunks not needed
//      for half an iteration (longest unused first), else the furthest next
//      use (Belady's MIN);
//   2. when they move: each fetch, with the evictions that make its room, is
//      hoisted to the earliest moment at which its victims are no longer
//      needed and device memory holds it at every moment until its use, in
//      the order the chunks are needed (the link is a queue).
// Host moments (CPU optimizer updates) need their chunks off the device:
// host-homed ones leave right after their last device use, NVMe-homed ones
// are read ahead within `host_staging_bytes` and written back after. An
// update that may run on the device is placed there when its states fit in
// the device memory the all-host plan leaves at its peak, and the plan with
// it there is no slower (Note [Host moments], Note [Where updates run]).
// The prediction replays the plan on a model of the links: one queue per
// direction (host->device, device->host, NVMe read, NVMe write), each at its
// measured bandwidth; a moment starts when its compute is requested and
// every chunk it needs has arrived, and the wait is its stall.
//
// Pure functions of their inputs; thread-safe.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/status.h"
#include "strata/types.h"

namespace strata::offload {

struct TraceMoment {
  std::vector<ChunkId> chunks;   // needed on `tier` during this moment (no duplicates)
  uint64_t non_model_bytes = 0;  // device memory in use besides chunks
  double compute_seconds = 0;    // compute once the chunks are there
  // Where the compute runs: the device, or the host (a CPU optimizer update:
  // its chunks must be off the device, and read from NVMe first when that is
  // their home; they are written back there after).
  Tier tier = Tier::kDevice;
  // Set on a host moment that may run on the device instead (an optimizer
  // update): its compute time there. The planner places it (Note [Where
  // updates run] in planner.cc).
  std::optional<double> device_compute_seconds;
};

struct Trace {
  std::vector<TraceMoment> moments;
};

// The links chunks move over, in bytes per second.
enum class Link : uint8_t { kHostToDevice, kDeviceToHost, kNvmeRead, kNvmeWrite };
inline constexpr int kNumLinks = 4;
std::string_view LinkName(Link link);

struct LinkBandwidths {
  std::array<double, kNumLinks> bytes_per_second = {25e9, 25e9, 3e9, 2e9};
};

struct PlannerInput {
  Trace trace;
  std::vector<uint64_t> chunk_bytes;  // by ChunkId
  std::vector<Tier> home;             // by ChunkId: kHost or kNvme, where an evicted chunk goes
  uint64_t device_bytes = 0;          // device memory for chunks and non-model memory together
  LinkBandwidths links;
  // Host memory for NVMe-homed chunks read ahead of a host moment (0: each
  // is read when its moment begins).
  uint64_t host_staging_bytes = 0;
};

// One fetch to the device, issued at the start of moment `issue` for the
// chunk's next use at moment `needed`, after evicting `victims` (to their
// homes). Moments index one iteration; `needed < issue` means the use is in
// the next iteration (a prefetch across the iteration boundary).
struct PlannedFetch {
  ChunkId chunk;
  uint32_t issue = 0;
  uint32_t needed = 0;
  std::vector<ChunkId> victims;
};

// A read of an NVMe-homed chunk into host memory for the host moment
// `needed` (in the next iteration when below the issue moment).
struct PlannedRead {
  ChunkId chunk;
  uint32_t needed = 0;
  bool operator==(const PlannedRead&) const = default;
};

struct Prediction {
  double step_seconds = 0;     // one steady-state iteration
  double compute_seconds = 0;  // the trace's compute alone
  double stall_seconds = 0;    // waiting for chunks
  std::array<uint64_t, kNumLinks> bytes = {};  // per iteration
  uint32_t fetches = 0;
  std::vector<double> stall_per_moment;
  double stall_fraction() const { return step_seconds > 0 ? stall_seconds / step_seconds : 0; }
  uint64_t bytes_moved() const;
};

struct Plan {
  uint32_t num_moments = 0;
  // Fetches by issue moment, in the order to issue them.
  std::vector<std::vector<PlannedFetch>> fetches_at;
  // Evictions that make room for a moment's non-model memory (activations
  // growing), issued at the start of that moment before its fetches.
  std::vector<std::vector<ChunkId>> evictions_at;
  Prediction prediction;
  // The most device memory (chunks resident or arriving, and non-model
  // memory) the plan uses at any moment; never above device_bytes.
  uint64_t peak_device_bytes = 0;
  // Chunks a later host moment needs, sent to the host right after their
  // last use on the device, by moment; nothing waits for them but that host
  // moment.
  std::vector<std::vector<ChunkId>> offloads_at;
  // By moment: where it computes (an update moment placed on the device
  // runs there; every other moment where its trace says).
  std::vector<Tier> compute_tier;
  // NVMe-homed chunks of host moments read ahead, by issue moment, in order
  // (on the NVMe read queue); each host moment writes its NVMe-homed chunks
  // back when it ends.
  std::vector<std::vector<PlannedRead>> host_reads_at;
  // The chunks the plan has on the device (or arriving) when an iteration
  // begins, in the steady state: an executor whose device holds others puts
  // them right first, or the two drift apart.
  std::vector<ChunkId> resident_at_start;
};

// InvalidArgument when the input is malformed (a chunk id out of range, a
// home that is not host or NVMe), OutOfMemory naming the moment and the
// shortfall when one moment's chunks and non-model memory exceed the device.
Result<Plan> BuildPlan(const PlannerInput& input);

// The baseline: no plan, no prefetch; each moment fetches what it lacks on
// demand, evicting the least recently used chunks. Same link model.
Result<Prediction> PredictLru(const PlannerInput& input);

}  // namespace strata::offload
