// ExtentAllocator: hands out aligned [offset, offset + size) ranges of a
// linear space of fixed capacity — the slots of one tier (a device arena, a
// pinned host arena, or the NVMe byte space).
//
// First fit over an ordered free list, with freed extents merged with their
// neighbours, so the chunk-sized slots a tier holds (mostly of one or two
// sizes) do not fragment the space over time. Sizes are rounded up to the
// alignment. Not thread-safe: the owning tier pool guards it.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <vector>

namespace strata::memory {

struct Extent {
  uint64_t offset = 0;
  uint64_t size_bytes = 0;
  bool operator==(const Extent&) const = default;
};

class ExtentAllocator {
 public:
  ExtentAllocator(uint64_t capacity_bytes, uint64_t alignment_bytes);

  // The lowest-addressed free extent that fits, or nullopt when none does
  // (which may happen with free bytes left, if they are not contiguous).
  std::optional<Extent> Allocate(uint64_t size_bytes);
  // Returns an extent obtained from Allocate. Freeing twice or freeing an
  // extent that overlaps free space aborts (a bug in the caller).
  void Free(Extent extent);
  // Allocates every free piece of [begin, end) (so nothing else can be
  // placed there) and returns them; each is later given back with Free.
  std::vector<Extent> ClaimFree(uint64_t begin, uint64_t end);
  // The free extents, by offset.
  std::vector<Extent> FreeExtents() const;

  uint64_t RoundUp(uint64_t size_bytes) const;
  uint64_t capacity_bytes() const { return capacity_bytes_; }
  uint64_t used_bytes() const { return used_bytes_; }
  uint64_t free_bytes() const { return capacity_bytes_ - used_bytes_; }
  uint64_t largest_free_bytes() const;

 private:
  uint64_t capacity_bytes_;
  uint64_t alignment_bytes_;
  uint64_t used_bytes_ = 0;
  std::map<uint64_t, uint64_t> free_;  // offset -> size, disjoint and never adjacent
};

}  // namespace strata::memory
