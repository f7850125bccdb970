// The CUDA optimizer kernels (interface: optim/cuda/cuda_kernels.h; launch
// structs: optim/cuda/cuda_kernels_launch.h).
//
// Algorithm: multi-tensor apply.
//   1. The host packs up to kMaxChunksPerLaunch non-empty chunks into a
//      ChunkTable, passed by value as the kernel argument (about 2 KiB, under
//      the 4 KiB kernel-parameter limit): each chunk's pointers, size and
//      dtypes, and block_start[c], the first block of chunk c in the grid.
//      Chunk c gets ceil(n / kTileElements) blocks, at most a per-kernel cap;
//      more chunks take more launches.
//   2. A block finds its chunk by binary search over block_start, then walks
//      the chunk's tiles (kTileElements = 1024 elements) from its own index
//      with a stride of the chunk's block count: a grid-stride loop within the
//      chunk, so any n works with a bounded grid.
//   3. Within a tile, thread t owns the group of 4 elements at 4t: one float4
//      load/store per fp32 array and one 8-byte load/store per bf16/fp16
//      array when every array of the chunk is aligned for that (cudaMalloc'd
//      arrays are), element by element otherwise and for the last, partial
//      group of a chunk. A warp thus reads 512 contiguous bytes per array.
//   4. Each element is the reference's formula (optim/cpu/cpu_reference.cc)
//      with every operation rounded on its own: __fmul_rn, __fadd_rn,
//      __fsub_rn, __fdiv_rn and __fsqrt_rn are IEEE round-to-nearest and are
//      never contracted into a fused multiply-add (nvcc contracts a * b + c
//      by default), so each operation rounds as the reference's does.
//   5. The 16-bit copy is rounded as src/base/half.h rounds: bf16 by the same
//      bit arithmetic (NaN -> 0xFFFF, as PyTorch writes it); fp16 by the
//      hardware's IEEE round-to-nearest-even (__float2half_rn: subnormals
//      kept, 65520 and up to inf) with NaN mapped to sign | 0x7E00 first, as
//      half.h maps it (the hardware's NaN need not be that pattern).
//   Sum of squares: the same tiling; each thread sums the squares of its
//   gradients widened to fp64, a block reduces with warp shuffles and then
//   its warps in order and writes one partial; a one-block kernel per launch
//   adds the launch's partials in order to the total. No atomics: the same
//   chunks give the same sum bit for bit, so a rerun derives the same clip
//   coefficient (and the same weights) from it.
//
// Reference: scalar::UpdateRange and scalar::SumSquaresRange
// (optim/cpu/cpu_reference.cc), in tests/optim/cuda/cuda_kernels_test.cc.
// Tolerance: master and states |x - ref| <= 1e-6 + 1e-5 |ref| (NaN where the
// reference has NaN; the tolerance of the CPU vector versions: the kernel is
// expected to match bit for bit, and the test reports how many values do);
// 16-bit outputs equal half.h's rounding of the kernel's own master, bit for
// bit; sum of squares relative 1e-9 (the summation order differs).
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <set>

// nvcc's front end wrongly warns (#2810) that status.h assigns to a
// [[nodiscard]] type; the host compiler, which sees the same code, does not.
#pragma nv_diag_suppress 2810
#include "optim/cuda/cuda_kernels_launch.h"
#include "src/base/cuda_check.h"
#pragma nv_diag_default 2810

namespace strata::optim::cuda_internal {
namespace {

constexpr int kThreadsPerBlock = 256;
constexpr int kWarpSize = 32;
constexpr int kWarpsPerBlock = kThreadsPerBlock / kWarpSize;
// Elements per thread per tile: one float4 of each fp32 array.
constexpr int kGroupElements = 4;
constexpr uint64_t kTileElements = uint64_t{kThreadsPerBlock} * kGroupElements;
// Chunks per launch: 32 descriptors of 56 bytes keep the argument near 2 KiB,
// and a model's chunks of one step take few launches.
constexpr int kMaxChunksPerLaunch = 32;
// Blocks per chunk in the update: 8192 blocks of 256 threads is several
// waves on any current GPU (an H100 holds 132 x 8 such blocks at once), so a
// large chunk keeps every SM busy and the last wave is a small part of the
// time; a chunk of more than 8 Mi elements loops over its tiles.
constexpr uint32_t kMaxUpdateBlocksPerChunk = 8192;
// Blocks per chunk in the sum of squares: fewer, since each block leaves a
// partial for the finishing kernel; 1024 still fills an H100 four times.
constexpr uint32_t kMaxSumBlocksPerChunk = 1024;
// The sum of squares reads each gradient once, well under a second for any
// GPU's memory; a minute means the GPU is hung.
constexpr uint32_t kKernelTimeoutMs = 60'000;

// What one launch covers.
struct ChunkTable {
  LaunchChunk chunks[kMaxChunksPerLaunch];
  uint32_t block_start[kMaxChunksPerLaunch + 1];  // chunk c owns blocks [block_start[c], block_start[c + 1])
  int num_chunks;
};

struct UpdateArgs {
  LaunchConstants constants;
  ChunkTable table;
};
static_assert(sizeof(UpdateArgs) <= 4096, "the update's kernel argument must stay under the 4 KiB parameter limit");

// What the update writes besides fp32 master and states.
enum class ParamOut { kNone, kBf16, kFp16 };

// --- device code -------------------------------------------------------------

// The block's chunk, its index among the chunk's blocks, and their number.
struct BlockWork {
  LaunchChunk chunk;
  uint32_t first_tile;
  uint32_t tile_stride;
};

__device__ BlockWork WorkOfBlock(const ChunkTable& table) {
  // The last chunk whose first block is at or before this one; no chunk in a
  // table is empty, so block_start strictly increases.
  const uint32_t block = blockIdx.x;
  int lo = 0;
  int hi = table.num_chunks - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.block_start[mid] <= block) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return BlockWork{table.chunks[lo], block - table.block_start[lo], table.block_start[lo + 1] - table.block_start[lo]};
}

// 16-bit <-> fp32, as src/base/half.h converts (bits are the low 16 of a uint32_t).
__device__ __forceinline__ float FloatFromBf16(uint32_t bits) { return __uint_as_float(bits << 16); }
__device__ __forceinline__ float FloatFromFp16(uint32_t bits) {
  return __half2float(__ushort_as_half(static_cast<unsigned short>(bits)));  // exact
}
__device__ __forceinline__ uint32_t Bf16FromFloat(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;  // NaN, as src/base/half.h
  const uint32_t kept_lsb = (bits >> 16) & 1u;
  return (bits + 0x7FFFu + kept_lsb) >> 16;  // round to nearest, ties to even
}
__device__ __forceinline__ uint32_t Fp16FromFloat(float value) {
  const uint32_t bits = __float_as_uint(value);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return ((bits >> 16) & 0x8000u) | 0x7E00u;  // NaN, sign kept
  return __half_as_ushort(__float2half_rn(value));
}

__device__ __forceinline__ bool Aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// Whether every array of `t` takes whole-group loads: 16 bytes for 4 fp32
// elements, 8 for 4 16-bit ones. A group starts at a multiple of 4 elements,
// so the array's own alignment decides. Null arrays are not read.
__device__ bool GroupsAligned(const LaunchChunk& t) {
  const uintptr_t grad_bytes = t.grad_type == ElementType::kFloat32 ? 16 : 8;
  const uintptr_t state_bytes = t.state_type == ElementType::kFloat32 ? 16 : 8;
  return Aligned(t.master, 16) && Aligned(t.state[0], state_bytes) && Aligned(t.state[1], state_bytes) &&
         Aligned(t.grad, grad_bytes) && Aligned(t.param, 8);
}

// The elements of a group that exist, `left` being those from its start to
// the end of the chunk.
__device__ __forceinline__ int GroupCount(uint64_t left) {
  return left < kGroupElements ? static_cast<int>(left) : kGroupElements;
}

// Elements [i, i + count) of an fp32 array; kWhole: count is 4 and one
// 16-byte access moves them.
template <bool kWhole>
__device__ __forceinline__ void LoadFloats(const float* p, uint64_t i, int count, float (&out)[kGroupElements]) {
  if constexpr (kWhole) {
    const float4 v = *reinterpret_cast<const float4*>(p + i);
    out[0] = v.x;
    out[1] = v.y;
    out[2] = v.z;
    out[3] = v.w;
  } else {
    for (int k = 0; k < kGroupElements; ++k) {
      if (k < count) out[k] = p[i + k];
    }
  }
}

template <bool kWhole>
__device__ __forceinline__ void StoreFloats(float* p, uint64_t i, int count, const float (&in)[kGroupElements]) {
  if constexpr (kWhole) {
    *reinterpret_cast<float4*>(p + i) = make_float4(in[0], in[1], in[2], in[3]);
  } else {
    for (int k = 0; k < kGroupElements; ++k) {
      if (k < count) p[i + k] = in[k];
    }
  }
}

// The gradients [i, i + count) in fp32, whatever their stored type.
template <ElementType G, bool kWhole>
__device__ __forceinline__ void LoadGrads(const void* grad, uint64_t i, int count, float (&out)[kGroupElements]) {
  if constexpr (G == ElementType::kFloat32) {
    LoadFloats<kWhole>(static_cast<const float*>(grad), i, count, out);
  } else {
    const uint16_t* p = static_cast<const uint16_t*>(grad);
    uint32_t bits[kGroupElements] = {};
    if constexpr (kWhole) {
      const uint2 v = *reinterpret_cast<const uint2*>(p + i);  // little-endian: element i in the low half of v.x
      bits[0] = v.x & 0xFFFFu;
      bits[1] = v.x >> 16;
      bits[2] = v.y & 0xFFFFu;
      bits[3] = v.y >> 16;
    } else {
      for (int k = 0; k < kGroupElements; ++k) {
        if (k < count) bits[k] = p[i + k];
      }
    }
    for (int k = 0; k < kGroupElements; ++k) {
      out[k] = G == ElementType::kBFloat16 ? FloatFromBf16(bits[k]) : FloatFromFp16(bits[k]);
    }
  }
}

// The 16-bit compute copy of the weights [i, i + count), when there is one.
template <ParamOut P, bool kWhole>
__device__ __forceinline__ void StoreParams(void* param, uint64_t i, int count, const float (&weight)[kGroupElements]) {
  if constexpr (P != ParamOut::kNone) {
    uint32_t bits[kGroupElements];
    for (int k = 0; k < kGroupElements; ++k) {
      bits[k] = P == ParamOut::kBf16 ? Bf16FromFloat(weight[k]) : Fp16FromFloat(weight[k]);
    }
    uint16_t* p = static_cast<uint16_t*>(param);
    if constexpr (kWhole) {
      *reinterpret_cast<uint2*>(p + i) = make_uint2(bits[0] | bits[1] << 16, bits[2] | bits[3] << 16);
    } else {
      for (int k = 0; k < kGroupElements; ++k) {
        if (k < count) p[i + k] = static_cast<uint16_t>(bits[k]);
      }
    }
  }
}

// The moments [i, i + count) in fp32 (bf16 ones exactly), and back (bf16:
// rounded to nearest even, Note [bf16 states] in optim/cpu/cpu_kernels.cc).
template <ElementType S, bool kWhole>
__device__ __forceinline__ void LoadStates(const float* state, uint64_t i, int count, float (&out)[kGroupElements]) {
  LoadGrads<S, kWhole>(state, i, count, out);
}

template <ElementType S, bool kWhole>
__device__ __forceinline__ void StoreStates(float* state, uint64_t i, int count, const float (&in)[kGroupElements]) {
  if constexpr (S == ElementType::kFloat32) {
    StoreFloats<kWhole>(state, i, count, in);
  } else {
    StoreParams<ParamOut::kBf16, kWhole>(state, i, count, in);
  }
}

// Adam and AdamW for one element: AdamRange of the reference, operation for
// operation. Returns the new weight; updates the two moments in place.
__device__ __forceinline__ float AdamElement(const LaunchConstants& c, float g, float master, float& exp_avg,
                                             float& exp_avg_sq) {
  // g = fma(w, decay_l2, g * multiplier): unscale and clip, then Adam's L2 (0 for AdamW)
  const float grad = __fmaf_rn(master, c.decay_l2, __fmul_rn(g, c.grad_multiplier));
  const float weight = __fmul_rn(master, c.decay_factor);  // AdamW's decay (1 for Adam)
  // m = fma(1 - beta1, g - m, m);  v = fma((1 - beta2) g, g, v beta2)
  const float m = __fmaf_rn(c.one_minus_beta1, __fsub_rn(grad, exp_avg), exp_avg);
  const float v = __fmaf_rn(__fmul_rn(c.one_minus_beta2, grad), grad, __fmul_rn(exp_avg_sq, c.beta2));
  // w + ((-lr / (1 - beta1^t)) m) / (sqrt(v) / sqrt(1 - beta2^t) + eps)
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.sqrt_correction2), c.eps);
  exp_avg = m;
  exp_avg_sq = v;
  return __fadd_rn(weight, __fdiv_rn(__fmul_rn(c.neg_step_size, m), denom));
}

// SGD for one element: SgdRange of the reference. `buffer` is the momentum
// buffer's element, read and written only `with_momentum`.
__device__ __forceinline__ float SgdElement(const LaunchConstants& c, float g, float master, bool with_momentum,
                                            float& buffer) {
  // d = fma(w, weight_decay, g * multiplier)
  float d = __fmaf_rn(master, c.decay_l2, __fmul_rn(g, c.grad_multiplier));
  if (with_momentum) {
    // b = d on the first step, else fma(d, 1 - dampening, b momentum)
    const float b = c.first_step ? d : __fmaf_rn(d, c.one_minus_dampening, __fmul_rn(buffer, c.momentum));
    buffer = b;
    // Nesterov looks ahead along the buffer: fma(b, momentum, d); else d = b.
    d = c.nesterov ? __fmaf_rn(b, c.momentum, d) : b;
  }
  return __fmaf_rn(d, -c.lr, master);
}

// Updates elements [i, i + count) of one chunk.
template <bool kSgd, ElementType G, ParamOut P, ElementType S, bool kWhole>
__device__ __forceinline__ void UpdateGroup(const LaunchConstants& c, const LaunchChunk& t, uint64_t i, int count) {
  float grad[kGroupElements] = {};
  float weight[kGroupElements] = {};
  float state0[kGroupElements] = {};
  float state1[kGroupElements] = {};
  LoadGrads<G, kWhole>(t.grad, i, count, grad);
  LoadFloats<kWhole>(t.master, i, count, weight);
  if constexpr (kSgd) {
    const bool with_momentum = t.state[0] != nullptr;
    if (with_momentum) LoadStates<S, kWhole>(t.state[0], i, count, state0);
    for (int k = 0; k < kGroupElements; ++k) weight[k] = SgdElement(c, grad[k], weight[k], with_momentum, state0[k]);
    if (with_momentum) StoreStates<S, kWhole>(t.state[0], i, count, state0);
  } else {
    LoadStates<S, kWhole>(t.state[0], i, count, state0);
    LoadStates<S, kWhole>(t.state[1], i, count, state1);
    for (int k = 0; k < kGroupElements; ++k) weight[k] = AdamElement(c, grad[k], weight[k], state0[k], state1[k]);
    StoreStates<S, kWhole>(t.state[0], i, count, state0);
    StoreStates<S, kWhole>(t.state[1], i, count, state1);
  }
  // Lanes past `count` computed on zeros and are not stored.
  StoreFloats<kWhole>(t.master, i, count, weight);
  StoreParams<P, kWhole>(t.param, i, count, weight);
}

// This block's tiles of one chunk.
template <bool kSgd, ElementType G, ParamOut P, ElementType S>
__device__ void UpdateTiles(const LaunchConstants& c, const LaunchChunk& t, uint32_t first_tile, uint32_t tile_stride) {
  const bool whole_groups = GroupsAligned(t);
  const uint64_t num_tiles = (t.n + kTileElements - 1) / kTileElements;
  for (uint64_t tile = first_tile; tile < num_tiles; tile += tile_stride) {
    const uint64_t i = tile * kTileElements + uint64_t{threadIdx.x} * kGroupElements;
    if (i >= t.n) break;  // the chunk's last tile, past its end; later tiles are further
    const int count = GroupCount(t.n - i);
    if (whole_groups && count == kGroupElements) {
      UpdateGroup<kSgd, G, P, S, true>(c, t, i, kGroupElements);
    } else {
      UpdateGroup<kSgd, G, P, S, false>(c, t, i, count);
    }
  }
}

template <bool kSgd, ElementType G, ElementType S>
__device__ void UpdateTilesForParam(const LaunchConstants& c, const LaunchChunk& t, uint32_t first_tile,
                                    uint32_t tile_stride) {
  if (t.param == nullptr) {
    UpdateTiles<kSgd, G, ParamOut::kNone, S>(c, t, first_tile, tile_stride);
  } else if (t.param_type == ElementType::kFloat16) {
    UpdateTiles<kSgd, G, ParamOut::kFp16, S>(c, t, first_tile, tile_stride);
  } else {
    UpdateTiles<kSgd, G, ParamOut::kBf16, S>(c, t, first_tile, tile_stride);
  }
}

template <bool kSgd, ElementType G>
__device__ void UpdateTilesForStates(const LaunchConstants& c, const LaunchChunk& t, uint32_t first_tile,
                                     uint32_t tile_stride) {
  if (t.state_type == ElementType::kBFloat16) {
    UpdateTilesForParam<kSgd, G, ElementType::kBFloat16>(c, t, first_tile, tile_stride);
  } else {
    UpdateTilesForParam<kSgd, G, ElementType::kFloat32>(c, t, first_tile, tile_stride);
  }
}

// __grid_constant__: the argument stays in the read-only parameter space even
// though the chunk table is indexed with a run-time value (without it, nvcc
// would copy the whole table to each thread's local memory).
template <bool kSgd>
__global__ void __launch_bounds__(kThreadsPerBlock) UpdateKernel(const __grid_constant__ UpdateArgs args) {
  const BlockWork work = WorkOfBlock(args.table);
  // The types are the same for every thread of the block: no divergence.
  switch (work.chunk.grad_type) {
    case ElementType::kFloat32:
      UpdateTilesForStates<kSgd, ElementType::kFloat32>(args.constants, work.chunk, work.first_tile, work.tile_stride);
      break;
    case ElementType::kBFloat16:
      UpdateTilesForStates<kSgd, ElementType::kBFloat16>(args.constants, work.chunk, work.first_tile, work.tile_stride);
      break;
    case ElementType::kFloat16:
      UpdateTilesForStates<kSgd, ElementType::kFloat16>(args.constants, work.chunk, work.first_tile, work.tile_stride);
      break;
  }
}

// This thread's part of the sum of squares of one chunk's gradients.
template <ElementType G>
__device__ double SumSquaresTiles(const LaunchChunk& t, uint32_t first_tile, uint32_t tile_stride) {
  const bool whole_groups = Aligned(t.grad, G == ElementType::kFloat32 ? 16 : 8);
  const uint64_t num_tiles = (t.n + kTileElements - 1) / kTileElements;
  double sum = 0;
  for (uint64_t tile = first_tile; tile < num_tiles; tile += tile_stride) {
    const uint64_t i = tile * kTileElements + uint64_t{threadIdx.x} * kGroupElements;
    if (i >= t.n) break;
    const int count = GroupCount(t.n - i);
    float grad[kGroupElements] = {};
    if (whole_groups && count == kGroupElements) {
      LoadGrads<G, true>(t.grad, i, count, grad);
    } else {
      LoadGrads<G, false>(t.grad, i, count, grad);
    }
    for (int k = 0; k < kGroupElements; ++k) {
      const double g = grad[k];  // zero past `count`
      sum += g * g;
    }
  }
  return sum;
}

// The block's total of `value`, in thread 0 (0 elsewhere). Every thread of
// the block must call it, once per kernel. The order of the additions is
// fixed, so the result is too.
__device__ double BlockSum(double value) {
  __shared__ double warp_sums[kWarpsPerBlock];
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffffu, value, offset);
  if (threadIdx.x % kWarpSize == 0) warp_sums[threadIdx.x / kWarpSize] = value;
  __syncthreads();
  double total = 0;
  if (threadIdx.x == 0) {
    for (int w = 0; w < kWarpsPerBlock; ++w) total += warp_sums[w];
  }
  return total;
}

// One partial per block: partials[blockIdx.x].
__global__ void __launch_bounds__(kThreadsPerBlock) SumSquaresKernel(const __grid_constant__ ChunkTable table,
                                                                     double* partials) {
  const BlockWork work = WorkOfBlock(table);
  double sum = 0;
  switch (work.chunk.grad_type) {
    case ElementType::kFloat32:
      sum = SumSquaresTiles<ElementType::kFloat32>(work.chunk, work.first_tile, work.tile_stride);
      break;
    case ElementType::kBFloat16:
      sum = SumSquaresTiles<ElementType::kBFloat16>(work.chunk, work.first_tile, work.tile_stride);
      break;
    case ElementType::kFloat16:
      sum = SumSquaresTiles<ElementType::kFloat16>(work.chunk, work.first_tile, work.tile_stride);
      break;
  }
  const double block_sum = BlockSum(sum);
  if (threadIdx.x == 0) partials[blockIdx.x] = block_sum;
}

// One block: *total += the sum of partials[0, count), in a fixed order.
__global__ void __launch_bounds__(kThreadsPerBlock) AddPartialsKernel(const double* partials, uint32_t count,
                                                                      double* total) {
  double sum = 0;
  for (uint32_t i = threadIdx.x; i < count; i += kThreadsPerBlock) sum += partials[i];
  const double block_sum = BlockSum(sum);
  if (threadIdx.x == 0) *total += block_sum;
}

// --- 8-bit states -----------------------------------------------------------
//
// One block of 256 elements a tile, thread t its element t: the scalar
// reference's Adam8bitUpdate (optim/cpu/cpu_reference.cc) operation for
// operation, each rounded on its own; then the block's largest magnitude of
// each moment (NaN if one is), by warp shuffles and the block's warps, as
// its scale, and each value divided by it and coded by its encoder's entry
// (Note [Encoding by thresholds] in optim/state_codec.cc). Chunks of fp32
// moments (under int8 states) take the arithmetic without the codes.

constexpr uint64_t k8bitTileElements = kThreadsPerBlock;
constexpr uint64_t kInt8BlockBytes = k8bitTileElements + sizeof(float);  // 256 codes, then the scale
static_assert(k8bitTileElements == 256, "a tile is one block of 8-bit states");

// The code maps and encoders of both moments, on each device (Upload8bitTables).
__device__ float g_code_maps[2][256];
__device__ uint32_t g_encoder_entries[2][kEncoderEntries];

struct Update8bitArgs {
  Launch8bitConstants constants;
  ChunkTable table;
};
static_assert(sizeof(Update8bitArgs) <= 4096, "the 8-bit update's kernel argument must stay under 4 KiB");

template <ElementType G>
__device__ __forceinline__ float LoadGrad(const void* grad, uint64_t i) {
  if constexpr (G == ElementType::kFloat32) {
    return static_cast<const float*>(grad)[i];
  } else if constexpr (G == ElementType::kBFloat16) {
    return FloatFromBf16(static_cast<const uint16_t*>(grad)[i]);
  } else {
    return FloatFromFp16(static_cast<const uint16_t*>(grad)[i]);
  }
}

template <ParamOut P>
__device__ __forceinline__ void StoreParam(void* param, uint64_t i, float weight) {
  if constexpr (P == ParamOut::kBf16) {
    static_cast<uint16_t*>(param)[i] = static_cast<uint16_t>(Bf16FromFloat(weight));
  } else if constexpr (P == ParamOut::kFp16) {
    static_cast<uint16_t*>(param)[i] = static_cast<uint16_t>(Fp16FromFloat(weight));
  }
}

// The largest |value| over the block, NaN if any is NaN (BlockScale's
// largest); every thread gets it. Every thread of the block must call it.
__device__ float BlockLargest(float value) {
  __shared__ float warp_largest[kWarpsPerBlock];
  const float magnitude = fabsf(value);
  const bool nan = __syncthreads_or(isnan(magnitude)) != 0;
  float largest = isnan(magnitude) ? 0.0f : magnitude;
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    largest = fmaxf(largest, __shfl_down_sync(0xffffffffu, largest, offset));
  }
  if (threadIdx.x % kWarpSize == 0) warp_largest[threadIdx.x / kWarpSize] = largest;
  __syncthreads();
  largest = 0.0f;
  for (int w = 0; w < kWarpsPerBlock; ++w) largest = fmaxf(largest, warp_largest[w]);
  __syncthreads();  // warp_largest is read before the next call writes it
  return nan ? __int_as_float(0x7fffffff) : largest;
}

// The code of `value` in a block of scale `scale` (EncodeByThresholds of
// value / scale; NaN: code 0).
__device__ __forceinline__ uint32_t Encode(float value, float scale, const uint32_t* entries) {
  const float scaled = __fdiv_rn(value, scale);
  if (isnan(scaled)) return 0;
  const uint32_t bits = __float_as_uint(scaled);
  const uint32_t magnitude = (bits & 0x7fffffffu) >> kEncoderLowBits;
  const uint32_t lowest = kEncoderMinExponent << kEncoderBucketBits;
  const uint32_t in_sign = magnitude < lowest ? 0 : min(magnitude - lowest, kEncoderBucketsPerSign - 1);
  const uint32_t entry = __ldg(entries + (bits >> 31) * kEncoderBucketsPerSign + in_sign);
  uint32_t code = entry & 0xffu;
  if ((bits & ((1u << kEncoderLowBits) - 1)) >= entry >> 8) code += bits >> 31 ? 0xffu : 1u;  // -1 or +1
  return code & 0xffu;
}

// Stores one moment's block: its scale (thread 0) and each thread's code.
__device__ __forceinline__ void StoreBlock(uint8_t* block, float value, int moment) {
  const float largest = BlockLargest(value);
  const float scale = isnan(largest) || largest > 1e-12f ? largest : 1e-12f;
  block[threadIdx.x] = static_cast<uint8_t>(Encode(value, scale, g_encoder_entries[moment]));
  if (threadIdx.x == 0) *reinterpret_cast<float*>(block + k8bitTileElements) = scale;
}

// This block's tiles of one chunk: kBlocks, 8-bit moments; else fp32 ones.
template <ElementType G, ParamOut P, bool kBlocks>
__device__ void Update8bitTiles(const Launch8bitConstants& c, const LaunchChunk& t, uint32_t first_tile,
                                uint32_t tile_stride, const float (&maps)[2][256]) {
  const uint64_t num_tiles = (t.n + k8bitTileElements - 1) / k8bitTileElements;
  for (uint64_t tile = first_tile; tile < num_tiles; tile += tile_stride) {
    const uint64_t i = tile * k8bitTileElements + threadIdx.x;
    const bool mine = i < t.n;  // every thread in a chunk of blocks
    uint8_t* blocks[2] = {reinterpret_cast<uint8_t*>(t.state[0]) + tile * kInt8BlockBytes,
                          reinterpret_cast<uint8_t*>(t.state[1]) + tile * kInt8BlockBytes};
    float g = 0, weight = 0, m = 0, v = 0;
    if (mine) {
      g = __fmul_rn(LoadGrad<G>(t.grad, i), c.grad_multiplier);
      weight = t.master[i];
      if constexpr (kBlocks) {
        m = __fmul_rn(maps[0][blocks[0][threadIdx.x]], *reinterpret_cast<const float*>(blocks[0] + k8bitTileElements));
        v = __fmul_rn(maps[1][blocks[1][threadIdx.x]], *reinterpret_cast<const float*>(blocks[1] + k8bitTileElements));
      } else {
        m = t.state[0][i];
        v = t.state[1][i];
      }
    }
    if (c.decoupled) {
      weight = __fsub_rn(weight, __fmul_rn(c.lr_decay, weight));
    } else {
      g = __fadd_rn(g, __fmul_rn(c.weight_decay, weight));
    }
    m = __fadd_rn(__fmul_rn(c.one_minus_beta1, __fsub_rn(g, m)), m);  // lerp(m, g, 1 - beta1)
    v = __fadd_rn(__fmul_rn(c.one_minus_beta2, __fsub_rn(__fmul_rn(g, g), v)), v);
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(v), c.sqrt_correction2), c.eps);
    weight = __fsub_rn(weight, __fdiv_rn(__fmul_rn(c.lr, __fdiv_rn(m, c.correction1)), denom));
    if (mine) {
      t.master[i] = weight;
      StoreParam<P>(t.param, i, weight);
    }
    if constexpr (kBlocks) {
      StoreBlock(blocks[0], m, 0);
      StoreBlock(blocks[1], v, 1);
    } else if (mine) {
      t.state[0][i] = m;
      t.state[1][i] = v;
    }
  }
}

template <ElementType G, ParamOut P>
__device__ void Update8bitTilesForStates(const Launch8bitConstants& c, const LaunchChunk& t, uint32_t first_tile,
                                         uint32_t tile_stride, const float (&maps)[2][256]) {
  if (t.int8_blocks) {
    Update8bitTiles<G, P, true>(c, t, first_tile, tile_stride, maps);
  } else {
    Update8bitTiles<G, P, false>(c, t, first_tile, tile_stride, maps);
  }
}

template <ElementType G>
__device__ void Update8bitTilesForParam(const Launch8bitConstants& c, const LaunchChunk& t, uint32_t first_tile,
                                        uint32_t tile_stride, const float (&maps)[2][256]) {
  if (t.param == nullptr) {
    Update8bitTilesForStates<G, ParamOut::kNone>(c, t, first_tile, tile_stride, maps);
  } else if (t.param_type == ElementType::kFloat16) {
    Update8bitTilesForStates<G, ParamOut::kFp16>(c, t, first_tile, tile_stride, maps);
  } else {
    Update8bitTilesForStates<G, ParamOut::kBf16>(c, t, first_tile, tile_stride, maps);
  }
}

__global__ void __launch_bounds__(kThreadsPerBlock) Update8bitKernel(const __grid_constant__ Update8bitArgs args) {
  __shared__ float maps[2][256];  // read at the codes of each thread: shared memory, not one broadcast
  maps[0][threadIdx.x] = g_code_maps[0][threadIdx.x];
  maps[1][threadIdx.x] = g_code_maps[1][threadIdx.x];
  __syncthreads();
  const BlockWork work = WorkOfBlock(args.table);
  switch (work.chunk.grad_type) {
    case ElementType::kFloat32:
      Update8bitTilesForParam<ElementType::kFloat32>(args.constants, work.chunk, work.first_tile, work.tile_stride,
                                                     maps);
      break;
    case ElementType::kBFloat16:
      Update8bitTilesForParam<ElementType::kBFloat16>(args.constants, work.chunk, work.first_tile, work.tile_stride,
                                                      maps);
      break;
    case ElementType::kFloat16:
      Update8bitTilesForParam<ElementType::kFloat16>(args.constants, work.chunk, work.first_tile, work.tile_stride,
                                                     maps);
      break;
  }
}

// --- host code ---------------------------------------------------------------

// Packs the next chunks from *next into `table`: up to kMaxChunksPerLaunch
// non-empty ones, chunk c with ceil(n / tile_elements) blocks but at most
// `max_blocks_per_chunk`. Returns the launch's block count; 0 when no chunk
// is left.
uint32_t FillTable(const LaunchChunk* chunks, size_t num_chunks, size_t* next, uint32_t max_blocks_per_chunk,
                   ChunkTable* table, uint64_t tile_elements = kTileElements) {
  uint32_t num_blocks = 0;
  table->num_chunks = 0;
  for (; *next < num_chunks && table->num_chunks < kMaxChunksPerLaunch; ++*next) {
    const LaunchChunk& chunk = chunks[*next];
    if (chunk.n == 0) continue;
    const uint64_t tiles = (chunk.n + tile_elements - 1) / tile_elements;
    table->chunks[table->num_chunks] = chunk;
    table->block_start[table->num_chunks] = num_blocks;
    num_blocks += static_cast<uint32_t>(std::min<uint64_t>(tiles, max_blocks_per_chunk));
    ++table->num_chunks;
  }
  table->block_start[table->num_chunks] = num_blocks;
  return num_blocks;
}

// Frees scratch memory in stream order, after the kernels that use it.
// Release errors are ignored: they come from a context that is already
// broken, which the calls before reported.
struct StreamOrderedFree {
  cudaStream_t stream;
  void operator()(void* data) const { static_cast<void>(cudaFreeAsync(data, stream)); }
};

Status WaitForStream(cudaStream_t stream, const char* what) {
  return internal::WaitForCudaWork([stream] { return cudaStreamQuery(stream); }, kKernelTimeoutMs, what);
}

// Copies the code maps and encoders to the current device, once per device.
Status Upload8bitTables(const Host8bitTables& tables) {
  static std::mutex mutex;
  static std::set<int> done;
  int device = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetDevice(&device));
  const std::lock_guard<std::mutex> lock(mutex);
  if (done.count(device) > 0) return Status::Ok();
  for (int k = 0; k < 2; ++k) {
    STRATA_CUDA_RETURN_IF_ERROR(
        cudaMemcpyToSymbol(g_code_maps, tables.maps[k], 256 * sizeof(float), k * 256 * sizeof(float)));
    STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyToSymbol(g_encoder_entries, tables.entries[k],
                                                   kEncoderEntries * sizeof(uint32_t),
                                                   k * kEncoderEntries * sizeof(uint32_t)));
  }
  // From pageable memory the copies may return before their bytes land, and a kernel on a non-blocking
  // stream is not ordered after them: wait here, once per device.
  STRATA_CUDA_RETURN_IF_ERROR(cudaDeviceSynchronize());
  done.insert(device);
  return Status::Ok();
}

}  // namespace

Status EnqueueUpdate(const LaunchConstants& constants, const LaunchChunk* chunks, size_t num_chunks,
                     void* cuda_stream) {
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  UpdateArgs args{};
  args.constants = constants;
  size_t next = 0;
  for (;;) {
    const uint32_t num_blocks = FillTable(chunks, num_chunks, &next, kMaxUpdateBlocksPerChunk, &args.table);
    if (num_blocks == 0) return Status::Ok();
    if (constants.sgd) {
      UpdateKernel<true><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
    } else {
      UpdateKernel<false><<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
    }
    STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
}

Status Enqueue8bitUpdate(const Launch8bitConstants& constants, const Host8bitTables& tables,
                         const LaunchChunk* chunks, size_t num_chunks, void* cuda_stream) {
  STRATA_RETURN_IF_ERROR(Upload8bitTables(tables));
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  Update8bitArgs args{};
  args.constants = constants;
  size_t next = 0;
  for (;;) {
    const uint32_t num_blocks =
        FillTable(chunks, num_chunks, &next, kMaxUpdateBlocksPerChunk, &args.table, k8bitTileElements);
    if (num_blocks == 0) return Status::Ok();
    Update8bitKernel<<<num_blocks, kThreadsPerBlock, 0, stream>>>(args);
    STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
}

Status EnqueueZero(void* device_dst, size_t size_bytes, void* cuda_stream) {
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_dst, 0, size_bytes, static_cast<cudaStream_t>(cuda_stream)));
  return Status::Ok();
}

Result<double> SumSquares(const LaunchChunk* chunks, size_t num_chunks, void* cuda_stream) {
  const auto stream = static_cast<cudaStream_t>(cuda_stream);
  // Scratch: the total, then the partials of the largest launch (launches
  // run in stream order, so each reuses them).
  ChunkTable table{};
  uint32_t max_blocks = 0;
  for (size_t next = 0;;) {
    const uint32_t num_blocks = FillTable(chunks, num_chunks, &next, kMaxSumBlocksPerChunk, &table);
    if (num_blocks == 0) break;
    max_blocks = std::max(max_blocks, num_blocks);
  }
  if (max_blocks == 0) return 0.0;
  void* scratch_raw = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMallocAsync(&scratch_raw, (size_t{max_blocks} + 1) * sizeof(double), stream));
  const std::unique_ptr<void, StreamOrderedFree> scratch(scratch_raw, StreamOrderedFree{stream});
  double* const total = static_cast<double*>(scratch.get());
  double* const partials = total + 1;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(total, 0, sizeof(double), stream));

  for (size_t next = 0;;) {
    const uint32_t num_blocks = FillTable(chunks, num_chunks, &next, kMaxSumBlocksPerChunk, &table);
    if (num_blocks == 0) break;
    SumSquaresKernel<<<num_blocks, kThreadsPerBlock, 0, stream>>>(table, partials);
    STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
    AddPartialsKernel<<<1, kThreadsPerBlock, 0, stream>>>(partials, num_blocks, total);
    STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  }
  // Wait with a timeout first: the copy below, into pageable memory, would
  // block until the stream reached it with none.
  STRATA_RETURN_IF_ERROR(WaitForStream(stream, "SumSquaresKernel"));
  double sum = 0;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(&sum, total, sizeof(double), cudaMemcpyDeviceToHost, stream));
  // A copy to pageable memory returns once it is done; this wait is a formality.
  STRATA_RETURN_IF_ERROR(WaitForStream(stream, "the copy of the sum of squares"));
  return sum;
}

}  // namespace strata::optim::cuda_internal
