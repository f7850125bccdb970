// The machine's topology as strata needs it: how many NUMA nodes there are,
// which node a PCI device (a GPU, an NVMe drive) hangs off, and a one-line
// summary for logs and `strata selftest`.
//
// The topology is discovered once, on first use, with hwloc (PCI devices
// included) and then kept for the life of the process: memory allocated with
// it (AllocateAlignedHost) may be freed at any time, static destruction
// included, so it is never destroyed. NUMA nodes are named by their operating
// system index, as in /sys/devices/system/node/nodeN and `numactl`.
//
// Thread-safety: every function may be called from any thread at once.
// Only this unit and src/buffer.cc include <hwloc.h>.
#pragma once

#include <string>

// hwloc's topology handle, declared here so that this header needs no hwloc
// header (hwloc_topology_t is `struct hwloc_topology*`).
struct hwloc_topology;

namespace strata {

// Number of NUMA nodes; 1 when the topology could not be discovered (a
// machine always has at least one node).
int NumaNodeCount();

// The NUMA node (OS index) closest to the PCI device with the given bus id
// ("0000:3b:00.0" as from cudaDeviceGetPCIBusId, or "3b:00.0"); -1 when the
// device is unknown, the topology could not be discovered, or the device is
// not local to exactly one node.
int NumaNodeOfPciDevice(const std::string& pci_bus_id);

// "1 NUMA node, 2 cores" or "2 NUMA nodes, 64 cores, 128 hardware threads";
// "topology unknown: <why>" when discovery failed.
std::string DescribeTopology();

namespace internal {
// The process-wide topology, loaded on the first call; nullptr when hwloc
// could not discover it (logged once). Never destroyed. For src/buffer.cc.
hwloc_topology* SharedTopology();
}  // namespace internal

}  // namespace strata
