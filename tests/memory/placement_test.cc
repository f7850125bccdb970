#include "memory/placement.h"

#include <algorithm>
#include <string>
#include <vector>

#include "test_util.h"

namespace strata::memory {
namespace {

constexpr uint64_t kKiB = 1024;
constexpr uint64_t kMiB = 1024 * kKiB;

// Eight modules of one fp32 tensor each, one 1024-element chunk per kind:
// 32 chunks of 4 KiB (param, grad, exp_avg, exp_avg_sq per group), 64 KiB of
// params and grads, 64 KiB of optimizer states.
ChunkLayout EightGroups(ShardSpec shard = {}) {
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < 8; ++i) {
    tensors.push_back({"m" + std::to_string(i) + ".w", {1024}, DType::kFloat32, true, "m" + std::to_string(i)});
  }
  Result<ChunkLayout> layout = ChunkLayout::Build(tensors, 1024, 0, 0, shard);
  STRATA_CHECK(layout.ok(), "{}", layout.status().ToString());
  return std::move(layout).value();
}

TierCapacities Capacities(uint64_t host_bytes, uint64_t nvme_bytes, uint64_t device_bytes = kMiB) {
  return {device_bytes, host_bytes, nvme_bytes, nvme_bytes > 0};
}

// The homes of the state chunks, in layout order.
std::vector<Tier> StateHomes(const ChunkLayout& layout, const Placement& placement) {
  std::vector<Tier> homes;
  for (const ChunkDesc& chunk : layout.chunks()) {
    if (IsStateChunk(chunk)) homes.push_back(placement.homes[chunk.id.value()]);
  }
  return homes;
}

size_t CountOf(const std::vector<Tier>& homes, Tier tier) {
  return static_cast<size_t>(std::count(homes.begin(), homes.end(), tier));
}

TEST(PlacementTest, EverythingOnTheHostWhenItFitsAndNothingReserved) {
  const ChunkLayout layout = EightGroups();
  ASSERT_EQ(layout.chunks().size(), 32u);
  ASSERT_EQ(layout.report().total_bytes, 128 * kKiB);
  ASSERT_OK_AND_ASSIGN(Placement placement, PlaceChunks(layout, Capacities(kMiB, kMiB), Options{}));
  EXPECT_EQ(CountOf(placement.homes, Tier::kHost), 32u);
  EXPECT_EQ(placement.host_staging_bytes, 0u);
}

TEST(PlacementTest, AdaptiveKeepsParamsAndGradsOnTheHostAndSendsStatesBeyondHostRoomToNvme) {
  const ChunkLayout layout = EightGroups();
  // 112 KiB of host for 128 KiB of chunks: a reserve is kept. Staging is
  // min(stream_ring, host / 4 = 28 KiB, max(host / 8, 4 * 8 KiB of a group's
  // states)) = 28 KiB, plus two 4 KiB chunks of slack: 36 KiB. That leaves
  // 76 KiB for homes: the 64 KiB of params and grads, then 3 state chunks.
  ASSERT_OK_AND_ASSIGN(Placement placement, PlaceChunks(layout, Capacities(112 * kKiB, kMiB), Options{}));
  EXPECT_EQ(placement.host_staging_bytes, 28 * kKiB);
  for (const ChunkDesc& chunk : layout.chunks()) {
    if (!IsStateChunk(chunk)) {
      EXPECT_EQ(placement.homes[chunk.id.value()], Tier::kHost) << chunk.id.value();
    }
  }
  const std::vector<Tier> states = StateHomes(layout, placement);
  ASSERT_EQ(states.size(), 16u);
  for (size_t i = 0; i < states.size(); ++i) EXPECT_EQ(states[i], i < 3 ? Tier::kHost : Tier::kNvme) << i;
  EXPECT_EQ(CountOf(placement.homes, Tier::kDevice), 0u);  // the device is a cache, no chunk's home
}

TEST(PlacementTest, StaticPolicyHomesOnlyItsShareOfStatesOnTheHostFirstInLayoutOrder) {
  const ChunkLayout layout = EightGroups();
  Options options;
  options.placement.policy = PlacementPolicy::kStatic;
  options.placement.host_states = 0.5;
  // The host could hold everything; the policy puts half of the 64 KiB of states there.
  ASSERT_OK_AND_ASSIGN(Placement placement, PlaceChunks(layout, Capacities(kMiB, kMiB), options));
  const std::vector<Tier> states = StateHomes(layout, placement);
  for (size_t i = 0; i < states.size(); ++i) EXPECT_EQ(states[i], i < 8 ? Tier::kHost : Tier::kNvme) << i;
  EXPECT_EQ(CountOf(placement.homes, Tier::kHost), 16u + 8u);
}

TEST(PlacementTest, StaticShareTheHostCannotHoldIsOutOfMemoryNamingTheOption) {
  const ChunkLayout layout = EightGroups();
  Options options;
  options.placement.policy = PlacementPolicy::kStatic;
  options.placement.host_states = 1.0;
  // As above, 12 KiB of host is left for states: far from all 64 KiB.
  Result<Placement> placement = PlaceChunks(layout, Capacities(112 * kKiB, kMiB), options);
  ASSERT_EQ(placement.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(placement.status().message().find("placement.host_states 1 asks for 64KiB"), std::string::npos)
      << placement.status().ToString();
}

TEST(PlacementTest, ChunksThatFitNoTierAreOutOfMemoryNamingTheBudgets) {
  const ChunkLayout layout = EightGroups();
  // No NVMe tier: the host holds params and grads, the states fit nowhere.
  Result<Placement> placement = PlaceChunks(layout, Capacities(64 * kKiB, 0), Options{});
  ASSERT_EQ(placement.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(placement.status().message().find("(nvme.capacity, not configured)"), std::string::npos)
      << placement.status().ToString();
}

TEST(PlacementTest, DeviceSmallerThanTheLargestChunkIsOutOfMemory) {
  const ChunkLayout layout = EightGroups();
  Result<Placement> placement = PlaceChunks(layout, Capacities(kMiB, kMiB, 2 * kKiB), Options{});
  ASSERT_EQ(placement.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(placement.status().message().find("the largest param or grad chunk is 4KiB"), std::string::npos)
      << placement.status().ToString();
}

TEST(PlacementTest, TheDeviceNeedsRoomForParamAndGradChunksNotTheLargerMasters) {
  // bf16: 4KiB param and grad chunks, 8KiB fp32 masters and states; only the former go to the device.
  std::vector<TensorSpec> tensors;
  for (int i = 0; i < 4; ++i) tensors.push_back({"w" + std::to_string(i), {2048}, DType::kBFloat16, true, "w"});
  ASSERT_OK_AND_ASSIGN(ChunkLayout layout, ChunkLayout::Build(tensors, 2048, 0, 0, {}));
  uint64_t largest = 0, largest_on_device = 0;
  for (const ChunkDesc& chunk : layout.chunks()) {
    largest = std::max(largest, chunk.size_bytes());
    if (chunk.kind == ChunkKind::kParam || chunk.kind == ChunkKind::kGrad) {
      largest_on_device = std::max(largest_on_device, chunk.size_bytes());
    }
  }
  ASSERT_LT(largest_on_device, largest);
  ASSERT_OK(PlaceChunks(layout, Capacities(kMiB, kMiB, largest_on_device), Options{}).status());
  Result<Placement> refused = PlaceChunks(layout, Capacities(kMiB, kMiB, largest_on_device - 1), Options{});
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory) << refused.status().ToString();
}

TEST(PlacementTest, ShardedParamsNeedDeviceRoomForTheGatheredChunksKept) {
  const ChunkLayout layout = EightGroups({0, 2, true});
  // kKeptGatheredChunks gathered param chunks stay pinned, plus two: 4 x 4 KiB.
  Result<Placement> tight = PlaceChunks(layout, Capacities(kMiB, kMiB, 12 * kKiB), Options{});
  ASSERT_EQ(tight.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(tight.status().message().find("comm.shard_params"), std::string::npos) << tight.status().ToString();
  ASSERT_OK_AND_ASSIGN(Placement placement, PlaceChunks(layout, Capacities(kMiB, kMiB, 16 * kKiB), Options{}));
  // A transient param chunk is homed on the host (and never stored there).
  for (const ChunkDesc& chunk : layout.chunks()) {
    if (chunk.transient) {
      EXPECT_EQ(placement.homes[chunk.id.value()], Tier::kHost) << chunk.id.value();
    }
  }
}

}  // namespace
}  // namespace strata::memory
