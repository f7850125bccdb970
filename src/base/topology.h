// The machine's NUMA nodes (by OS index), the node a PCI device hangs off,
// and a summary; discovered once with hwloc and never destroyed (Note
// [Topology lifetime] in topology.cc). Thread-safe.
#pragma once

#include <string>

// hwloc's topology handle (hwloc_topology_t), without an hwloc header.
struct hwloc_topology;

namespace strata {

// Number of NUMA nodes; 1 when the topology could not be discovered.
int NumaNodeCount();

// The NUMA node closest to the PCI device with the given bus id
// ("0000:3b:00.0" or "3b:00.0"); -1 when the device is unknown, the topology
// could not be discovered, or the device is not local to exactly one node.
int NumaNodeOfPciDevice(const std::string& pci_bus_id);

// "2 NUMA nodes, 64 cores, 128 hardware threads", or "topology unknown: <why>".
std::string DescribeTopology();

namespace internal {
// The process-wide topology, loaded on the first call; nullptr when hwloc
// could not discover it (logged once).
hwloc_topology* SharedTopology();
}  // namespace internal

}  // namespace strata
