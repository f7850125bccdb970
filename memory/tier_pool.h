// Tier pools: the slots of each memory tier, with their capacity accounting.
//
// MemoryTierPool is the device tier (one arena from the device backend) or
// the host tier (one pinned arena); a slot is an extent of the arena and its
// address is arena + offset. NvmeTierPool is the NVMe tier over a Storage
// backend; it keeps a CRC32C of every slot written and checks it on every
// read, so a flipped byte on the drive is a Corruption error, never wrong
// data.
//
// Ownership: a pool owns its arena (or borrows its Storage, which must
// outlive it). Thread-safety: every method may be called from any thread;
// a mutex guards the allocator and the CRC table and is never held during
// I/O.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "memory/extent_allocator.h"
#include "src/base/alignment.h"
#include "strata/buffer.h"
#include "strata/device.h"
#include "strata/stats.h"
#include "strata/status.h"
#include "strata/storage.h"
#include "strata/types.h"

namespace strata::memory {

// Slot sizes are multiples of this: the O_DIRECT block, and more than enough
// alignment for SIMD and GPU vector loads at a slot's start.
inline constexpr uint64_t kSlotAlignmentBytes = kIoAlignmentBytes;

class TierPool {
 public:
  virtual ~TierPool() = default;
  virtual Tier tier() const = 0;
  // A free slot of at least size_bytes, or nullopt when the tier has no room.
  std::optional<Extent> Allocate(uint64_t size_bytes);
  void Free(Extent extent);
  TierUsage usage() const;
  uint64_t largest_free_bytes() const;
  // ExtentAllocator's ClaimFree and FreeExtents, under the pool's lock.
  std::vector<Extent> ClaimFree(uint64_t begin, uint64_t end);
  std::vector<Extent> FreeExtents() const;
  // The OutOfMemory error for a request this tier cannot hold.
  Status OutOfMemoryError(uint64_t size_bytes, std::string_view why) const;

 protected:
  explicit TierPool(uint64_t capacity_bytes);
  // Called with mu_ held, as a slot is freed, before anyone can take it again.
  virtual void OnFreeLocked(Extent /*extent*/) {}

  mutable std::mutex mu_;  // guards allocator_, peak_bytes_ and what subclasses say
  ExtentAllocator allocator_;
  uint64_t peak_bytes_ = 0;
};

class MemoryTierPool final : public TierPool {
 public:
  // The device tier: one arena of `capacity_bytes` from device.Allocate.
  static Result<std::unique_ptr<MemoryTierPool>> CreateDevice(Device& device, uint64_t capacity_bytes);
  // The host tier: one pinned arena from device.AllocatePinnedHost.
  static Result<std::unique_ptr<MemoryTierPool>> CreateHost(Device& device, uint64_t capacity_bytes, int numa_node);

  Tier tier() const override { return tier_; }
  std::byte* Address(Extent extent) const { return arena_.bytes() + extent.offset; }
  const Buffer& arena() const { return arena_; }

 private:
  MemoryTierPool(Tier tier, Buffer arena);
  Tier tier_;
  Buffer arena_;
};

class NvmeTierPool final : public TierPool {
 public:
  // `storage` must outlive the pool; the pool uses all of its capacity.
  explicit NvmeTierPool(Storage& storage);

  Tier tier() const override { return Tier::kNvme; }
  // Writes `size_bytes` (a multiple of the slot alignment, <= the extent)
  // from an aligned buffer into the slot and records its CRC32C.
  Status Write(Extent extent, const std::byte* src, uint64_t size_bytes);
  // Reads the slot back and checks its CRC: Corruption (expected and found
  // CRC, offset) when the bytes differ from what was written.
  Status Read(Extent extent, std::byte* dst, uint64_t size_bytes);

  Storage& storage() { return storage_; }

 private:
  void OnFreeLocked(Extent extent) override;

  Storage& storage_;
  // CRC32C of every kCrcPieceBytes piece of each written slot, by slot offset.
  std::map<uint64_t, std::vector<uint32_t>> crcs_by_offset_;  // guarded by mu_
};

}  // namespace strata::memory
