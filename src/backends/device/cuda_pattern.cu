// Pattern kernels for checking copies.
//
// Note [Pattern]
// Byte i of the pattern for `seed` is byte (i % 8) of the little-endian word
// PatternWord(seed, i / 8), where PatternWord is the splitmix64 finalizer
// applied to seed + (i / 8 + 1) * golden ratio. Every bit depends on the seed
// and on the position, so a dropped, repeated or shifted piece of a copy and
// a copy from the wrong buffer all show up as mismatches. Fill device memory
// on the device, copy it, check the copy on the host with PatternByte (or
// the reverse: fill on the host, copy, count mismatches on the device). The
// host and device code share the inline functions of cuda_pattern.h
// (compiled by nvcc as __host__ __device__), so the host check is the
// kernel's own reference; the header has no CUDA types, so that host code
// includes it with the host compiler.
//
// Algorithm: a grid-stride loop over 8-byte words; when the buffer is 8-byte
// aligned each thread writes (or reads) whole words, PatternWord(seed, w),
// which on the little-endian GPU puts byte k of the word at byte 8w + k --
// exactly PatternByte(seed, 8w + k). The last size % 8 bytes, and every byte
// of an unaligned buffer, go one byte at a time. Counting XORs each word with
// its expected value and counts the nonzero bytes of the difference, sums
// within a warp with shuffles and adds one total per warp to a global counter.
//
// Reference: PatternByte on the host, the same inline function; the tests
// fill on one side, copy, and compare on the other. Tolerance: none, the
// check is exact (a mismatch count of 0).
#include <cstdint>
#include <memory>

// nvcc's front end wrongly warns (#2810) that status.h assigns to a
// [[nodiscard]] type; the host compiler, which sees the same code, does not.
#pragma nv_diag_suppress 2810
#include "src/base/cuda_check.h"
#include "src/backends/device/cuda_pattern.h"
#pragma nv_diag_default 2810

namespace strata {
namespace {

constexpr int kThreadsPerBlock = 256;
// Enough blocks to fill any current GPU several times over; the grid-stride
// loop covers the rest.
constexpr uint64_t kMaxBlocks = 8192;
// A pattern kernel over tens of GiB takes well under a second; a minute
// means the GPU is hung.
constexpr uint32_t kKernelTimeoutMs = 60'000;

__global__ void FillPatternKernel(uint8_t* dst, uint64_t size_bytes, uint64_t seed) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned = reinterpret_cast<uintptr_t>(dst) % 8 == 0;
  const uint64_t num_words = aligned ? size_bytes / 8 : 0;
  auto* words = reinterpret_cast<uint64_t*>(dst);
  for (uint64_t w = first; w < num_words; w += stride) words[w] = PatternWord(seed, w);
  for (uint64_t i = num_words * 8 + first; i < size_bytes; i += stride) dst[i] = PatternByte(seed, i);
}

// Number of nonzero bytes in `x`: fold each byte's 8 bits into its lowest bit
// (every shift stays within the byte for the bit that is kept), then count.
__device__ int NonZeroBytes(uint64_t x) {
  x |= x >> 4;
  x |= x >> 2;
  x |= x >> 1;
  return __popcll(x & 0x0101010101010101ull);
}

__global__ void CountMismatchesKernel(const uint8_t* src, uint64_t size_bytes, uint64_t seed,
                                      unsigned long long* mismatches) {
  const uint64_t stride = static_cast<uint64_t>(gridDim.x) * blockDim.x;
  const uint64_t first = static_cast<uint64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const bool aligned = reinterpret_cast<uintptr_t>(src) % 8 == 0;
  const uint64_t num_words = aligned ? size_bytes / 8 : 0;
  const auto* words = reinterpret_cast<const uint64_t*>(src);
  unsigned long long count = 0;
  for (uint64_t w = first; w < num_words; w += stride) count += NonZeroBytes(words[w] ^ PatternWord(seed, w));
  for (uint64_t i = num_words * 8 + first; i < size_bytes; i += stride) count += src[i] != PatternByte(seed, i);
  // Every thread reaches this point (the loops above have no early exit and
  // the block size is a multiple of 32), as the full-mask shuffle requires.
  for (int offset = 16; offset > 0; offset /= 2) count += __shfl_down_sync(0xffffffffu, count, offset);
  if (threadIdx.x % 32 == 0 && count != 0) atomicAdd(mismatches, count);
}

unsigned int BlocksFor(uint64_t size_bytes) {
  const uint64_t words = (size_bytes + 7) / 8;
  const uint64_t blocks = (words + kThreadsPerBlock - 1) / kThreadsPerBlock;
  return static_cast<unsigned int>(blocks < 1 ? 1 : (blocks > kMaxBlocks ? kMaxBlocks : blocks));
}

// RAII owners of the CUDA handles used here. Release errors are ignored: they
// come from a context that is already broken, which the calls before reported.
struct StreamDeleter {
  void operator()(cudaStream_t stream) const { static_cast<void>(cudaStreamDestroy(stream)); }
};
using UniqueStream = std::unique_ptr<CUstream_st, StreamDeleter>;
struct DeviceMemoryDeleter {
  void operator()(void* data) const { static_cast<void>(cudaFree(data)); }
};
struct PinnedMemoryDeleter {
  void operator()(void* data) const { static_cast<void>(cudaFreeHost(data)); }
};

Result<UniqueStream> CreateStream() {
  cudaStream_t stream = nullptr;
  // Non-blocking: independent of the legacy default stream, like the copy
  // streams, so a pattern kernel does not wait for unrelated work.
  STRATA_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return UniqueStream(stream);
}

Status WaitForStream(cudaStream_t stream, const char* what) {
  return internal::WaitForCudaWork([stream] { return cudaStreamQuery(stream); }, kKernelTimeoutMs, what);
}

}  // namespace

Status FillPatternOnDevice(void* dst, size_t size_bytes, uint64_t seed) {
  if (size_bytes == 0) return Status::Ok();
  if (dst == nullptr) return InvalidArgument("FillPatternOnDevice: null destination for {} bytes", size_bytes);
  STRATA_ASSIGN_OR_RETURN(UniqueStream stream, CreateStream());
  FillPatternKernel<<<BlocksFor(size_bytes), kThreadsPerBlock, 0, stream.get()>>>(static_cast<uint8_t*>(dst),
                                                                                  size_bytes, seed);
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  return WaitForStream(stream.get(), "FillPatternKernel");
}

Result<uint64_t> CountPatternMismatchesOnDevice(const void* src, size_t size_bytes, uint64_t seed) {
  if (size_bytes == 0) return uint64_t{0};
  if (src == nullptr) return InvalidArgument("CountPatternMismatchesOnDevice: null source for {} bytes", size_bytes);
  STRATA_ASSIGN_OR_RETURN(UniqueStream stream, CreateStream());

  void* raw_device_count = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMalloc(&raw_device_count, sizeof(unsigned long long)));
  std::unique_ptr<void, DeviceMemoryDeleter> device_count(raw_device_count);
  // Pinned, so the copy back is truly asynchronous and the wait below (which
  // has a timeout) is the only one.
  void* raw_host_count = nullptr;
  STRATA_CUDA_RETURN_IF_ERROR(cudaMallocHost(&raw_host_count, sizeof(unsigned long long)));
  std::unique_ptr<void, PinnedMemoryDeleter> host_count(raw_host_count);

  STRATA_CUDA_RETURN_IF_ERROR(cudaMemsetAsync(device_count.get(), 0, sizeof(unsigned long long), stream.get()));
  CountMismatchesKernel<<<BlocksFor(size_bytes), kThreadsPerBlock, 0, stream.get()>>>(
      static_cast<const uint8_t*>(src), size_bytes, seed, static_cast<unsigned long long*>(device_count.get()));
  STRATA_CUDA_RETURN_IF_ERROR(cudaGetLastError());
  STRATA_CUDA_RETURN_IF_ERROR(cudaMemcpyAsync(host_count.get(), device_count.get(), sizeof(unsigned long long),
                                              cudaMemcpyDeviceToHost, stream.get()));
  STRATA_RETURN_IF_ERROR(WaitForStream(stream.get(), "CountMismatchesKernel"));
  return static_cast<uint64_t>(*static_cast<unsigned long long*>(host_count.get()));
}

}  // namespace strata
