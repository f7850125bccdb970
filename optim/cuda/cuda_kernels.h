// The optimizer update on a CUDA GPU: the fused pass of the CPU kernels
// (optim/cpu_kernels.h) over device-resident chunks -- read the gradient
// (fp32, bf16 or fp16), multiply it by grad_multiplier, update the fp32
// master weights and optimizer states, write the bf16/fp16 compute copy --
// and the gradients' sum of squares for the global norm.
//
// Algorithm (optim/cuda_kernels.cu): multi-tensor apply. One kernel launch
// takes up to 32 chunks in a by-value argument (each chunk's pointers, size
// and dtypes, and the index of its first block in the grid). A block finds its
// chunk by binary search over those indices and walks tiles of 1024 elements
// of it, 4 consecutive elements per thread: one 16-byte load or store per
// fp32 array and one 8-byte one per bf16/fp16 array when the chunk's arrays
// are aligned for it, element by element otherwise and in the last group of a
// chunk. More chunks take more launches. Every element is the reference's
// formula with each operation rounded on its own (__fmul_rn, __fadd_rn,
// __fdiv_rn, __fsqrt_rn: nothing is contracted into a fused multiply-add),
// so the kernel computes what the reference computes, operation by operation.
// The sum of squares widens each gradient to fp64, sums per thread, per block
// and per launch in a fixed order (no atomics): the same chunks give the same
// sum bit for bit.
//
// Reference and tolerance (tests/optim/cuda_kernels_test.cc): the scalar path
// optim/cpu_reference.cc (scalar::UpdateRange, scalar::SumSquaresRange).
// Master weights and states: |x - ref| <= 1e-6 + 1e-5 |ref|, NaN where the
// reference has NaN (the tolerance of the CPU vector versions; the kernel is
// expected to match bit for bit, and the test reports how many values do).
// 16-bit compute copies: exactly optim/half.h's round-to-nearest-even of the
// kernel's own fp32 result (bf16 NaN -> 0xFFFF, fp16 NaN -> sign | 0x7E00).
// Sum of squares: relative 1e-9.
//
// Device and streams: every pointer in a ChunkTensors is device memory of the
// calling thread's current CUDA device, and `cuda_stream` (a cudaStream_t;
// null for the legacy default stream) belongs to that device. The arrays
// must stay valid until the stream has run the work.
//
// Thread-safety: no state; calls from any threads on disjoint chunks are
// safe, on the same or different streams.
#pragma once

#include <span>

#include "optim/cpu/cpu_kernels.h"
#include "optim/optimizer.h"
#include "strata/status.h"

namespace strata::optim {

// Enqueues the update of every chunk on `cuda_stream` and returns without
// waiting for it. Chunks with n == 0 are skipped; an empty span does nothing.
// InvalidArgument, before anything is enqueued, when a chunk's arrays do not
// fit the kind (a null master or gradient, an Adam chunk without both
// states, a compute copy with param_dtype fp32 or bf16/fp16 without one);
// an SGD chunk with state[0] null is updated without momentum, as in the
// reference. DeviceError when a launch fails (the chunks before it may have
// been enqueued).
Status UpdateChunksCuda(const UpdateConstants& constants, std::span<const ChunkTensors> chunks, void* cuda_stream);

// The sum of squares of every chunk's gradients as stored (grad_dtype), in
// fp64: non-finite when any gradient is inf or NaN. Synchronizes: enqueues
// the reduction on `cuda_stream` after the work already there, then waits for
// the stream (Timeout after a minute). Reads only n, grad and grad_dtype.
// InvalidArgument for a null gradient with n > 0; DeviceError when CUDA
// fails. 0 for no elements.
Result<double> SumSquaresCuda(std::span<const ChunkTensors> chunks, void* cuda_stream);

}  // namespace strata::optim
