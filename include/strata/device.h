// The device backend seam: where the `device` tier's memory comes from and how
// bytes move between it and host memory.
//
// Implementations: CUDA, and a host-emulated device (host memory with a
// capacity, a copy thread per stream, real events, an optional bandwidth
// throttle imitating PCIe).
//
// Ownership: Allocate* return Buffers that free themselves; events are shared
// between the backend and every waiter. Thread-safety: every method may be
// called from any thread at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "strata/buffer.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata {

inline constexpr int kNumaNodeNearDevice = -1;
inline constexpr int kNumaNodeUnbound = -2;

// Completion of one queued copy.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks until the work completes and returns its Status; Timeout when it
  // has not completed within `timeout_ms` (the work itself goes on).
  virtual Status Wait(uint32_t timeout_ms) = 0;
  // True once the work has completed (successfully or not).
  virtual bool Done() = 0;
};

// Copies on one stream run in the order they were queued; the two streams run
// in parallel with each other.
enum class CopyStream : uint8_t { kHostToDevice, kDeviceToHost };

class Device {
 public:
  virtual ~Device() = default;

  // "emulated (host memory, 2.0 GB/s throttle)" or "cuda:0 NVIDIA H100 80GB HBM3".
  virtual std::string Describe() const = 0;
  virtual bool is_emulated() const = 0;
  // True when device pointers can be dereferenced by the host (emulated).
  virtual bool host_accessible() const = 0;

  // Device memory of at most capacity_bytes() in all. OutOfMemory names the
  // request, what is allocated and the capacity; DeviceError carries the
  // backend's own error text.
  virtual Result<Buffer> Allocate(size_t size_bytes) = 0;
  virtual size_t capacity_bytes() const = 0;
  virtual size_t allocated_bytes() const = 0;

  // Page-locked host memory, aligned to 4096 bytes (usable for O_DIRECT and
  // asynchronous copies), on `numa_node` when >= 0, on the node nearest the
  // device for kNumaNodeNearDevice (the emulated device has no such node:
  // unbound), unbound for kNumaNodeUnbound.
  virtual Result<Buffer> AllocatePinnedHost(size_t size_bytes, int numa_node) = 0;

  // Queues a copy of `size_bytes` from `src` to `dst` on `stream`
  // (kHostToDevice: host src, device dst; kDeviceToHost: the reverse). Both
  // buffers must stay valid until the returned event completes.
  virtual Result<std::shared_ptr<Event>> CopyAsync(CopyStream stream, void* dst, const void* src,
                                                   size_t size_bytes) = 0;

  // Fills device memory with a byte value (synchronous).
  virtual Status Memset(void* device_dst, int value, size_t size_bytes) = 0;

  // Copies between two non-overlapping ranges of device memory (synchronous;
  // not ordered with queued copies), at the device's memory bandwidth.
  virtual Status CopyWithinDevice(void* device_dst, const void* device_src, size_t size_bytes) = 0;

  // Waits for every queued copy on both streams.
  virtual Status Synchronize(uint32_t timeout_ms) = 0;

  // An event that completes once the work queued so far on `stream`, the
  // framework's (a cudaStream_t; 0: the legacy default stream), has finished,
  // recorded without waiting (ChunkAccess::ReleaseAfter takes it). The
  // emulated device's framework computes on the host and is done with a
  // chunk when it lets it go: its fence is complete at once.
  virtual Result<std::shared_ptr<Event>> RecordFence(uintptr_t stream) = 0;
  // Waits for the work queued so far on the framework's `stream` (Timeout
  // after `timeout_ms`); at once on the emulated device.
  virtual Status SynchronizeStream(uintptr_t stream, uint32_t timeout_ms) = 0;
};

struct EmulatedDeviceOptions {
  size_t capacity_bytes = size_t{1} << 30;
  double bandwidth_gbps = 0.0;  // per stream; 0 = unthrottled
};
Result<std::unique_ptr<Device>> CreateEmulatedDevice(const EmulatedDeviceOptions& options);

// Whether this build has the CUDA backend and a CUDA device is visible.
bool CudaDeviceAvailable();
// NotSupported when built without CUDA or no device is present.
Result<std::unique_ptr<Device>> CreateCudaDevice(int device_index, size_t capacity_bytes);
// device.budget auto on a GPU: half the memory cudaMemGetInfo finds free on
// device `device_index` now, in whole MiB. NotSupported as CreateCudaDevice.
Result<size_t> CudaAutoBudget(int device_index);

// Picks the backend named by options.device.backend (kAuto: CUDA if available).
Result<std::unique_ptr<Device>> CreateDevice(const Options& options);

}  // namespace strata
