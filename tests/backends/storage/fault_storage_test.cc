// Tests of FaultInjectingStorage (every fault happens, is reported as
// documented, and expires) and of the memory backend it usually wraps.

#include <cerrno>
#include <chrono>
#include <cstring>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "strata/buffer.h"
#include "strata/storage.h"
#include "test_util.h"

namespace strata {
namespace {

// gmock is not linked: a plain substring check that prints both strings.
#define EXPECT_CONTAINS(text, part) \
  EXPECT_NE(std::string(text).find(part), std::string::npos) << "'" << (text) << "' lacks '" << (part) << "'"

constexpr size_t kAlign = 4096;
constexpr size_t kCapacity = size_t{1} << 20;
constexpr size_t kBlock = 4 * kAlign;

class FaultStorageTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<std::unique_ptr<Storage>> base = CreateMemoryStorage(kCapacity, kAlign);
    ASSERT_TRUE(base.ok()) << base.status().ToString();
    storage_ = std::make_unique<FaultInjectingStorage>(std::move(base).value());
    std::mt19937_64 rng(testing::TestSeed());
    data_ = AllocateAlignedHost(kBlock, kAlign);
    other_ = AllocateAlignedHost(kBlock, kAlign);
    out_ = AllocateAlignedHost(kBlock, kAlign);
    ASSERT_TRUE(data_ && other_ && out_);
    testing::FillRandom(data_.data(), kBlock, rng);
    testing::FillRandom(other_.data(), kBlock, rng);
  }

  bool OutEquals(const Buffer& expected) const { return std::memcmp(out_.data(), expected.data(), kBlock) == 0; }
  size_t CountDifferingBytes(const Buffer& a, const Buffer& b) const {
    size_t differing = 0;
    for (size_t i = 0; i < kBlock; ++i) differing += a.bytes()[i] != b.bytes()[i] ? 1 : 0;
    return differing;
  }

  std::unique_ptr<FaultInjectingStorage> storage_;
  Buffer data_;
  Buffer other_;
  Buffer out_;
};

TEST_F(FaultStorageTest, PassesDataThroughWhenNoFaultIsArmed) {
  ASSERT_OK(storage_->Write(kBlock, data_.bytes(), kBlock));
  ASSERT_OK(storage_->Read(kBlock, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));
  EXPECT_EQ(storage_->writes(), 1);
  EXPECT_EQ(storage_->reads(), 1);
}

TEST_F(FaultStorageTest, FailedWriteIsIoErrorNamingOffsetAndErrno) {
  storage_->FailWrites(ENOSPC);
  Status status = storage_->Write(2 * kBlock, data_.bytes(), kBlock);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(status.message(), "injected fault: write at offset 32768");
  EXPECT_CONTAINS(status.message(), "No space left on device (errno 28)");
}

TEST_F(FaultStorageTest, FailedWriteLeavesPreviouslyStoredBytesIntact) {
  ASSERT_OK(storage_->Write(0, data_.bytes(), kBlock));
  storage_->FailWrites(EIO);
  EXPECT_EQ(storage_->Write(0, other_.bytes(), kBlock).code(), StatusCode::kIoError);
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));
}

TEST_F(FaultStorageTest, FailedReadIsIoErrorNamingOffsetAndErrno) {
  storage_->FailReads(EIO);
  Status status = storage_->Read(kBlock, out_.bytes(), kBlock);
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(status.message(), "injected fault: read at offset 16384");
  EXPECT_CONTAINS(status.message(), "Input/output error (errno 5)");
}

TEST_F(FaultStorageTest, FaultsExpireAfterCountOperations) {
  storage_->FailWrites(EIO, 2);
  EXPECT_FALSE(storage_->Write(0, data_.bytes(), kBlock).ok());
  EXPECT_FALSE(storage_->Write(0, data_.bytes(), kBlock).ok());
  EXPECT_OK(storage_->Write(0, data_.bytes(), kBlock));

  storage_->FailReads(EIO, 3);
  for (int i = 0; i < 3; ++i) EXPECT_FALSE(storage_->Read(0, out_.bytes(), kBlock).ok()) << "read " << i;
  EXPECT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));

  storage_->ShortReads(1);
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_FALSE(OutEquals(data_));
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));

  storage_->CorruptReads(2);
  for (int i = 0; i < 2; ++i) {
    ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
    EXPECT_FALSE(OutEquals(data_)) << "read " << i;
  }
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));

  storage_->CorruptWrites(1);
  ASSERT_OK(storage_->Write(0, data_.bytes(), kBlock));
  ASSERT_OK(storage_->Write(kBlock, data_.bytes(), kBlock));
  ASSERT_OK(storage_->Read(kBlock, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));
}

TEST_F(FaultStorageTest, WriteFaultsDoNotFireOnReadsAndReadFaultsNotOnWrites) {
  storage_->FailWrites(EIO);
  storage_->FailReads(EIO);
  ASSERT_FALSE(storage_->Read(0, out_.bytes(), kBlock).ok());  // takes the read fault only
  EXPECT_FALSE(storage_->Write(0, data_.bytes(), kBlock).ok());
  EXPECT_OK(storage_->Write(0, data_.bytes(), kBlock));
  EXPECT_OK(storage_->Read(0, out_.bytes(), kBlock));
}

TEST_F(FaultStorageTest, ShortReadReportsSuccessWithSecondHalfLost) {
  ASSERT_OK(storage_->Write(0, data_.bytes(), kBlock));
  storage_->ShortReads();
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_EQ(std::memcmp(out_.data(), data_.data(), kBlock / 2), 0);
  for (size_t i = kBlock / 2; i < kBlock; ++i) ASSERT_EQ(out_.bytes()[i], std::byte{0xA5}) << "byte " << i;
}

TEST_F(FaultStorageTest, CorruptWriteStoresOneFlippedByteAndLeavesCallerBufferAlone) {
  Buffer original = AllocateAlignedHost(kBlock, kAlign);
  std::memcpy(original.data(), data_.data(), kBlock);
  storage_->CorruptWrites();
  ASSERT_OK(storage_->Write(0, data_.bytes(), kBlock));
  EXPECT_EQ(std::memcmp(data_.data(), original.data(), kBlock), 0);
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_EQ(CountDifferingBytes(out_, data_), 1u);
  EXPECT_EQ(out_.bytes()[kBlock / 2], data_.bytes()[kBlock / 2] ^ std::byte{0xFF});
}

TEST_F(FaultStorageTest, CorruptReadFlipsOneByteButLeavesStoredDataAlone) {
  ASSERT_OK(storage_->Write(0, data_.bytes(), kBlock));
  storage_->CorruptReads();
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_EQ(CountDifferingBytes(out_, data_), 1u);
  EXPECT_EQ(out_.bytes()[kBlock / 2], data_.bytes()[kBlock / 2] ^ std::byte{0xFF});
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_TRUE(OutEquals(data_));
}

TEST_F(FaultStorageTest, DelayMakesEveryOperationTakeAtLeastTheDelay) {
  constexpr uint32_t kDelayMs = 50;
  storage_->SetDelayMs(kDelayMs);
  auto start = std::chrono::steady_clock::now();
  ASSERT_OK(storage_->Write(0, data_.bytes(), kBlock));
  auto after_write = std::chrono::steady_clock::now();
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  auto after_read = std::chrono::steady_clock::now();
  EXPECT_GE(after_write - start, std::chrono::milliseconds(kDelayMs));
  EXPECT_GE(after_read - after_write, std::chrono::milliseconds(kDelayMs));

  storage_->SetDelayMs(0);
  auto undelayed_start = std::chrono::steady_clock::now();
  ASSERT_OK(storage_->Read(0, out_.bytes(), kBlock));
  EXPECT_LT(std::chrono::steady_clock::now() - undelayed_start, std::chrono::milliseconds(kDelayMs));
}

TEST_F(FaultStorageTest, DelayedOperationsInSeveralThreadsSleepConcurrently) {
  // The delay runs outside the mutex: four delayed reads overlap instead of
  // queueing behind each other.
  constexpr uint32_t kDelayMs = 200;
  constexpr int kThreads = 4;
  storage_->SetDelayMs(kDelayMs);
  std::vector<Buffer> outs;
  for (int i = 0; i < kThreads; ++i) outs.push_back(AllocateAlignedHost(kBlock, kAlign));
  auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> threads;
  std::vector<Status> results(kThreads);
  for (int i = 0; i < kThreads; ++i) {
    threads.emplace_back([&, i] { results[i] = storage_->Read(i * kBlock, outs[i].bytes(), kBlock); });
  }
  for (std::thread& thread : threads) thread.join();
  auto elapsed = std::chrono::steady_clock::now() - start;
  for (const Status& status : results) EXPECT_OK(status);
  EXPECT_GE(elapsed, std::chrono::milliseconds(kDelayMs));
  EXPECT_LT(elapsed, std::chrono::milliseconds(kDelayMs * kThreads - kDelayMs / 2));
  EXPECT_EQ(storage_->reads(), kThreads);
}

TEST_F(FaultStorageTest, MisalignedCallIsInvalidArgumentAndConsumesNoFault) {
  storage_->FailWrites(EIO);
  EXPECT_EQ(storage_->Write(100, data_.bytes(), kBlock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage_->Write(0, data_.bytes() + 1, kBlock).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(storage_->writes(), 0);
  EXPECT_EQ(storage_->Write(0, data_.bytes(), kBlock).code(), StatusCode::kIoError);
}

TEST_F(FaultStorageTest, DescribesItselfAndForwardsGeometryOfBase) {
  EXPECT_CONTAINS(storage_->Describe(), "fault-injecting(host memory");
  EXPECT_EQ(storage_->capacity_bytes(), kCapacity);
  EXPECT_EQ(storage_->alignment_bytes(), kAlign);
}

TEST(MemoryStorageTest, FreshStorageReadsAsZeros) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateMemoryStorage(kCapacity, kAlign));
  Buffer out = AllocateAlignedHost(kBlock, kAlign);
  std::memset(out.data(), 0x5A, kBlock);
  ASSERT_OK(storage->Read(kCapacity - kBlock, out.bytes(), kBlock));
  for (size_t i = 0; i < kBlock; ++i) ASSERT_EQ(out.bytes()[i], std::byte{0}) << "byte " << i;
}

TEST(MemoryStorageTest, RejectsMisalignedAndOutOfBoundsRanges) {
  ASSERT_OK_AND_ASSIGN(std::unique_ptr<Storage> storage, CreateMemoryStorage(kCapacity, kAlign));
  Buffer buffer = AllocateAlignedHost(2 * kBlock, kAlign);
  Status offset = storage->Write(kAlign / 2, buffer.bytes(), kBlock);
  EXPECT_EQ(offset.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(offset.message(), "offset 2048");
  Status size = storage->Write(0, buffer.bytes(), kBlock + 512);
  EXPECT_EQ(size.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(size.message(), "size");
  Status address = storage->Read(0, buffer.bytes() + 512, kBlock);
  EXPECT_EQ(address.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(address.message(), "address");
  Status bounds = storage->Read(kCapacity - kBlock, buffer.bytes(), 2 * kBlock);
  EXPECT_EQ(bounds.code(), StatusCode::kInvalidArgument);
  EXPECT_CONTAINS(bounds.message(), "capacity");
  Status wrapping = storage->Read(~uint64_t{0} - (kAlign - 1), buffer.bytes(), kBlock);
  EXPECT_EQ(wrapping.code(), StatusCode::kInvalidArgument);
  EXPECT_OK(storage->Read(kCapacity, buffer.bytes(), 0));
}

TEST(MemoryStorageTest, RejectsZeroCapacityAndBadAlignment) {
  EXPECT_EQ(CreateMemoryStorage(0, kAlign).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateMemoryStorage(kCapacity, 3000).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(CreateMemoryStorage(kCapacity, 0).status().code(), StatusCode::kInvalidArgument);
}

TEST(FaultStorageNthRequestTest, NthRequestFailsAndEverythingStoredStaysReadable) {
  auto base = CreateMemoryStorage(64 * 4096);
  ASSERT_TRUE(base.ok());
  FaultInjectingStorage storage(std::move(base).value());
  Buffer buffer = AllocateAlignedHost(4096, 4096);
  storage.FailWrites(EIO, 1, /*after=*/2);  // the third write fails
  for (int i = 0; i < 5; ++i) {
    std::memset(buffer.data(), i + 1, 4096);
    Status status = storage.Write(static_cast<uint64_t>(i) * 4096, buffer.bytes(), 4096);
    if (i == 2) {
      EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
    } else {
      EXPECT_TRUE(status.ok()) << i << ": " << status.ToString();
    }
  }
  storage.FailReads(EIO, 1, /*after=*/1);  // the second read fails
  for (int i = 0; i < 5; ++i) {
    Status status = storage.Read(static_cast<uint64_t>(i) * 4096, buffer.bytes(), 4096);
    if (i == 1) {
      EXPECT_EQ(status.code(), StatusCode::kIoError);
      continue;
    }
    ASSERT_TRUE(status.ok()) << status.ToString();
    EXPECT_EQ(buffer.bytes()[100], std::byte(i == 2 ? 0 : i + 1)) << i;  // the failed write stored nothing
  }
  ASSERT_OK(storage.Read(4096, buffer.bytes(), 4096));  // the failed read lost nothing
  EXPECT_EQ(buffer.bytes()[0], std::byte{2});
}

}  // namespace
}  // namespace strata
