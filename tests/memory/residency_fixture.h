// A residency manager over an emulated device, a host arena and an NVMe tier
// on memory storage behind a fault injector: the whole tier stack with every
// fault reachable, and no files.
#pragma once

#include <cstring>

#include "memory/residency.h"
#include "test_util.h"

namespace strata::memory::testing {

struct ResidencyStack {
  struct Config {
    uint64_t chunk_bytes = 64 << 10;
    uint32_t num_chunks = 8;
    uint32_t device_chunks = 2;  // capacities, in chunks
    uint32_t host_chunks = 2;
    uint32_t nvme_chunks = 16;   // 0: no NVMe tier
    double bandwidth_gbps = 0;
    uint32_t timeout_ms = 10'000;
    // Chunk sizes when they differ (num_chunks is then their count); the
    // capacities stay in units of chunk_bytes.
    std::vector<uint64_t> chunk_sizes;
    uint32_t transient_chunks = 0;  // the first ones are transient (dropped when moved down)
  };

  explicit ResidencyStack(Config c) : config(c) {
    EmulatedDeviceOptions device_options;
    device_options.capacity_bytes = config.device_chunks * config.chunk_bytes;
    device_options.bandwidth_gbps = config.bandwidth_gbps;
    device = std::move(CreateEmulatedDevice(device_options)).value();
    device_pool = std::move(MemoryTierPool::CreateDevice(*device, config.device_chunks * config.chunk_bytes)).value();
    host_pool = std::move(MemoryTierPool::CreateHost(*device, config.host_chunks * config.chunk_bytes, -1)).value();
    if (config.nvme_chunks > 0) {
      auto wrapped = std::make_unique<FaultInjectingStorage>(
          std::move(CreateMemoryStorage(config.nvme_chunks * config.chunk_bytes)).value());
      faults = wrapped.get();
      storage = std::move(wrapped);
      nvme_pool = std::make_unique<NvmeTierPool>(*storage);
    }
    std::vector<ChunkDesc> chunks;
    if (config.chunk_sizes.empty()) config.chunk_sizes.assign(config.num_chunks, config.chunk_bytes);
    config.num_chunks = static_cast<uint32_t>(config.chunk_sizes.size());
    for (uint32_t i = 0; i < config.num_chunks; ++i) {
      const uint64_t elements = config.chunk_sizes[i] / 4;
      chunks.push_back({ChunkId(i), ChunkKind::kParam, DType::kFloat32, i, elements, elements});
      chunks.back().transient = i < config.transient_chunks;
    }
    ResidencyConfig rc;
    rc.device = device.get();
    rc.device_pool = device_pool.get();
    rc.host_pool = host_pool.get();
    rc.nvme_pool = nvme_pool.get();
    rc.wait_timeout_ms = config.timeout_ms;
    residency = std::make_unique<ResidencyManager>(rc, chunks);
  }
  ~ResidencyStack() { residency.reset(); }

  // Fills chunk `id` (accessed on the host) with bytes derived from `value`.
  Status Fill(uint32_t id, uint8_t value) {
    STRATA_ASSIGN_OR_RETURN(ChunkAccess access, residency->Access(ChunkId(id), Tier::kHost));
    for (uint64_t i = 0; i < access.size_bytes(); ++i) access.data()[i] = std::byte(static_cast<uint8_t>(value + i * 7));
    return Status::Ok();
  }
  // True when chunk `id`, accessed on `tier`, holds Fill(id, value)'s bytes.
  bool Holds(uint32_t id, uint8_t value, Tier tier = Tier::kHost) {
    Result<ChunkAccess> access = residency->Access(ChunkId(id), tier);
    if (!access.ok()) {
      ADD_FAILURE() << access.status().ToString();
      return false;
    }
    for (uint64_t i = 0; i < access->size_bytes(); ++i) {
      if (access->data()[i] != std::byte(static_cast<uint8_t>(value + i * 7))) return false;
    }
    return true;
  }

  Config config;
  std::unique_ptr<Device> device;
  std::unique_ptr<MemoryTierPool> device_pool;
  std::unique_ptr<MemoryTierPool> host_pool;
  FaultInjectingStorage* faults = nullptr;
  std::unique_ptr<Storage> storage;
  std::unique_ptr<NvmeTierPool> nvme_pool;
  std::unique_ptr<ResidencyManager> residency;
};

}  // namespace strata::memory::testing
