#include "offload/schedule/planner.h"

#include <random>

#include "test_util.h"

namespace strata::offload {
namespace {

// Chunks of one size; every home on the host; each moment needs the listed
// chunks and computes for `compute_seconds`.
PlannerInput UnitInput(const std::vector<std::vector<uint32_t>>& moments, uint32_t device_chunks,
                       double compute_seconds, double bytes_per_second, uint64_t chunk_bytes = 1000) {
  PlannerInput input;
  uint32_t chunks = 0;
  for (const auto& m : moments) {
    TraceMoment moment{.compute_seconds = compute_seconds};
    for (uint32_t c : m) {
      moment.chunks.push_back(ChunkId(c));
      chunks = std::max(chunks, c + 1);
    }
    input.trace.moments.push_back(moment);
  }
  input.chunk_bytes.assign(chunks, chunk_bytes);
  input.home.assign(chunks, Tier::kHost);
  input.device_bytes = device_chunks * chunk_bytes;
  input.links.bytes_per_second.fill(bytes_per_second);
  return input;
}

TEST(PlannerTest, EverythingFitsMeansNothingMovesInTheSteadyState) {
  PlannerInput input = UnitInput({{0, 1}, {2}, {1, 3}}, /*device_chunks=*/4, 1.0, 1000);
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_EQ(plan.prediction.fetches, 0u);
  EXPECT_EQ(plan.prediction.bytes_moved(), 0u);
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 0);
  EXPECT_DOUBLE_EQ(plan.prediction.step_seconds, 3.0);
}

TEST(PlannerTest, TwoChunksThroughOneSlotStallForTheWholeSwap) {
  // Each moment needs the chunk the other evicts: nothing can be hoisted.
  // Per moment: 1 s to take the other chunk off the device, 1 s to bring
  // this one, 1 s of compute.
  PlannerInput input = UnitInput({{0}, {1}}, /*device_chunks=*/1, 1.0, /*bytes_per_second=*/1000);
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_EQ(plan.prediction.fetches, 2u);
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kHostToDevice)], 2000u);
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kDeviceToHost)], 2000u);
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 4.0);
  EXPECT_DOUBLE_EQ(plan.prediction.step_seconds, 6.0);
}

TEST(PlannerTest, FetchesStartRightAfterTheirVictimsLastUse) {
  // Two slots, three chunks: m0 {0}, m1 {1}, m2 {0}, m3 {2}. Chunk 2 evicts
  // chunk 1 (next used furthest away), whose last use is m1: the fetch starts
  // at m2. Chunk 1 comes back for m1 of the next iteration evicting chunk 2,
  // last used at m3: that fetch starts at m0.
  PlannerInput input = UnitInput({{0}, {1}, {0}, {2}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/2000);
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  ASSERT_EQ(plan.fetches_at.size(), 4u);
  ASSERT_EQ(plan.fetches_at[0].size(), 1u);
  EXPECT_EQ(plan.fetches_at[0][0].chunk, ChunkId(1));
  EXPECT_EQ(plan.fetches_at[0][0].needed, 1u);
  EXPECT_EQ(plan.fetches_at[0][0].victims, std::vector<ChunkId>{ChunkId(2)});
  EXPECT_TRUE(plan.fetches_at[1].empty());
  ASSERT_EQ(plan.fetches_at[2].size(), 1u);
  EXPECT_EQ(plan.fetches_at[2][0].chunk, ChunkId(2));
  EXPECT_EQ(plan.fetches_at[2][0].needed, 3u);
  EXPECT_EQ(plan.fetches_at[2][0].victims, std::vector<ChunkId>{ChunkId(1)});
  EXPECT_TRUE(plan.fetches_at[3].empty());
  // Eviction (0.5 s) and fetch (0.5 s) fit in the 1 s of compute before the use.
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 0);
  EXPECT_DOUBLE_EQ(plan.prediction.step_seconds, 4.0);
  // LRU fetches the same chunks, on demand: 1 s of stall each.
  ASSERT_OK_AND_ASSIGN(Prediction lru, PredictLru(input));
  EXPECT_EQ(lru.fetches, 2u);
  EXPECT_DOUBLE_EQ(lru.stall_seconds, 2.0);
}

// A layer-by-layer model: forward 0..L-1, backward L-1..0, one chunk per
// layer, the device holding a few layers.
PlannerInput Layers(uint32_t layers, uint32_t device_chunks, double compute_seconds, double bytes_per_second) {
  std::vector<std::vector<uint32_t>> moments;
  for (uint32_t l = 0; l < layers; ++l) moments.push_back({l});
  for (uint32_t l = layers; l-- > 0;) moments.push_back({l});
  return UnitInput(moments, device_chunks, compute_seconds, bytes_per_second);
}

TEST(PlannerTest, PrefetchHidesTransfersWhenComputeIsLonger) {
  // 1 ms per chunk each way, 3 ms of compute per moment: every transfer can
  // hide behind compute; LRU waits for each one.
  PlannerInput input = Layers(12, /*device_chunks=*/4, 3e-3, /*bytes_per_second=*/1e6);
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  ASSERT_OK_AND_ASSIGN(Prediction lru, PredictLru(input));
  EXPECT_LE(plan.prediction.stall_fraction(), 0.05) << plan.prediction.stall_seconds;
  EXPECT_GT(lru.stall_fraction(), 5 * plan.prediction.stall_fraction());
  EXPECT_LE(plan.prediction.bytes_moved(), lru.bytes_moved());
  EXPECT_LE(plan.peak_device_bytes, input.device_bytes);
}

TEST(PlannerTest, NvmeHomedChunksPayTheDriveToo) {
  PlannerInput input = UnitInput({{0}, {1}}, /*device_chunks=*/1, 1.0, 1000);
  input.home = {Tier::kNvme, Tier::kNvme};
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kNvmeRead)], 2000u);
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kNvmeWrite)], 2000u);
  // Off the device 1 s, read 1 s (in parallel), onto the device 1 s.
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 4.0);
}

TEST(PlannerTest, NonModelMemoryGrowingEvictsChunksAndIsCountedAtEveryMoment) {
  // Activations take 2 of 4 chunk slots during m1 and m2.
  PlannerInput input = UnitInput({{0, 1}, {2}, {3}, {0, 1}}, /*device_chunks=*/4, 1.0, 1e6);
  input.trace.moments[1].non_model_bytes = 2000;
  input.trace.moments[2].non_model_bytes = 2000;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_LE(plan.peak_device_bytes, input.device_bytes);
  EXPECT_GT(plan.prediction.fetches, 0u);
}

TEST(PlannerTest, AChunkEvictedForActivationsIsNotFetchedBeforeItLeaves) {
  // m3's activations push chunk 0 out; m8 needs it back. Its fetch (victim:
  // chunk 1, last used at m1) must not start before m3, when it leaves.
  PlannerInput input = UnitInput({{0}, {1}, {}, {}, {}, {}, {}, {}, {0}, {}}, /*device_chunks=*/2, 1.0, 1000);
  input.trace.moments[3].non_model_bytes = 1000;
  input.trace.moments[8].non_model_bytes = 1000;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));  // the schedule check inside passes
  bool fetched_after_leaving = false;
  for (uint32_t k = 0; k < plan.num_moments; ++k) {
    for (const PlannedFetch& f : plan.fetches_at[k]) {
      if (f.chunk == ChunkId(0) && f.needed == 8) {
        EXPECT_GE(f.issue, 3u);
        fetched_after_leaving = true;
      }
    }
  }
  EXPECT_TRUE(fetched_after_leaving);
  EXPECT_EQ(plan.resident_at_start.size(), 2u);
}

TEST(PlannerTest, AMomentWaitsForTheRoomItsActivationsNeed) {
  // Two slots; m2's activations take one: a chunk leaves first (1 s over
  // device->host), and m2 cannot start before.
  PlannerInput input = UnitInput({{0}, {1}, {}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/1000);
  input.trace.moments[2].non_model_bytes = 1000;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  ASSERT_EQ(plan.evictions_at[2].size(), 1u);
  ASSERT_EQ(plan.prediction.stall_per_moment.size(), 3u);
  EXPECT_DOUBLE_EQ(plan.prediction.stall_per_moment[2], 1.0);
}

TEST(PlannerTest, AMomentThatCannotFitIsOutOfMemoryWithTheShortfall) {
  PlannerInput input = UnitInput({{0, 1, 2}}, /*device_chunks=*/2, 1.0, 1000);
  Result<Plan> plan = BuildPlan(input);
  EXPECT_EQ(plan.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(plan.status().message().find("moment 0"), std::string::npos) << plan.status().ToString();
  EXPECT_NE(plan.status().message().find("1000B more"), std::string::npos) << plan.status().ToString();
}

// Note [The device model]: the budget bounds the chunks; activations live
// beside it and evict chunks only when the two together exceed the device.
TEST(PlannerTest, ActivationsBesideTheBudgetEvictNothing) {
  // AMomentWaitsForTheRoomItsActivationsNeed's trace, on a device with room for the activations beside the budget.
  PlannerInput input = UnitInput({{0}, {1}, {}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/1000);
  input.trace.moments[2].non_model_bytes = 1000;
  input.device_chunk_bytes = input.device_bytes;
  input.device_bytes += 1000;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_TRUE(plan.evictions_at[2].empty());
  EXPECT_EQ(plan.prediction.fetches, 0u);
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 0);
  EXPECT_EQ(plan.peak_chunk_bytes, 2000u);
  EXPECT_EQ(plan.peak_device_bytes, 3000u);
}

TEST(PlannerTest, ChunksStayWithinTheBudgetWhateverRoomTheDeviceHas) {
  PlannerInput input = UnitInput({{0}, {1}, {2}}, /*device_chunks=*/10, 1.0, /*bytes_per_second=*/1000);
  input.device_chunk_bytes = 2000;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_EQ(plan.peak_chunk_bytes, 2000u);
  EXPECT_GT(plan.prediction.fetches, 0u);  // three chunks through two slots
  input.trace.moments[0].chunks = {ChunkId(0), ChunkId(1), ChunkId(2)};
  Result<Plan> refused = BuildPlan(input);
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  for (const char* part : {"moment 0 needs", "of chunks on the device", "1000B more", "device.budget"}) {
    EXPECT_NE(refused.status().message().find(part), std::string::npos) << refused.status().ToString();
  }
}

TEST(PlannerTest, MalformedInputsAreRejected) {
  PlannerInput input = UnitInput({{0}}, 1, 1.0, 1000);
  input.trace.moments[0].chunks.push_back(ChunkId(7));
  EXPECT_EQ(BuildPlan(input).status().code(), StatusCode::kInvalidArgument);
  input = UnitInput({{0}}, 1, 1.0, 1000);
  input.home[0] = Tier::kDevice;
  EXPECT_EQ(BuildPlan(input).status().code(), StatusCode::kInvalidArgument);
  input = UnitInput({{0}}, 1, 1.0, 0);
  EXPECT_EQ(PredictLru(input).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(BuildPlan(PlannerInput{}).status().code(), StatusCode::kInvalidArgument);
}

// Random traces of random chunk sizes and non-model memory: every plan
// passes BuildPlan's own schedule check (each moment's chunks on the device,
// no fetch of a chunk already there, no eviction of one that is not) and
// never holds more than the device.
TEST(PlannerTest, AHostMomentTakesItsChunkOffTheDeviceAndItComesBackAfter) {
  // m0 uses chunk 0 on the device, m1 chunk 1, m2 chunk 0 on the host (a CPU
  // update). Chunk 0 goes down right after m0 (1 s, hidden by m1) and up
  // again for the next m0, not before m2 ends: 1 s of stall there.
  PlannerInput input = UnitInput({{0}, {1}, {0}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/1000);
  input.trace.moments[2].tier = Tier::kHost;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  EXPECT_EQ(plan.compute_tier, (std::vector<Tier>{Tier::kDevice, Tier::kDevice, Tier::kHost}));
  EXPECT_EQ(plan.offloads_at[1], std::vector<ChunkId>{ChunkId(0)});
  ASSERT_EQ(plan.fetches_at[0].size(), 1u);
  EXPECT_EQ(plan.fetches_at[0][0].chunk, ChunkId(0));
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kDeviceToHost)], 1000u);
  EXPECT_EQ(plan.prediction.bytes[static_cast<int>(Link::kHostToDevice)], 1000u);
  EXPECT_EQ(plan.prediction.stall_per_moment, (std::vector<double>{1.0, 0.0, 0.0}));
  EXPECT_DOUBLE_EQ(plan.prediction.step_seconds, 4.0);
  EXPECT_EQ(plan.resident_at_start, std::vector<ChunkId>{ChunkId(1)});  // 0 left for m2 before
}

// m0 and m1 compute on the device with chunks 0 and 1 (homed on
// `device_home`, and on the device throughout); m2 updates chunk 2, homed on
// NVMe, on the host. Every link moves 1000 B/s, chunks are 1000 B.
PlannerInput HostUpdate(uint64_t staging_bytes, Tier device_home = Tier::kNvme) {
  PlannerInput input = UnitInput({{0}, {1}, {2}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/1000);
  input.trace.moments[2].tier = Tier::kHost;
  input.home = {device_home, device_home, Tier::kNvme};
  input.host_staging_bytes = staging_bytes;
  return input;
}

TEST(PlannerTest, NvmeChunksOfAHostMomentAreReadAheadAsFarAsStagingAllows) {
  // With room for one chunk: the read is issued at m0, and waits there for
  // the write-back of the iteration before (1 s); then 1 s of reading, done
  // when m2 begins.
  ASSERT_OK_AND_ASSIGN(Plan ahead, BuildPlan(HostUpdate(1000)));
  EXPECT_EQ(ahead.host_reads_at[0], (std::vector<PlannedRead>{{ChunkId(2), 2}}));
  EXPECT_EQ(ahead.prediction.bytes[static_cast<int>(Link::kNvmeRead)], 1000u);
  EXPECT_EQ(ahead.prediction.bytes[static_cast<int>(Link::kNvmeWrite)], 1000u);
  EXPECT_EQ(ahead.prediction.bytes[static_cast<int>(Link::kHostToDevice)], 0u);
  EXPECT_DOUBLE_EQ(ahead.prediction.stall_seconds, 0.0);
  EXPECT_DOUBLE_EQ(ahead.prediction.step_seconds, 3.0);
  // Without staging memory it is read when m2 begins: 1 s of stall.
  ASSERT_OK_AND_ASSIGN(Plan late, BuildPlan(HostUpdate(0)));
  EXPECT_EQ(late.host_reads_at[2], (std::vector<PlannedRead>{{ChunkId(2), 2}}));
  EXPECT_DOUBLE_EQ(late.prediction.stall_seconds, 1.0);
  ASSERT_OK_AND_ASSIGN(Prediction lru, PredictLru(HostUpdate(1000)));
  EXPECT_DOUBLE_EQ(lru.stall_seconds, 1.0);  // no read-ahead without a plan
}

TEST(PlannerTest, ReadsAheadUseTheHostRoomOfChunksOnTheDevice) {
  // No staging memory, but chunks 0 and 1 are homed on the host and stay on
  // the device: their host slots are free, and the read goes there at m0.
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(HostUpdate(0, Tier::kHost)));
  EXPECT_EQ(plan.host_read_room, (std::vector<uint64_t>{2000, 2000, 2000}));
  EXPECT_EQ(plan.host_reads_at[0], (std::vector<PlannedRead>{{ChunkId(2), 2}}));
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 0.0);
  EXPECT_DOUBLE_EQ(plan.prediction.step_seconds, 3.0);
  // Homed on NVMe they free no host slot there: the read waits for m2.
  ASSERT_OK_AND_ASSIGN(Plan late, BuildPlan(HostUpdate(0, Tier::kNvme)));
  EXPECT_EQ(late.host_read_room, (std::vector<uint64_t>{0, 0, 0}));
  EXPECT_EQ(late.host_reads_at[2], (std::vector<PlannedRead>{{ChunkId(2), 2}}));
}

TEST(PlannerTest, ReadsAheadStartWithTheirIterationNotAmongTheUpdatesBeforeIt) {
  // Forward and backward over chunks 0 and 1, then two updates of chunks 2
  // and 3, homed on NVMe, with staging for both. Each read could follow its
  // chunk's write-back in the updates of the iteration before; it is issued
  // from the iteration's first moment on, where the drive has nothing else to do.
  PlannerInput input = UnitInput({{0}, {1}, {1}, {0}, {2}, {3}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/1000);
  for (int m : {4, 5}) input.trace.moments[m].tier = Tier::kHost;
  input.home[2] = input.home[3] = Tier::kNvme;
  input.host_staging_bytes = 2000;
  ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
  uint32_t reads = 0;
  for (uint32_t k = 0; k < plan.num_moments; ++k) {
    for (const PlannedRead& r : plan.host_reads_at[k]) {
      reads++;
      EXPECT_LE(k, r.needed) << "chunk " << r.chunk.value() << " is read among the updates before its iteration";
      EXPECT_LT(k, 4u) << "chunk " << r.chunk.value() << " is read only once the updates begin";
    }
  }
  EXPECT_EQ(reads, 2u);
  EXPECT_DOUBLE_EQ(plan.prediction.stall_seconds, 0.0);
}

// Seven moments on the device, chunk 0 used by the first; then chunk 0's
// update on the host with chunk 7 (its state), homed on `state_home`.
PlannerInput LateUpdate(Tier state_home) {
  PlannerInput input =
      UnitInput({{0}, {1}, {2}, {3}, {4}, {5}, {6}, {0, 7}}, /*device_chunks=*/8, 1.0, /*bytes_per_second=*/1e6);
  input.trace.moments[7].tier = Tier::kHost;
  input.home[7] = state_home;
  return input;
}

TEST(PlannerTest, AnUpdateThatReadsFromNvmeTakesItsChunksOffTheDeviceShortlyBeforeIt) {
  const auto offloaded_at = [](const Plan& plan) {
    std::vector<uint32_t> at;
    for (uint32_t k = 0; k < plan.num_moments; ++k) {
      for (ChunkId c : plan.offloads_at[k]) {
        if (c == ChunkId(0)) at.push_back(k);
      }
    }
    return at;
  };
  // Its state on the host: chunk 0 goes right after its last use.
  ASSERT_OK_AND_ASSIGN(Plan on_host, BuildPlan(LateUpdate(Tier::kHost)));
  EXPECT_EQ(offloaded_at(on_host), std::vector<uint32_t>{1});
  // Its state read from NVMe: chunk 0 stays on the device, leaving its host
  // slot to reads ahead, until shortly before the update.
  ASSERT_OK_AND_ASSIGN(Plan reads, BuildPlan(LateUpdate(Tier::kNvme)));
  const std::vector<uint32_t> at = offloaded_at(reads);
  ASSERT_EQ(at.size(), 1u);
  EXPECT_GT(at[0], 1u);
  EXPECT_LT(at[0], 7u);
  EXPECT_EQ(reads.host_read_room[1], on_host.host_read_room[1] + 1000) << "chunk 0's host slot, free while on the device";
  EXPECT_DOUBLE_EQ(reads.prediction.stall_per_moment[7], 0.0);  // the offload crossed before the update
}

TEST(PlannerTest, AnUpdateRunsOnTheDeviceOnlyWhenItsStatesFitBesideEverythingElse) {
  PlannerInput input = HostUpdate(0);
  input.trace.moments[2].device_compute_seconds = 0.25;
  // Three slots: chunks 0 and 1 stay, and chunk 2 fits beside them: it moves
  // to the device once and stays; the update takes 0.25 s there.
  input.device_bytes = 3000;
  ASSERT_OK_AND_ASSIGN(Plan roomy, BuildPlan(input));
  EXPECT_EQ(roomy.compute_tier[2], Tier::kDevice);
  EXPECT_EQ(roomy.prediction.bytes_moved(), 0u);
  EXPECT_DOUBLE_EQ(roomy.prediction.step_seconds, 2.25);
  // Two slots: on the device it would push chunks 0 and 1 out every
  // iteration; it stays on the host.
  input.device_bytes = 2000;
  ASSERT_OK_AND_ASSIGN(Plan tight, BuildPlan(input));
  EXPECT_EQ(tight.compute_tier[2], Tier::kHost);
  EXPECT_EQ(tight.prediction.bytes[static_cast<int>(Link::kHostToDevice)], 0u);
}

// Forward over layers 0 and 1, backward back (1 s each on the device), and
// each layer's update on the host (1 s: its param chunk, 0 or 1, and its
// state chunk, 2 or 3): after backward, or beside it as soon as the layer's
// backward is done. The links are fast enough to leave out.
PlannerInput TwoLayerStep(bool overlapped) {
  const std::vector<std::vector<uint32_t>> between = {{0}, {1}, {1}, {0}, {1, 2}, {0, 3}};
  const std::vector<std::vector<uint32_t>> early = {{0}, {1}, {1}, {1, 2}, {0}, {0, 3}};
  PlannerInput input = UnitInput(overlapped ? early : between, /*device_chunks=*/4, 1.0, /*bytes_per_second=*/1e9);
  for (TraceMoment& m : input.trace.moments) {
    if (m.chunks.size() < 2) continue;
    m.tier = Tier::kHost;
    m.overlap = overlapped;
  }
  return input;
}

TEST(PlannerTest, OverlappedUpdatesOverlapItAndTheNextForwardWaitsForThem) {
  // After: 4 s of device moments, then 2 s of updates.
  ASSERT_OK_AND_ASSIGN(Plan after, BuildPlan(TwoLayerStep(false)));
  EXPECT_NEAR(after.prediction.step_seconds, 6.0, 1e-3);
  // Overlapped: layer 1's update runs with layer 0's backward (3 s to 4 s),
  // layer 0's from 4 s to 5 s, and the step (the iteration's end) waits for
  // it.
  ASSERT_OK_AND_ASSIGN(Plan overlapped, BuildPlan(TwoLayerStep(true)));
  EXPECT_NEAR(overlapped.prediction.step_seconds, 5.0, 1e-3);
  EXPECT_NEAR(overlapped.prediction.stall_per_moment[3], 0.0, 1e-9);  // the device's lane never waits for one
  EXPECT_EQ(overlapped.compute_tier[3], Tier::kHost);
  // An update longer than the rest of backward holds the step for the rest of it.
  PlannerInput slow = TwoLayerStep(true);
  slow.trace.moments[3].compute_seconds = 3.0;
  ASSERT_OK_AND_ASSIGN(Plan held, BuildPlan(slow));
  EXPECT_NEAR(held.prediction.step_seconds, 7.0, 1e-3);  // 3 s, layer 1's update to 6 s, layer 0's to 7 s
  // Only a host moment computes beside the others.
  PlannerInput wrong = TwoLayerStep(true);
  wrong.trace.moments[0].overlap = true;
  EXPECT_EQ(BuildPlan(wrong).status().code(), StatusCode::kInvalidArgument);
}

TEST(PlannerTest, AReadAheadWaitsForTheStagingMemoryAnEarlierWriteBackHolds) {
  // m0 computes on the device; m1 and m2 update chunks 1 and 2, homed on
  // NVMe, beside it. Each read, update and write-back takes 1 s. With room
  // for one chunk, chunk 2's read waits for chunk 1's write-back to free it;
  // with room for two it runs beside chunk 1's update.
  const auto step = [](uint64_t staging) {
    PlannerInput input = UnitInput({{0}, {1}, {2}}, /*device_chunks=*/2, 1.0, /*bytes_per_second=*/1000);
    for (int m : {1, 2}) {
      input.trace.moments[m].tier = Tier::kHost;
      input.trace.moments[m].overlap = true;
      input.home[m] = Tier::kNvme;
    }
    input.home[0] = Tier::kNvme;  // on the device, it frees no host room for the reads
    input.host_staging_bytes = staging;
    Result<Plan> plan = BuildPlan(input);
    EXPECT_OK(plan.status());
    return plan.ok() ? plan->prediction.step_seconds : 0.0;
  };
  const double one = step(1000), two = step(2000);
  EXPECT_GE(one, two + 0.9) << "room for one chunk: " << one << " s, for two: " << two << " s";
}

TEST(PlannerTest, RandomTracesGivePlansThatHoldTogether) {
  std::mt19937_64 rng(testing::TestSeed());
  for (int trial = 0; trial < 200; ++trial) {
    const uint32_t chunks = 2 + rng() % 12;
    const bool one_size = trial % 2 == 0;  // chunks of one size, or of many
    PlannerInput input;
    for (uint32_t c = 0; c < chunks; ++c) {
      input.chunk_bytes.push_back(one_size ? 1000 : 500 + rng() % 2000);
      input.home.push_back(rng() % 3 == 0 ? Tier::kNvme : Tier::kHost);
    }
    const uint64_t largest = *std::max_element(input.chunk_bytes.begin(), input.chunk_bytes.end());
    input.device_bytes = largest * (2 + rng() % 4);
    input.host_staging_bytes = largest * (rng() % 3);
    // Half the trials: chunks bounded by a budget, activations with room beside it (Note [The device model]).
    const uint64_t chunk_room = input.device_bytes;
    if (trial % 4 >= 2) {
      input.device_chunk_bytes = chunk_room;
      input.device_bytes += largest * (rng() % 3);
    }
    const uint32_t moments = 1 + rng() % 20;
    for (uint32_t m = 0; m < moments; ++m) {
      TraceMoment moment{.compute_seconds = 1e-3 * static_cast<double>(rng() % 5)};
      uint64_t bytes = 0;
      for (uint32_t k = 0; k < 1 + rng() % 3; ++k) {
        ChunkId c(static_cast<uint32_t>(rng() % chunks));
        if (std::find(moment.chunks.begin(), moment.chunks.end(), c) != moment.chunks.end()) continue;
        if (bytes + input.chunk_bytes[c.value()] > chunk_room) continue;
        moment.chunks.push_back(c);
        bytes += input.chunk_bytes[c.value()];
      }
      moment.non_model_bytes = rng() % (input.device_bytes - bytes + 1);
      if (rng() % 4 == 0) {  // a CPU update, which the planner may move to the device
        moment.tier = Tier::kHost;
        if (rng() % 2 == 0) moment.device_compute_seconds = 1e-4 * static_cast<double>(rng() % 5);
        moment.overlap = rng() % 2 == 0;
      }
      input.trace.moments.push_back(moment);
    }
    SCOPED_TRACE("trial " + std::to_string(trial));
    ASSERT_OK_AND_ASSIGN(Plan plan, BuildPlan(input));
    ASSERT_OK_AND_ASSIGN(Prediction lru, PredictLru(input));
    EXPECT_LE(plan.peak_device_bytes, input.device_bytes);
    EXPECT_LE(plan.peak_chunk_bytes, chunk_room);
    // Overlapped updates compute beside the rest.
    double overlapped = 0;
    for (const TraceMoment& m : input.trace.moments) overlapped += m.overlap ? m.compute_seconds : 0;
    EXPECT_GE(lru.step_seconds, lru.compute_seconds - overlapped - 1e-12);
    EXPECT_GE(plan.prediction.step_seconds, plan.prediction.compute_seconds - overlapped - 1e-12);
  }
}

}  // namespace
}  // namespace strata::offload
