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

// The pattern kernels (src/backends/device/cuda_pattern.cu) likewise, so that the gpu
// tests build everywhere and skip where there is no device.
Status FillPatternOnDevice(void* /*dst*/, size_t /*size_bytes*/, uint64_t /*seed*/) {
  return NotSupported("this build has no CUDA backend");
}
Result<uint64_t> CountPatternMismatchesOnDevice(const void* /*src*/, size_t /*size_bytes*/, uint64_t /*seed*/) {
  return NotSupported("this build has no CUDA backend");
}
#endif

Result<std::unique_ptr<Device>> CreateDevice(const Options& options) {
  EmulatedDeviceOptions emulated;
  emulated.capacity_bytes = options.device.budget_bytes;
  emulated.bandwidth_gbps = options.device.emulated_bandwidth_gbps;

  switch (options.device.backend) {
    case DeviceBackendKind::kEmulated:
      return CreateEmulatedDevice(emulated);
    case DeviceBackendKind::kCuda:
      return CreateCudaDevice(options.device.index, options.device.budget_bytes);
    case DeviceBackendKind::kAuto:
      if (CudaDeviceAvailable()) {
        return CreateCudaDevice(options.device.index, options.device.budget_bytes);
      }
      STRATA_LOG_INFO("no CUDA device available: using the emulated device (host memory, {})",
                      FormatSize(options.device.budget_bytes));
      return CreateEmulatedDevice(emulated);
  }
  return InvalidArgument("unknown device backend {}", static_cast<int>(options.device.backend));
}

}  // namespace strata
