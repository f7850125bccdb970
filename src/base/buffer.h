// Host memory as the engine sizes its defaults by it, beside the Buffer
// allocators of strata/buffer.h. Thread-safe.
#pragma once

#include <cstdint>
#include <optional>

namespace strata {

// Bytes this process may still take without pushing the machine into
// reclaim: MemAvailable of /proc/meminfo, or less where a cgroup v2 limit
// (memory.max less memory.current, of the process's cgroup or any above it)
// leaves less. nullopt when /proc/meminfo cannot be read.
std::optional<uint64_t> AvailableHostMemoryBytes();

// Gives the heap's free pages back to the kernel (glibc's malloc_trim), as
// an engine closes: see Note [Returning the heap] in src/base/buffer.cc. A
// no-op where the C library has no such call.
void ReturnFreeHeapPages();

}  // namespace strata
