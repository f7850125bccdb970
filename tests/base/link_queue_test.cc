#include "src/base/link_queue.h"

#include "test_util.h"

namespace strata {
namespace {

TEST(LinkQueueTest, TransfersCrossOneAtATimeInTheOrderQueuedAtTheRate) {
  LinkQueue link(1e9);  // 1 GB/s: a byte a nanosecond
  EXPECT_DOUBLE_EQ(link.Transfer(0.0, 500'000'000), 0.5);
  // Ready before the link is free: it waits for the one ahead.
  EXPECT_DOUBLE_EQ(link.Transfer(0.1, 250'000'000), 0.75);
  // Ready after the link went idle: it starts when ready, not when the link freed.
  EXPECT_DOUBLE_EQ(link.Transfer(2.0, 1'000'000'000), 3.0);
  EXPECT_DOUBLE_EQ(link.free_at(), 3.0);
  EXPECT_DOUBLE_EQ(link.Transfer(1.0, 0), 3.0);  // nothing to move still waits its turn
}

TEST(LinkQueueTest, AnUnthrottledLinkCrossesAsSoonAsATransferStarts) {
  LinkQueue link;
  EXPECT_DOUBLE_EQ(link.Transfer(1.5, uint64_t{1} << 40), 1.5);
  EXPECT_DOUBLE_EQ(link.Transfer(0.5, 1), 1.5);
}

}  // namespace
}  // namespace strata
