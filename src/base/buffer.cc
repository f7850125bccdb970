#include "strata/buffer.h"

#include "src/base/buffer.h"

#include <hwloc.h>
#include <malloc.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <system_error>

#include "src/base/topology.h"
#include "src/base/logging.h"

namespace strata {
namespace {

// Note [Huge pages for I/O buffers]
// A direct I/O request is a scatter-gather list of the buffer's physical
// pages. With 4 KiB pages a 1 MiB request is 256 segments, more than many
// queues take in one command (virtio-blk here allows 254; NVMe drives need a
// PRP list page per 512): the block layer splits it, and the drive sees more,
// smaller commands. Backed by 2 MiB transparent huge pages the same request
// is one or a few segments. Measured on the development VM with
// `strata bench io`: sequential reads went from ~0.8-0.9x fio to 1.4-1.5x fio.
// So every allocation of at least one huge page is aligned to 2 MiB and
// advised MADV_HUGEPAGE (the kernel may still decline; nothing breaks).
constexpr size_t kHugePageBytes = size_t{2} << 20;

// Note [Reserved regions]
// A tier's arena is sized for the most the tier may hold, which a run may
// never fill. So it is mapped (anonymous, private) rather than taken from
// the heap: the kernel commits a page when it is first written, so the arena
// costs what its slots have held, and munmap gives every page back the
// moment the arena dies. The heap promises neither: glibc serves a request
// below its mmap threshold (128 KiB, rising to 32 MiB as large blocks are
// freed) from an arena that keeps freed pages resident until its top is
// trimmed, so a closed engine's arena could stay in the process's RSS. A
// region bound to a NUMA node gets the node's policy before any page exists,
// so each page is placed as it is first written. Memory pinned for DMA is
// committed whole by the pinning, whatever the slots have held: the CUDA
// backend page-locks the host arena, and with an NVMe tier the engine
// registers it with io_uring as fixed buffers, which pins every page. There
// only the size of the arena keeps the cost down (Note [Host budget auto] in
// memory/engine.cc).

// Relaxed: a configuration switch read at allocation time, not a
// synchronization point.
std::atomic<bool> g_huge_pages{true};

void AdviseHugePages(void* data, size_t rounded_bytes) {
  if (rounded_bytes < kHugePageBytes) return;
  // Best effort: a kernel without THP (or with it set to "never") says no.
  (void)::madvise(data, rounded_bytes, MADV_HUGEPAGE);
}

bool IsValidAlignment(size_t alignment_bytes) {
  return alignment_bytes >= sizeof(void*) && (alignment_bytes & (alignment_bytes - 1)) == 0;
}

size_t PageSizeBytes() {
  long page = ::sysconf(_SC_PAGESIZE);
  // 4096 is the page size of every platform strata runs on; sysconf failing
  // is not worth an error.
  return page > 0 ? static_cast<size_t>(page) : 4096;
}

// The NUMA node of OS index `numa_node`, or null (with a warning: the
// caller falls back to unbound memory) when there is no such node.
hwloc_obj_t NumaNodeObject(hwloc_topology_t topology, int numa_node, size_t size_bytes) {
  hwloc_obj_t node = hwloc_get_numanode_obj_by_os_index(topology, static_cast<unsigned>(numa_node));
  if (node == nullptr) {
    STRATA_LOG_WARNING("cannot bind {} to NUMA node {}: no such node ({} nodes); using unbound memory",
                       FormatSize(size_bytes), numa_node, NumaNodeCount());
  }
  return node;
}

// STRICT: without it hwloc may silently hand out unbound memory, and the
// warnings below would never tell anyone that placement was lost.
constexpr int kBindFlags = HWLOC_MEMBIND_BYNODESET | HWLOC_MEMBIND_STRICT;

// Binds whole pages [data, data + rounded_bytes) to `node`: pages that
// exist are migrated, the rest are placed there when first written. Warns
// when the kernel refuses (the memory stays unbound).
void BindPages(hwloc_topology_t topology, hwloc_obj_t node, void* data, size_t rounded_bytes, size_t size_bytes,
               int numa_node) {
  if (hwloc_set_area_membind(topology, data, rounded_bytes, node->nodeset, HWLOC_MEMBIND_BIND,
                             kBindFlags | HWLOC_MEMBIND_MIGRATE) != 0) {
    const int bind_errno = errno;
    STRATA_LOG_WARNING("cannot bind {} to NUMA node {} ({}); using unbound memory", FormatSize(size_bytes), numa_node,
                       std::generic_category().message(bind_errno));
  }
}

// Memory bound to NUMA node `numa_node` (an OS index), or an empty Buffer
// when binding is not possible (the caller falls back to unbound memory).
// `rounded_bytes` is `size_bytes` rounded up to the alignment.
Buffer AllocateBound(size_t size_bytes, size_t rounded_bytes, size_t alignment_bytes, int numa_node) {
  hwloc_topology_t topology = internal::SharedTopology();
  if (topology == nullptr) return {};
  hwloc_obj_t node = NumaNodeObject(topology, numa_node, size_bytes);
  if (node == nullptr) return {};

  if (alignment_bytes <= PageSizeBytes()) {
    // hwloc allocates whole pages (mmap + mbind on Linux), so any alignment
    // up to a page holds.
    void* data = hwloc_alloc_membind(topology, rounded_bytes, node->nodeset, HWLOC_MEMBIND_BIND, kBindFlags);
    if (data == nullptr) {
      const int bind_errno = errno;  // before anything else can change it
      STRATA_LOG_WARNING("cannot bind {} to NUMA node {} ({}); using unbound memory", FormatSize(size_bytes), numa_node,
                         std::generic_category().message(bind_errno));
      return {};
    }
    // hwloc_free needs the length that was mapped, not the Buffer's size.
    return Buffer(data, size_bytes,
                  [topology, rounded_bytes](void* ptr, size_t) { hwloc_free(topology, ptr, rounded_bytes); });
  }

  // Alignment beyond a page: allocate, then bind the range. It is whole pages
  // (aligned beyond a page, a multiple of the alignment in size) shared with
  // no other allocation, so pages the heap had already touched can be
  // migrated; the rest are placed on the node when first written.
  void* data = std::aligned_alloc(alignment_bytes, rounded_bytes);
  if (data == nullptr) return {};
  BindPages(topology, node, data, rounded_bytes, size_bytes, numa_node);
  return Buffer(data, size_bytes, [](void* ptr, size_t) { std::free(ptr); });
}

// `rounded_bytes` of fresh anonymous pages starting at a multiple of
// `alignment_bytes` (a power of two, at least a page), or null. The mapping
// is made `alignment_bytes` longer than needed and trimmed at both ends.
void* MapAligned(size_t rounded_bytes, size_t alignment_bytes) {
  const size_t slack_bytes = alignment_bytes - PageSizeBytes();
  if (rounded_bytes > SIZE_MAX - slack_bytes) return nullptr;
  const size_t mapped_bytes = rounded_bytes + slack_bytes;
  void* mapped = ::mmap(nullptr, mapped_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (mapped == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(mapped);
  const uintptr_t start = (base + alignment_bytes - 1) & ~(uintptr_t{alignment_bytes} - 1);
  const size_t head_bytes = start - base;
  const size_t tail_bytes = mapped_bytes - head_bytes - rounded_bytes;
  // Unmapping part of a fresh private mapping cannot fail but for bad arguments.
  if (head_bytes > 0) (void)::munmap(mapped, head_bytes);
  if (tail_bytes > 0) (void)::munmap(reinterpret_cast<void*>(start + rounded_bytes), tail_bytes);
  return reinterpret_cast<void*>(start);
}

// The number after `key` on the line of `path` that starts with it
// ("MemAvailable:" in /proc/meminfo), times `unit_bytes`; nullopt when
// there is no such line.
std::optional<uint64_t> ReadField(const std::string& path, const std::string& key, uint64_t unit_bytes) {
  std::ifstream file(path);
  std::string line;
  while (std::getline(file, line)) {
    if (line.rfind(key, 0) != 0) continue;
    try {
      return std::stoull(line.substr(key.size())) * unit_bytes;
    } catch (const std::exception&) {
      return std::nullopt;
    }
  }
  return std::nullopt;
}

// What the cgroup v2 limits leave this process: for its cgroup and every one
// above it that has a memory.max, that limit less memory.current; the least
// of them, or nullopt where no limit is set or none can be read.
std::optional<uint64_t> CgroupRoomBytes() {
  std::optional<uint64_t> room;
  std::ifstream self("/proc/self/cgroup");
  std::string line;
  while (std::getline(self, line)) {
    if (line.rfind("0::", 0) != 0) continue;  // the v2 hierarchy's line
    const std::string root = "/sys/fs/cgroup";
    std::filesystem::path dir = root + line.substr(3);  // "0::/a/b" -> /sys/fs/cgroup/a/b
    for (; dir.string().size() > root.size(); dir = dir.parent_path()) {
      std::optional<uint64_t> max = ReadField((dir / "memory.max").string(), "", 1);  // "max" reads as nullopt
      std::optional<uint64_t> current = ReadField((dir / "memory.current").string(), "", 1);
      if (!max || !current) continue;
      const uint64_t left = *max > *current ? *max - *current : 0;
      room = room ? std::min(*room, left) : left;
    }
  }
  return room;
}

}  // namespace

std::optional<uint64_t> AvailableHostMemoryBytes() {
  std::optional<uint64_t> available = ReadField("/proc/meminfo", "MemAvailable:", 1024);  // the file says kB: KiB
  if (!available) return std::nullopt;
  if (std::optional<uint64_t> cgroup = CgroupRoomBytes()) return std::min(*available, *cgroup);
  return available;
}

// Note [Returning the heap]
// What an engine and the framework around it free at close goes back to the
// C library's heap, not to the kernel: glibc keeps freed blocks below its
// mmap threshold (which rises to 32 MiB as large blocks are freed) for
// reuse, and trims only the top of the heap. A sweep or a notebook that
// makes engine after engine then sees its RSS climb (measured: 1.2 MiB a
// cycle with a 4M-parameter model), though nothing leaks. malloc_trim(0)
// walks the heap and gives every free page back; a few milliseconds, once
// per close.
void ReturnFreeHeapPages() {
#ifdef __GLIBC__
  (void)::malloc_trim(0);  // returns whether anything was released: either is fine
#endif
}

void SetHugePagesEnabled(bool enabled) { g_huge_pages.store(enabled, std::memory_order_relaxed); }
bool HugePagesEnabled() { return g_huge_pages.load(std::memory_order_relaxed); }

Buffer AllocateAlignedHost(size_t size_bytes, size_t alignment_bytes, int numa_node) {
  if (size_bytes == 0 || !IsValidAlignment(alignment_bytes)) return {};
  const bool huge = HugePagesEnabled() && size_bytes >= kHugePageBytes;
  if (huge) alignment_bytes = std::max(alignment_bytes, kHugePageBytes);  // see Note [Huge pages for I/O buffers]
  if (size_bytes > SIZE_MAX - (alignment_bytes - 1)) return {};
  // std::aligned_alloc requires a size that is a multiple of the alignment.
  const size_t rounded_bytes = (size_bytes + alignment_bytes - 1) & ~(alignment_bytes - 1);

  // The topology is consulted only when placement was asked for, so that
  // processes that never ask do not pay for discovering it.
  if (numa_node >= 0 && NumaNodeCount() > 1) {
    Buffer bound = AllocateBound(size_bytes, rounded_bytes, alignment_bytes, numa_node);
    if (bound) {
      if (huge) AdviseHugePages(bound.data(), rounded_bytes);
      return bound;
    }
  }
  void* data = std::aligned_alloc(alignment_bytes, rounded_bytes);
  if (data == nullptr) return {};
  if (huge) AdviseHugePages(data, rounded_bytes);
  return Buffer(data, size_bytes, [](void* ptr, size_t) { std::free(ptr); });
}

Buffer ReserveHostRegion(size_t size_bytes, int numa_node) {
  if (size_bytes == 0) return {};
  // See Note [Reserved regions].
  const bool huge = HugePagesEnabled() && size_bytes >= kHugePageBytes;
  const size_t alignment_bytes = huge ? kHugePageBytes : PageSizeBytes();
  if (size_bytes > SIZE_MAX - (alignment_bytes - 1)) return {};
  const size_t rounded_bytes = (size_bytes + alignment_bytes - 1) & ~(alignment_bytes - 1);
  void* data = MapAligned(rounded_bytes, alignment_bytes);
  if (data == nullptr) return {};
  if (huge) AdviseHugePages(data, rounded_bytes);
  if (numa_node >= 0 && NumaNodeCount() > 1) {
    hwloc_topology_t topology = internal::SharedTopology();
    hwloc_obj_t node = topology != nullptr ? NumaNodeObject(topology, numa_node, size_bytes) : nullptr;
    if (node != nullptr) BindPages(topology, node, data, rounded_bytes, size_bytes, numa_node);
  }
  return Buffer(data, size_bytes, [rounded_bytes](void* ptr, size_t) { (void)::munmap(ptr, rounded_bytes); });
}

}  // namespace strata
