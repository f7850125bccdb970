// The CUDA runtime's boundary: the one macro that turns a cudaError_t into a
// Status, and the timed wait on asynchronous CUDA work. Included only by
// sources compiled with CUDA (the include check enforces it), so the rest of
// base stays free of CUDA headers. Header-only; stateless; thread-safe.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <thread>

#include "strata/status.h"

namespace strata::internal {

// DeviceError naming the failed call, CUDA's text for the error and where it
// was made. Also clears the runtime's "last error", which a non-sticky error
// (a failed allocation, a bad argument) would otherwise leave behind for the
// next cudaGetLastError() -- a kernel-launch check, say -- to misreport.
inline Status CudaErrorToStatus(cudaError_t error, const char* call, const char* file, int line) {
  static_cast<void>(cudaGetLastError());
  return DeviceError("{} failed: {} ({}) at {}:{}", call, cudaGetErrorString(error), cudaGetErrorName(error), file,
                     line);
}

// Calls `query` (cudaEventQuery or cudaStreamQuery on one handle) until it
// reports completion, an error, or `timeout_ms` has passed. Polling, because
// cudaEventSynchronize has no timeout and a hung copy must become an error,
// not a hang. Spins with yields first (copies often finish within
// microseconds), then sleeps with a growing pause so a long wait does not
// burn a core.
template <typename Query>
Status WaitForCudaWork(Query query, uint32_t timeout_ms, const char* what) {
  // 200 us: small against a copy worth waiting for (1 MiB takes ~40 us at
  // PCIe 5 rates, 256 MiB ~10 ms), large enough to leave the core idle.
  constexpr std::chrono::microseconds kMaxPause{200};
  constexpr int kSpinPolls = 64;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  std::chrono::microseconds pause{2};
  for (int poll = 0;; ++poll) {
    const cudaError_t error = query();
    if (error == cudaSuccess) return Status::Ok();
    if (error != cudaErrorNotReady) return CudaErrorToStatus(error, what, __FILE__, __LINE__);
    if (std::chrono::steady_clock::now() >= deadline) {
      return Timeout("{} not complete after the {} ms timeout (the work goes on)", what, timeout_ms);
    }
    if (poll < kSpinPolls) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(pause);
      pause = std::min(pause * 2, kMaxPause);
    }
  }
}

}  // namespace strata::internal

// Returns a DeviceError from the enclosing function when the CUDA runtime
// call `call` fails. The one conversion of CUDA errors.
#define STRATA_CUDA_RETURN_IF_ERROR(call)                                                          \
  do {                                                                                             \
    const cudaError_t strata_cuda_error_ = (call);                                                 \
    if (strata_cuda_error_ != cudaSuccess)                                                         \
      return ::strata::internal::CudaErrorToStatus(strata_cuda_error_, #call, __FILE__, __LINE__); \
  } while (0)
