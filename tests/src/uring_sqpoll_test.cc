// SQPOLL rings (option nvme.sqpoll, experimental): they round-trip data, or
// fall back to ordinary rings where the kernel refuses them. Runs alone:
// under CPU contention on small VMs their completions were seen to stall.
#include <cstring>
#include <random>

#include "strata/buffer.h"
#include "strata/storage.h"
#include "test_util.h"

namespace strata {
namespace {

TEST(UringSqpollTest, SqpollRingRoundTripsOrFallsBack) {
  testing::ScratchDir a("sqpoll-a"), b("sqpoll-b");
  UringStorageOptions options;
  options.dirs = {a.path(), b.path()};
  options.capacity_bytes = 4 << 20;
  options.block_size_bytes = 64 << 10;
  options.queue_depth = 8;
  options.io_timeout_ms = 10'000;
  options.sqpoll = true;
  ASSERT_OK_AND_ASSIGN(auto storage, CreateUringStorage(options));
  std::mt19937_64 rng(testing::TestSeed());
  Buffer source = AllocateAlignedHost(1 << 20, 4096);
  testing::FillRandom(source.data(), 1 << 20, rng);
  Buffer target = AllocateAlignedHost(1 << 20, 4096);
  ASSERT_OK(storage->Write(0, source.bytes(), 1 << 20));
  ASSERT_OK(storage->Read(0, target.bytes(), 1 << 20));
  EXPECT_EQ(std::memcmp(source.data(), target.data(), 1 << 20), 0);
}

}  // namespace
}  // namespace strata
