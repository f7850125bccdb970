// Note [Homes]
// Every chunk gets a home tier when the engine is finalized: first the
// chunks compute touches every iteration (params and grads), then the
// optimizer states, each in layout order, on the host while it has room,
// then on NVMe. So the states are what goes to NVMe first (read and written
// once a step, by the update); params and grads only when the host cannot
// hold even them. The device tier is a cache of what compute touches, so no
// chunk calls it home.
//
// The static placement policy homes a fixed share of the optimizer states
// (placement.host_states) on the host and the rest on NVMe; the adaptive one
// puts as many as fit. A frozen group's master shard (parameters sharded) is
// its parameters, not a state, and is homed like them. A transient param
// chunk is given the host and takes none of it: it is never stored there
// (moved off the device, it is dropped).
//
// Note [Host reserve]
// When some chunks must live on NVMe (the model exceeds the host, or the
// static policy sends the states beyond its share there), part of the host tier stays free of
// homes: staging room for NVMe-homed states read ahead of their CPU update —
// four typical (median) chunk groups' optimizer states (one updated, one
// being written back, two read ahead), at least an eighth of the host tier,
// at most a quarter of it and at most optimizer.stream_ring — and two of the
// largest chunks of slack, so that free space in pieces can be joined. A
// typical group, not the largest: an embedding's group may be many times the
// others.

//
// Note [NVMe capacity by default]
// With nvme.dirs but no nvme.capacity, the engine homes the chunks with the
// NVMe tier unbounded, then sizes it to what they need there: the chunks
// homed on NVMe, an eighth more, and kSpareNvmeChunks of the largest chunk.
// The eighth is for fragmentation: NVMe slots are never compacted, and first
// fit leaves free pieces between slots of differing sizes (param and state
// chunks, tensors with chunks of their own) too small for the larger ones;
// the demo's GPT (141MiB homed on NVMe in 1.8 and 2.25MiB chunks) needed 9%
// beyond its homed bytes. Of the spare chunks, two are for chunks homed
// elsewhere that land on NVMe: the host tier, full, pushes its least
// recently used chunk down. Full, it holds all but less than a chunk of its
// budget, and the host-homed chunks take no more than the budget (less the
// reserve), so before a push less than a chunk's worth of them is off the
// host beyond what NVMe-homed chunks visiting it left free on NVMe; the push
// adds one. The third is for a chunk written in place on NVMe, which takes a
// fresh slot before it frees its old one (ResidencyManager::WriteChunk). The
// space is preallocated, so a default of every chunk (or the whole drive)
// would take space the run never uses.

#include "memory/placement.h"

#include <algorithm>
#include <string>

#include <fmt/format.h>

#include "memory/tier_pool.h"
#include "src/base/alignment.h"
#include "strata/engine.h"

namespace strata::memory {
namespace {

// See Note [NVMe capacity by default].
constexpr uint64_t kFragmentationShare = 8;  // an eighth more
constexpr uint64_t kSpareNvmeChunks = 3;
// See Note [Host budget auto] in memory/engine.cc.
constexpr uint64_t kSpareHostChunks = 2;

struct StateTotals {
  uint64_t bytes = 0;
  uint64_t largest_chunk_bytes = 0;
};

StateTotals StatesOf(const std::vector<ChunkDesc>& chunks) {
  StateTotals totals;
  for (const ChunkDesc& chunk : chunks) {
    if (!IsStateChunk(chunk)) continue;
    totals.bytes += chunk.size_bytes();
    totals.largest_chunk_bytes = std::max(totals.largest_chunk_bytes, chunk.size_bytes());
  }
  return totals;
}

Status NoRoomError(const ChunkLayout& layout, const TierCapacities& capacities, const HostReserve& reserve,
                   const PlacementOptions& placement) {
  return OutOfMemory(
      "model states need {} in {} chunks but the host tier holds {} (host.budget{}) and the NVMe tier {} "
      "(nvme.capacity{}): raise a budget or add nvme.dirs{}",
      FormatSize(layout.report().total_bytes), layout.chunks().size(), FormatSize(capacities.host_bytes),
      reserve.reserved_bytes > 0
          ? fmt::format(", {} of it kept for staging NVMe reads", FormatSize(reserve.reserved_bytes))
          : std::string(),
      FormatSize(capacities.nvme_bytes),
      capacities.has_nvme ? "" : ", not configured",
      placement.policy == PlacementPolicy::kStatic
          ? fmt::format(", or raise placement.host_states ({}: the rest of the states go to NVMe)",
                        placement.host_states)
          : std::string());
}

// The static policy's share must fit on the host, to within one state chunk.
Status CheckStaticShare(const std::vector<ChunkDesc>& chunks, const std::vector<Tier>& homes, uint64_t share_bytes,
                        const StateTotals& states, const TierCapacities& capacities, const HostReserve& reserve,
                        double host_states) {
  uint64_t host_state_bytes = 0;
  for (size_t i = 0; i < homes.size(); ++i) {
    if (homes[i] == Tier::kHost && IsStateChunk(chunks[i])) host_state_bytes += chunks[i].size_bytes();
  }
  if (host_state_bytes + states.largest_chunk_bytes >= share_bytes) return Status::Ok();
  return OutOfMemory(
      "placement.host_states {} asks for {} of the {} of optimizer states in host memory, but host.budget {} "
      "holds only {} of them beside the params and grads{}: raise host.budget or lower placement.host_states",
      host_states, FormatSize(share_bytes), FormatSize(states.bytes), FormatSize(capacities.host_bytes),
      FormatSize(host_state_bytes),
      reserve.reserved_bytes > 0 ? fmt::format(" and {} kept for staging", FormatSize(reserve.reserved_bytes))
                                 : std::string());
}

// The device must hold the largest param or grad chunk (what compute pins
// there; masters and optimizer states are updated in host memory) and,
// params sharded, the gathered param chunks kept pinned after their gather
// and a moment's own.
Status CheckDeviceRoom(const std::vector<ChunkDesc>& chunks, uint64_t device_bytes) {
  uint64_t largest_chunk = 0;
  uint64_t largest_transient = 0;
  for (const ChunkDesc& chunk : chunks) {
    if (chunk.kind == ChunkKind::kParam || chunk.kind == ChunkKind::kGrad) {
      largest_chunk = std::max(largest_chunk, chunk.size_bytes());
    }
    if (chunk.transient) largest_transient = std::max(largest_transient, chunk.size_bytes());
  }
  if ((kKeptGatheredChunks + 2) * largest_transient > device_bytes) {
    return OutOfMemory(
        "comm.shard_params: the device tier holds {} (device.budget) but gathered parameters need room for {} of "
        "the largest param chunk ({} each: {} kept pinned after their gather, and a moment's own): raise "
        "device.budget, lower chunk.size_elems / chunk.search_max_elems, or turn comm.shard_params off",
        FormatSize(device_bytes), kKeptGatheredChunks + 2, FormatSize(largest_transient), kKeptGatheredChunks);
  }
  if (largest_chunk > device_bytes) {
    return OutOfMemory("the largest param or grad chunk is {} but the device tier holds {} (device.budget): raise "
                       "device.budget to at least {} or lower chunk.size_elems / chunk.search_max_elems",
                       FormatSize(largest_chunk), FormatSize(device_bytes), FormatSize(largest_chunk));
  }
  return Status::Ok();
}

}  // namespace

// See Note [Homes].
std::vector<std::optional<Tier>> AssignHomes(const std::vector<ChunkDesc>& chunks, uint64_t host_bytes,
                                             uint64_t nvme_bytes, uint64_t max_host_state_bytes) {
  std::vector<std::optional<Tier>> homes(chunks.size());
  for (bool states : {false, true}) {
    for (size_t i = 0; i < chunks.size(); ++i) {
      if (IsStateChunk(chunks[i]) != states) continue;
      const uint64_t size = chunks[i].size_bytes();
      if (chunks[i].transient) {
        homes[i] = Tier::kHost;
      } else if (size <= host_bytes && (!states || size <= max_host_state_bytes)) {
        homes[i] = Tier::kHost;
        host_bytes -= size;
        if (states) max_host_state_bytes -= size;
      } else if (size <= nvme_bytes) {
        homes[i] = Tier::kNvme;
        nvme_bytes -= size;
      }
    }
  }
  return homes;
}

namespace {

// The chunks homed on `tier` (a transient one is stored nowhere), an eighth
// more, and `spare_chunks` of the largest chunk.
uint64_t HomedBytesWithSlack(const std::vector<ChunkDesc>& chunks, const std::vector<Tier>& homes, Tier tier,
                             uint64_t spare_chunks) {
  uint64_t homed = 0;
  uint64_t largest = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (homes[i] == tier && !chunks[i].transient) homed += chunks[i].size_bytes();
    largest = std::max(largest, chunks[i].size_bytes());
  }
  return homed + RoundUp(homed / kFragmentationShare, kSlotAlignmentBytes) + spare_chunks * largest;
}

}  // namespace

// See Note [NVMe capacity by default].
uint64_t NvmeBytesNeeded(const std::vector<ChunkDesc>& chunks, const std::vector<Tier>& homes) {
  return HomedBytesWithSlack(chunks, homes, Tier::kNvme, kSpareNvmeChunks);
}

uint64_t HostBytesNeeded(const std::vector<ChunkDesc>& chunks, const std::vector<Tier>& homes) {
  return HomedBytesWithSlack(chunks, homes, Tier::kHost, kSpareHostChunks);
}

AutoHostSize AutoHostSizeFor(const std::vector<ChunkDesc>& chunks, const Placement& placement) {
  uint64_t nvme_homed = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (placement.homes[i] == Tier::kNvme) nvme_homed += chunks[i].size_bytes();
  }
  AutoHostSize size;
  size.staging_bytes = std::min(placement.host_staging_bytes, nvme_homed);
  size.capacity_bytes = RoundUp(HostBytesNeeded(chunks, placement.homes) + size.staging_bytes, kSlotAlignmentBytes);
  return size;
}

// See Note [Host reserve].
HostReserve HostReserveFor(const ChunkLayout& layout, uint64_t host_bytes, uint64_t nvme_bytes, uint64_t stream_ring,
                           bool states_on_nvme) {
  if ((layout.report().total_bytes <= host_bytes && !states_on_nvme) || nvme_bytes == 0) return {};
  std::vector<uint64_t> group_states;
  uint64_t largest_chunk = 0;
  for (const ChunkGroup& group : layout.groups()) {
    uint64_t states = 0;
    for (int k = 0; k < kNumChunkKinds; ++k) {
      const std::optional<ChunkId> c = group.chunk_of_kind[k];
      if (!c) continue;
      largest_chunk = std::max(largest_chunk, layout.chunk(*c).size_bytes());
      if (IsStateChunk(layout.chunk(*c))) states += layout.chunk(*c).size_bytes();
    }
    group_states.push_back(states);
  }
  std::nth_element(group_states.begin(), group_states.begin() + group_states.size() / 2, group_states.end());
  const uint64_t median_states = group_states.empty() ? 0 : group_states[group_states.size() / 2];
  HostReserve reserve;
  reserve.staging_bytes = std::min({stream_ring, host_bytes / 4, std::max(host_bytes / 8, 4 * median_states)});
  reserve.reserved_bytes = std::min(host_bytes, reserve.staging_bytes + 2 * largest_chunk);
  return reserve;
}

Result<Placement> PlaceChunks(const ChunkLayout& layout, const TierCapacities& capacities, const Options& options) {
  const std::vector<ChunkDesc>& chunks = layout.chunks();
  const bool fixed = options.placement.policy == PlacementPolicy::kStatic;
  const HostReserve reserve = HostReserveFor(layout, capacities.host_bytes, capacities.nvme_bytes,
                                             options.optimizer.stream_ring_bytes,
                                             fixed && options.placement.host_states < 1.0);
  const StateTotals states = StatesOf(chunks);
  const auto share_bytes = static_cast<uint64_t>(options.placement.host_states * static_cast<double>(states.bytes));
  const std::vector<std::optional<Tier>> assigned =
      AssignHomes(chunks, capacities.host_bytes - reserve.reserved_bytes, capacities.nvme_bytes,
                  fixed ? share_bytes : std::numeric_limits<uint64_t>::max());
  Placement placement;
  placement.host_staging_bytes = reserve.staging_bytes;
  for (const std::optional<Tier>& home : assigned) {
    if (!home) return NoRoomError(layout, capacities, reserve, options.placement);
    placement.homes.push_back(*home);
  }
  if (fixed) {
    STRATA_RETURN_IF_ERROR(CheckStaticShare(chunks, placement.homes, share_bytes, states, capacities, reserve,
                                            options.placement.host_states));
  }
  STRATA_RETURN_IF_ERROR(CheckDeviceRoom(chunks, capacities.device_bytes));
  return placement;
}

}  // namespace strata::memory
