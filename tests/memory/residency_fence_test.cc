// The residency manager's fences (Note [Fences] in memory/residency.cc): a
// chunk a framework let go after an event on its stream is moved, read or
// overwritten only once the event has completed; and PinIfOn, which pins a
// chunk only where it lies.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <memory>
#include <mutex>
#include <optional>

#include "memory/residency.h"
#include "tests/memory/residency_fixture.h"

namespace strata::memory {
namespace {

using testing::ResidencyStack;

// A framework's stream as the tests drive it: its last kernel on a chunk
// ends when the test says so.
class ManualFence final : public Event {
 public:
  Status Wait(uint32_t timeout_ms) override {
    std::unique_lock lock(mu_);
    if (!done_cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return done_; })) {
      return Timeout("the test's fence did not complete in {} ms", timeout_ms);
    }
    return Status::Ok();
  }
  bool Done() override {
    std::lock_guard lock(mu_);
    return done_;
  }
  void Complete() {
    {
      std::lock_guard lock(mu_);
      done_ = true;
    }
    done_cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable done_cv_;
  bool done_ = false;
};

constexpr auto kStillWaiting = std::chrono::milliseconds(150);

// Note [Fences]: a chunk let go after a fence is in hold at once (pinned
// again without waiting), but its bytes leave the device only after the
// framework's last write to them, which the move then carries.
TEST(ResidencyFenceTest, AChunkReleasedAfterAFenceMovesOnlyOnceTheFenceCompletes) {
  ResidencyStack s({});
  auto fence = std::make_shared<ManualFence>();
  ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
  std::byte* bytes = access.data();
  const uint64_t size = access.size_bytes();
  access.ReleaseAfter(fence);
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kHold);
  ASSERT_OK(s.residency->Access(ChunkId(0), Tier::kDevice).status());  // nothing needs its slot: no wait
  std::future<Status> moved = std::async(std::launch::async, [&] { return s.residency->Move(ChunkId(0), Tier::kHost); });
  EXPECT_EQ(moved.wait_for(kStillWaiting), std::future_status::timeout);
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kInFlight);
  EXPECT_FALSE(s.residency->PinIfOn(ChunkId(0), Tier::kDevice).has_value());  // moving: not pinned where it was
  for (uint64_t i = 0; i < size; ++i) bytes[i] = std::byte(static_cast<uint8_t>(3 + i * 7));  // its last kernel
  fence->Complete();
  ASSERT_OK(moved.get());
  EXPECT_TRUE(s.Holds(0, 3, Tier::kHost));
  EXPECT_EQ(s.residency->stats().fence_waits, 1u);
}

// The same for a chunk evicted to make room for another and for one read
// out (a checkpoint, a gradient reduction): they wait; a fence completed
// meanwhile costs nothing.
TEST(ResidencyFenceTest, EvictionsAndReadsWaitForTheFenceOfTheChunkTheyTake) {
  ResidencyStack s({});  // the device holds 2 chunks
  auto fence = std::make_shared<ManualFence>();
  for (uint32_t id : {0u, 1u}) {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(id), Tier::kDevice));
    std::memset(access.data(), 1, access.size_bytes());
    access.ReleaseAfter(fence);
  }
  std::future<Status> evicting =
      std::async(std::launch::async, [&] { return s.residency->Access(ChunkId(2), Tier::kDevice).status(); });
  Buffer copy = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  std::future<Status> reading = std::async(std::launch::async, [&] {
    return s.residency->ReadChunk(ChunkId(1), copy.bytes());
  });
  EXPECT_EQ(evicting.wait_for(kStillWaiting), std::future_status::timeout);
  EXPECT_EQ(reading.wait_for(kStillWaiting), std::future_status::timeout);
  fence->Complete();
  ASSERT_OK(evicting.get());
  ASSERT_OK(reading.get());
  EXPECT_EQ(s.residency->tier(ChunkId(2)), Tier::kDevice);
  EXPECT_EQ(s.residency->stats().evictions, 1u);
  EXPECT_EQ(copy.bytes()[0], std::byte{1});
  const uint64_t waits = s.residency->stats().fence_waits;
  EXPECT_GE(waits, 1u);
  // Completed fences: moved without a wait.
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kHost));
  ASSERT_OK(s.residency->Move(ChunkId(1), Tier::kHost));
  EXPECT_EQ(s.residency->stats().fence_waits, waits);
}

// Releases after work on two streams: a move waits for both fences, not only
// the last (which completed first).
TEST(ResidencyFenceTest, AMoveWaitsForTheFenceOfEveryReleaseNotOnlyTheLast) {
  ResidencyStack s({});
  auto first = std::make_shared<ManualFence>();
  auto second = std::make_shared<ManualFence>();
  for (const auto& fence : {first, second}) {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
    access.ReleaseAfter(fence);
  }
  second->Complete();
  std::future<Status> moved = std::async(std::launch::async, [&] { return s.residency->Move(ChunkId(0), Tier::kHost); });
  EXPECT_EQ(moved.wait_for(kStillWaiting), std::future_status::timeout);
  first->Complete();
  ASSERT_OK(moved.get());
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
}

// A fence that never completes (a hung GPU): the move fails with Timeout and
// leaves the chunk where it was, and the slot taken for it is given back.
TEST(ResidencyFenceTest, AFenceThatTimesOutLeavesTheChunkWhereItWasAndTakesNoRoom) {
  ResidencyStack s({.timeout_ms = 200});
  auto fence = std::make_shared<ManualFence>();
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
    access.ReleaseAfter(fence);
  }
  const uint64_t host_used = s.residency->stats().tiers[static_cast<int>(Tier::kHost)].used_bytes;
  EXPECT_EQ(s.residency->Access(ChunkId(0), Tier::kHost).status().code(), StatusCode::kTimeout);
  EXPECT_EQ(s.residency->Move(ChunkId(0), Tier::kHost).code(), StatusCode::kTimeout);
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kDevice);
  EXPECT_EQ(s.residency->stats().tiers[static_cast<int>(Tier::kHost)].used_bytes, host_used);
  fence->Complete();
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kHost));
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
}

// PinIfOn (the gradients' norm at a step): pinned where it lies, or not at all; nothing moves.
TEST(ResidencyFenceTest, PinIfOnPinsAChunkWhereItLiesAndMovesNothing) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(0, 4));  // on the host
  EXPECT_FALSE(s.residency->PinIfOn(ChunkId(0), Tier::kDevice).has_value());
  EXPECT_FALSE(s.residency->PinIfOn(ChunkId(1), Tier::kHost).has_value());  // free: nowhere
  {
    std::optional<ChunkAccess> pinned = s.residency->PinIfOn(ChunkId(0), Tier::kHost);
    ASSERT_TRUE(pinned.has_value());
    EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kCompute);
    EXPECT_EQ(pinned->data()[0], std::byte{4});
  }
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kHold);
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
  const MemoryStats stats = s.residency->stats();
  EXPECT_EQ(stats.evictions + stats.compactions, 0u);
}

}  // namespace
}  // namespace strata::memory
