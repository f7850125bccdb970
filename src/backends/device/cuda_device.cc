// The CUDA device: cudaMalloc'd memory within a capacity, pinned host memory
// placed on the GPU's NUMA node, and two non-blocking copy streams whose
// copies each complete a CUDA event.
//
// Current device: CUDA's current device is per thread, and calls arrive from
// any thread (the caller's, the transfer workers'). Every entry point
// therefore makes this device current first (cudaSetDevice is a cheap
// thread-local store once the context exists) and leaves it current: a
// caller that drives several GPUs from one thread sets its own again.
//
// Waits: never cudaEventSynchronize or cudaDeviceSynchronize, which have no
// timeout; events are polled (internal::WaitForCudaWork) so that a hung copy
// becomes a Timeout.
//
// Lifetime: the Device must outlive its Buffers and the events of its copies
// (a Buffer's deleter frees through the device's context). The destructor
// waits, with a timeout, for queued copies.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>

#include "src/backends/device/capacity_ledger.h"
#include "src/base/alignment.h"
#include "src/base/cuda_check.h"
#include "src/base/logging.h"
#include "src/base/topology.h"
#include "strata/buffer.h"
#include "strata/device.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata {
namespace {

// Pinned host buffers are page-aligned for O_DIRECT (the device.h contract).
constexpr size_t kAlignmentBytes = kIoAlignmentBytes;
// How long Memset and the destructor wait for the GPU: matches the default
// device.copy_timeout_ms; longer means the GPU is hung.
constexpr uint32_t kInternalWaitTimeoutMs = 60'000;

Status SetDevice(int device_index) {
  STRATA_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_index));
  return Status::Ok();
}

// RAII owner of a stream. Destroying a stream with work still queued is
// allowed: CUDA releases it once the work is done.
struct StreamDeleter {
  void operator()(cudaStream_t stream) const { static_cast<void>(cudaStreamDestroy(stream)); }
};
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;

Result<UniqueStream> CreateNonBlockingStream() {
  cudaStream_t stream = nullptr;
  // Non-blocking: no implicit synchronization with the legacy default stream,
  // so copies overlap with whatever else the process runs there.
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return UniqueStream(stream);
}

// Completion of work queued on a stream: owns one CUDA event.
class CudaEvent final : public Event {
 public:
  CudaEvent(int device_index, cudaEvent_t event) : device_index_(device_index), event_(event) {}
  ~CudaEvent() override {
    // Best effort: an error here means the context is already broken, which
    // the calls that broke it have reported.
    if (SetDevice(device_index_).ok()) static_cast<void>(cudaEventDestroy(event_));
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  Status Wait(uint32_t timeout_ms) override {
    STRATA_RETURN_IF_ERROR(SetDevice(device_index_));
    cudaEvent_t event = event_;
    return internal::WaitForCudaWork([event] { return cudaEventQuery(event); }, timeout_ms, "cuda device: queued copy");
  }

  bool Done() override {
    if (!SetDevice(device_index_).ok()) return true;  // failed work counts as completed
    const cudaError_t error = cudaEventQuery(event_);
    if (error == cudaErrorNotReady) return false;
    if (error != cudaSuccess) static_cast<void>(cudaGetLastError());  // Wait reports it
    return true;
  }

 private:
  const int device_index_;
  const cudaEvent_t event_;
};

// Records a fresh event on `stream` and hands out its owner.
Result<std::shared_ptr<Event>> RecordEvent(int device_index, cudaStream_t stream) {
  cudaEvent_t raw = nullptr;
  // No timing: cheaper to record and query, and nothing here reads times.
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&raw, cudaEventDisableTiming));
  auto event = std::make_shared<CudaEvent>(device_index, raw);
  STRATA_CUDA_RETURN_IF_ERROR(cudaEventRecord(raw, stream));
  return std::shared_ptr<Event>(std::move(event));
}


Status FreeDeviceMemory(int device_index, void* data) {
  STRATA_RETURN_IF_ERROR(SetDevice(device_index));
  STRATA_CUDA_RETURN_IF_ERROR(cudaFree(data));
  return Status::Ok();
}

Status UnregisterHostMemory(int device_index, void* data) {
  STRATA_RETURN_IF_ERROR(SetDevice(device_index));
  STRATA_CUDA_RETURN_IF_ERROR(cudaHostUnregister(data));
  return Status::Ok();
}

Status FreePinnedHostMemory(int device_index, void* data) {
  STRATA_RETURN_IF_ERROR(SetDevice(device_index));
  STRATA_CUDA_RETURN_IF_ERROR(cudaFreeHost(data));
  return Status::Ok();
}

// What a CUDA device is made of; gathered before the device exists so that
// construction itself cannot fail.
struct CudaDeviceParts {
  int device_index = 0;
  std::string name;
  size_t total_memory_bytes = 0;
  int numa_node = -1;  // of the GPU's PCI slot; -1 when unknown
  size_t capacity_bytes = 0;
  UniqueStream host_to_device;
  UniqueStream device_to_host;
  UniqueStream memset;  // Memset and CopyWithinDevice: not queued behind host<->device copies
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(CudaDeviceParts parts)
      : parts_(std::move(parts)), ledger_(std::make_shared<CapacityLedger>(parts_.capacity_bytes)) {}

  ~CudaDevice() override {
    Status drained = Synchronize(kInternalWaitTimeoutMs);
    if (!drained.ok())
      STRATA_LOG_WARNING("cuda:{} shut down with copies still queued: {}", index(), drained.ToString());
    size_t leaked_bytes = ledger_->allocated_bytes();
    if (leaked_bytes != 0) {
      STRATA_LOG_WARNING("cuda:{} device destroyed with {} still allocated: its Buffers must not outlive it", index(),
                         FormatSize(leaked_bytes));
    }
    // Streams go while this device is current.
    if (SetDevice(index()).ok()) {
      parts_.host_to_device.reset();
      parts_.device_to_host.reset();
      parts_.memset.reset();
    }
  }

  std::string Describe() const override {
    std::string numa = parts_.numa_node >= 0 ? fmt::format(", NUMA node {}", parts_.numa_node) : std::string();
    return fmt::format("cuda:{} {} (capacity {} of {}{})", index(), parts_.name, FormatSize(ledger_->capacity_bytes()),
                       FormatSize(parts_.total_memory_bytes), numa);
  }
  bool is_emulated() const override { return false; }
  bool host_accessible() const override { return false; }

  Result<Buffer> Allocate(size_t size_bytes) override {
    if (size_bytes == 0) return InvalidArgument("device (cuda:{}): cannot allocate 0 bytes", index());
    size_t allocated_before_bytes = 0;
    if (!ledger_->TryReserve(size_bytes, &allocated_before_bytes)) {
      return OutOfMemory("device (cuda:{}): cannot allocate {}: {} allocated of {} capacity", index(),
                         FormatSize(size_bytes), FormatSize(allocated_before_bytes),
                         FormatSize(ledger_->capacity_bytes()));
    }
    Result<void*> data = AllocateWithinReservation(size_bytes, allocated_before_bytes);
    if (!data.ok()) {
      ledger_->Release(size_bytes);
      return data.status();
    }
    const int device_index = index();
    return Buffer(*data, size_bytes, [ledger = ledger_, device_index](void* ptr, size_t size) {
      Status freed = FreeDeviceMemory(device_index, ptr);
      if (!freed.ok()) STRATA_LOG_ERROR("freeing {} of device memory: {}", FormatSize(size), freed.ToString());
      ledger->Release(size);
    });
  }
  size_t capacity_bytes() const override { return ledger_->capacity_bytes(); }
  size_t allocated_bytes() const override { return ledger_->allocated_bytes(); }

  Result<Buffer> AllocatePinnedHost(size_t size_bytes, int numa_node) override {
    if (size_bytes == 0) return InvalidArgument("pinned host (cuda:{}): cannot allocate 0 bytes", index());
    // Unplaced requests go next to the GPU: its DMA engines read and write
    // this memory, and crossing the socket link costs bandwidth.
    const int node = numa_node == kNumaNodeNearDevice ? parts_.numa_node : numa_node;
    STRATA_RETURN_IF_ERROR(SetDevice(index()));

    Buffer host = AllocateAlignedHost(size_bytes, kAlignmentBytes, node);
    if (host) {
      // Portable: pinned for every GPU's context, not only this one.
      const cudaError_t error = cudaHostRegister(host.data(), size_bytes, cudaHostRegisterPortable);
      if (error == cudaSuccess) {
        void* data = host.data();
        // std::function needs a copyable callable: the host Buffer rides in a
        // shared_ptr, and is freed after it is unregistered.
        auto owned = std::make_shared<Buffer>(std::move(host));
        const int device_index = index();
        return Buffer(data, size_bytes, [owned, device_index](void* ptr, size_t size) {
          Status unregistered = UnregisterHostMemory(device_index, ptr);
          if (!unregistered.ok()) {
            STRATA_LOG_ERROR("unregistering {} of pinned memory: {}", FormatSize(size), unregistered.ToString());
          }
          owned->Reset();
        });
      }
      // Registration fails where the kernel limits locked memory in ways
      // cudaHostAlloc sidesteps (or on odd mappings); placement is lost, the
      // pinning is kept.
      STRATA_LOG_WARNING("cudaHostRegister of {} failed ({}): falling back to cudaHostAlloc", FormatSize(size_bytes),
                         internal::CudaErrorToStatus(error, "cudaHostRegister", __FILE__, __LINE__).message());
    }
    return AllocateHostAllocFallback(size_bytes);
  }

  Result<std::shared_ptr<Event>> CopyAsync(CopyStream stream, void* dst, const void* src, size_t size_bytes) override {
    if (dst == nullptr || src == nullptr || size_bytes == 0) {
      return InvalidArgument("cuda device: CopyAsync needs non-null pointers and a size > 0 (dst {}, src {}, {} bytes)",
                             dst, src, size_bytes);
    }
    cudaStream_t cuda_stream = nullptr;
    cudaMemcpyKind kind = cudaMemcpyDefault;
    switch (stream) {
      case CopyStream::kHostToDevice:
        cuda_stream = parts_.host_to_device.get();
        kind = cudaMemcpyHostToDevice;
        break;
      case CopyStream::kDeviceToHost:
        cuda_stream = parts_.device_to_host.get();
        kind = cudaMemcpyDeviceToHost;
        break;
    }
    if (cuda_stream == nullptr) return InvalidArgument("cuda device: unknown copy stream {}", static_cast<int>(stream));
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    // No lock: two threads queuing on one stream at once may interleave their
    // copy and event record, and then an event also covers the other thread's
    // copy -- it completes later than strictly needed, never too early.
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(dst, src, size_bytes, kind, cuda_stream));
    return RecordEvent(index(), cuda_stream);
  }

  // On a stream of its own: not ordered with queued copies, so a caller
  // waits for a copy into the same memory first.
  Status Memset(void* device_dst, int value, size_t size_bytes) override {
    if (size_bytes == 0) return Status::Ok();
    if (device_dst == nullptr) return InvalidArgument("cuda device: Memset of {} bytes at null", size_bytes);
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    // cudaMemsetAsync plus a timed wait rather than cudaMemset: the latter
    // may return before the memory is set and offers no timeout.
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_dst, value, size_bytes, parts_.memset.get()));
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, RecordEvent(index(), parts_.memset.get()));
    return done->Wait(kInternalWaitTimeoutMs);
  }

  Status CopyWithinDevice(void* device_dst, const void* device_src, size_t size_bytes) override {
    if (size_bytes == 0) return Status::Ok();
    if (device_dst == nullptr || device_src == nullptr) {
      return InvalidArgument("cuda device: CopyWithinDevice of {} bytes needs non-null pointers", size_bytes);
    }
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    // On Memset's stream, waited for: cudaMemcpy does not wait for a
    // device-to-device copy before returning.
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyAsync(device_dst, device_src, size_bytes, cudaMemcpyDeviceToDevice, parts_.memset.get()));
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> done, RecordEvent(index(), parts_.memset.get()));
    return done->Wait(kInternalWaitTimeoutMs);
  }

  Result<std::shared_ptr<Event>> RecordFence(uintptr_t stream) override {
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    return RecordEvent(index(), reinterpret_cast<cudaStream_t>(stream));
  }

  Status SynchronizeStream(uintptr_t stream, uint32_t timeout_ms) override {
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    const auto raw = reinterpret_cast<cudaStream_t>(stream);
    return internal::WaitForCudaWork([raw] { return cudaStreamQuery(raw); }, timeout_ms, "cuda device: a stream");
  }

  Status Synchronize(uint32_t timeout_ms) override {
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> host_to_device, RecordEvent(index(), parts_.host_to_device.get()));
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> device_to_host, RecordEvent(index(), parts_.device_to_host.get()));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    for (const std::shared_ptr<Event>& marker : {host_to_device, device_to_host}) {
      auto left = std::chrono::ceil<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
      Status status = marker->Wait(static_cast<uint32_t>(std::max<int64_t>(0, left.count())));
      if (status.code() == StatusCode::kTimeout) {
        return Timeout("cuda:{}: queued copies not finished within the {} ms timeout of Synchronize", index(),
                       timeout_ms);
      }
      STRATA_RETURN_IF_ERROR(status);
    }
    return Status::Ok();
  }

 private:
  int index() const { return parts_.device_index; }

  // cudaMalloc for a request the ledger has already admitted.
  Result<void*> AllocateWithinReservation(size_t size_bytes, size_t allocated_before_bytes) {
    STRATA_RETURN_IF_ERROR(SetDevice(index()));
    void* data = nullptr;
    const cudaError_t error = cudaMalloc(&data, size_bytes);
    if (error == cudaErrorMemoryAllocation) {
      static_cast<void>(cudaGetLastError());  // not sticky: clear it for the next caller
      size_t free_bytes = 0;
      size_t total_bytes = 0;
      std::string gpu_figures =
          cudaMemGetInfo(&free_bytes, &total_bytes) == cudaSuccess
              ? fmt::format("{} free of {} on the GPU", FormatSize(free_bytes), FormatSize(total_bytes))
              : std::string("GPU free memory unknown");
      return OutOfMemory(
          "device (cuda:{}): cannot allocate {}: {} allocated of {} capacity, but cudaMalloc ran out ({})", index(),
          FormatSize(size_bytes), FormatSize(allocated_before_bytes), FormatSize(ledger_->capacity_bytes()),
          gpu_figures);
    }
    if (error != cudaSuccess) return internal::CudaErrorToStatus(error, "cudaMalloc", __FILE__, __LINE__);
    return data;
  }

  // Pinned memory from cudaHostAlloc, over-allocated by an alignment so the
  // 4096-byte alignment holds whatever cudaHostAlloc returns (in practice it
  // is already page-aligned).
  Result<Buffer> AllocateHostAllocFallback(size_t size_bytes) {
    void* raw = nullptr;
    const size_t padded_bytes = size_bytes + kAlignmentBytes - 1;
    const cudaError_t error = cudaHostAlloc(&raw, padded_bytes, cudaHostAllocPortable);
    if (error == cudaErrorMemoryAllocation) {
      static_cast<void>(cudaGetLastError());
      return OutOfMemory("pinned host (cuda:{}): cannot allocate {}", index(), FormatSize(size_bytes));
    }
    if (error != cudaSuccess) return internal::CudaErrorToStatus(error, "cudaHostAlloc", __FILE__, __LINE__);
    const auto address = reinterpret_cast<uintptr_t>(raw);
    void* aligned = reinterpret_cast<void*>((address + kAlignmentBytes - 1) & ~uintptr_t{kAlignmentBytes - 1});
    const int device_index = index();
    return Buffer(aligned, size_bytes, [raw, device_index](void*, size_t size) {
      Status freed = FreePinnedHostMemory(device_index, raw);
      if (!freed.ok()) STRATA_LOG_ERROR("freeing {} of pinned memory: {}", FormatSize(size), freed.ToString());
    });
  }

  CudaDeviceParts parts_;
  std::shared_ptr<CapacityLedger> ledger_;
};

}  // namespace

bool CudaDeviceAvailable() {
  int count = 0;
  const cudaError_t error = cudaGetDeviceCount(&count);
  if (error != cudaSuccess) {
    // No driver or no device: an answer, not an error; clear it so it does
    // not surface in a later cudaGetLastError().
    static_cast<void>(cudaGetLastError());
    return false;
  }
  return count > 0;
}

namespace {

// NotSupported where no CUDA device is visible; InvalidArgument for an index beyond those that are.
Status CheckCudaIndex(int device_index) {
  int count = 0;
  const cudaError_t count_error = cudaGetDeviceCount(&count);
  if (count_error != cudaSuccess || count == 0) {
    std::string why = count_error != cudaSuccess ? cudaGetErrorString(count_error) : "0 devices";
    static_cast<void>(cudaGetLastError());
    return NotSupported("no CUDA device visible ({})", why);
  }
  if (device_index < 0 || device_index >= count) {
    return InvalidArgument("CUDA device index {} out of range: {} device(s) visible", device_index, count);
  }
  return Status::Ok();
}

}  // namespace

Result<size_t> CudaAutoBudget(int device_index) {
  STRATA_RETURN_IF_ERROR(CheckCudaIndex(device_index).WithContext("device.budget auto"));
  STRATA_RETURN_IF_ERROR(SetDevice(device_index));
  size_t free_bytes = 0, total_bytes = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  constexpr size_t kMiB = size_t{1} << 20;
  const size_t budget = free_bytes / 2 / kMiB * kMiB;
  if (budget == 0) {
    return OutOfMemory("device.budget auto: cuda:{} has {} free of {}: give device.budget a size", device_index,
                       FormatSize(free_bytes), FormatSize(total_bytes));
  }
  return budget;
}

Result<std::unique_ptr<Device>> CreateCudaDevice(int device_index, size_t capacity_bytes) {
  STRATA_RETURN_IF_ERROR(CheckCudaIndex(device_index));
  if (capacity_bytes == 0) return InvalidArgument("cuda:{}: capacity must be > 0 bytes", device_index);

  CudaDeviceParts parts;
  parts.device_index = device_index;
  parts.capacity_bytes = capacity_bytes;
  STRATA_RETURN_IF_ERROR(SetDevice(device_index));
  cudaDeviceProp properties{};
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDeviceProperties(&properties, device_index));
  parts.name = properties.name;
  parts.total_memory_bytes = properties.totalGlobalMem;
  // "0000:3b:00.0" is 12 characters; CUDA asks for room for 13 or more.
  char pci_bus_id[32] = {};
  if (cudaDeviceGetPCIBusId(pci_bus_id, sizeof(pci_bus_id), device_index) == cudaSuccess) {
    parts.numa_node = NumaNodeOfPciDevice(pci_bus_id);
  } else {
    static_cast<void>(cudaGetLastError());  // placement is an optimization; go on without it
  }
  STRATA_ASSIGN_OR_RETURN(parts.host_to_device, CreateNonBlockingStream());
  STRATA_ASSIGN_OR_RETURN(parts.device_to_host, CreateNonBlockingStream());
  STRATA_ASSIGN_OR_RETURN(parts.memset, CreateNonBlockingStream());
  return std::unique_ptr<Device>(std::make_unique<CudaDevice>(std::move(parts)));
}

}  // namespace strata
