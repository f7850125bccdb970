#include "memory/tier_pool.h"

#include <cerrno>
#include <cstring>
#include <fstream>
#include <string>

#include "test_util.h"

namespace strata::memory {
namespace {

std::unique_ptr<Device> Emulated(size_t capacity) {
  EmulatedDeviceOptions options;
  options.capacity_bytes = capacity;
  Result<std::unique_ptr<Device>> device = CreateEmulatedDevice(options);
  STRATA_CHECK(device.ok(), "{}", device.status().ToString());
  return std::move(device).value();
}

// The process's resident memory (VmRSS of /proc/self/status), in bytes.
uint64_t ResidentBytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stoull(line.substr(6)) * 1024;  // in kB
  }
  return 0;
}

struct NvmeFixture {
  FaultInjectingStorage* faults = nullptr;
  std::unique_ptr<Storage> storage;
  std::unique_ptr<NvmeTierPool> pool;
  Buffer buffer = AllocateAlignedHost(64 << 10, 4096);
  explicit NvmeFixture(size_t capacity = 1 << 20) {
    Result<std::unique_ptr<Storage>> base = CreateMemoryStorage(capacity);
    STRATA_CHECK(base.ok(), "{}", base.status().ToString());
    auto wrapped = std::make_unique<FaultInjectingStorage>(std::move(base).value());
    faults = wrapped.get();
    storage = std::move(wrapped);
    pool = std::make_unique<NvmeTierPool>(*storage);
  }
};

TEST(MemoryTierPoolTest, SlotsAreDisjointAddressesInTheArena) {
  auto device = Emulated(1 << 20);
  ASSERT_OK_AND_ASSIGN(auto pool, MemoryTierPool::CreateDevice(*device, 1 << 20));
  auto a = pool->Allocate(10000);
  auto b = pool->Allocate(10000);
  ASSERT_TRUE(a && b);
  EXPECT_GE(pool->Address(*b), pool->Address(*a) + 10000);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(pool->Address(*b)) % kSlotAlignmentBytes, 0u);
  EXPECT_EQ(pool->usage().used_bytes, 2u * 12288);
  pool->Free(*a);
  EXPECT_EQ(pool->usage().used_bytes, 12288u);
  EXPECT_EQ(pool->usage().peak_bytes, 2u * 12288);
}

// Note [Reserved regions]: slots cost memory once written, and the arena's
// pages all go back when the pool dies.
TEST(MemoryTierPoolTest, TheHostArenaCostsWhatItsSlotsHoldAndGivesItAllBack) {
  auto device = Emulated(1 << 20);
  constexpr uint64_t kMiB = 1 << 20;
  const uint64_t before = ResidentBytes();
  {
    ASSERT_OK_AND_ASSIGN(auto pool, MemoryTierPool::CreateHost(*device, 512 * kMiB, -1));
    EXPECT_LT(ResidentBytes(), before + 8 * kMiB);
    std::optional<Extent> slot = pool->Allocate(64 * kMiB);
    ASSERT_TRUE(slot);
    std::memset(pool->Address(*slot), 0x5a, 64 * kMiB);
    EXPECT_GE(ResidentBytes(), before + 60 * kMiB);
    EXPECT_LT(ResidentBytes(), before + 72 * kMiB);
  }
  EXPECT_LT(ResidentBytes(), before + 4 * kMiB);
}

TEST(MemoryTierPoolTest, DeviceAllocationFailureIsReportedWithTheOption) {
  auto device = Emulated(1 << 20);
  Result<std::unique_ptr<MemoryTierPool>> pool = MemoryTierPool::CreateDevice(*device, 4 << 20);
  ASSERT_FALSE(pool.ok());
  EXPECT_EQ(pool.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(pool.status().message().find("device.budget"), std::string::npos) << pool.status().ToString();
}

TEST(MemoryTierPoolTest, ABudgetBelowOneSlotIsRefusedNamingTheOptionAndTheSlot) {
  auto device = Emulated(1 << 20);
  const std::pair<Result<std::unique_ptr<MemoryTierPool>>, const char*> pools[] = {
      {MemoryTierPool::CreateDevice(*device, 409), "device.budget"},
      {MemoryTierPool::CreateHost(*device, kSlotAlignmentBytes - 1, -1), "host.budget"}};
  for (const auto& [pool, option] : pools) {
    ASSERT_FALSE(pool.ok()) << option;
    EXPECT_EQ(pool.status().code(), StatusCode::kOutOfMemory);
    for (const char* part : {option, "no slot", "4KiB"}) {
      EXPECT_NE(pool.status().message().find(part), std::string::npos) << part << " not in " << pool.status().ToString();
    }
  }
}

TEST(MemoryTierPoolTest, OutOfMemoryErrorNamesTierRequestUseAndCapacity) {
  auto device = Emulated(1 << 20);
  ASSERT_OK_AND_ASSIGN(auto pool, MemoryTierPool::CreateHost(*device, 64 << 10, -1));
  ASSERT_TRUE(pool->Allocate(60 << 10));
  EXPECT_FALSE(pool->Allocate(8 << 10).has_value());
  Status status = pool->OutOfMemoryError(8 << 10, "test");
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  for (const char* part : {"host tier", "8KiB", "60KiB", "64KiB"}) {
    EXPECT_NE(status.message().find(part), std::string::npos) << part << " not in " << status.message();
  }
}

TEST(NvmeTierPoolTest, RoundTripsBytes) {
  NvmeFixture f;
  std::mt19937_64 rng(testing::TestSeed());
  testing::FillRandom(f.buffer.data(), 16384, rng);
  std::vector<std::byte> original(f.buffer.bytes(), f.buffer.bytes() + 16384);
  auto slot = f.pool->Allocate(16384);
  ASSERT_TRUE(slot);
  ASSERT_OK(f.pool->Write(*slot, f.buffer.bytes(), 16384));
  std::memset(f.buffer.data(), 0, 16384);
  ASSERT_OK(f.pool->Read(*slot, f.buffer.bytes(), 16384));
  EXPECT_EQ(std::memcmp(original.data(), f.buffer.data(), 16384), 0);
}

TEST(NvmeTierPoolTest, FlippedByteOnTheDriveIsCorruptionNotData) {
  NvmeFixture f;
  std::memset(f.buffer.data(), 7, 8192);
  auto slot = f.pool->Allocate(8192);
  f.faults->CorruptWrites(1);
  ASSERT_OK(f.pool->Write(*slot, f.buffer.bytes(), 8192));
  Status status = f.pool->Read(*slot, f.buffer.bytes(), 8192);
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("CRC32C"), std::string::npos);
  EXPECT_NE(status.message().find("expected"), std::string::npos);
}

TEST(NvmeTierPoolTest, FlippedByteInTransitIsCorruption) {
  NvmeFixture f;
  std::memset(f.buffer.data(), 9, 8192);
  auto slot = f.pool->Allocate(8192);
  ASSERT_OK(f.pool->Write(*slot, f.buffer.bytes(), 8192));
  f.faults->CorruptReads(1);
  EXPECT_EQ(f.pool->Read(*slot, f.buffer.bytes(), 8192).code(), StatusCode::kCorruption);
  f.faults->ShortReads(1);
  EXPECT_EQ(f.pool->Read(*slot, f.buffer.bytes(), 8192).code(), StatusCode::kCorruption);
  // The fault was in transit: the stored bytes are still good.
  ASSERT_OK(f.pool->Read(*slot, f.buffer.bytes(), 8192));
  EXPECT_EQ(f.buffer.bytes()[100], std::byte{9});
}

TEST(NvmeTierPoolTest, FailedWriteKeepsThePreviousContentAndCrc) {
  NvmeFixture f;
  auto slot = f.pool->Allocate(4096);
  std::memset(f.buffer.data(), 1, 4096);
  ASSERT_OK(f.pool->Write(*slot, f.buffer.bytes(), 4096));
  std::memset(f.buffer.data(), 2, 4096);
  f.faults->FailWrites(ENOSPC);
  Status status = f.pool->Write(*slot, f.buffer.bytes(), 4096);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find("No space left"), std::string::npos) << status.ToString();
  ASSERT_OK(f.pool->Read(*slot, f.buffer.bytes(), 4096));
  EXPECT_EQ(f.buffer.bytes()[0], std::byte{1});
}

TEST(NvmeTierPoolTest, ReadErrorIsIoError) {
  NvmeFixture f;
  auto slot = f.pool->Allocate(4096);
  ASSERT_OK(f.pool->Write(*slot, f.buffer.bytes(), 4096));
  f.faults->FailReads(EIO);
  Status status = f.pool->Read(*slot, f.buffer.bytes(), 4096);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_NE(status.message().find("errno 5"), std::string::npos) << status.ToString();
}

}  // namespace
}  // namespace strata::memory
