// The one alignment of direct I/O, chunk slots and the buffers that meet
// them, and rounding to it. Pure; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

namespace strata {

// O_DIRECT needs offsets, sizes and buffers aligned to the drive's logical
// block: 4096 bytes covers both 512e and 4Kn drives, and is the page size of
// every platform strata runs on.
inline constexpr size_t kIoAlignmentBytes = 4096;

// `bytes` rounded up to a multiple of `alignment` (default kIoAlignmentBytes).
constexpr uint64_t RoundUp(uint64_t bytes, uint64_t alignment = kIoAlignmentBytes) {
  return (bytes + alignment - 1) / alignment * alignment;
}

// Whether `pointer` is a multiple of `alignment`.
inline bool IsAligned(const void* pointer, size_t alignment = kIoAlignmentBytes) {
  return reinterpret_cast<uintptr_t>(pointer) % alignment == 0;
}

}  // namespace strata
