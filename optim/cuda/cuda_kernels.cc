// The C++20 side of the CUDA optimizer kernels: checks the callers' chunks and
// translates them into the plain launch structs of
// optim/cuda/cuda_kernels_launch.h, which optim/cuda/cuda_kernels.cu (C++17) takes.
// No CUDA call here; every one is in the .cu.
#include "optim/cuda/cuda_kernels.h"

#include <vector>

#include "optim/cuda/cuda_kernels_launch.h"
#include "optim/state_codec.h"

namespace strata::optim {
namespace {

using cuda_internal::ElementType;
using cuda_internal::LaunchChunk;
using cuda_internal::LaunchConstants;

ElementType ElementTypeOf(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ElementType::kFloat32;
    case DType::kBFloat16: return ElementType::kBFloat16;
    case DType::kFloat16: return ElementType::kFloat16;
    case DType::kInt8Block: break;  // KnownDType refuses it first
  }
  return ElementType::kFloat32;
}

bool KnownDType(DType dtype) {
  return dtype == DType::kFloat32 || dtype == DType::kBFloat16 || dtype == DType::kFloat16;
}

// The gradient alone: all SumSquaresCuda reads.
Status CheckGrad(const ChunkTensors& t, size_t index) {
  if (t.n == 0) return Status::Ok();
  if (t.grad == nullptr) return InvalidArgument("cuda optimizer: chunk {} of {} elements has no gradient", index, t.n);
  if (!KnownDType(t.grad_dtype)) {
    return InvalidArgument("cuda optimizer: chunk {} has gradient dtype {}, not fp32, bf16 or fp16", index,
                           static_cast<int>(t.grad_dtype));
  }
  return Status::Ok();
}

// The rules of Optimizer::UpdateChunk's check (optim/optimizer.cc), with the
// states told by the kind: Adam needs both; SGD's momentum buffer is optional.
Status CheckChunk(OptimizerKind kind, const ChunkTensors& t, size_t index) {
  if (t.n == 0) return Status::Ok();
  STRATA_RETURN_IF_ERROR(CheckGrad(t, index));
  if (t.master == nullptr) {
    return InvalidArgument("cuda optimizer: chunk {} of {} elements has no master (fp32 weight) array", index, t.n);
  }
  if (!KnownDType(t.param_dtype) || (t.param_dtype == DType::kFloat32) != (t.param == nullptr)) {
    return InvalidArgument("cuda optimizer: chunk {} has param dtype {} with {} compute copy: fp32 parameters are "
                           "updated in place in `master` (param null); bf16/fp16 ones need the copy",
                           index, KnownDType(t.param_dtype) ? DTypeName(t.param_dtype) : "?",
                           t.param == nullptr ? "no" : "a");
  }
  if (t.state_dtype == DType::kInt8Block && (kind == OptimizerKind::kSgd || t.n % kInt8BlockElems != 0)) {
    return InvalidArgument("cuda optimizer: chunk {} of {} elements has int8 states: they are Adam's, in whole "
                           "blocks of {}",
                           index, t.n, kInt8BlockElems);
  }
  if (t.state_dtype != DType::kFloat32 && t.state_dtype != DType::kBFloat16 && t.state_dtype != DType::kInt8Block) {
    return InvalidArgument("cuda optimizer: chunk {} has states of dtype {}: they are fp32, bf16 or int8", index,
                           DTypeName(t.state_dtype));
  }
  if (kind != OptimizerKind::kSgd && (t.state[0] == nullptr || t.state[1] == nullptr)) {
    return InvalidArgument("cuda optimizer: {} keeps 2 state arrays per chunk; chunk {} has no state[{}]",
                           OptimizerKindName(kind), index, t.state[0] == nullptr ? 0 : 1);
  }
  return Status::Ok();
}

LaunchChunk ToLaunchChunk(const ChunkTensors& t) {
  LaunchChunk chunk;
  chunk.n = t.n;
  chunk.master = t.master;
  chunk.grad = t.grad;
  chunk.state[0] = t.state[0];
  chunk.state[1] = t.state[1];
  chunk.param = t.param;
  chunk.grad_type = ElementTypeOf(t.grad_dtype);
  chunk.param_type = t.param_dtype == DType::kFloat16 ? ElementType::kFloat16 : ElementType::kBFloat16;
  chunk.state_type = t.state_dtype == DType::kBFloat16 ? ElementType::kBFloat16 : ElementType::kFloat32;
  chunk.int8_blocks = t.state_dtype == DType::kInt8Block;
  return chunk;
}

cuda_internal::Launch8bitConstants ToLaunch8bitConstants(const UpdateConstants& c) {
  const Adam8bitConstants& a = c.adam8bit;
  return {.decoupled = a.decoupled, .grad_multiplier = c.grad_multiplier, .lr = a.lr,
          .weight_decay = a.weight_decay, .lr_decay = a.lr_decay, .one_minus_beta1 = a.one_minus_beta1,
          .one_minus_beta2 = a.one_minus_beta2, .correction1 = a.correction1,
          .sqrt_correction2 = a.sqrt_correction2, .eps = a.eps};
}

// The code maps and encoders the 8-bit kernel takes to the device.
cuda_internal::Host8bitTables HostTables() {
  static_assert(cuda_internal::kEncoderMinExponent == ThresholdEncoder::kMinExponent &&
                cuda_internal::kEncoderBucketBits == ThresholdEncoder::kBucketBits &&
                cuda_internal::kEncoderEntries == 2 * ThresholdEncoder::kBucketsPerSign);
  const StateTables &first = TablesOf(true), &second = TablesOf(false);
  return {.maps = {first.map, second.map}, .entries = {first.entry, second.entry}};
}

LaunchConstants ToLaunchConstants(const UpdateConstants& c) {
  LaunchConstants launch;
  launch.sgd = c.kind == OptimizerKind::kSgd;
  launch.grad_multiplier = c.grad_multiplier;
  launch.decay_l2 = c.decay_l2;
  launch.decay_factor = c.decay_factor;
  launch.one_minus_beta1 = c.one_minus_beta1;
  launch.beta2 = c.beta2;
  launch.one_minus_beta2 = c.one_minus_beta2;
  launch.neg_step_size = c.neg_step_size;
  launch.sqrt_correction2 = c.sqrt_correction2;
  launch.eps = c.eps;
  launch.lr = c.lr;
  launch.momentum = c.momentum;
  launch.one_minus_dampening = c.one_minus_dampening;
  launch.nesterov = c.nesterov;
  launch.first_step = c.first_step;
  return launch;
}

}  // namespace

Status UpdateChunksCuda(const UpdateConstants& constants, std::span<const ChunkTensors> chunks, void* cuda_stream) {
  if (constants.kind != OptimizerKind::kAdamW && constants.kind != OptimizerKind::kAdam &&
      constants.kind != OptimizerKind::kSgd) {
    return InvalidArgument("cuda optimizer: unknown optimizer kind {}", static_cast<int>(constants.kind));
  }
  // Every chunk is checked before any is enqueued, so a bad one changes nothing.
  // The 8-bit kernel takes 8-bit states, and under int8 states the fp32 ones too (torchao's arithmetic).
  std::vector<LaunchChunk> launch_chunks, eight_bit;
  for (size_t i = 0; i < chunks.size(); ++i) {
    STRATA_RETURN_IF_ERROR(CheckChunk(constants.kind, chunks[i], i));
    if (chunks[i].n == 0) continue;
    const bool adam8bit = chunks[i].state_dtype == DType::kInt8Block ||
                          (constants.adam8bit_arithmetic && chunks[i].state_dtype == DType::kFloat32);
    (adam8bit ? eight_bit : launch_chunks).push_back(ToLaunchChunk(chunks[i]));
  }
  if (!eight_bit.empty()) {
    STRATA_RETURN_IF_ERROR(cuda_internal::Enqueue8bitUpdate(ToLaunch8bitConstants(constants), HostTables(),
                                                            eight_bit.data(), eight_bit.size(), cuda_stream));
  }
  if (launch_chunks.empty()) return Status::Ok();
  return cuda_internal::EnqueueUpdate(ToLaunchConstants(constants), launch_chunks.data(), launch_chunks.size(),
                                      cuda_stream);
}

Status ZeroCuda(void* device_dst, size_t size_bytes, void* cuda_stream) {
  if (size_bytes == 0) return Status::Ok();
  return cuda_internal::EnqueueZero(device_dst, size_bytes, cuda_stream);
}

Result<double> SumSquaresCuda(std::span<const ChunkTensors> chunks, void* cuda_stream) {
  std::vector<LaunchChunk> launch_chunks;
  launch_chunks.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    STRATA_RETURN_IF_ERROR(CheckGrad(chunks[i], i));
    if (chunks[i].n > 0) launch_chunks.push_back(ToLaunchChunk(chunks[i]));
  }
  if (launch_chunks.empty()) return 0.0;
  return cuda_internal::SumSquares(launch_chunks.data(), launch_chunks.size(), cuda_stream);
}

}  // namespace strata::optim
