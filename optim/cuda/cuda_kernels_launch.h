// The launch interface of the CUDA optimizer kernels (optim/cuda/cuda_kernels.cu),
// internal to optim/: the per-step constants and one chunk's device arrays in
// plain C++17 types.
//
// Why a second header: nvcc compiles .cu files as C++17 in this build (CMake
// 3.25 cannot pass it C++20), and the caller-facing types cannot be parsed as
// C++17 -- optim/optimizer.h takes std::span, strata/types.h declares
// operator<=>, src/base/half.h uses std::bit_cast. So callers use
// optim/cuda/cuda_kernels.h (C++20); optim/cuda/cuda_kernels.cc checks their chunks and
// translates UpdateConstants and ChunkTensors into the structs below, which
// the kernels take by value.
//
// No CUDA types: a stream travels as void* (a cudaStream_t). Pure functions
// over caller-owned device memory; thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>

#include "strata/status.h"

namespace strata::optim::cuda_internal {

// DType's three values, for the gradient and the compute copy.
enum class ElementType : uint8_t { kFloat32, kBFloat16, kFloat16 };

// UpdateConstants (optim/cpu/cpu_kernels.h), field for field; `sgd` stands for
// the kind (Adam and AdamW share the Adam path: their difference is in
// decay_l2 and decay_factor).
struct LaunchConstants {
  bool sgd = false;
  float grad_multiplier = 1.0f;
  float decay_l2 = 0.0f;
  float decay_factor = 1.0f;
  float one_minus_beta1 = 0, beta2 = 0, one_minus_beta2 = 0;
  float neg_step_size = 0;
  float sqrt_correction2 = 0;
  float eps = 0;
  float lr = 0, momentum = 0, one_minus_dampening = 1;
  bool nesterov = false;
  bool first_step = false;
};

// One chunk's device arrays, n elements each (ChunkTensors without DType).
struct LaunchChunk {
  uint64_t n = 0;
  float* master = nullptr;
  const void* grad = nullptr;
  float* state[2] = {nullptr, nullptr};  // Adam: exp_avg, exp_avg_sq; SGD: momentum_buffer or null
  void* param = nullptr;                 // the bf16/fp16 compute copy; null: none
  ElementType grad_type = ElementType::kFloat32;
  ElementType param_type = ElementType::kBFloat16;  // kBFloat16 or kFloat16 when param is set
  ElementType state_type = ElementType::kFloat32;   // kBFloat16: `state` points at bf16 arrays
  bool int8_blocks = false;  // Enqueue8bitUpdate: `state` points at blocks of 256 codes and their scale
};

// Enqueues the update of `chunks` on `cuda_stream` (null: the legacy default
// stream), in as many launches as the kernel's chunk table needs (32 chunks
// each); chunks with n == 0 are skipped. The arrays must fit the kind (cuda_kernels.cc checks).
// DeviceError when a launch fails.
Status EnqueueUpdate(const LaunchConstants& constants, const LaunchChunk* chunks, size_t num_chunks,
                     void* cuda_stream);

// Adam8bitConstants (optim/cpu/cpu_kernels.h), field for field, with the
// step's gradient multiplier: the update of 8-bit states and, under int8
// states, of the small tensors' fp32 ones (Note [8-bit states in chunks] in
// optim/cpu/cpu_kernels.cc).
struct Launch8bitConstants {
  bool decoupled = true;
  float grad_multiplier = 1.0f;
  float lr = 0, weight_decay = 0, lr_decay = 0;
  float one_minus_beta1 = 0, one_minus_beta2 = 0;
  float correction1 = 1, sqrt_correction2 = 1;
  float eps = 0;
};

// ThresholdEncoder's shape (optim/state_codec.h; cuda_kernels.cc checks them
// against it): each moment's code map has 256 values and its encoder
// kEncoderEntries entries, negative values' buckets after the positive ones'.
inline constexpr uint32_t kEncoderMinExponent = 97;
inline constexpr uint32_t kEncoderBucketBits = 7;
inline constexpr uint32_t kEncoderLowBits = 23 - kEncoderBucketBits;
inline constexpr uint32_t kEncoderBucketsPerSign = 31 << kEncoderBucketBits;
inline constexpr uint32_t kEncoderEntries = 2 * kEncoderBucketsPerSign;

// The two moments' code maps and encoders (the first moment's, the signed
// ones, first), in host memory: copied to each device once.
struct Host8bitTables {
  const float* maps[2] = {nullptr, nullptr};       // 256 each
  const uint32_t* entries[2] = {nullptr, nullptr};  // kEncoderEntries each
};

// Enqueues the 8-bit Adam update of `chunks`: those whose `int8_blocks` is
// set hold their moments in blocks (n a multiple of 256), the others fp32
// moments updated with the same arithmetic. DeviceError when CUDA fails.
Status Enqueue8bitUpdate(const Launch8bitConstants& constants, const Host8bitTables& tables,
                         const LaunchChunk* chunks, size_t num_chunks, void* cuda_stream);

// Enqueues a fill of `size_bytes` zero bytes at `device_dst` on `cuda_stream`.
// DeviceError when CUDA refuses it.
Status EnqueueZero(void* device_dst, size_t size_bytes, void* cuda_stream);

// The gradients' sum of squares in fp64; waits for `cuda_stream` (with a
// timeout). Only n, grad and grad_type of each chunk are read.
Result<double> SumSquares(const LaunchChunk* chunks, size_t num_chunks, void* cuda_stream);

}  // namespace strata::optim::cuda_internal
