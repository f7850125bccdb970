// Picks the device backend named by the options. In a build without CUDA the
// CUDA entry points are stubs here, so callers need no #ifdef of their own.
#include "strata/device.h"

#include <memory>

#include "src/backends/device/cuda_pattern.h"
#include "src/base/logging.h"
#include "strata/options.h"
#include "strata/status.h"

namespace strata {

#ifndef STRATA_WITH_CUDA
bool CudaDeviceAvailable() { return false; }

Result<std::unique_ptr<Device>> CreateCudaDevice(int /*device_index*/, size_t /*capacity_bytes*/) {
  return NotSupported("this build has no CUDA backend (configure with the CUDA toolkit and STRATA_ENABLE_CUDA=ON)");
}

Result<size_t> CudaAutoBudget(int /*device_index*/) {
  return NotSupported("device.budget auto: this build has no CUDA backend");
}

// The pattern kernels (src/backends/device/cuda_pattern.cu) likewise, so that the gpu
// tests build everywhere and skip where there is no device.
Status FillPatternOnDevice(void* /*dst*/, size_t /*size_bytes*/, uint64_t /*seed*/) {
  return NotSupported("this build has no CUDA backend");
}
Result<uint64_t> CountPatternMismatchesOnDevice(const void* /*src*/, size_t /*size_bytes*/, uint64_t /*seed*/) {
  return NotSupported("this build has no CUDA backend");
}
#endif

namespace {

// device.budget on a GPU: the size given, or auto's share of the free memory.
Result<std::unique_ptr<Device>> CreateCudaDeviceWithin(const DeviceOptions& options) {
  size_t budget = options.budget_bytes;
  if (options.budget_auto) {
    STRATA_ASSIGN_OR_RETURN(budget, CudaAutoBudget(options.index));
    STRATA_LOG_INFO("device.budget auto: {} for chunks on cuda:{} (half the memory free now)", FormatSize(budget),
                    options.index);
  }
  return CreateCudaDevice(options.index, budget);
}

}  // namespace

Result<std::unique_ptr<Device>> CreateDevice(const Options& options) {
  EmulatedDeviceOptions emulated;
  emulated.capacity_bytes = options.device.budget_bytes;
  emulated.bandwidth_gbps = options.device.emulated_bandwidth_gbps;

  switch (options.device.backend) {
    case DeviceBackendKind::kEmulated:
      return CreateEmulatedDevice(emulated);
    case DeviceBackendKind::kCuda:
      return CreateCudaDeviceWithin(options.device);
    case DeviceBackendKind::kAuto:
      if (CudaDeviceAvailable()) return CreateCudaDeviceWithin(options.device);
      STRATA_LOG_INFO("no CUDA device available: using the emulated device (host memory, {})",
                      FormatSize(options.device.budget_bytes));
      return CreateEmulatedDevice(emulated);
  }
  return InvalidArgument("unknown device backend {}", static_cast<int>(options.device.backend));
}

}  // namespace strata
