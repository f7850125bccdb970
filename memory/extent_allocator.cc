#include "memory/extent_allocator.h"

#include <algorithm>

#include "strata/status.h"

namespace strata::memory {

ExtentAllocator::ExtentAllocator(uint64_t capacity_bytes, uint64_t alignment_bytes)
    : capacity_bytes_(capacity_bytes / alignment_bytes * alignment_bytes), alignment_bytes_(alignment_bytes) {
  STRATA_CHECK(alignment_bytes > 0 && (alignment_bytes & (alignment_bytes - 1)) == 0,
               "alignment {} is not a power of two", alignment_bytes);
  if (capacity_bytes_ > 0) free_.emplace(0, capacity_bytes_);
}

uint64_t ExtentAllocator::RoundUp(uint64_t size_bytes) const {
  return (size_bytes + alignment_bytes_ - 1) / alignment_bytes_ * alignment_bytes_;
}

std::optional<Extent> ExtentAllocator::Allocate(uint64_t size_bytes) {
  uint64_t size = RoundUp(std::max<uint64_t>(size_bytes, 1));
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < size) continue;
    Extent extent{it->first, size};
    uint64_t rest = it->second - size;
    uint64_t rest_offset = it->first + size;
    free_.erase(it);
    if (rest > 0) free_.emplace(rest_offset, rest);
    used_bytes_ += size;
    return extent;
  }
  return std::nullopt;
}

void ExtentAllocator::Free(Extent extent) {
  STRATA_CHECK(extent.size_bytes > 0 && extent.offset + extent.size_bytes <= capacity_bytes_,
               "freeing extent [{}, +{}) outside capacity {}", extent.offset, extent.size_bytes, capacity_bytes_);
  auto next = free_.lower_bound(extent.offset);
  STRATA_CHECK(next == free_.end() || next->first >= extent.offset + extent.size_bytes,
               "freeing extent [{}, +{}) that overlaps free space", extent.offset, extent.size_bytes);
  uint64_t offset = extent.offset;
  uint64_t size = extent.size_bytes;
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    STRATA_CHECK(prev->first + prev->second <= offset, "freeing extent [{}, +{}) that overlaps free space", offset,
                 size);
    if (prev->first + prev->second == offset) {  // merge with the free extent before
      offset = prev->first;
      size += prev->second;
      free_.erase(prev);
    }
  }
  if (next != free_.end() && next->first == extent.offset + extent.size_bytes) {  // and with the one after
    size += next->second;
    free_.erase(next);
  }
  free_.emplace(offset, size);
  used_bytes_ -= extent.size_bytes;
}

std::vector<Extent> ExtentAllocator::ClaimFree(uint64_t begin, uint64_t end) {
  std::vector<Extent> claimed;
  auto it = free_.upper_bound(begin);
  if (it != free_.begin()) --it;
  while (it != free_.end() && it->first < end) {
    const uint64_t piece_begin = std::max(it->first, begin);
    const uint64_t piece_end = std::min(it->first + it->second, end);
    if (piece_begin >= piece_end) {
      ++it;
      continue;
    }
    // Split the free extent around the claimed piece.
    const uint64_t offset = it->first, size = it->second;
    it = free_.erase(it);
    if (piece_begin > offset) free_.emplace(offset, piece_begin - offset);
    if (offset + size > piece_end) it = free_.emplace(piece_end, offset + size - piece_end).first;
    claimed.push_back({piece_begin, piece_end - piece_begin});
    used_bytes_ += piece_end - piece_begin;
  }
  return claimed;
}

std::vector<Extent> ExtentAllocator::FreeExtents() const {
  std::vector<Extent> extents;
  extents.reserve(free_.size());
  for (const auto& [offset, size] : free_) extents.push_back({offset, size});
  return extents;
}

uint64_t ExtentAllocator::largest_free_bytes() const {
  uint64_t largest = 0;
  for (const auto& [offset, size] : free_) largest = std::max(largest, size);
  return largest;
}

}  // namespace strata::memory
