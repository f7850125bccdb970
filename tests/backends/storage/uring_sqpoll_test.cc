// SQPOLL rings (option nvme.sqpoll): data round-trips, and a long batch does
// not stall at its end (Note [Counting submissions under SQPOLL]); where the
// kernel refuses SQPOLL the storage falls back to ordinary rings.
#include <cstring>
#include <random>
#include <vector>

#include "strata/buffer.h"
#include "strata/storage.h"
#include "test_util.h"

namespace strata {
namespace {

UringStorageOptions SqpollOptions(const std::vector<std::string>& dirs) {
  UringStorageOptions options;
  options.dirs = dirs;
  options.capacity_bytes = 64 << 20;
  options.block_size_bytes = 64 << 10;
  options.queue_depth = 8;
  options.io_timeout_ms = 20'000;
  options.sqpoll = true;
  return options;
}

TEST(UringSqpollTest, SqpollRingRoundTripsOrFallsBack) {
  testing::ScratchDir a("sqpoll-a"), b("sqpoll-b");
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(SqpollOptions({a.path(), b.path()})));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer source = AllocateAlignedHost(1 << 20, 4096);
  testing::FillRandom(source.data(), 1 << 20, rng);
  Buffer target = AllocateAlignedHost(1 << 20, 4096);
  ASSERT_OK(storage->Write(0, source.bytes(), 1 << 20));
  ASSERT_OK(storage->Read(0, target.bytes(), 1 << 20));
  EXPECT_EQ(std::memcmp(source.data(), target.data(), 1 << 20), 0);
}

TEST(UringSqpollTest, LongBatchOfSmallRequestsCompletesWithEveryByte) {
  // 1024 requests of 64 KiB through 8 slots: before the fix the last few were
  // counted twice and the call waited for them until its deadline.
  testing::ScratchDir dir("sqpoll-long");
  UringStorageOptions options = SqpollOptions({dir.path()});
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(options));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer source = AllocateAlignedHost(options.capacity_bytes, 4096);
  testing::FillRandom(source.data(), options.capacity_bytes, rng);
  Buffer target = AllocateAlignedHost(options.capacity_bytes, 4096);
  std::vector<IoSegment> writes, reads;
  for (uint64_t offset = 0; offset < options.capacity_bytes; offset += options.block_size_bytes) {
    writes.push_back({offset, source.bytes() + offset, options.block_size_bytes});
    reads.push_back({offset, target.bytes() + offset, options.block_size_bytes});
  }
  ASSERT_OK(storage->WriteBatch(writes));
  ASSERT_OK(storage->ReadBatch(reads));
  EXPECT_EQ(std::memcmp(source.data(), target.data(), options.capacity_bytes), 0);
}

}  // namespace
}  // namespace strata
