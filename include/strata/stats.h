// Statistics of the memory tiers and of the links between them: what the
// engine reports (Engine::stats()). Plain values.
#pragma once

#include <array>
#include <cstdint>

#include "strata/types.h"

namespace strata {

struct TierUsage {
  uint64_t capacity_bytes = 0;
  uint64_t used_bytes = 0;
  uint64_t peak_bytes = 0;
};

struct LinkStats {
  uint64_t moves = 0;
  uint64_t bytes = 0;
  double seconds = 0;  // time the moves took, end to end
  double gbps() const { return seconds > 0 ? static_cast<double>(bytes) / seconds / 1e9 : 0.0; }
};

struct MemoryStats {
  std::array<std::array<LinkStats, kNumTiers>, kNumTiers> links{};  // [from][to]
  std::array<TierUsage, kNumTiers> tiers{};
  std::array<bool, kNumTiers> tier_present{};
  uint64_t evictions = 0;
  uint64_t materializations = 0;  // free chunks given a zero-filled slot
  uint64_t drops = 0;             // transient chunks dropped instead of moved down (gathered params)
  uint64_t compactions = 0;       // chunks moved within a tier to join its free pieces
  uint64_t compacted_bytes = 0;
  uint64_t fence_waits = 0;       // moves that waited for the framework to finish with a chunk (Note [Fences])
};

}  // namespace strata
