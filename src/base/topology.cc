// Note [Topology lifetime]
// The topology is discovered once, on first use, with hwloc (PCI devices
// included) and then kept for the life of the process: memory allocated with
// it (AllocateAlignedHost binds host buffers to a node) may be freed at any
// time, static destruction included, so it is never destroyed. Only this
// unit and src/base/buffer.cc include <hwloc.h>; the header declares the
// handle's struct so that it needs no hwloc header. A machine always has at
// least one NUMA node, so a failed discovery reports one. PCI bus ids are
// taken as cudaDeviceGetPCIBusId writes them ("0000:3b:00.0") or without the
// domain; NUMA nodes are named as in /sys/devices/system/node/nodeN and
// `numactl`.

#include "src/base/topology.h"

#include <hwloc.h>

#include <cerrno>
#include <string>
#include <system_error>

#include "src/base/logging.h"

namespace strata {
namespace {

struct LoadedTopology {
  // Owned for the life of the process and deliberately never destroyed:
  // see Note [Topology lifetime].
  hwloc_topology_t topology = nullptr;
  std::string error;  // why discovery failed; empty when `topology` is set
};

LoadedTopology LoadTopology() {
  LoadedTopology loaded;
  hwloc_topology_t topology = nullptr;
  if (hwloc_topology_init(&topology) != 0) {
    loaded.error = fmt::format("hwloc_topology_init failed: {}", std::generic_category().message(errno));
    return loaded;
  }
  // PCI devices are needed to place pinned buffers next to a GPU or a drive;
  // "important" keeps GPUs, NICs and storage controllers and skips bridges
  // that lead nowhere, which keeps discovery fast.
  if (hwloc_topology_set_io_types_filter(topology, HWLOC_TYPE_FILTER_KEEP_IMPORTANT) != 0 ||
      hwloc_topology_load(topology) != 0) {
    loaded.error = fmt::format("hwloc_topology_load failed: {}", std::generic_category().message(errno));
    hwloc_topology_destroy(topology);
    return loaded;
  }
  loaded.topology = topology;
  return loaded;
}

// Thread-safe lazy initialization through a function-local static (C++11
// guarantees exactly one initialization even when first called concurrently).
// After that the topology is only read, which hwloc allows from many threads.
const LoadedTopology& Loaded() {
  static const LoadedTopology loaded = [] {
    LoadedTopology result = LoadTopology();
    if (result.topology == nullptr) {
      STRATA_LOG_WARNING("topology unknown ({}): NUMA placement is disabled", result.error);
    }
    return result;
  }();
  return loaded;
}

int CountObjects(hwloc_topology_t topology, hwloc_obj_type_t type) {
  int count = hwloc_get_nbobjs_by_type(topology, type);
  return count > 0 ? count : 0;
}

std::string Plural(int count, const char* singular, const char* plural) {
  return fmt::format("{} {}", count, count == 1 ? singular : plural);
}

}  // namespace

namespace internal {
hwloc_topology* SharedTopology() { return Loaded().topology; }
}  // namespace internal

int NumaNodeCount() {
  hwloc_topology_t topology = Loaded().topology;
  if (topology == nullptr) return 1;
  int count = CountObjects(topology, HWLOC_OBJ_NUMANODE);
  return count > 0 ? count : 1;
}

int NumaNodeOfPciDevice(const std::string& pci_bus_id) {
  hwloc_topology_t topology = Loaded().topology;
  if (topology == nullptr) return -1;
  hwloc_obj_t device = hwloc_get_pcidev_by_busidstring(topology, pci_bus_id.c_str());
  if (device == nullptr) return -1;
  // A PCI device has no nodeset of its own: its locality is that of the
  // nearest ancestor that is not an I/O object (a package or a NUMA group).
  hwloc_obj_t ancestor = hwloc_get_non_io_ancestor_obj(topology, device);
  if (ancestor == nullptr || ancestor->nodeset == nullptr) return -1;
  if (hwloc_bitmap_weight(ancestor->nodeset) != 1) return -1;
  return hwloc_bitmap_first(ancestor->nodeset);
}

std::string DescribeTopology() {
  const LoadedTopology& loaded = Loaded();
  if (loaded.topology == nullptr) return "topology unknown: " + loaded.error;
  int nodes = CountObjects(loaded.topology, HWLOC_OBJ_NUMANODE);
  int cores = CountObjects(loaded.topology, HWLOC_OBJ_CORE);
  int threads = CountObjects(loaded.topology, HWLOC_OBJ_PU);
  std::string text = Plural(nodes, "NUMA node", "NUMA nodes") + ", " + Plural(cores, "core", "cores");
  // Hardware threads only add information when SMT is on.
  if (threads != cores) text += ", " + Plural(threads, "hardware thread", "hardware threads");
  return text;
}

}  // namespace strata
