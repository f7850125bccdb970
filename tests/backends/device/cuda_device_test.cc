// Tests of the CUDA device (src/device/cuda_device.cc) and the pattern
// kernels (src/backends/device/cuda_pattern.cu), end to end on a real GPU: bytes
// written by a kernel are checked on the host after a copy, and bytes written
// on the host are checked by a kernel. Every test skips when no CUDA device is
// visible (or the build has no CUDA backend).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "src/backends/device/cuda_pattern.h"
#include "strata/buffer.h"
#include "strata/device.h"
#include "strata/options.h"
#include "test_util.h"

namespace strata {
namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr uint32_t kWaitMs = 60'000;

std::unique_ptr<Device> MakeCudaDevice(size_t capacity_bytes) {
  Result<std::unique_ptr<Device>> device = CreateCudaDevice(0, capacity_bytes);
  EXPECT_TRUE(device.ok()) << device.status().ToString();
  return device.ok() ? std::move(device).value() : nullptr;
}

// Index of the first byte of `data` that is not the pattern, or -1.
int64_t FirstPatternMismatch(const void* data, size_t size_bytes, uint64_t seed) {
  const auto* bytes = static_cast<const uint8_t*>(data);
  for (size_t i = 0; i < size_bytes; ++i) {
    if (bytes[i] != PatternByte(seed, i)) return static_cast<int64_t>(i);
  }
  return -1;
}

TEST(CudaDeviceTest, DescribesTheGpu) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  auto device = MakeCudaDevice(64 * kMiB);
  ASSERT_NE(device, nullptr);
  std::printf("%s\n", device->Describe().c_str());
  EXPECT_EQ(device->Describe().rfind("cuda:0 ", 0), 0u) << device->Describe();
  EXPECT_FALSE(device->is_emulated());
  EXPECT_FALSE(device->host_accessible());
  EXPECT_EQ(device->capacity_bytes(), 64 * kMiB);
}

TEST(CudaDeviceTest, AnAutoBudgetIsHalfTheFreeMemory) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  ASSERT_OK_AND_ASSIGN(size_t budget, CudaAutoBudget(0));
  std::printf("device.budget auto: %zu MiB\n", budget / kMiB);
  EXPECT_GT(budget, 0u);
  EXPECT_EQ(budget % kMiB, 0u);
  Options options;  // device.budget auto by default
  ASSERT_OK(SetOption(options, "device.backend", "cuda"));
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, CreateDevice(options));
  EXPECT_NEAR(static_cast<double>(device->capacity_bytes()), static_cast<double>(budget), 256.0 * kMiB);
  ASSERT_OK(SetOption(options, "device.budget", "64MiB"));
  ASSERT_OK_AND_ASSIGN(device, CreateDevice(options));
  EXPECT_EQ(device->capacity_bytes(), 64 * kMiB);
}

TEST(CudaDeviceTest, AnAutoBudgetForADeviceNotThereIsAnErrorNamingIt) {
  // Runs without a GPU too: then no device is visible at all.
  const Result<size_t> budget = CudaAutoBudget(-1);
  ASSERT_FALSE(budget.ok());
  EXPECT_EQ(budget.status().code(),
            strata::CudaDeviceAvailable() ? StatusCode::kInvalidArgument : StatusCode::kNotSupported);
  EXPECT_NE(budget.status().ToString().find("device.budget auto"), std::string::npos) << budget.status().ToString();
}

TEST(CudaDeviceTest, PatternFilledOnTheDeviceArrivesOnTheHost) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = testing::TestSeed();
  auto device = MakeCudaDevice(64 * kMiB);
  ASSERT_NE(device, nullptr);
  // Odd size: the kernel's byte tail and the copy's last partial page.
  const size_t size_bytes = 5 * kMiB + 3;
  ASSERT_OK_AND_ASSIGN(Buffer on_device, device->Allocate(size_bytes));
  EXPECT_EQ(device->allocated_bytes(), size_bytes);
  ASSERT_OK_AND_ASSIGN(Buffer pinned, device->AllocatePinnedHost(size_bytes, -1));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pinned.data()) % 4096, 0u);
  std::memset(pinned.data(), 0, size_bytes);

  ASSERT_OK(FillPatternOnDevice(on_device.data(), size_bytes, seed));
  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Event> down,
                       device->CopyAsync(CopyStream::kDeviceToHost, pinned.data(), on_device.data(), size_bytes));
  ASSERT_OK(down->Wait(kWaitMs));
  EXPECT_TRUE(down->Done());
  EXPECT_EQ(FirstPatternMismatch(pinned.data(), size_bytes, seed), -1);
}

TEST(CudaDeviceTest, PatternWrittenOnTheHostArrivesOnTheDevice) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  const uint64_t seed = testing::TestSeed();
  auto device = MakeCudaDevice(64 * kMiB);
  ASSERT_NE(device, nullptr);
  const size_t size_bytes = 7 * kMiB + 5;
  ASSERT_OK_AND_ASSIGN(Buffer on_device, device->Allocate(size_bytes));
  ASSERT_OK_AND_ASSIGN(Buffer pinned, device->AllocatePinnedHost(size_bytes, -1));
  auto* bytes = static_cast<uint8_t*>(pinned.data());
  for (size_t i = 0; i < size_bytes; ++i) bytes[i] = PatternByte(seed, i);

  ASSERT_OK(device->Memset(on_device.data(), 0, size_bytes));
  ASSERT_OK_AND_ASSIGN(uint64_t before, CountPatternMismatchesOnDevice(on_device.data(), size_bytes, seed));
  EXPECT_GT(before, size_bytes / 2);  // zeros match the pattern only by chance (1 in 256)

  ASSERT_OK_AND_ASSIGN(std::shared_ptr<Event> up,
                       device->CopyAsync(CopyStream::kHostToDevice, on_device.data(), pinned.data(), size_bytes));
  ASSERT_OK(up->Wait(kWaitMs));
  ASSERT_OK_AND_ASSIGN(uint64_t after, CountPatternMismatchesOnDevice(on_device.data(), size_bytes, seed));
  EXPECT_EQ(after, 0u);
  // The counter counts bytes: spoil exactly three and it finds three.
  ASSERT_OK(device->Memset(static_cast<uint8_t*>(on_device.data()) + 1000, static_cast<uint8_t>(~bytes[1000]), 1));
  ASSERT_OK(device->Memset(static_cast<uint8_t*>(on_device.data()) + 1001, static_cast<uint8_t>(~bytes[1001]), 1));
  ASSERT_OK(device->Memset(static_cast<uint8_t*>(on_device.data()) + size_bytes - 1,
                           static_cast<uint8_t>(~bytes[size_bytes - 1]), 1));
  ASSERT_OK_AND_ASSIGN(uint64_t spoiled, CountPatternMismatchesOnDevice(on_device.data(), size_bytes, seed));
  EXPECT_EQ(spoiled, 3u);
}

TEST(CudaDeviceTest, AllocationOverCapacityIsOutOfMemory) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  auto device = MakeCudaDevice(16 * kMiB);
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(Buffer held, device->Allocate(12 * kMiB));
  Result<Buffer> over = device->Allocate(8 * kMiB);
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), StatusCode::kOutOfMemory);
  const std::string& message = over.status().message();
  EXPECT_NE(message.find("cannot allocate " + FormatSize(8 * kMiB)), std::string::npos) << message;
  EXPECT_NE(message.find(FormatSize(12 * kMiB) + " allocated of " + FormatSize(16 * kMiB)), std::string::npos)
      << message;
  held.Reset();
  EXPECT_EQ(device->allocated_bytes(), 0u);
  ASSERT_OK_AND_ASSIGN(Buffer fits, device->Allocate(16 * kMiB));
}

TEST(CudaDeviceTest, AllocationBeyondTheGpuIsOutOfMemoryWithGpuFigures) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  // A capacity far beyond any GPU: the ledger admits the request and
  // cudaMalloc refuses it.
  auto device = MakeCudaDevice(size_t{1} << 50);
  ASSERT_NE(device, nullptr);
  Result<Buffer> huge = device->Allocate(size_t{1} << 49);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), StatusCode::kOutOfMemory) << huge.status().ToString();
  EXPECT_NE(huge.status().message().find("on the GPU"), std::string::npos) << huge.status().message();
  EXPECT_EQ(device->allocated_bytes(), 0u);
  // The failure leaves the runtime usable.
  ASSERT_OK_AND_ASSIGN(Buffer small, device->Allocate(kMiB));
}

TEST(CudaDeviceTest, SynchronizeAndBadArguments) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  auto device = MakeCudaDevice(64 * kMiB);
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(Buffer on_device, device->Allocate(kMiB));
  ASSERT_OK_AND_ASSIGN(Buffer pinned, device->AllocatePinnedHost(kMiB, -1));
  for (int i = 0; i < 8; ++i) {
    ASSERT_OK(device->CopyAsync(CopyStream::kHostToDevice, on_device.data(), pinned.data(), kMiB).status());
    ASSERT_OK(device->CopyAsync(CopyStream::kDeviceToHost, pinned.data(), on_device.data(), kMiB).status());
  }
  ASSERT_OK(device->Synchronize(kWaitMs));
  EXPECT_EQ(device->CopyAsync(CopyStream::kHostToDevice, nullptr, pinned.data(), 16).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device->CopyAsync(CopyStream::kHostToDevice, on_device.data(), pinned.data(), 0).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(device->Allocate(0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateCudaDevice(1 << 20, kMiB).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaDeviceTest, CopyBandwidthWithPinnedMemory) {
  if (!strata::CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  constexpr size_t kSizeBytes = 256 * kMiB;
  constexpr int kRepeats = 5;
  auto device = MakeCudaDevice(kSizeBytes);
  ASSERT_NE(device, nullptr);
  ASSERT_OK_AND_ASSIGN(Buffer on_device, device->Allocate(kSizeBytes));
  ASSERT_OK_AND_ASSIGN(Buffer pinned, device->AllocatePinnedHost(kSizeBytes, -1));
  std::memset(pinned.data(), 1, kSizeBytes);
  // Warm-up: first-touch costs (context, TLB) out of the measurement.
  ASSERT_OK(device->CopyAsync(CopyStream::kHostToDevice, on_device.data(), pinned.data(), kSizeBytes).status());
  ASSERT_OK(device->Synchronize(kWaitMs));

  for (CopyStream stream : {CopyStream::kHostToDevice, CopyStream::kDeviceToHost}) {
    const bool up = stream == CopyStream::kHostToDevice;
    void* dst = up ? on_device.data() : pinned.data();
    const void* src = up ? pinned.data() : on_device.data();
    const auto start = std::chrono::steady_clock::now();
    std::vector<std::shared_ptr<Event>> events;
    for (int i = 0; i < kRepeats; ++i) {
      ASSERT_OK_AND_ASSIGN(std::shared_ptr<Event> event, device->CopyAsync(stream, dst, src, kSizeBytes));
      events.push_back(std::move(event));
    }
    ASSERT_OK(events.back()->Wait(kWaitMs));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double gbps = static_cast<double>(kSizeBytes) * kRepeats / seconds / 1e9;
    std::printf("%s: %d x %s in %.1f ms = %.1f GB/s\n", up ? "host->device" : "device->host", kRepeats,
                FormatSize(kSizeBytes).c_str(), seconds * 1e3, gbps);
    EXPECT_GT(gbps, 1.0) << "pinned copies far below any PCIe generation";
  }
}

}  // namespace
}  // namespace strata
