// The optimizer update on a CUDA GPU over device-resident chunks (the fused
// pass of optim/cpu/cpu_kernels.h), and the gradients' sum of squares.
// Algorithm, reference and tolerance: optim/cuda/cuda_kernels.cu.
//
// Every pointer is device memory of the calling thread's current device, and
// `cuda_stream` (a cudaStream_t; null: the legacy default stream) belongs to
// it; the arrays stay valid until the stream has run the work. No state:
// calls from any threads on disjoint chunks are safe, on any streams.
#pragma once

#include <span>

#include "optim/cpu/cpu_kernels.h"
#include "optim/optimizer.h"
#include "strata/status.h"

namespace strata::optim {

// Enqueues the update of every chunk (n == 0: skipped) without waiting.
// InvalidArgument, before anything is enqueued, for arrays that do not fit the
// kind (SGD with state[0] null: no momentum); DeviceError when a launch fails.
Status UpdateChunksCuda(const UpdateConstants& constants, std::span<const ChunkTensors> chunks, void* cuda_stream);

// Enqueues zeroing `size_bytes` of device memory at `device_dst` (a grad
// chunk after its update) on `cuda_stream`. DeviceError when CUDA refuses it.
Status ZeroCuda(void* device_dst, size_t size_bytes, void* cuda_stream);

// The gradients' sum of squares as stored, in fp64 (non-finite when one is);
// waits for `cuda_stream` (Timeout after a minute). InvalidArgument for a null
// gradient with n > 0; DeviceError when CUDA fails.
Result<double> SumSquaresCuda(std::span<const ChunkTensors> chunks, void* cuda_stream);

}  // namespace strata::optim
