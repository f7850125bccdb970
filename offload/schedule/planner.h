// The placement planner: from one recorded iteration (the trace), which
// chunk to fetch to the device before which moment, which to evict, where
// each optimizer update runs, and what step time and stalls to expect. It
// plans for the steady state of a repeated iteration, in two stages (which
// bytes move, then when), and predicts on a model of the links (Notes
// [Planning in two stages], [Host moments], [Where updates run] and [The link
// model] in planner.cc).
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
  // update): its compute time there.
  std::optional<double> device_compute_seconds;
  // A host moment computing beside the device moments after it (an update
  // started in backward), not between them: Note [Overlapped updates]
  // in planner.cc.
  bool overlap = false;
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
  // The most of it chunks may take at once: the device tier's capacity
  // (device.budget), beside which the framework's non-model memory has the
  // rest (Note [The device model] in planner.cc). 0: all of device_bytes.
  uint64_t device_chunk_bytes = 0;
  LinkBandwidths links;
  // Host memory for NVMe-homed chunks read ahead of a host moment, beside
  // the host room of the host-homed chunks on the device (Note [Room for
  // reads ahead] in planner.cc).
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
  // The most bytes of chunks resident or arriving at any moment; never above
  // device_chunk_bytes.
  uint64_t peak_chunk_bytes = 0;
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
  // By moment: the host memory reads ahead may hold as it begins
  // (host_staging_bytes and the room of the host-homed chunks the plan has
  // on the device then: Note [Room for reads ahead] in planner.cc).
  std::vector<uint64_t> host_read_room;
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
