// The planner's internals shared by its two files: the trace unrolled, the
// schedule stage 1 makes and stage 2 hoists (planner.cc), and the
// prediction's replay of a schedule on the link model (planner_replay.cc).
// Not the planner's interface (planner.h).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "offload/schedule/planner.h"

namespace strata::offload::planning {

constexpr uint32_t kCopies = 3;
// Moments before a host moment that reads from NVMe at which its other
// chunks leave the device: Note [Offloads that leave the host room].
constexpr uint64_t kOffloadLeadMoments = 4;
constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

// Note [The device model].
inline uint64_t ChunkCapacity(const PlannerInput& input) {
  return input.device_chunk_bytes > 0 ? std::min(input.device_chunk_bytes, input.device_bytes) : input.device_bytes;
}

inline int LinkIndex(Link link) { return static_cast<int>(link); }

// The trace unrolled kCopies times, with each chunk's uses.
struct Unrolled {
  const PlannerInput& input;
  uint32_t period;
  uint64_t length;
  std::vector<std::vector<uint64_t>> uses;  // by chunk: moments (unrolled) that need it on the device, ascending

  bool ends_with_host_moment = false;  // a host moment after the last device moment
  uint32_t first_device_moment = 0;     // the first device moment's index (period: none)

  explicit Unrolled(const PlannerInput& in)
      : input(in), period(static_cast<uint32_t>(in.trace.moments.size())), length(uint64_t{kCopies} * period) {
    const auto& moments = in.trace.moments;
    const auto last_device = std::find_if(moments.rbegin(), moments.rend(),
                                          [](const TraceMoment& m) { return m.tier == Tier::kDevice; });
    ends_with_host_moment = last_device != moments.rend() && last_device != moments.rbegin();
    first_device_moment = static_cast<uint32_t>(
        std::find_if(moments.begin(), moments.end(), [](const TraceMoment& m) { return m.tier == Tier::kDevice; }) -
        moments.begin());
    uses.resize(in.chunk_bytes.size());
    for (uint64_t g = 0; g < length; ++g) {
      if (!on_host(g)) {
        for (ChunkId c : moment(g).chunks) uses[c.value()].push_back(g);
      }
    }
  }
  bool on_host(uint64_t g) const { return moment(g).tier == Tier::kHost; }
  bool host_chunk_at(ChunkId c, uint64_t g) const {
    const std::vector<ChunkId>& chunks = moment(g).chunks;
    return on_host(g) && std::find(chunks.begin(), chunks.end(), c) != chunks.end();
  }
  bool nvme_homed(ChunkId c) const { return input.home[c.value()] == Tier::kNvme; }
  const TraceMoment& moment(uint64_t g) const { return input.trace.moments[g % period]; }
  uint64_t size(ChunkId c) const { return input.chunk_bytes[c.value()]; }
  // The first use at or after g, kNever when none.
  uint64_t NextUse(ChunkId c, uint64_t g) const {
    const std::vector<uint64_t>& u = uses[c.value()];
    auto it = std::lower_bound(u.begin(), u.end(), g);
    return it == u.end() ? kNever : *it;
  }
  // The last use before g, or none.
  std::optional<uint64_t> LastUseBefore(ChunkId c, uint64_t g) const {
    const std::vector<uint64_t>& u = uses[c.value()];
    auto it = std::lower_bound(u.begin(), u.end(), g);
    if (it == u.begin()) return std::nullopt;
    return *(it - 1);
  }
};

struct Fetch {
  ChunkId chunk;
  uint64_t needed = 0;
  uint64_t issue = 0;
  std::vector<ChunkId> victims;
  uint64_t left_at = 0;  // the moment the chunk last left the device for non-model room (0: never)
};

// An NVMe-homed chunk read into host memory for a host moment.
struct HostRead {
  ChunkId chunk;
  uint64_t needed = 0;
  uint64_t issue = 0;
  uint64_t lower = 0;  // not before: the chunk left the device, or was written back, before this
};

// Stage 1 (and the LRU baseline): demand fetches and their victims.
struct Schedule {
  std::vector<Fetch> fetches;                      // in order of need
  std::vector<HostRead> host_reads;                // in order of need
  std::vector<std::vector<ChunkId>> evictions_at;  // by unrolled moment: room for non-model memory
  std::vector<std::vector<ChunkId>> offloads_at;   // by unrolled moment: off early for a host moment
  std::vector<uint64_t> occupancy;                 // by unrolled moment: chunks resident + non-model
  std::vector<uint64_t> chunk_occupancy;           // by unrolled moment: chunks resident
  std::vector<uint64_t> read_room;                 // by unrolled moment: Note [Room for reads ahead]
};

template <typename T>
std::vector<std::vector<const T*>> ByIssue(const std::vector<T>& moves, uint64_t until) {
  std::vector<std::vector<const T*>> issued_at(until);
  for (const T& m : moves) {
    if (m.issue < until) issued_at[m.issue].push_back(&m);
  }
  return issued_at;
}

// The fetches issued at each unrolled moment before `until`, in order.
std::vector<std::vector<const Fetch*>> IssuedAt(const Schedule& schedule, uint64_t until);

// The prediction of `schedule` on the link model (Note [The link model] in
// planner_replay.cc), measured over the middle copy of the trace.
Prediction Replay(const Unrolled& u, const Schedule& schedule);

}  // namespace strata::offload::planning
