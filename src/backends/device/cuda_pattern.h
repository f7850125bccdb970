// A deterministic byte pattern, written and checked on the GPU or on the
// host alike, so that a copy between them can be checked end to end. Byte i
// of the pattern for `seed` is PatternByte(seed, i); see Note [Pattern] in
// cuda_pattern.cu. The kernels run on the calling thread's current CUDA
// device, on memory of that device; without CUDA they are NotSupported. No
// CUDA types here. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/status.h"

#if defined(__CUDACC__)
#define STRATA_HOST_DEVICE __host__ __device__
#else
#define STRATA_HOST_DEVICE
#endif

namespace strata {

// splitmix64's output function: a bijection with full avalanche, so
// neighbouring words get unrelated values.
STRATA_HOST_DEVICE inline uint64_t PatternWord(uint64_t seed, uint64_t word_index) {
  uint64_t z = seed + (word_index + 1) * 0x9E3779B97F4A7C15ull;  // golden ratio step
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

STRATA_HOST_DEVICE inline uint8_t PatternByte(uint64_t seed, uint64_t index) {
  return static_cast<uint8_t>(PatternWord(seed, index / 8) >> ((index % 8) * 8));
}

// Writes the pattern for `seed` into `size_bytes` of device memory at `dst`;
// returns once it is written (or Timeout after a minute).
Status FillPatternOnDevice(void* dst, size_t size_bytes, uint64_t seed);

// How many of the `size_bytes` bytes of device memory at `src` differ from
// the pattern for `seed`.
Result<uint64_t> CountPatternMismatchesOnDevice(const void* src, size_t size_bytes, uint64_t seed);

}  // namespace strata
