// Placement: the home tier of every chunk of a layout, decided once from the
// layout, the tiers' capacities and the placement options. The device tier
// is a cache of what compute touches, so no chunk is homed there. Pure
// functions; thread-safe. See Note [Homes] in placement.cc.
#pragma once

#include <cstdint>
#include <limits>
#include <optional>
#include <vector>

#include "memory/chunk_layout.h"
#include "strata/options.h"
#include "strata/status.h"
#include "strata/types.h"

namespace strata::memory {

// Home tiers, one per chunk: params and grads first, then optimizer states,
// each in layout order, on the host while `host_bytes` lasts, then on NVMe
// while `nvme_bytes` lasts; nullopt for a chunk that fits on neither. States
// take at most `max_host_state_bytes` of the host. A transient chunk is
// given the host and takes none of it.
std::vector<std::optional<Tier>> AssignHomes(const std::vector<ChunkDesc>& chunks, uint64_t host_bytes,
                                             uint64_t nvme_bytes,
                                             uint64_t max_host_state_bytes = std::numeric_limits<uint64_t>::max());

// Host memory kept free of homes when some chunks must live on NVMe; zero
// when the host holds every chunk (and `states_on_nvme`, the static policy's
// share below one, does not send states there anyway) or there is no NVMe
// tier. See Note [Host reserve].
struct HostReserve {
  uint64_t staging_bytes = 0;   // for NVMe-homed chunks read ahead of their CPU update
  uint64_t reserved_bytes = 0;  // staging and slack: what homes may not use
};
HostReserve HostReserveFor(const ChunkLayout& layout, uint64_t host_bytes, uint64_t nvme_bytes, uint64_t stream_ring,
                           bool states_on_nvme = false);

// The capacities of the tiers, in bytes.
struct TierCapacities {
  uint64_t device_bytes = 0;
  uint64_t host_bytes = 0;
  uint64_t nvme_bytes = 0;
  bool has_nvme = false;  // false: no NVMe tier configured
};

struct Placement {
  std::vector<Tier> homes;          // one per chunk of the layout: host or NVMe
  uint64_t host_staging_bytes = 0;  // HostReserve::staging_bytes
};

// NVMe space the chunks need when homed as `homes` (one per chunk): those
// homed on NVMe, an eighth more, and room for three of the largest chunks. See Note [NVMe
// capacity by default].
uint64_t NvmeBytesNeeded(const std::vector<ChunkDesc>& chunks, const std::vector<Tier>& homes);

// Host memory the chunks need when homed as `homes`: those homed on the host
// (transient ones take none), an eighth more and room for two of the largest
// chunks. See Note [Host budget auto] in memory/engine.cc.
uint64_t HostBytesNeeded(const std::vector<ChunkDesc>& chunks, const std::vector<Tier>& homes);

// host.budget auto: the host tier the chunks homed as `placement.homes` need
// (HostBytesNeeded) and, where some are homed on NVMe, staging for them: the
// placement's, at most their bytes (staging more than there is to read gains
// nothing). See Note [Host budget auto] in memory/engine.cc.
struct AutoHostSize {
  uint64_t capacity_bytes = 0;
  uint64_t staging_bytes = 0;
};
AutoHostSize AutoHostSizeFor(const std::vector<ChunkDesc>& chunks, const Placement& placement);

// The homes of every chunk of `layout` under options.placement (adaptive:
// the host while it has room; static: at most placement.host_states of the
// optimizer states on the host), beside the host reserve. OutOfMemory, naming
// the options to change, when a chunk fits on no tier, when the static share
// does not fit on the host, or when the device cannot hold the largest chunk
// (or, params sharded, the gathered chunks kept on it).
Result<Placement> PlaceChunks(const ChunkLayout& layout, const TierCapacities& capacities, const Options& options);

}  // namespace strata::memory
