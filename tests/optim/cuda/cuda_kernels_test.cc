// Tests of the CUDA optimizer kernels (optim/cuda_kernels.{h,cc,cu}) against
// the scalar reference (optim/cpu_reference.cc) on fresh random data, and a
// benchmark of the AdamW update against a device-to-device copy in the same
// run. Tolerance (optim/cuda_kernels.h): master and states
// |x - ref| <= 1e-6 + 1e-5 |ref|, NaN where the reference has NaN; 16-bit
// compute copies bit for bit optim/half.h's rounding of the GPU's own master;
// sums of squares relative 1e-9.
//
// Tests that run kernels skip when no CUDA device is visible; the checks of
// the arguments, and the errors of a machine without a device, run anywhere.
#include "optim/cuda/cuda_kernels.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "optim/optimizer.h"
#include "optim/state_codec.h"
#include "src/base/half.h"
#include "tests/optim/optim_test_util.h"
#include "strata/device.h"

// Fails the test (fatally) when a CUDA runtime call fails.
#define ASSERT_CUDA_OK(call)                                                                       \
  do {                                                                                             \
    const cudaError_t strata_test_cuda_error_ = (call);                                            \
    ASSERT_EQ(strata_test_cuda_error_, cudaSuccess) << #call << ": "                               \
                                                    << cudaGetErrorString(strata_test_cuda_error_); \
  } while (0)

namespace strata::optim {
namespace {

using testing::Bf16States;
using testing::Case;
using testing::Cases;
using testing::ChunkArrays;
using testing::ExpectClose;
using testing::ExpectParamIsRoundedMaster;
using testing::RandomChunk;

using testing::kAllDTypes;
// One call updates chunks of all these sizes: a single element, a tail
// shorter than a group of 4, whole tiles plus tails, and more than 64 tiles.
constexpr size_t kSizes[] = {1, 7, 1000, 4099, 65537};

// --- device memory ------------------------------------------------------------

struct CudaFree {
  void operator()(void* data) const { static_cast<void>(cudaFree(data)); }
};
using DeviceMemory = std::unique_ptr<void, CudaFree>;

struct StreamDeleter {
  void operator()(cudaStream_t stream) const { static_cast<void>(cudaStreamDestroy(stream)); }
};
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;

struct EventDeleter {
  void operator()(cudaEvent_t event) const { static_cast<void>(cudaEventDestroy(event)); }
};
using UniqueEvent = std::unique_ptr<CUevent_st, EventDeleter>;

void CreateStream(UniqueStream* stream) {
  cudaStream_t raw = nullptr;
  ASSERT_CUDA_OK(cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
  stream->reset(raw);
}

void CreateEvent(UniqueEvent* event) {
  cudaEvent_t raw = nullptr;
  ASSERT_CUDA_OK(cudaEventCreate(&raw));
  event->reset(raw);
}

void Allocate(size_t size_bytes, DeviceMemory* memory) {
  void* raw = nullptr;
  ASSERT_CUDA_OK(cudaMalloc(&raw, size_bytes));
  memory->reset(raw);
}

// A chunk's arrays on the device and the ChunkTensors that points at them.
struct DeviceChunk {
  std::vector<DeviceMemory> memory;
  ChunkTensors view;
};

// A device copy of the n elements at `host` (null stays null), `shift`
// elements past the start of its own cudaMalloc block (256-byte aligned):
// shift 0 lets the kernel move whole groups of 4 elements, any shift that is
// not a multiple of 4 sends it element by element.
template <typename T>
void CopyArrayToDevice(const T* host, size_t n, size_t shift, DeviceChunk* chunk, T** device) {
  *device = nullptr;
  if (host == nullptr) return;
  DeviceMemory memory;
  ASSERT_NO_FATAL_FAILURE(Allocate((n + shift) * sizeof(T), &memory));
  *device = static_cast<T*>(memory.get()) + shift;
  chunk->memory.push_back(std::move(memory));
  ASSERT_CUDA_OK(cudaMemcpy(*device, host, n * sizeof(T), cudaMemcpyHostToDevice));
}

// Copies the arrays that `host` points at to the device.
void Upload(const ChunkTensors& host, size_t shift, DeviceChunk* chunk) {
  chunk->view = ChunkTensors{.n = host.n, .param_dtype = host.param_dtype, .grad_dtype = host.grad_dtype};
  if (host.n == 0) return;  // nothing to copy; every pointer stays null
  const size_t n = host.n;
  ChunkTensors& view = chunk->view;
  ASSERT_NO_FATAL_FAILURE(CopyArrayToDevice<float>(host.master, n, shift, chunk, &view.master));
  for (int s = 0; s < 2; ++s) {
    ASSERT_NO_FATAL_FAILURE(CopyArrayToDevice<float>(host.state[s], n, shift, chunk, &view.state[s]));
  }
  if (host.grad_dtype == DType::kFloat32) {
    float* grad = nullptr;
    ASSERT_NO_FATAL_FAILURE(CopyArrayToDevice(static_cast<const float*>(host.grad), n, shift, chunk, &grad));
    view.grad = grad;
  } else {
    uint16_t* grad = nullptr;
    ASSERT_NO_FATAL_FAILURE(CopyArrayToDevice(static_cast<const uint16_t*>(host.grad), n, shift, chunk, &grad));
    view.grad = grad;
  }
  uint16_t* param = nullptr;
  ASSERT_NO_FATAL_FAILURE(CopyArrayToDevice(static_cast<const uint16_t*>(host.param), n, shift, chunk, &param));
  view.param = param;
}

// Copies what an update writes (master, states, compute copy) back to `host`.
void Download(const DeviceChunk& chunk, const ChunkTensors& host) {
  const ChunkTensors& device = chunk.view;
  if (host.n == 0) return;
  const size_t n = host.n;
  ASSERT_CUDA_OK(cudaMemcpy(host.master, device.master, n * sizeof(float), cudaMemcpyDeviceToHost));
  for (int s = 0; s < 2; ++s) {
    if (host.state[s] == nullptr) continue;
    ASSERT_CUDA_OK(cudaMemcpy(host.state[s], device.state[s], n * sizeof(float), cudaMemcpyDeviceToHost));
  }
  if (host.param != nullptr) {
    ASSERT_CUDA_OK(cudaMemcpy(host.param, device.param, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
  }
}

// Stores `value` as gradient i of a device chunk, in the chunk's dtype.
void SetDeviceGrad(const ChunkTensors& device, size_t i, float value) {
  if (device.grad_dtype == DType::kFloat32) {
    float* grad = static_cast<float*>(const_cast<void*>(device.grad));
    ASSERT_CUDA_OK(cudaMemcpy(grad + i, &value, sizeof(float), cudaMemcpyHostToDevice));
  } else {
    const uint16_t bits = device.grad_dtype == DType::kBFloat16 ? Bf16FromFloat(value) : Fp16FromFloat(value);
    uint16_t* grad = static_cast<uint16_t*>(const_cast<void*>(device.grad));
    ASSERT_CUDA_OK(cudaMemcpy(grad + i, &bits, sizeof(uint16_t), cudaMemcpyHostToDevice));
  }
}

// --- update against the reference ---------------------------------------------

// `a`'s arrays with only the states `config` keeps: SGD without momentum
// has none, so the kernels take the path without a buffer.
ChunkTensors ViewFor(const OptimizerConfig& config, ChunkArrays& a) {
  ChunkTensors t = a.view();
  if (t.n == 0) return ChunkTensors{.param_dtype = t.param_dtype, .grad_dtype = t.grad_dtype};
  for (int s = NumStates(config); s < 2; ++s) t.state[s] = nullptr;
  return t;
}

// Runs UpdateChunksCuda once over all `chunks` (each copied to the device with
// the shift `shift_of(index)`) and copies the results back into them.
template <typename ShiftOf>
void UpdateOnGpu(const UpdateConstants& constants, const OptimizerConfig& config, cudaStream_t stream,
                 ShiftOf shift_of, std::vector<ChunkArrays>* chunks) {
  std::vector<DeviceChunk> device(chunks->size());
  std::vector<ChunkTensors> views;
  for (size_t i = 0; i < chunks->size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(Upload(ViewFor(config, (*chunks)[i]), shift_of(i), &device[i]));
    views.push_back(device[i].view);
  }
  ASSERT_OK(UpdateChunksCuda(constants, views, stream));
  ASSERT_CUDA_OK(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < chunks->size(); ++i) {
    ASSERT_NO_FATAL_FAILURE(Download(device[i], ViewFor(config, (*chunks)[i])));
  }
}

// How many fp32 results equal the reference's bit for bit. The kernel rounds
// every operation as the reference does, so all are expected to; reported
// for a person to read, not asserted (the contract is the tolerance).
struct BitIdentical {
  size_t same = 0;
  size_t compared = 0;
  void Count(const std::vector<float>& got, const std::vector<float>& ref) {
    for (size_t i = 0; i < ref.size(); ++i) {
      if (std::isnan(ref[i])) continue;  // NaN payloads differ between CPU and GPU; ExpectClose checks NaN-ness
      ++compared;
      same += std::bit_cast<uint32_t>(got[i]) == std::bit_cast<uint32_t>(ref[i]);
    }
  }
  void Print(const char* test) const {
    std::printf("[ bits     ] %s: %zu of %zu fp32 results bit-identical to the reference\n", test, same, compared);
  }
};

// The GPU's chunk against the reference's, after the same update.
void ExpectMatchesReference(const ChunkArrays& got, const ChunkArrays& ref, BitIdentical* identical) {
  ASSERT_NO_FATAL_FAILURE(ExpectClose(got.master, ref.master, "master"));
  ASSERT_NO_FATAL_FAILURE(ExpectClose(got.state0, ref.state0, "state0"));
  ASSERT_NO_FATAL_FAILURE(ExpectClose(got.state1, ref.state1, "state1"));
  ASSERT_NO_FATAL_FAILURE(ExpectParamIsRoundedMaster(got));
  identical->Count(got.master, ref.master);
  identical->Count(got.state0, ref.state0);
  identical->Count(got.state1, ref.state1);
}

// Updates `start` with the reference and on the GPU, and compares.
template <typename ShiftOf>
void CompareWithReference(const Case& c, const std::vector<ChunkArrays>& start, cudaStream_t stream,
                          ShiftOf shift_of, BitIdentical* identical) {
  const UpdateConstants constants = MakeUpdateConstants(c.config, c.step, c.grad_multiplier);
  std::vector<ChunkArrays> ref = start;
  std::vector<ChunkArrays> got = start;
  for (ChunkArrays& a : ref) scalar::UpdateRange(constants, ViewFor(c.config, a), 0, a.master.size());
  ASSERT_NO_FATAL_FAILURE(UpdateOnGpu(constants, c.config, stream, shift_of, &got));
  for (size_t i = 0; i < ref.size(); ++i) {
    SCOPED_TRACE(fmt::format("chunk {} of {} elements, shift {}", i, ref[i].master.size(), shift_of(i)));
    ASSERT_NO_FATAL_FAILURE(ExpectMatchesReference(got[i], ref[i], identical));
  }
}

TEST(CudaKernelsTest, UpdateMatchesTheScalarReferenceForEveryKindAndDtype) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  // Odd chunks one element off alignment: the element-by-element path.
  const auto shift_of = [](size_t i) -> size_t { return i % 2; };
  BitIdentical identical;
  for (const Case& c : Cases()) {
    for (DType grad_dtype : kAllDTypes) {
      for (DType param_dtype : kAllDTypes) {
        SCOPED_TRACE(fmt::format("{} grad {} param {}", c.name, DTypeName(grad_dtype), DTypeName(param_dtype)));
        std::vector<ChunkArrays> start;
        for (size_t n : kSizes) start.push_back(RandomChunk(n, grad_dtype, param_dtype, rng));
        ASSERT_NO_FATAL_FAILURE(CompareWithReference(c, start, stream.get(), shift_of, &identical));
      }
    }
  }
  identical.Print("every kind and dtype");
}

// What train_step queues for a group updated on a GPU (Note [Updates on the
// device] in offload/training/train_step.cc): Optimizer::UpdateChunkOnDevice,
// then ZeroOnDevice of the gradient, against Optimizer::UpdateChunk on the host.
TEST(CudaKernelsTest, TheOptimizersUpdateOnTheDeviceIsItsHostUpdateBitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  for (const Case& c : Cases()) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Optimizer> optimizer, Optimizer::Create(c.config));
    ASSERT_OK_AND_ASSIGN(const StepPlan plan, optimizer->PlanStep(GradStats{.sum_squares = 2.0}));
    for (DType grad_dtype : kAllDTypes) {
      for (DType param_dtype : kAllDTypes) {
        SCOPED_TRACE(fmt::format("{} grad {} param {}", c.name, DTypeName(grad_dtype), DTypeName(param_dtype)));
        ChunkArrays host = RandomChunk(4099, grad_dtype, param_dtype, rng);
        ChunkArrays from_gpu = host;
        DeviceChunk device;
        ASSERT_NO_FATAL_FAILURE(Upload(ViewFor(c.config, from_gpu), 0, &device));
        ASSERT_OK(optimizer->UpdateChunk(plan, ViewFor(c.config, host)));
        ASSERT_OK(optimizer->UpdateChunkOnDevice(plan, device.view, 0, stream.get()));
        const size_t grad_bytes = host.master.size() * DTypeSizeBytes(grad_dtype);
        ASSERT_OK(Optimizer::ZeroOnDevice(const_cast<void*>(device.view.grad), grad_bytes, stream.get()));
        ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));
        ASSERT_NO_FATAL_FAILURE(Download(device, ViewFor(c.config, from_gpu)));
        EXPECT_EQ(std::memcmp(from_gpu.master.data(), host.master.data(), host.master.size() * sizeof(float)), 0);
        for (int s = 0; s < NumStates(c.config); ++s) {
          const std::vector<float>& got = s == 0 ? from_gpu.state0 : from_gpu.state1;
          const std::vector<float>& want = s == 0 ? host.state0 : host.state1;
          EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)), 0) << "state " << s;
        }
        if (param_dtype != DType::kFloat32) {
          EXPECT_EQ(from_gpu.param16, host.param16);
        }
        std::vector<std::byte> grad(grad_bytes, std::byte{1});
        ASSERT_CUDA_OK(cudaMemcpy(grad.data(), device.view.grad, grad_bytes, cudaMemcpyDeviceToHost));
        EXPECT_EQ(std::count(grad.begin(), grad.end(), std::byte{0}), static_cast<std::ptrdiff_t>(grad_bytes));
      }
    }
  }
}

// bf16 moments (Note [bf16 states]): the device's update of a chunk is the
// host's bit for bit, whole groups and element by element.
TEST(CudaKernelsTest, Bf16StatesOnTheDeviceAreTheHostUpdateBitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  for (const Case& c : Cases()) {
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Optimizer> optimizer, Optimizer::Create(c.config));
    ASSERT_OK_AND_ASSIGN(const StepPlan plan, optimizer->PlanStep(GradStats{.sum_squares = 2.0}));
    for (DType dtype : kAllDTypes) {
      for (size_t shift : {0, 1}) {
        SCOPED_TRACE(fmt::format("{} dtype {} shift {}", c.name, DTypeName(dtype), shift));
        ChunkArrays host = RandomChunk(4099, dtype, dtype, rng);
        Bf16States states(host);
        ChunkArrays from_gpu = host;
        std::vector<uint16_t> gpu_states[2] = {states.state0, states.state1};
        ChunkTensors on_host = states.view(host);
        if (NumStates(c.config) == 0) on_host.state[0] = on_host.state[1] = nullptr;
        DeviceChunk device;
        ASSERT_NO_FATAL_FAILURE(Upload(ViewFor(c.config, from_gpu), shift, &device));
        for (int s = 0; s < NumStates(c.config); ++s) {
          uint16_t* moment = nullptr;
          ASSERT_NO_FATAL_FAILURE(CopyArrayToDevice<uint16_t>(gpu_states[s].data(), 4099, shift, &device, &moment));
          device.view.state[s] = reinterpret_cast<float*>(moment);
        }
        device.view.state_dtype = DType::kBFloat16;
        ASSERT_OK(optimizer->UpdateChunk(plan, on_host));
        ASSERT_OK(optimizer->UpdateChunkOnDevice(plan, device.view, 0, stream.get()));
        ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));
        ASSERT_CUDA_OK(cudaMemcpy(from_gpu.master.data(), device.view.master, 4099 * sizeof(float),
                                  cudaMemcpyDeviceToHost));
        EXPECT_EQ(std::memcmp(from_gpu.master.data(), host.master.data(), 4099 * sizeof(float)), 0);
        for (int s = 0; s < NumStates(c.config); ++s) {
          ASSERT_CUDA_OK(cudaMemcpy(gpu_states[s].data(), device.view.state[s], 4099 * sizeof(uint16_t),
                                    cudaMemcpyDeviceToHost));
          EXPECT_EQ(gpu_states[s], s == 0 ? states.state0 : states.state1) << "state " << s;
        }
      }
    }
  }
}

// Random 8-bit moments of n elements (whole blocks) as a chunk holds them:
// each block's codes, then its scale (Note [8-bit states in chunks]).
std::vector<uint8_t> RandomInt8Blocks(size_t n, bool is_signed, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1e-3f);
  std::vector<uint8_t> blocks(ChunkBytes(DType::kInt8Block, n));
  std::vector<float> values(kStateBlockElems);
  for (size_t b = 0; b < n / kStateBlockElems; ++b) {
    for (float& x : values) x = is_signed ? normal(rng) : normal(rng) * normal(rng);
    float scale = 0;
    QuantizeBlocks(values.data(), kStateBlockElems, is_signed, blocks.data() + b * kInt8BlockBytes, &scale);
    std::memcpy(blocks.data() + b * kInt8BlockBytes + kStateBlockElems, &scale, sizeof(scale));
  }
  return blocks;
}

// Int8 states: the device's update of a chunk of 8-bit moments is the
// host's bit for bit (weights, compute copy, codes and scales), and under
// int8 states so is that of a small tensors' chunk of fp32 moments (torchao's
// arithmetic); with and without a clip, fp32 and bf16 gradients.
TEST(CudaKernelsTest, Int8StatesOnTheDeviceAreTheHostUpdateBitForBit) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  for (double clip : {0.0, 0.5}) {
    const OptimizerConfig config{.lr = 1e-3, .weight_decay = 0.01, .max_grad_norm = clip, .int8_states = true};
    ASSERT_OK_AND_ASSIGN(std::unique_ptr<Optimizer> optimizer, Optimizer::Create(config));
    ASSERT_OK_AND_ASSIGN(const StepPlan plan, optimizer->PlanStep(GradStats{.sum_squares = 2.0}));
    for (DType dtype : {DType::kFloat32, DType::kBFloat16}) {
      for (const bool blocks : {true, false}) {
        SCOPED_TRACE(fmt::format("clip {} dtype {} {}", clip, DTypeName(dtype), blocks ? "int8" : "fp32 moments"));
        const size_t n = blocks ? 40 * kStateBlockElems : 1000;
        ChunkArrays host = RandomChunk(n, dtype, dtype, rng);
        ChunkArrays from_gpu = host;
        std::vector<uint8_t> moments[2];
        ChunkTensors on_host = host.view();
        if (blocks) {
          for (int s = 0; s < 2; ++s) {
            moments[s] = RandomInt8Blocks(n, s == 0, rng);
            on_host.state[s] = reinterpret_cast<float*>(moments[s].data());
          }
          on_host.state_dtype = DType::kInt8Block;
        }
        DeviceChunk device;
        ASSERT_NO_FATAL_FAILURE(Upload(ViewFor(config, from_gpu), 0, &device));
        if (blocks) {
          for (int s = 0; s < 2; ++s) {
            uint8_t* moment = nullptr;
            ASSERT_NO_FATAL_FAILURE(
                CopyArrayToDevice<uint8_t>(moments[s].data(), moments[s].size(), 0, &device, &moment));
            device.view.state[s] = reinterpret_cast<float*>(moment);
          }
          device.view.state_dtype = DType::kInt8Block;
        }
        ASSERT_OK(optimizer->UpdateChunk(plan, on_host));
        ASSERT_OK(optimizer->UpdateChunkOnDevice(plan, device.view, 0, stream.get()));
        ASSERT_CUDA_OK(cudaStreamSynchronize(stream.get()));
        ASSERT_CUDA_OK(
            cudaMemcpy(from_gpu.master.data(), device.view.master, n * sizeof(float), cudaMemcpyDeviceToHost));
        EXPECT_EQ(std::memcmp(from_gpu.master.data(), host.master.data(), n * sizeof(float)), 0);
        if (dtype != DType::kFloat32) {
          ASSERT_CUDA_OK(cudaMemcpy(from_gpu.param16.data(), device.view.param, n * sizeof(uint16_t),
                                    cudaMemcpyDeviceToHost));
          EXPECT_EQ(from_gpu.param16, host.param16);
        }
        for (int s = 0; s < 2; ++s) {
          if (blocks) {
            std::vector<uint8_t> back(moments[s].size());
            ASSERT_CUDA_OK(cudaMemcpy(back.data(), device.view.state[s], back.size(), cudaMemcpyDeviceToHost));
            EXPECT_EQ(back, moments[s]) << "state " << s;
          } else {
            std::vector<float> back(n);
            ASSERT_CUDA_OK(cudaMemcpy(back.data(), device.view.state[s], n * sizeof(float), cudaMemcpyDeviceToHost));
            EXPECT_EQ(std::memcmp(back.data(), s == 0 ? host.state0.data() : host.state1.data(), n * sizeof(float)),
                      0)
                << "state " << s;
          }
        }
      }
    }
  }
}

TEST(CudaKernelsTest, NanAndInfGradientsPropagateLikeTheReference) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  const auto shift_of = [](size_t i) -> size_t { return i % 2; };
  BitIdentical identical;
  for (DType grad_dtype : kAllDTypes) {
    for (DType param_dtype : {DType::kBFloat16, DType::kFloat16}) {
      std::vector<ChunkArrays> start;
      for (size_t n : {size_t{67}, size_t{4099}}) {
        ChunkArrays a = RandomChunk(n, grad_dtype, param_dtype, rng);
        a.set_grad(3, std::numeric_limits<float>::quiet_NaN());
        a.set_grad(20, std::numeric_limits<float>::infinity());
        a.set_grad(n - 1, -std::numeric_limits<float>::infinity());  // in the chunk's last, partial group
        start.push_back(std::move(a));
      }
      for (const Case& c : Cases()) {
        SCOPED_TRACE(fmt::format("{} grad {} param {}", c.name, DTypeName(grad_dtype), DTypeName(param_dtype)));
        ASSERT_NO_FATAL_FAILURE(CompareWithReference(c, start, stream.get(), shift_of, &identical));
      }
    }
  }
  identical.Print("inf and NaN gradients");
}

// More chunks than one launch takes, each with its own dtypes and alignment,
// and empty chunks (all pointers null) among them.
TEST(CudaKernelsTest, ManyChunksOfMixedDtypesInOneCall) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  std::uniform_int_distribution<size_t> size(1, 5000);
  std::vector<ChunkArrays> start;
  for (size_t i = 0; i < 75; ++i) {
    const size_t n = i % 10 == 9 ? 0 : size(rng);
    start.push_back(RandomChunk(n, kAllDTypes[i % 3], kAllDTypes[(i / 3) % 3], rng));
  }
  // Shifts 0..3 elements: 16-byte aligned, and three ways not.
  const auto shift_of = [](size_t i) -> size_t { return i % 4; };
  BitIdentical identical;
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.name);
    ASSERT_NO_FATAL_FAILURE(CompareWithReference(c, start, stream.get(), shift_of, &identical));
  }
  identical.Print("75 mixed chunks");
}

// A chunk with more tiles than the grid gives it (8192 blocks of 1024
// elements for the update, 1024 for the sum of squares): its blocks loop.
TEST(CudaKernelsTest, ChunksLargerThanTheirGridLoopOverTheirTiles) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  const size_t n = (size_t{8} << 20) + 4099;
  const std::vector<ChunkArrays> start = {RandomChunk(n, DType::kBFloat16, DType::kBFloat16, rng)};
  BitIdentical identical;
  ASSERT_NO_FATAL_FAILURE(
      CompareWithReference(Cases()[0], start, stream.get(), [](size_t) -> size_t { return 0; }, &identical));
  identical.Print("a chunk of 8 Mi + 4099 elements");

  DeviceChunk device;
  ChunkArrays host = start[0];
  ASSERT_NO_FATAL_FAILURE(Upload(host.view(), 0, &device));
  const double ref = scalar::SumSquaresRange(host.view().grad, DType::kBFloat16, 0, n);
  ASSERT_OK_AND_ASSIGN(const double sum, SumSquaresCuda(std::span(&device.view, 1), stream.get()));
  EXPECT_NEAR(sum, ref, 1e-9 * ref);
}

// --- arguments and errors -------------------------------------------------------

// No CUDA call is made for these, so they run with or without a device.
TEST(CudaKernelsTest, NothingToDoIsOk) {
  const UpdateConstants constants = MakeUpdateConstants({}, 1, 1.0f);
  EXPECT_OK(UpdateChunksCuda(constants, {}, nullptr));
  const std::vector<ChunkTensors> empty(3);  // n == 0, every pointer null
  EXPECT_OK(UpdateChunksCuda(constants, empty, nullptr));
  ASSERT_OK_AND_ASSIGN(double sum, SumSquaresCuda(empty, nullptr));
  EXPECT_EQ(sum, 0.0);
}

TEST(CudaKernelsTest, ChunksThatDoNotFitAreRejectedBeforeAnythingIsEnqueued) {
  // Host arrays: nothing may touch them, since nothing is enqueued when any
  // chunk of the call is wrong. The good chunk comes first.
  std::mt19937_64 rng(::strata::testing::TestSeed());
  ChunkArrays good = RandomChunk(5, DType::kFloat32, DType::kBFloat16, rng);
  ChunkArrays bad = RandomChunk(5, DType::kBFloat16, DType::kBFloat16, rng);
  const ChunkArrays good_before = good;
  const UpdateConstants adamw = MakeUpdateConstants({.kind = OptimizerKind::kAdamW}, 1, 1.0f);
  const auto expect_rejected = [&](const ChunkTensors& wrong, const UpdateConstants& constants, const char* says) {
    const std::vector<ChunkTensors> chunks = {good.view(), wrong};
    const Status status = UpdateChunksCuda(constants, chunks, nullptr);
    EXPECT_EQ(status.code(), StatusCode::kInvalidArgument) << status.ToString();
    EXPECT_NE(status.message().find("chunk 1"), std::string::npos) << status.message();
    EXPECT_NE(status.message().find(says), std::string::npos) << status.message();
  };
  ChunkTensors no_state = bad.view();
  no_state.state[1] = nullptr;
  expect_rejected(no_state, adamw, "state[1]");
  ChunkTensors no_master = bad.view();
  no_master.master = nullptr;
  expect_rejected(no_master, adamw, "master");
  ChunkTensors no_grad = bad.view();
  no_grad.grad = nullptr;
  expect_rejected(no_grad, adamw, "no gradient");
  ChunkTensors fp32_with_copy = bad.view();
  fp32_with_copy.param_dtype = DType::kFloat32;
  expect_rejected(fp32_with_copy, adamw, "param dtype fp32");
  ChunkTensors bf16_without_copy = bad.view();
  bf16_without_copy.param = nullptr;
  expect_rejected(bf16_without_copy, adamw, "param dtype bf16");
  // Adam needs both states (SGD none: a null state[0] means no momentum).
  ChunkTensors no_states = bad.view();
  no_states.state[0] = no_states.state[1] = nullptr;
  expect_rejected(no_states, adamw, "state[0]");
  ChunkTensors fp16_states = bad.view();  // states are fp32 or bf16
  fp16_states.state_dtype = DType::kFloat16;
  expect_rejected(fp16_states, adamw, "states of dtype fp16");

  Result<double> sum = SumSquaresCuda(std::vector<ChunkTensors>{good.view(), no_grad}, nullptr);
  EXPECT_EQ(sum.status().code(), StatusCode::kInvalidArgument) << sum.status().ToString();

  EXPECT_EQ(good.master, good_before.master);
  EXPECT_EQ(good.state0, good_before.state0);
  EXPECT_EQ(good.param16, good_before.param16);
}

// The CUDA runtime's errors arrive as DeviceError naming the failed call.
// Forced by running where there is no device (a CI machine without a GPU).
TEST(CudaKernelsTest, WithoutADeviceTheKernelsReportDeviceErrors) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a CUDA device is present; this checks the error path without one";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  ChunkArrays host = RandomChunk(100, DType::kBFloat16, DType::kBFloat16, rng);
  const std::vector<ChunkTensors> chunks = {host.view()};
  const Status update = UpdateChunksCuda(MakeUpdateConstants({}, 1, 1.0f), chunks, nullptr);
  EXPECT_EQ(update.code(), StatusCode::kDeviceError) << update.ToString();
  EXPECT_NE(update.message().find("failed"), std::string::npos) << update.message();
  const Result<double> sum = SumSquaresCuda(chunks, nullptr);
  EXPECT_EQ(sum.status().code(), StatusCode::kDeviceError) << sum.status().ToString();
}

// --- sum of squares ---------------------------------------------------------------

TEST(CudaKernelsTest, SumOfSquaresMatchesTheReferenceAndSeesInfAndNan) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937_64 rng(::strata::testing::TestSeed());
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  // One call per gradient dtype, and one over chunks of all three.
  std::vector<std::vector<DType>> calls;
  for (DType dtype : kAllDTypes) calls.push_back(std::vector<DType>(std::size(kSizes), dtype));
  calls.push_back({DType::kFloat16, DType::kFloat32, DType::kBFloat16, DType::kFloat32, DType::kFloat16});
  for (const std::vector<DType>& dtypes : calls) {
    std::vector<ChunkArrays> host;
    std::vector<DeviceChunk> device(std::size(kSizes));
    std::vector<ChunkTensors> views;
    double ref = 0;
    for (size_t i = 0; i < std::size(kSizes); ++i) {
      host.push_back(RandomChunk(kSizes[i], dtypes[i], DType::kFloat32, rng));
      const ChunkTensors view = host.back().view();
      ref += scalar::SumSquaresRange(view.grad, view.grad_dtype, 0, view.n);
      ASSERT_NO_FATAL_FAILURE(Upload(view, i % 2, &device[i]));
      views.push_back(device[i].view);
    }
    SCOPED_TRACE(fmt::format("first chunk's grad {}", DTypeName(dtypes[0])));
    ASSERT_OK_AND_ASSIGN(const double sum, SumSquaresCuda(views, stream.get()));
    EXPECT_NEAR(sum, ref, 1e-9 * ref);
    // A fixed order of additions: the same chunks, the same bits.
    ASSERT_OK_AND_ASSIGN(const double again, SumSquaresCuda(views, stream.get()));
    EXPECT_EQ(std::bit_cast<uint64_t>(again), std::bit_cast<uint64_t>(sum));

    ASSERT_NO_FATAL_FAILURE(SetDeviceGrad(views[4], kSizes[4] - 1, std::numeric_limits<float>::infinity()));
    ASSERT_OK_AND_ASSIGN(const double with_inf, SumSquaresCuda(views, stream.get()));
    EXPECT_FALSE(std::isfinite(with_inf)) << with_inf;
    ASSERT_NO_FATAL_FAILURE(SetDeviceGrad(views[2], 500, std::numeric_limits<float>::quiet_NaN()));
    ASSERT_OK_AND_ASSIGN(const double with_nan, SumSquaresCuda(views, stream.get()));
    EXPECT_TRUE(std::isnan(with_nan)) << with_nan;
  }
}

TEST(CudaKernelsTest, SumOfSquaresOfTheLargestFiniteGradientsIsFinite) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  std::vector<float> huge(100, std::numeric_limits<float>::max());
  DeviceChunk device;
  ASSERT_NO_FATAL_FAILURE(Upload(ChunkTensors{.n = huge.size(), .grad = huge.data()}, 0, &device));
  ASSERT_OK_AND_ASSIGN(const double sum, SumSquaresCuda(std::span(&device.view, 1), stream.get()));
  EXPECT_TRUE(std::isfinite(sum));
  const double max = std::numeric_limits<float>::max();
  EXPECT_NEAR(sum, 100 * max * max, 1e-9 * 100 * max * max);
}

// --- bandwidth ----------------------------------------------------------------------

float MedianMs(std::vector<float> ms) {
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

void ElapsedMs(cudaEvent_t start, cudaEvent_t stop, std::vector<float>* ms) {
  ASSERT_CUDA_OK(cudaEventSynchronize(stop));
  float elapsed = 0;
  ASSERT_CUDA_OK(cudaEventElapsedTime(&elapsed, start, stop));
  ms->push_back(elapsed);
}

// The AdamW update of 64 Mi parameters with `states` moments, and a
// device-to-device copy of as many bytes (read + write): fp32 moments move
// 28 bytes a parameter (reads weight, exp_avg, exp_avg_sq and gradient,
// writes the first three), int8 ones 16.06 (the moments' 260 bytes a block of
// 256 each way). Their bandwidths in the same run, and the ratio: how close
// the update comes to what the GPU's memory does for a plain copy.
void TimeUpdateAgainstACopy(DType states) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kParams = size_t{64} << 20;
  const size_t moment_bytes = ChunkBytes(states, kParams);
  const size_t kUpdateBytes = kParams * 3 * sizeof(float) + 4 * moment_bytes;
  const size_t kCopyBytes = kUpdateBytes / 2;
  constexpr int kWarmups = 2;
  constexpr int kRuns = 9;
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  ASSERT_CUDA_OK(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t needed_bytes = 2 * kParams * sizeof(float) + 2 * moment_bytes + 2 * kCopyBytes;
  if (free_bytes < needed_bytes + (size_t{256} << 20)) {
    GTEST_SKIP() << "needs " << needed_bytes << " bytes of GPU memory, " << free_bytes << " free";
  }
  UniqueStream stream;
  ASSERT_NO_FATAL_FAILURE(CreateStream(&stream));
  DeviceMemory master, exp_avg, exp_avg_sq, grad, copy_src, copy_dst;
  for (DeviceMemory* array : {&master, &exp_avg, &exp_avg_sq, &grad}) {
    const size_t bytes = array == &exp_avg || array == &exp_avg_sq ? moment_bytes : kParams * sizeof(float);
    ASSERT_NO_FATAL_FAILURE(Allocate(bytes, array));
    // Bytes 0x3C: every float is 0.0115, a positive normal number (a valid
    // exp_avg_sq and block scale too); the values do not change the time.
    ASSERT_CUDA_OK(cudaMemset(array->get(), 0x3C, bytes));
  }
  ASSERT_NO_FATAL_FAILURE(Allocate(kCopyBytes, &copy_src));
  ASSERT_NO_FATAL_FAILURE(Allocate(kCopyBytes, &copy_dst));
  ASSERT_CUDA_OK(cudaMemset(copy_src.get(), 0x3C, kCopyBytes));
  const ChunkTensors chunk{.n = kParams,
                           .master = static_cast<float*>(master.get()),
                           .grad = grad.get(),
                           .state = {static_cast<float*>(exp_avg.get()), static_cast<float*>(exp_avg_sq.get())},
                           .state_dtype = states};
  const UpdateConstants constants =
      MakeUpdateConstants({.kind = OptimizerKind::kAdamW, .lr = 1e-3f, .weight_decay = 0.01f}, 10, 1.0f);
  UniqueEvent start, stop;
  ASSERT_NO_FATAL_FAILURE(CreateEvent(&start));
  ASSERT_NO_FATAL_FAILURE(CreateEvent(&stop));

  // Alternating, so that a clock or a neighbour on the GPU that changes
  // during the run affects both alike.
  std::vector<float> update_ms, copy_ms;
  for (int run = 0; run < kWarmups + kRuns; ++run) {
    ASSERT_CUDA_OK(cudaEventRecord(start.get(), stream.get()));
    ASSERT_OK(UpdateChunksCuda(constants, std::span(&chunk, 1), stream.get()));
    ASSERT_CUDA_OK(cudaEventRecord(stop.get(), stream.get()));
    ASSERT_NO_FATAL_FAILURE(ElapsedMs(start.get(), stop.get(), &update_ms));
    ASSERT_CUDA_OK(cudaEventRecord(start.get(), stream.get()));
    ASSERT_CUDA_OK(
        cudaMemcpyAsync(copy_dst.get(), copy_src.get(), kCopyBytes, cudaMemcpyDeviceToDevice, stream.get()));
    ASSERT_CUDA_OK(cudaEventRecord(stop.get(), stream.get()));
    ASSERT_NO_FATAL_FAILURE(ElapsedMs(start.get(), stop.get(), &copy_ms));
  }
  update_ms.erase(update_ms.begin(), update_ms.begin() + kWarmups);
  copy_ms.erase(copy_ms.begin(), copy_ms.begin() + kWarmups);
  const double update_s = MedianMs(update_ms) * 1e-3;
  const double copy_s = MedianMs(copy_ms) * 1e-3;
  const double update_gbps = static_cast<double>(kUpdateBytes) / update_s / 1e9;
  const double copy_gbps = 2.0 * static_cast<double>(kCopyBytes) / copy_s / 1e9;

  cudaDeviceProp properties{};
  int device_index = 0;
  ASSERT_CUDA_OK(cudaGetDevice(&device_index));
  ASSERT_CUDA_OK(cudaGetDeviceProperties(&properties, device_index));
  std::printf("[ bench    ] %s, median of %d runs\n", properties.name, kRuns);
  std::printf("[ bench    ] %-34s %10s %10s\n", "", "ms", "GB/s");
  const std::string update = fmt::format("adamw update, {} states, 64 Mi params", DTypeName(states));
  const std::string copy = fmt::format("d2d copy, {} MiB (read + write)", kCopyBytes >> 20);
  std::printf("[ bench    ] %-34s %10.3f %10.1f\n", update.c_str(), update_s * 1e3, update_gbps);
  std::printf("[ bench    ] %-34s %10.3f %10.1f\n", copy.c_str(), copy_s * 1e3, copy_gbps);
  std::printf("[ bench    ] update / copy bandwidth: %.3f\n", update_gbps / copy_gbps);
  ::testing::Test::RecordProperty("device", properties.name);
  ::testing::Test::RecordProperty("update_gbps", std::to_string(update_gbps));
  ::testing::Test::RecordProperty("copy_gbps", std::to_string(copy_gbps));
  ::testing::Test::RecordProperty("update_over_copy", std::to_string(update_gbps / copy_gbps));
  EXPECT_GT(update_gbps, 0.0);
  EXPECT_GT(copy_gbps, 0.0);
}

TEST(CudaKernelsTest, AdamWFp32UpdateBandwidthAgainstADeviceCopy) { TimeUpdateAgainstACopy(DType::kFloat32); }

// Goal (issue 36): at least 0.85 of the copy's bandwidth for its bytes.
TEST(CudaKernelsTest, AdamWInt8StatesUpdateBandwidthAgainstADeviceCopy) { TimeUpdateAgainstACopy(DType::kInt8Block); }

}  // namespace
}  // namespace strata::optim
