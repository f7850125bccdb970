#include "memory/tier_pool.h"

#include <algorithm>

#include "src/base/crc32c.h"
#include "strata/options.h"

namespace strata::memory {

TierPool::TierPool(uint64_t capacity_bytes) : allocator_(capacity_bytes, kSlotAlignmentBytes) {}

std::optional<Extent> TierPool::Allocate(uint64_t size_bytes) {
  std::lock_guard lock(mu_);
  std::optional<Extent> extent = allocator_.Allocate(size_bytes);
  if (extent) peak_bytes_ = std::max(peak_bytes_, allocator_.used_bytes());
  return extent;
}

void TierPool::Free(Extent extent) {
  std::lock_guard lock(mu_);
  allocator_.Free(extent);
  OnFreeLocked(extent);
}

TierUsage TierPool::usage() const {
  std::lock_guard lock(mu_);
  return {allocator_.capacity_bytes(), allocator_.used_bytes(), peak_bytes_};
}

uint64_t TierPool::largest_free_bytes() const {
  std::lock_guard lock(mu_);
  return allocator_.largest_free_bytes();
}

std::vector<Extent> TierPool::ClaimFree(uint64_t begin, uint64_t end) {
  std::lock_guard lock(mu_);
  return allocator_.ClaimFree(begin, end);
}

std::vector<Extent> TierPool::FreeExtents() const {
  std::lock_guard lock(mu_);
  return allocator_.FreeExtents();
}

Status TierPool::OutOfMemoryError(uint64_t size_bytes, std::string_view why) const {
  TierUsage u = usage();
  return OutOfMemory("{} tier: cannot hold {} ({} bytes): {} of {} capacity in use, largest free slot {}; {}",
                     TierName(tier()), FormatSize(size_bytes), size_bytes, FormatSize(u.used_bytes),
                     FormatSize(u.capacity_bytes), FormatSize(largest_free_bytes()), why);
}

MemoryTierPool::MemoryTierPool(Tier tier, Buffer arena)
    : TierPool(arena.size_bytes()), tier_(tier), arena_(std::move(arena)) {}

namespace {

// The arena of a tier of `capacity_bytes`: whole slots. OutOfMemory naming
// `option` when it holds none.
Result<uint64_t> ArenaBytes(uint64_t capacity_bytes, std::string_view option) {
  const uint64_t size = capacity_bytes / kSlotAlignmentBytes * kSlotAlignmentBytes;
  if (size == 0) {
    return OutOfMemory("{} {} holds no slot: the tier is allocated in slots of {}; raise {} to at least {}", option,
                       FormatSize(capacity_bytes), FormatSize(kSlotAlignmentBytes), option,
                       FormatSize(kSlotAlignmentBytes));
  }
  return size;
}

}  // namespace

Result<std::unique_ptr<MemoryTierPool>> MemoryTierPool::CreateDevice(Device& device, uint64_t capacity_bytes) {
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, ArenaBytes(capacity_bytes, "device.budget"));
  Result<Buffer> arena = device.Allocate(size);
  if (!arena.ok()) return arena.status().WithContext("device tier: allocating its arena (option device.budget)");
  return std::unique_ptr<MemoryTierPool>(new MemoryTierPool(Tier::kDevice, std::move(arena).value()));
}

Result<std::unique_ptr<MemoryTierPool>> MemoryTierPool::CreateHost(Device& device, uint64_t capacity_bytes,
                                                                   int numa_node) {
  STRATA_ASSIGN_OR_RETURN(const uint64_t size, ArenaBytes(capacity_bytes, "host.budget"));
  Result<Buffer> arena = device.AllocatePinnedHost(size, numa_node);
  if (!arena.ok()) return arena.status().WithContext("host tier: allocating its pinned arena (option host.budget)");
  return std::unique_ptr<MemoryTierPool>(new MemoryTierPool(Tier::kHost, std::move(arena).value()));
}

NvmeTierPool::NvmeTierPool(Storage& storage) : TierPool(storage.capacity_bytes()), storage_(storage) {}

Status NvmeTierPool::Write(Extent extent, const std::byte* src, uint64_t size_bytes) {
  STRATA_CHECK(size_bytes <= extent.size_bytes, "write of {} bytes into a slot of {}", size_bytes, extent.size_bytes);
  std::vector<uint32_t> crcs = Crc32cPieces(src, size_bytes);
  STRATA_RETURN_IF_ERROR(storage_.Write(extent.offset, src, size_bytes));
  std::lock_guard lock(mu_);
  crcs_by_offset_[extent.offset] = std::move(crcs);
  return Status::Ok();
}

Status NvmeTierPool::Read(Extent extent, std::byte* dst, uint64_t size_bytes) {
  std::vector<uint32_t> expected;
  {
    std::lock_guard lock(mu_);
    auto it = crcs_by_offset_.find(extent.offset);
    if (it == crcs_by_offset_.end()) {
      return Internal("nvme tier: read of slot at offset {} that was never written", extent.offset);
    }
    expected = it->second;
  }
  STRATA_RETURN_IF_ERROR(storage_.Read(extent.offset, dst, size_bytes));
  std::vector<uint32_t> found = Crc32cPieces(dst, size_bytes);
  if (found.size() != expected.size()) {
    return Internal("nvme tier: slot at offset {} read as {} bytes but was written with another size", extent.offset,
                    size_bytes);
  }
  for (size_t i = 0; i < found.size(); ++i) {
    if (found[i] != expected[i]) {
      return Corruption("nvme tier: slot at offset {} ({} bytes, {}): the piece at +{} has CRC32C {:#010x}, expected "
                        "{:#010x}",
                        extent.offset, size_bytes, storage_.Describe(), i * kCrcPieceBytes, found[i], expected[i]);
    }
  }
  return Status::Ok();
}

void NvmeTierPool::OnFreeLocked(Extent extent) { crcs_by_offset_.erase(extent.offset); }

}  // namespace strata::memory
