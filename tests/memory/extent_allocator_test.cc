#include "memory/extent_allocator.h"

#include <algorithm>
#include <vector>

#include "test_util.h"

namespace strata::memory {
namespace {

TEST(ExtentAllocatorTest, RoundsSizesUpToAlignment) {
  ExtentAllocator allocator(1 << 20, 4096);
  auto a = allocator.Allocate(1);
  auto b = allocator.Allocate(4097);
  ASSERT_TRUE(a && b);
  EXPECT_EQ(a->size_bytes, 4096u);
  EXPECT_EQ(b->size_bytes, 8192u);
  EXPECT_EQ(b->offset, 4096u);
  EXPECT_EQ(allocator.used_bytes(), 12288u);
}

TEST(ExtentAllocatorTest, FailsWhenFullAndReusesFreedSpace) {
  ExtentAllocator allocator(4 * 4096, 4096);
  std::vector<Extent> extents;
  for (int i = 0; i < 4; ++i) extents.push_back(*allocator.Allocate(4096));
  EXPECT_FALSE(allocator.Allocate(4096).has_value());
  allocator.Free(extents[2]);
  auto again = allocator.Allocate(4096);
  ASSERT_TRUE(again);
  EXPECT_EQ(again->offset, extents[2].offset);
}

TEST(ExtentAllocatorTest, MergesNeighboursOnFree) {
  ExtentAllocator allocator(3 * 4096, 4096);
  Extent a = *allocator.Allocate(4096), b = *allocator.Allocate(4096), c = *allocator.Allocate(4096);
  allocator.Free(a);
  allocator.Free(c);
  EXPECT_EQ(allocator.largest_free_bytes(), 4096u);  // two holes, not adjacent
  EXPECT_FALSE(allocator.Allocate(8192).has_value());
  allocator.Free(b);  // joins both holes
  EXPECT_EQ(allocator.largest_free_bytes(), 3u * 4096);
  EXPECT_TRUE(allocator.Allocate(3 * 4096).has_value());
}

TEST(ExtentAllocatorTest, RandomAllocateFreeKeepsExtentsDisjointAndAccountingExact) {
  std::mt19937_64 rng(testing::TestSeed());
  ExtentAllocator allocator(256 * 4096, 4096);
  std::vector<Extent> live;
  for (int step = 0; step < 5000; ++step) {
    if (live.empty() || rng() % 3 != 0) {
      if (auto e = allocator.Allocate((rng() % 16 + 1) * 4096 - rng() % 4096)) live.push_back(*e);
    } else {
      size_t index = rng() % live.size();
      allocator.Free(live[index]);
      live.erase(live.begin() + static_cast<long>(index));
    }
    uint64_t used = 0;
    for (const Extent& e : live) used += e.size_bytes;
    ASSERT_EQ(allocator.used_bytes(), used);
  }
  std::sort(live.begin(), live.end(), [](const Extent& x, const Extent& y) { return x.offset < y.offset; });
  for (size_t i = 1; i < live.size(); ++i) ASSERT_LE(live[i - 1].offset + live[i - 1].size_bytes, live[i].offset);
  for (const Extent& e : live) allocator.Free(e);
  EXPECT_EQ(allocator.largest_free_bytes(), allocator.capacity_bytes());
}

TEST(ExtentAllocatorTest, ClaimFreeTakesOnlyTheFreePiecesOfTheRange) {
  const uint64_t k = 4096;
  ExtentAllocator allocator(8 * k, k);
  std::vector<Extent> slots;
  for (int i = 0; i < 8; ++i) slots.push_back(*allocator.Allocate(k));
  for (int i : {1, 2, 4, 7}) allocator.Free(slots[i]);
  // Free: [1k, 3k), [4k, 5k), [7k, 8k). Claim [2k, 6k): the pieces [2k, 3k) and [4k, 5k).
  std::vector<Extent> claimed = allocator.ClaimFree(2 * k, 6 * k);
  EXPECT_EQ(claimed, (std::vector<Extent>{{2 * k, k}, {4 * k, k}}));
  EXPECT_EQ(allocator.FreeExtents(), (std::vector<Extent>{{1 * k, k}, {7 * k, k}}));
  EXPECT_EQ(allocator.used_bytes(), 6 * k);
  for (Extent e : claimed) allocator.Free(e);
  EXPECT_EQ(allocator.FreeExtents(), (std::vector<Extent>{{1 * k, 2 * k}, {4 * k, k}, {7 * k, k}}));
  EXPECT_TRUE(allocator.ClaimFree(5 * k, 7 * k).empty());
}

TEST(ExtentAllocatorDeathTest, DoubleFreeAborts) {
  ExtentAllocator allocator(4 * 4096, 4096);
  Extent a = *allocator.Allocate(4096);
  allocator.Free(a);
  EXPECT_DEATH(allocator.Free(a), "overlaps free space");
}

}  // namespace
}  // namespace strata::memory
