// A deterministic byte pattern written and checked on the GPU, for end-to-end
// tests of host<->device copies and for bandwidth measurements: fill device
// memory on the device, copy it, check the copy on the host with PatternByte
// (or the reverse: fill on the host, copy, count mismatches on the device).
//
// Byte i of the pattern for `seed` is byte (i % 8) of the little-endian word
// PatternWord(seed, i / 8), where PatternWord is the splitmix64 finalizer
// applied to seed + (i / 8 + 1) * golden ratio. Every bit depends on the seed
// and on the position, so a dropped, repeated or shifted piece of a copy and
// a copy from the wrong buffer all show up as mismatches.
//
// The host and device code share the inline functions below (compiled by nvcc
// as __host__ __device__), so the host check is the kernel's own reference.
// The kernels run on the calling thread's current CUDA device; the memory
// must belong to it. In a build without CUDA the two functions return
// NotSupported. No CUDA types here: tests include this with the host compiler.
// Thread-safe.
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
