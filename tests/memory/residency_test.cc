#include "memory/residency.h"

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <optional>
#include <thread>

#include "tests/memory/residency_fixture.h"

namespace strata::memory {
namespace {

using testing::ResidencyStack;

TEST(ResidencyTest, FreeChunkReadsAsZerosAndMovesThroughStates) {
  ResidencyStack s({});
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kFree);
  EXPECT_FALSE(s.residency->tier(ChunkId(0)).has_value());
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
    EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kCompute);
    for (uint64_t i = 0; i < access.size_bytes(); ++i) ASSERT_EQ(access.data()[i], std::byte{0});
  }
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kHold);
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kDevice);
  EXPECT_EQ(s.residency->stats().materializations, 1u);
}

// A transient chunk (a gathered param chunk) is dropped, not copied, when
// it is moved or evicted down: it takes no room below, and comes back free
// (zeros). On its way up it moves as any other.
TEST(ResidencyTest, ATransientChunkIsDroppedInsteadOfMovedDown) {
  ResidencyStack s({.transient_chunks = 1});  // device and host hold 2 chunks each
  ASSERT_OK(s.Fill(0, 7));  // materialized on the host
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kDevice));
  EXPECT_TRUE(s.Holds(0, 7, Tier::kDevice));
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kHost));
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kFree);
  EXPECT_EQ(s.residency->stats().drops, 1u);
  EXPECT_EQ(s.residency->stats().tiers[static_cast<int>(Tier::kHost)].used_bytes, 0u);
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
    for (uint64_t i = 0; i < access.size_bytes(); ++i) ASSERT_EQ(access.data()[i], std::byte{0});
    std::memset(access.data(), 9, access.size_bytes());
  }
  // Evicted by two others: dropped, and the host keeps its room.
  for (uint32_t id : {1u, 2u}) ASSERT_OK(s.residency->Access(ChunkId(id), Tier::kDevice).status());
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kFree);
  EXPECT_EQ(s.residency->stats().drops, 2u);
  EXPECT_EQ(s.residency->stats().evictions, 1u);
  EXPECT_EQ(s.residency->stats().tiers[static_cast<int>(Tier::kHost)].used_bytes, 0u);
  // Chunks that are not transient still move down with their bytes.
  ASSERT_OK(s.Fill(1, 5));
  ASSERT_OK(s.residency->Move(ChunkId(1), Tier::kNvme));
  EXPECT_TRUE(s.Holds(1, 5));
}

TEST(ResidencyTest, MovesBetweenEveryPairOfTiersKeepEveryByte) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(0, 42));
  const Tier path[] = {Tier::kDevice, Tier::kNvme, Tier::kHost, Tier::kNvme, Tier::kDevice, Tier::kHost, Tier::kDevice};
  for (Tier tier : path) {
    ASSERT_OK(s.residency->Move(ChunkId(0), tier));
    EXPECT_EQ(s.residency->tier(ChunkId(0)), tier);
  }
  EXPECT_TRUE(s.Holds(0, 42, Tier::kDevice));  // the emulated device is host-readable
  EXPECT_TRUE(s.Holds(0, 42, Tier::kHost));
  MemoryStats stats = s.residency->stats();
  for (int from = 0; from < kNumTiers; ++from) {
    for (int to = 0; to < kNumTiers; ++to) {
      if (from == to) continue;
      EXPECT_GE(stats.links[from][to].moves, 1u) << from << "->" << to;
    }
  }
}

TEST(ResidencyTest, EvictsLeastRecentlyUsedChunkOneTierDown) {
  ResidencyStack s({});  // device holds 2 chunks
  for (uint32_t id : {0u, 1u, 0u}) ASSERT_OK(s.residency->Access(ChunkId(id), Tier::kDevice).status());
  ASSERT_OK(s.residency->Access(ChunkId(2), Tier::kDevice).status());
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kDevice);  // used more recently than 1
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kHost);
  EXPECT_EQ(s.residency->tier(ChunkId(2)), Tier::kDevice);
  EXPECT_EQ(s.residency->stats().evictions, 1u);
}

TEST(ResidencyTest, EvictionCascadesDeviceToHostToNvme) {
  ResidencyStack s({});  // device 2, host 2
  for (uint32_t id = 0; id < 6; ++id) ASSERT_OK(s.Fill(id, static_cast<uint8_t>(id)));
  for (uint32_t id = 0; id < 6; ++id) ASSERT_OK(s.residency->Access(ChunkId(id), Tier::kDevice).status());
  int on[kNumTiers] = {};
  for (uint32_t id = 0; id < 6; ++id) on[static_cast<int>(*s.residency->tier(ChunkId(id)))]++;
  EXPECT_EQ(on[0], 2);
  EXPECT_EQ(on[1], 2);
  EXPECT_EQ(on[2], 2);
  for (uint32_t id = 0; id < 6; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(id))) << id;
}

TEST(ResidencyTest, PinnedChunksAreNeverEvictedAndFullTierIsOutOfMemory) {
  ResidencyStack s({});
  ASSERT_OK_AND_ASSIGN(ChunkAccess a, s.residency->Access(ChunkId(0), Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(ChunkAccess b, s.residency->Access(ChunkId(1), Tier::kDevice));
  Result<ChunkAccess> c = s.residency->Access(ChunkId(2), Tier::kDevice);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kOutOfMemory);
  for (const char* part : {"device tier", "every chunk on it is in use", "128KiB of 128KiB"}) {
    EXPECT_NE(c.status().message().find(part), std::string::npos) << c.status().ToString();
  }
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kDevice);
  b.Release();
  EXPECT_OK(s.residency->Access(ChunkId(2), Tier::kDevice).status());
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kHost);
}

TEST(ResidencyTest, FullHostWithoutNvmeIsOutOfMemoryNamingTheOption) {
  ResidencyStack s({.nvme_chunks = 0});
  for (uint32_t id = 0; id < 2; ++id) ASSERT_OK(s.Fill(id, 1));  // host holds 2
  Status status = s.residency->Access(ChunkId(2), Tier::kHost).status();
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory);
  EXPECT_NE(status.message().find("nvme.dirs"), std::string::npos) << status.ToString();
  EXPECT_EQ(s.residency->Move(ChunkId(0), Tier::kNvme).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(s.Holds(0, 1));
}

TEST(ResidencyTest, ReadChunkCopiesFromAnyTierWithoutMovingIt) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(0, 77));
  Buffer copy = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  for (Tier tier : {Tier::kHost, Tier::kDevice, Tier::kNvme}) {
    ASSERT_OK(s.residency->Move(ChunkId(0), tier));
    std::memset(copy.data(), 0xFF, copy.size_bytes());
    ASSERT_OK(s.residency->ReadChunk(ChunkId(0), copy.bytes()));
    EXPECT_EQ(s.residency->tier(ChunkId(0)), tier);
    for (uint64_t i = 0; i < copy.size_bytes(); ++i) {
      ASSERT_EQ(copy.bytes()[i], std::byte(static_cast<uint8_t>(77 + i * 7))) << TierName(tier) << " byte " << i;
    }
  }
  ASSERT_OK(s.residency->ReadChunk(ChunkId(6), copy.bytes()));  // free: zeros
  EXPECT_EQ(copy.bytes()[10], std::byte{0});
}

// WriteChunk overwrites a chunk where it is, reading nothing: on NVMe into
// a fresh slot (a failed write leaves the old bytes), a free chunk homed on
// NVMe straight there.
TEST(ResidencyTest, WriteChunkOverwritesWhereTheChunkIsWithoutReadingIt) {
  ResidencyStack s({});
  Buffer bytes = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  const auto pattern = [&](uint8_t value) {
    for (uint64_t i = 0; i < bytes.size_bytes(); ++i) bytes.bytes()[i] = std::byte(static_cast<uint8_t>(value + i * 7));
  };
  for (Tier tier : {Tier::kHost, Tier::kDevice, Tier::kNvme}) {
    ASSERT_OK(s.Fill(0, 1));
    ASSERT_OK(s.residency->Move(ChunkId(0), tier));
    const int reads = s.faults->reads();
    pattern(static_cast<uint8_t>(40 + static_cast<int>(tier)));
    ASSERT_OK(s.residency->WriteChunk(ChunkId(0), bytes.bytes()));
    EXPECT_EQ(s.residency->tier(ChunkId(0)), tier);
    EXPECT_EQ(s.faults->reads(), reads) << TierName(tier);
    EXPECT_TRUE(s.Holds(0, static_cast<uint8_t>(40 + static_cast<int>(tier)))) << TierName(tier);
  }
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kNvme));
  const uint64_t used = s.nvme_pool->usage().used_bytes;
  pattern(90);
  s.faults->FailWrites(EIO);
  EXPECT_EQ(s.residency->WriteChunk(ChunkId(0), bytes.bytes()).code(), StatusCode::kIoError);
  EXPECT_EQ(s.nvme_pool->usage().used_bytes, used);  // the fresh slot returned
  EXPECT_TRUE(s.Holds(0, 40 + static_cast<int>(Tier::kNvme)));  // the bytes before the failed write
  s.residency->SetHome(ChunkId(5), Tier::kNvme);
  pattern(70);
  ASSERT_OK(s.residency->WriteChunk(ChunkId(5), bytes.bytes()));
  EXPECT_EQ(s.residency->tier(ChunkId(5)), Tier::kNvme);
  EXPECT_TRUE(s.Holds(5, 70));
  EXPECT_EQ(s.residency->WriteChunk(ChunkId(5), bytes.bytes() + 8).code(), StatusCode::kInvalidArgument);
}

// FillIfOn writes a transient chunk only where it already is, in hold: a
// free chunk, one on another tier or one pinned is left alone (nothing runs,
// nothing moves), and a chunk that is not transient is refused. While the
// fill runs the chunk is in flight: a chunk that needs its room waits for
// the fill and then evicts it, rather than finding it pinned (OutOfMemory).
TEST(ResidencyTest, FillIfOnWritesATransientChunkWhereItIsAndRoomWaitsForTheFill) {
  ResidencyStack s({.transient_chunks = 1});  // the device holds two chunks
  const uint64_t bytes = s.config.chunk_bytes;
  std::atomic<int> calls{0};
  const auto fill = [&](int value) {
    return [&calls, bytes, value](std::byte* data) {
      calls++;
      std::memset(data, value, bytes);
      return Status::Ok();
    };
  };
  ASSERT_OK_AND_ASSIGN(std::optional<uint64_t> filled, s.residency->FillIfOn(ChunkId(0), Tier::kDevice, fill(1)));
  EXPECT_FALSE(filled.has_value());  // free
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kFree);
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kHost));
  ASSERT_OK_AND_ASSIGN(filled, s.residency->FillIfOn(ChunkId(0), Tier::kDevice, fill(1)));
  EXPECT_FALSE(filled.has_value());  // on the host
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kDevice));
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess pinned, s.residency->Access(ChunkId(0), Tier::kDevice));
    ASSERT_OK_AND_ASSIGN(filled, s.residency->FillIfOn(ChunkId(0), Tier::kDevice, fill(1)));
    EXPECT_FALSE(filled.has_value());  // pinned
  }
  EXPECT_EQ(calls.load(), 0);
  ASSERT_OK_AND_ASSIGN(filled, s.residency->FillIfOn(ChunkId(0), Tier::kDevice, fill(6)));
  ASSERT_TRUE(filled.has_value());
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
    EXPECT_EQ(access.generation(), *filled);
    for (uint64_t i = 0; i < bytes; ++i) ASSERT_EQ(access.data()[i], std::byte{6});
  }
  EXPECT_EQ(s.residency->FillIfOn(ChunkId(1), Tier::kDevice, fill(1)).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(calls.load(), 1);

  // The device: chunk 1 pinned, chunk 0 being filled. Chunk 2 waits for the fill, then takes chunk 0's room.
  ASSERT_OK_AND_ASSIGN(ChunkAccess other, s.residency->Access(ChunkId(1), Tier::kDevice));
  std::atomic<bool> filling{false};
  std::thread filler([&] {
    Result<std::optional<uint64_t>> slow = s.residency->FillIfOn(ChunkId(0), Tier::kDevice, [&](std::byte* data) {
      filling = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
      std::memset(data, 7, bytes);
      return Status::Ok();
    });
    EXPECT_OK(slow.status());
  });
  while (!filling) std::this_thread::yield();
  Result<ChunkAccess> third = s.residency->Access(ChunkId(2), Tier::kDevice);
  filler.join();
  EXPECT_OK(third.status());
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kFree);  // evicted: dropped
}

// A fill that fails keeps the chunk where it is (its bytes, partly written,
// get a new generation); a fill that timed out (a copy that may still write)
// leaves the chunk free and its slot allocated for good.
TEST(ResidencyTest, AFailedFillKeepsTheChunkAndATimedOutOneQuarantinesItsSlot) {
  ResidencyStack s({.transient_chunks = 1});
  const auto generation = [&] {
    Result<ChunkAccess> pin = s.residency->Access(ChunkId(0), Tier::kDevice);
    EXPECT_OK(pin.status());
    return pin.ok() ? pin->generation() : 0;
  };
  const uint64_t before = generation();
  Result<std::optional<uint64_t>> failed =
      s.residency->FillIfOn(ChunkId(0), Tier::kDevice, [](std::byte*) { return IoError("injected"); });
  EXPECT_EQ(failed.status().code(), StatusCode::kIoError);
  EXPECT_NE(failed.status().message().find("filling chunk 0 on device"), std::string::npos) << failed.status().ToString();
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kDevice);
  EXPECT_NE(generation(), before);
  const uint64_t used = s.residency->stats().tiers[static_cast<int>(Tier::kDevice)].used_bytes;
  Result<std::optional<uint64_t>> late =
      s.residency->FillIfOn(ChunkId(0), Tier::kDevice, [](std::byte*) { return Timeout("injected"); });
  EXPECT_EQ(late.status().code(), StatusCode::kTimeout);
  EXPECT_EQ(s.residency->state(ChunkId(0)), ChunkState::kFree);
  EXPECT_EQ(s.residency->stats().tiers[static_cast<int>(Tier::kDevice)].used_bytes, used);  // the slot kept
  ASSERT_OK(s.residency->Access(ChunkId(0), Tier::kDevice).status());  // materialized in the other slot
  EXPECT_EQ(s.residency->stats().tiers[static_cast<int>(Tier::kDevice)].used_bytes, used + s.config.chunk_bytes);
}

// A pin's generation names the chunk's placement: pins of one placement
// agree; a move, a drop, a materialization, a fill or a WriteChunk gives a new one.
TEST(ResidencyTest, AChunksGenerationChangesWithEveryNewSlotOrOverwrite) {
  ResidencyStack s({.transient_chunks = 1});
  const auto generation = [&](uint32_t id, Tier tier) {
    Result<ChunkAccess> pin = s.residency->Access(ChunkId(id), tier);
    EXPECT_OK(pin.status());
    return pin.ok() ? pin->generation() : 0;
  };
  const uint64_t materialized = generation(0, Tier::kDevice);
  EXPECT_EQ(generation(0, Tier::kDevice), materialized);
  ASSERT_OK_AND_ASSIGN(std::optional<uint64_t> filled,
                       s.residency->FillIfOn(ChunkId(0), Tier::kDevice, [](std::byte*) { return Status::Ok(); }));
  ASSERT_TRUE(filled.has_value());
  EXPECT_NE(*filled, materialized);
  EXPECT_EQ(generation(0, Tier::kDevice), *filled);
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kHost));  // transient: dropped
  const uint64_t again = generation(0, Tier::kDevice);     // materialized anew, maybe in the same slot
  EXPECT_NE(again, *filled);
  Buffer bytes = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  ASSERT_OK(s.residency->WriteChunk(ChunkId(0), bytes.bytes()));
  EXPECT_NE(generation(0, Tier::kDevice), again);
  // A chunk that is not transient: up and down with its bytes, a new placement each time.
  ASSERT_OK(s.Fill(1, 4));
  const uint64_t host = generation(1, Tier::kHost);
  ASSERT_OK(s.residency->Move(ChunkId(1), Tier::kDevice));
  EXPECT_NE(generation(1, Tier::kDevice), host);
}

TEST(ResidencyTest, AccessOnAnotherTierWhilePinnedIsInvalid) {
  ResidencyStack s({});
  ASSERT_OK_AND_ASSIGN(ChunkAccess pinned, s.residency->Access(ChunkId(0), Tier::kHost));
  ASSERT_OK_AND_ASSIGN(ChunkAccess shared, s.residency->Access(ChunkId(0), Tier::kHost));  // same tier: shared
  Result<ChunkAccess> elsewhere = s.residency->Access(ChunkId(0), Tier::kDevice);
  EXPECT_EQ(elsewhere.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.residency->Move(ChunkId(0), Tier::kNvme).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.residency->Access(ChunkId(0), Tier::kNvme).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(s.residency->Access(ChunkId(99), Tier::kHost).status().code(), StatusCode::kInvalidArgument);
}

TEST(ResidencyTest, FailedNvmeWriteDuringEvictionLosesNothing) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(0, 10));
  ASSERT_OK(s.Fill(1, 11));  // host is full
  s.faults->FailWrites(ENOSPC);
  Status status = s.residency->Access(ChunkId(2), Tier::kHost).status();
  EXPECT_EQ(status.code(), StatusCode::kIoError) << status.ToString();
  EXPECT_NE(status.message().find("evicting"), std::string::npos) << status.ToString();
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
  EXPECT_TRUE(s.Holds(0, 10));
  EXPECT_TRUE(s.Holds(1, 11));
  EXPECT_EQ(s.nvme_pool->usage().used_bytes, 0u);  // the failed slot was returned
  EXPECT_OK(s.residency->Access(ChunkId(2), Tier::kHost).status());  // the fault has passed
}

TEST(ResidencyTest, CorruptChunkOnNvmeIsCorruptionAndStaysPut) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(3, 33));
  s.faults->CorruptWrites(1);
  ASSERT_OK(s.residency->Move(ChunkId(3), Tier::kNvme));
  Status status = s.residency->Access(ChunkId(3), Tier::kHost).status();
  EXPECT_EQ(status.code(), StatusCode::kCorruption) << status.ToString();
  EXPECT_NE(status.message().find("chunk 3"), std::string::npos) << status.ToString();
  EXPECT_EQ(s.residency->tier(ChunkId(3)), Tier::kNvme);
  EXPECT_EQ(s.residency->state(ChunkId(3)), ChunkState::kHold);
}

TEST(ResidencyTest, NvmeReadErrorReachesTheCaller) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(0, 1));
  ASSERT_OK(s.residency->Move(ChunkId(0), Tier::kNvme));
  s.faults->FailReads(EIO);
  EXPECT_EQ(s.residency->Access(ChunkId(0), Tier::kDevice).status().code(), StatusCode::kIoError);
  EXPECT_TRUE(s.Holds(0, 1));
}

TEST(ResidencyTest, StuckCopyIsTimeoutAndChunkStaysIntact) {
  // 64 KiB at 0.0001 GB/s takes ~650 ms; the manager waits 10 ms. (At ~65 ms
  // a loaded CI machine once woke the waiter after the copy had ended.)
  ResidencyStack s({.bandwidth_gbps = 0.0001, .timeout_ms = 10});
  ASSERT_OK(s.Fill(0, 5));
  Status status = s.residency->Move(ChunkId(0), Tier::kDevice);
  EXPECT_EQ(status.code(), StatusCode::kTimeout) << status.ToString();
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
  EXPECT_TRUE(s.Holds(0, 5));
  ASSERT_OK(s.device->Synchronize(5'000));  // let the stray copy finish before teardown
}

TEST(ResidencyTest, AsynchronousMovesCompleteAndKeepBytes) {
  ResidencyStack s({.num_chunks = 8, .device_chunks = 3, .host_chunks = 3});
  for (uint32_t id = 0; id < 6; ++id) ASSERT_OK(s.Fill(id, static_cast<uint8_t>(100 + id)));
  std::vector<std::shared_future<Status>> moves;
  for (uint32_t id = 0; id < 6; ++id) moves.push_back(s.residency->MoveAsync(ChunkId(id), id % 2 ? Tier::kNvme : Tier::kDevice));
  for (auto& move : moves) EXPECT_OK(move.get());
  for (uint32_t id = 0; id < 6; ++id) {
    EXPECT_EQ(s.residency->tier(ChunkId(id)), id % 2 ? Tier::kNvme : Tier::kDevice);
    EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(100 + id)));
  }
}

TEST(ResidencyTest, MoveAllHomeReturnsUnpinnedChunks) {
  ResidencyStack s({});
  ASSERT_OK(s.Fill(0, 1));
  ASSERT_OK(s.Fill(1, 2));
  s.residency->SetHome(ChunkId(0), Tier::kNvme);
  ASSERT_OK_AND_ASSIGN(ChunkAccess pinned, s.residency->Access(ChunkId(1), Tier::kDevice));
  ASSERT_OK(s.residency->MoveAllHome());
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kNvme);
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kDevice);  // pinned: stays
  EXPECT_EQ(s.residency->state(ChunkId(5)), ChunkState::kFree);  // free: stays free
}

}  // namespace
}  // namespace strata::memory

namespace strata::memory {
namespace {

using testing::ResidencyStack;

TEST(ResidencyTest, SwapThatCannotHappenIsOutOfMemoryAtOnceNotATimeout) {
  // Device and host hold one chunk each, and there is no NVMe: bringing the
  // host chunk up would need the device chunk to go down into the slot the
  // host chunk still holds.
  ResidencyStack s({.device_chunks = 1, .host_chunks = 1, .nvme_chunks = 0, .timeout_ms = 5'000});
  ASSERT_OK(s.residency->Access(ChunkId(0), Tier::kDevice).status());
  ASSERT_OK(s.Fill(1, 1));
  auto start = std::chrono::steady_clock::now();
  Status status = s.residency->Access(ChunkId(1), Tier::kDevice).status();
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  EXPECT_EQ(status.code(), StatusCode::kOutOfMemory) << status.ToString();
  EXPECT_LT(seconds, 2.0);
  EXPECT_TRUE(s.Holds(1, 1));
}

TEST(ResidencyTest, VictimThatTheTierBelowCannotHoldGoesFurtherDown) {
  // The same swap with an NVMe tier: the device chunk goes straight to NVMe.
  ResidencyStack s({.device_chunks = 1, .host_chunks = 1, .timeout_ms = 5'000});
  ASSERT_OK(s.residency->Access(ChunkId(0), Tier::kDevice).status());
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess access, s.residency->Access(ChunkId(0), Tier::kDevice));
    std::memset(access.data(), 0x5A, access.size_bytes());
  }
  ASSERT_OK(s.Fill(1, 1));
  ASSERT_OK(s.residency->Access(ChunkId(1), Tier::kDevice).status());
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kDevice);
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kNvme);
  EXPECT_TRUE(s.Holds(1, 1, Tier::kDevice));
  Buffer aligned = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  ASSERT_OK(s.residency->ReadChunk(ChunkId(0), aligned.bytes()));
  for (uint64_t i = 0; i < s.config.chunk_bytes; ++i) ASSERT_EQ(aligned.bytes()[i], std::byte{0x5A}) << i;
}

// Device of four small slots holding chunks 1 and 3 (0 and 2 sent back to
// the host): two free slots, apart, for chunk 4 of twice the size.
ResidencyStack::Config FragmentedDevice() {
  const uint64_t small = 64 << 10;
  return {.chunk_bytes = small, .device_chunks = 4, .host_chunks = 8, .chunk_sizes = {small, small, small, small, 2 * small}};
}

Status FragmentDevice(ResidencyStack& s) {
  for (uint32_t id = 0; id < 5; ++id) STRATA_RETURN_IF_ERROR(s.Fill(id, static_cast<uint8_t>(10 + id)));
  for (uint32_t id = 0; id < 4; ++id) STRATA_RETURN_IF_ERROR(s.residency->Move(ChunkId(id), Tier::kDevice));
  for (uint32_t id : {0u, 2u}) STRATA_RETURN_IF_ERROR(s.residency->Move(ChunkId(id), Tier::kHost));
  return Status::Ok();
}

TEST(ResidencyTest, FreeSpaceInPiecesIsJoinedByMovingChunksWithinTheTierNotByEvicting) {
  ResidencyStack s(FragmentedDevice());
  ASSERT_OK(FragmentDevice(s));
  ASSERT_EQ(s.device_pool->largest_free_bytes(), s.config.chunk_bytes);
  const MemoryStats before = s.residency->stats();
  {
    // Chunk 3 is in use (against the tier's end, it stays there): the window
    // is chunk 1's slot and a free one beside it.
    ASSERT_OK_AND_ASSIGN(ChunkAccess pinned, s.residency->Access(ChunkId(3), Tier::kDevice));
    EXPECT_EQ(pinned.data(), s.device_pool->Address({3 * s.config.chunk_bytes, s.config.chunk_bytes}));
    ASSERT_OK(s.residency->Access(ChunkId(4), Tier::kDevice).status());
    EXPECT_EQ(pinned.data(), s.device_pool->Address({3 * s.config.chunk_bytes, s.config.chunk_bytes}));  // not moved
  }
  for (uint32_t id : {1u, 3u, 4u}) EXPECT_EQ(s.residency->tier(ChunkId(id)), Tier::kDevice) << id;
  MemoryStats stats = s.residency->stats();
  EXPECT_EQ(stats.evictions - before.evictions, 0u);
  EXPECT_EQ(stats.compactions - before.compactions, 1u);
  EXPECT_EQ(stats.compacted_bytes - before.compacted_bytes, s.config.chunk_bytes);
  for (uint32_t id = 0; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(10 + id), Tier::kHost)) << id;
}

// Issue 22: pinned while the tier is full, chunk 1 would split the room of
// this tight tier (two of its largest chunks) in two slots; no free room
// lies against an end, so room is made there (chunk 0 evicted), and chunk 4
// fits beside the pins once chunk 2 leaves.
TEST(ResidencyTest, AChunkPinnedWithoutFreeRoomWhereItKeepsTheRoomWholeGetsRoomMadeThere) {
  ResidencyStack s(FragmentedDevice());
  const uint64_t slot = s.config.chunk_bytes;
  for (uint32_t id = 0; id < 5; ++id) ASSERT_OK(s.Fill(id, static_cast<uint8_t>(10 + id)));
  for (uint32_t id = 0; id < 4; ++id) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kDevice));
  const MemoryStats before = s.residency->stats();
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
    EXPECT_EQ(one.data(), s.device_pool->Address({0, slot}));  // where chunk 0 was
    EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
    ASSERT_OK_AND_ASSIGN(ChunkAccess three, s.residency->Access(ChunkId(3), Tier::kDevice));
    EXPECT_EQ(three.data(), s.device_pool->Address({3 * slot, slot}));  // at the tier's end: stays
    ASSERT_OK(s.residency->Move(ChunkId(2), Tier::kHost));
    ASSERT_OK_AND_ASSIGN(ChunkAccess big, s.residency->Access(ChunkId(4), Tier::kDevice));
    EXPECT_EQ(big.data(), s.device_pool->Address({slot, 2 * slot}));
  }
  MemoryStats stats = s.residency->stats();
  EXPECT_EQ(stats.evictions - before.evictions, 1u);    // chunk 0, for chunk 1's place
  EXPECT_EQ(stats.compactions - before.compactions, 1u);  // chunk 1 into it
  for (uint32_t id = 0; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(10 + id), Tier::kHost)) << id;
}

// Chunks of one size never split the room for each other: a chunk pinned
// anywhere stays there, and nothing moves.
TEST(ResidencyTest, ChunksOfOneSizeArePinnedWhereTheyLie) {
  ResidencyStack s({.device_chunks = 4, .host_chunks = 8});
  for (uint32_t id = 0; id < 4; ++id) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(ChunkAccess two, s.residency->Access(ChunkId(2), Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
  EXPECT_EQ(two.data(), s.device_pool->Address({2 * s.config.chunk_bytes, s.config.chunk_bytes}));
  EXPECT_EQ(one.data(), s.device_pool->Address({s.config.chunk_bytes, s.config.chunk_bytes}));
  MemoryStats stats = s.residency->stats();
  EXPECT_EQ(stats.compactions + stats.evictions, 0u);
}

// A chunk whose own slot overlaps every place against the pins leaves it
// through the host (copies within the device must not overlap), a
// transient one too (copied, not dropped); a chunk that then needs the
// rest of the tier fits.
TEST(ResidencyTest, AChunkOverlappingItsPlaceAgainstThePinsGoesThroughTheHost) {
  const uint64_t k32 = 32 << 10;
  ResidencyStack s({.chunk_bytes = k32, .device_chunks = 8, .host_chunks = 16, .chunk_sizes = {4 * k32, 2 * k32, k32,
                    k32, 2 * k32}, .transient_chunks = 1});
  for (uint32_t id = 0; id < 5; ++id) ASSERT_OK(s.Fill(id, static_cast<uint8_t>(20 + id)));
  for (uint32_t id : {1u, 2u, 0u, 3u}) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kDevice));
  ASSERT_EQ(s.device_pool->usage().used_bytes, 8 * k32);  // 1 | 2 | 0 0 0 0 | 3
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
    ASSERT_EQ(one.data(), s.device_pool->Address({0, 2 * k32}));
    const MemoryStats before = s.residency->stats();
    ASSERT_OK_AND_ASSIGN(ChunkAccess zero, s.residency->Access(ChunkId(0), Tier::kDevice));
    EXPECT_EQ(zero.data(), s.device_pool->Address({2 * k32, 4 * k32}));  // against chunk 1
    EXPECT_EQ(s.residency->tier(ChunkId(2)), Tier::kHost);
    MemoryStats stats = s.residency->stats();
    EXPECT_EQ(stats.links[0][1].moves - before.links[0][1].moves, 2u);  // chunks 2 and 0
    EXPECT_EQ(stats.links[1][0].moves - before.links[1][0].moves, 1u);  // chunk 0 back
    EXPECT_EQ(stats.drops, 0u);
    ASSERT_OK_AND_ASSIGN(ChunkAccess four, s.residency->Access(ChunkId(4), Tier::kDevice));  // 256KiB of 256KiB pinned
    EXPECT_EQ(four.data(), s.device_pool->Address({6 * k32, 2 * k32}));
  }
  EXPECT_TRUE(s.Holds(0, 20, Tier::kDevice));
  for (uint32_t id = 1; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(20 + id), Tier::kHost)) << id;
}

// A chunk that arrives to be pinned goes straight to free room against the
// pins, not first to the lowest free slot and then there.
TEST(ResidencyTest, AChunkArrivingToBePinnedLandsAgainstThePinsWithoutAMoveWithinTheTier) {
  ResidencyStack s(FragmentedDevice());
  const uint64_t slot = s.config.chunk_bytes;
  for (uint32_t id = 0; id < 4; ++id) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(ChunkAccess three, s.residency->Access(ChunkId(3), Tier::kDevice));
  for (uint32_t id : {1u, 2u}) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kHost));
  ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
  EXPECT_EQ(one.data(), s.device_pool->Address({2 * slot, slot}));  // against chunk 3, not in slot 1
  EXPECT_EQ(s.residency->stats().compactions, 0u);
}

// Pins released out of order leave a hole between pins that a larger chunk
// cannot use: the limit Note [Pins against pins] states. The next chunk that
// fits the hole fills it.
TEST(ResidencyTest, APinReleasedOutOfOrderLeavesAHoleThatOnlyAChunkItHoldsFills) {
  ResidencyStack s(FragmentedDevice());
  const uint64_t slot = s.config.chunk_bytes;
  ASSERT_OK_AND_ASSIGN(ChunkAccess zero, s.residency->Access(ChunkId(0), Tier::kDevice));
  std::optional<ChunkAccess> one(s.residency->Access(ChunkId(1), Tier::kDevice).value());
  ASSERT_OK_AND_ASSIGN(ChunkAccess two, s.residency->Access(ChunkId(2), Tier::kDevice));
  one.reset();  // before chunk 2, pinned after it
  ASSERT_OK(s.residency->Move(ChunkId(1), Tier::kHost));
  Result<ChunkAccess> big = s.residency->Access(ChunkId(4), Tier::kDevice);
  EXPECT_EQ(big.status().code(), StatusCode::kOutOfMemory) << big.status().ToString();
  EXPECT_NE(big.status().message().find("(2 in use hold 128KiB), its 128KiB free in pieces between them"),
            std::string::npos)
      << big.status().ToString();
  ASSERT_OK_AND_ASSIGN(ChunkAccess three, s.residency->Access(ChunkId(3), Tier::kDevice));
  EXPECT_EQ(three.data(), s.device_pool->Address({slot, slot}));
}

// Issue 22: pins scattered over the tier split its room. On this tight tier
// (two of its largest chunks) a chunk whose pin would leave the room in
// pieces moves into free room against the pins or an end first (Note [Pins
// against pins]).
TEST(ResidencyTest, AChunkPinnedLiesAgainstPinsSoThatPinsDoNotSplitTheRoom) {
  ResidencyStack s(FragmentedDevice());
  ASSERT_OK(FragmentDevice(s));  // chunks 1 and 3 in hold at slots 1 and 3; slots 0 and 2 free
  const MemoryStats before = s.residency->stats();
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
    EXPECT_EQ(one.data(), s.device_pool->Address({0, s.config.chunk_bytes}));  // moved to the tier's start
    ASSERT_OK_AND_ASSIGN(ChunkAccess three, s.residency->Access(ChunkId(3), Tier::kDevice));  // at the end: stays
    EXPECT_EQ(three.data(), s.device_pool->Address({3 * s.config.chunk_bytes, s.config.chunk_bytes}));
    ASSERT_OK_AND_ASSIGN(ChunkAccess big, s.residency->Access(ChunkId(4), Tier::kDevice));
    EXPECT_EQ(big.data(), s.device_pool->Address({s.config.chunk_bytes, 2 * s.config.chunk_bytes}));
  }
  MemoryStats stats = s.residency->stats();
  EXPECT_EQ(stats.evictions - before.evictions, 0u);
  EXPECT_EQ(stats.compactions - before.compactions, 1u);
  for (uint32_t id = 0; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(10 + id), Tier::kHost)) << id;
}

// On a tier of many of its largest chunks, a pin that keeps a piece for the
// largest chunk stays where it lies, with room in pieces: no copy where the
// tier has room.
TEST(ResidencyTest, OnARoomyTierAChunkIsPinnedWhereItLiesWhileAPieceHoldsTheLargestChunk) {
  const uint64_t small = 64 << 10;
  ResidencyStack s({.chunk_bytes = small, .device_chunks = 16, .host_chunks = 32,
                    .chunk_sizes = {small, small, small, 2 * small}});
  for (uint32_t id = 0; id < 3; ++id) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
  EXPECT_EQ(one.data(), s.device_pool->Address({small, small}));
  EXPECT_EQ(s.residency->stats().compactions + s.residency->stats().evictions, 0u);
}

// Host of four small slots holding chunks 0 to 3 in hold, in that order;
// chunk 4, of twice the size, on NVMe.
ResidencyStack::Config FragmentedHost() {
  const uint64_t small = 64 << 10;
  return {.chunk_bytes = small, .device_chunks = 2, .host_chunks = 4,
          .chunk_sizes = {small, small, small, small, 2 * small}};
}

// Fills every chunk (with Fill(id, first + id)), sends them all to NVMe and
// brings `order` back to the host, in that order: each to the lowest free
// slot.
Status LayOnHost(ResidencyStack& s, uint8_t first, const std::vector<uint32_t>& order) {
  for (uint32_t id = 0; id < s.config.num_chunks; ++id) {
    STRATA_RETURN_IF_ERROR(s.Fill(id, static_cast<uint8_t>(first + id)));
    STRATA_RETURN_IF_ERROR(s.residency->Move(ChunkId(id), Tier::kNvme));
  }
  for (uint32_t id : order) STRATA_RETURN_IF_ERROR(s.residency->Move(ChunkId(id), Tier::kHost));
  return Status::Ok();
}

// Issue 22, the host tier: an optimizer step pins a group's chunks on the
// host together, and a tight host (two of its largest chunks) must hold
// them all. Chunk 1 pinned where it lies would leave the room in two slots
// apart; it moves to the tier's start within the host instead, so the chunk
// that needs the rest of the tier fits.
TEST(ResidencyTest, AChunkPinnedOnTheHostLiesAgainstPinsSoThatPinsDoNotSplitTheRoom) {
  ResidencyStack s(FragmentedHost());
  const uint64_t slot = s.config.chunk_bytes;
  ASSERT_OK(LayOnHost(s, 10, {0, 1, 2, 3}));
  for (uint32_t id : {0u, 2u}) ASSERT_OK(s.residency->Move(ChunkId(id), Tier::kNvme));
  const MemoryStats before = s.residency->stats();
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kHost));
    EXPECT_EQ(one.data(), s.host_pool->Address({0, slot}));
    ASSERT_OK_AND_ASSIGN(ChunkAccess three, s.residency->Access(ChunkId(3), Tier::kHost));  // at the end: stays
    EXPECT_EQ(three.data(), s.host_pool->Address({3 * slot, slot}));
    ASSERT_OK_AND_ASSIGN(ChunkAccess big, s.residency->Access(ChunkId(4), Tier::kHost));  // 256KiB of 256KiB pinned
    EXPECT_EQ(big.data(), s.host_pool->Address({slot, 2 * slot}));
  }
  MemoryStats stats = s.residency->stats();
  EXPECT_EQ(stats.evictions - before.evictions, 0u);
  EXPECT_EQ(stats.compactions - before.compactions, 1u);  // chunk 1, host to host
  for (uint32_t id = 0; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(10 + id), Tier::kHost)) << id;
}

// With the host full of chunks in hold, room against the pins is made by
// evicting one to NVMe, and the largest chunk then fits beside the pins.
TEST(ResidencyTest, AChunkPinnedOnAFullHostGetsRoomMadeAgainstThePinsByEvictingToNvme) {
  ResidencyStack s(FragmentedHost());
  const uint64_t slot = s.config.chunk_bytes;
  ASSERT_OK(LayOnHost(s, 10, {0, 1, 2, 3}));
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kHost));
    EXPECT_EQ(one.data(), s.host_pool->Address({0, slot}));  // where chunk 0 was
    EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kNvme);
    ASSERT_OK_AND_ASSIGN(ChunkAccess three, s.residency->Access(ChunkId(3), Tier::kHost));
    ASSERT_OK_AND_ASSIGN(ChunkAccess big, s.residency->Access(ChunkId(4), Tier::kHost));
    EXPECT_EQ(big.data(), s.host_pool->Address({slot, 2 * slot}));
    EXPECT_EQ(s.residency->tier(ChunkId(2)), Tier::kNvme);
  }
  for (uint32_t id = 0; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(10 + id), Tier::kHost)) << id;
}

// On the host a chunk whose own slot overlaps its place slides into it
// (copies within host memory may overlap): no round trip through NVMe.
TEST(ResidencyTest, AChunkOverlappingItsPlaceOnTheHostSlidesIntoIt) {
  const uint64_t k32 = 32 << 10;
  ResidencyStack s({.chunk_bytes = k32, .device_chunks = 8, .host_chunks = 8,
                    .chunk_sizes = {4 * k32, 2 * k32, k32, k32, 2 * k32}});
  ASSERT_OK(LayOnHost(s, 20, {1, 2, 0, 3}));
  ASSERT_EQ(s.host_pool->usage().used_bytes, 8 * k32);  // 1 1 | 2 | 0 0 0 0 | 3
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kHost));
    ASSERT_EQ(one.data(), s.host_pool->Address({0, 2 * k32}));
    const MemoryStats before = s.residency->stats();
    ASSERT_OK_AND_ASSIGN(ChunkAccess zero, s.residency->Access(ChunkId(0), Tier::kHost));
    EXPECT_EQ(zero.data(), s.host_pool->Address({2 * k32, 4 * k32}));  // against chunk 1
    MemoryStats stats = s.residency->stats();
    EXPECT_EQ(stats.links[1][2].moves - before.links[1][2].moves, 1u);  // chunk 2, not chunk 0
    EXPECT_EQ(stats.links[2][1].moves, before.links[2][1].moves);
    EXPECT_EQ(stats.compactions - before.compactions, 1u);  // the slide
    ASSERT_OK_AND_ASSIGN(ChunkAccess four, s.residency->Access(ChunkId(4), Tier::kHost));  // 256KiB of 256KiB pinned
    EXPECT_EQ(four.data(), s.host_pool->Address({6 * k32, 2 * k32}));
  }
  for (uint32_t id = 0; id < 5; ++id) EXPECT_TRUE(s.Holds(id, static_cast<uint8_t>(20 + id), Tier::kHost)) << id;
}

TEST(ResidencyTest, AMomentThatCannotFitTheTierIsOutOfMemoryNamingWhatItNeedsAndTheOption) {
  ResidencyStack s({.device_chunks = 2, .host_chunks = 4});
  ASSERT_OK_AND_ASSIGN(ChunkAccess zero, s.residency->Access(ChunkId(0), Tier::kDevice));
  ASSERT_OK_AND_ASSIGN(ChunkAccess one, s.residency->Access(ChunkId(1), Tier::kDevice));
  Result<ChunkAccess> two = s.residency->Access(ChunkId(2), Tier::kDevice);
  ASSERT_EQ(two.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(two.status().message().find("need 192KiB of the tier's 128KiB; raise device.budget to at least 192KiB or "
                                        "lower chunk.size_elems"),
            std::string::npos)
      << two.status().ToString();
}

TEST(ResidencyTest, ChunkMovedOnRequestCountsAsRecentlyUsed) {
  ResidencyStack s({});  // device holds 2
  ASSERT_OK(s.Fill(1, 1));                                            // used first, on the host
  ASSERT_OK(s.residency->Access(ChunkId(0), Tier::kDevice).status());  // used second
  ASSERT_OK(s.residency->Move(ChunkId(1), Tier::kDevice));            // prefetched last
  ASSERT_OK(s.residency->Access(ChunkId(2), Tier::kDevice).status());
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kDevice);
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
}

TEST(ResidencyTest, EvictionPrefersChunksThatAreNotAtHome) {
  ResidencyStack s({});  // host holds 2
  s.residency->SetHome(ChunkId(0), Tier::kHost);
  s.residency->SetHome(ChunkId(1), Tier::kNvme);
  ASSERT_OK(s.Fill(0, 1));  // least recently used, but at home on the host
  ASSERT_OK(s.Fill(1, 2));
  ASSERT_OK(s.Fill(2, 3));
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kNvme);
}

TEST(ResidencyTest, MoveAllHomeMovesDownBeforeUp) {
  ResidencyStack s({});  // host holds 2
  s.residency->SetHome(ChunkId(2), Tier::kNvme);
  ASSERT_OK(s.Fill(0, 1));
  ASSERT_OK(s.Fill(2, 3));
  ASSERT_OK(s.residency->Access(ChunkId(1), Tier::kDevice).status());  // home: host
  ASSERT_OK(s.residency->MoveAllHome());
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kHost);
  EXPECT_EQ(s.residency->tier(ChunkId(1)), Tier::kHost);
  EXPECT_EQ(s.residency->tier(ChunkId(2)), Tier::kNvme);
  EXPECT_EQ(s.residency->stats().evictions, 0u);
}

TEST(ResidencyTest, BounceBufferOfATimedOutCopyIsNeverReused) {
  // 64 KiB at 0.001 GB/s: the device->host leg of a device->NVMe move takes
  // ~65 ms and the manager waits 10 ms.
  ResidencyStack s({.bandwidth_gbps = 0.001, .timeout_ms = 10});
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess on_device, s.residency->Access(ChunkId(0), Tier::kDevice));
    std::memset(on_device.data(), 0x5C, on_device.size_bytes());
  }
  EXPECT_EQ(s.residency->Move(ChunkId(0), Tier::kNvme).code(), StatusCode::kTimeout);
  EXPECT_EQ(s.residency->tier(ChunkId(0)), Tier::kDevice);
  EXPECT_EQ(s.nvme_pool->usage().used_bytes, 0u);  // the NVMe slot was never written: returned
  // A new NVMe chunk is zero-filled through a bounce buffer while the late copy still runs.
  ASSERT_OK(s.residency->Move(ChunkId(1), Tier::kNvme));
  ASSERT_OK(s.device->Synchronize(5'000));
  Buffer copy = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  ASSERT_OK(s.residency->ReadChunk(ChunkId(1), copy.bytes()));
  for (uint64_t i = 0; i < copy.size_bytes(); ++i) ASSERT_EQ(copy.bytes()[i], std::byte{0}) << i;
}

// Storage that refuses the next `refusals` RegisterBuffer calls, as a backend
// whose kernel registration fails would; reads and writes pass through.
class RefusingRegistration final : public Storage {
 public:
  RefusingRegistration(std::unique_ptr<Storage> base, int refusals) : base_(std::move(base)), refusals_(refusals) {}
  std::string Describe() const override { return base_->Describe(); }
  size_t capacity_bytes() const override { return base_->capacity_bytes(); }
  size_t alignment_bytes() const override { return base_->alignment_bytes(); }
  Status Write(uint64_t offset, const std::byte* src, size_t size_bytes) override {
    return base_->Write(offset, src, size_bytes);
  }
  Status Read(uint64_t offset, std::byte* dst, size_t size_bytes) override { return base_->Read(offset, dst, size_bytes); }
  Status RegisterBuffer(void* data, size_t size_bytes) override {
    if (refusals_.fetch_sub(1, std::memory_order_relaxed) > 0) {  // a count only: no data rides on it
      return IoError("injected fault: registering {} bytes refused", size_bytes);
    }
    return base_->RegisterBuffer(data, size_bytes);
  }

 private:
  std::unique_ptr<Storage> base_;
  std::atomic<int> refusals_;
};

TEST(ResidencyTest, ABounceBufferWhoseRegistrationFailsGivesItsPlaceBack) {
  // The stack's device and memory tiers, with an NVMe tier whose storage refuses
  // more registrations than the manager may hold bounce buffers (transfer
  // workers + 2): a place kept by each refusal would leave none, and the next
  // move would wait out the timeout for one.
  ResidencyStack s({.nvme_chunks = 0, .timeout_ms = 2'000});
  s.residency.reset();  // this test's manager takes the stack's tiers
  constexpr int kRefusals = 8;
  RefusingRegistration storage(std::move(CreateMemoryStorage(16 * s.config.chunk_bytes)).value(), kRefusals);
  NvmeTierPool nvme(storage);
  std::vector<ChunkDesc> chunks;
  const uint64_t elements = s.config.chunk_bytes / 4;
  for (uint32_t i = 0; i < 2; ++i) chunks.push_back({ChunkId(i), ChunkKind::kParam, DType::kFloat32, i, elements, elements});
  ResidencyManager residency({.device = s.device.get(),
                              .device_pool = s.device_pool.get(),
                              .host_pool = s.host_pool.get(),
                              .nvme_pool = &nvme,
                              .transfer_workers = 2,
                              .wait_timeout_ms = s.config.timeout_ms},
                             chunks);
  {
    ASSERT_OK_AND_ASSIGN(ChunkAccess on_device, residency.Access(ChunkId(0), Tier::kDevice));
    std::memset(on_device.data(), 0x3A, on_device.size_bytes());
  }
  for (int i = 0; i < kRefusals; ++i) {
    const Status moved = residency.Move(ChunkId(0), Tier::kNvme);  // device -> NVMe goes through a bounce buffer
    ASSERT_EQ(moved.code(), StatusCode::kIoError) << "move " << i << ": " << moved.ToString();
    EXPECT_NE(moved.message().find("registering a pinned staging buffer"), std::string::npos) << moved.ToString();
    EXPECT_EQ(residency.tier(ChunkId(0)), Tier::kDevice);
    EXPECT_EQ(nvme.usage().used_bytes, 0u);  // the NVMe slot was never written: returned
  }
  ASSERT_OK(residency.Move(ChunkId(0), Tier::kNvme));  // registration accepted: a buffer is had at once
  Buffer copy = AllocateAlignedHost(s.config.chunk_bytes, 4096);
  ASSERT_OK(residency.ReadChunk(ChunkId(0), copy.bytes()));
  for (uint64_t i = 0; i < copy.size_bytes(); ++i) ASSERT_EQ(copy.bytes()[i], std::byte{0x3A}) << i;
}

TEST(ResidencyTest, ReadChunkRejectsMisalignedDestination) {
  ResidencyStack s({});
  Buffer copy = AllocateAlignedHost(s.config.chunk_bytes + 4096, 4096);
  EXPECT_EQ(s.residency->ReadChunk(ChunkId(0), copy.bytes() + 8).code(), StatusCode::kInvalidArgument);
}

TEST(ResidencyDeathTest, HandleOutlivingTheManagerAborts) {
  EXPECT_DEATH(
      {
        ResidencyStack s({});
        Result<ChunkAccess> kept = s.residency->Access(ChunkId(0), Tier::kHost);
        s.residency.reset();
      },
      "still accessed");
}

}  // namespace
}  // namespace strata::memory
