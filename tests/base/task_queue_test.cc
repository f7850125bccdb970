#include "src/base/task_queue.h"

#include <atomic>
#include <chrono>
#include <vector>

#include "test_util.h"

namespace strata {
namespace {

TEST(TaskQueueTest, OneWorkerRunsJobsInTheOrderQueued) {
  std::vector<int> order;
  std::vector<std::shared_future<Status>> done;
  {
    TaskQueue queue(1);
    for (int i = 0; i < 20; ++i) {
      done.push_back(queue.Push([&order, i] {
        order.push_back(i);
        return i == 7 ? IoError("job {} failed", i) : Status::Ok();
      }));
    }
    EXPECT_EQ(done[7].get().code(), StatusCode::kIoError);  // a job's status reaches its future
  }
  ASSERT_EQ(order.size(), 20u);
  for (int i = 0; i < 20; ++i) EXPECT_EQ(order[i], i);
}

TEST(TaskQueueTest, DestructionRunsEverythingQueuedFirst) {
  std::atomic<int> ran{0};
  std::vector<std::shared_future<Status>> done;
  {
    TaskQueue queue(2);
    for (int i = 0; i < 50; ++i) {
      done.push_back(queue.Push([&ran] {
        std::this_thread::sleep_for(std::chrono::microseconds(200));
        ran.fetch_add(1, std::memory_order_relaxed);
        return Status::Ok();
      }));
    }
  }
  EXPECT_EQ(ran.load(), 50);
  for (const auto& d : done) EXPECT_EQ(d.wait_for(std::chrono::seconds(0)), std::future_status::ready);
}

TEST(TaskQueueTest, SeveralWorkersRunJobsAtOnce) {
  TaskQueue queue(3);
  EXPECT_EQ(queue.threads(), 3u);
  std::atomic<int> inside{0}, most{0};
  std::vector<std::shared_future<Status>> done;
  for (int i = 0; i < 3; ++i) {
    done.push_back(queue.Push([&] {
      const int now = inside.fetch_add(1) + 1;
      int seen = most.load();
      while (now > seen && !most.compare_exchange_weak(seen, now)) {
      }
      // Wait (bounded) until all three are inside: they must run together.
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(5);
      while (inside.load() < 3 && std::chrono::steady_clock::now() < end) std::this_thread::yield();
      return Status::Ok();
    }));
  }
  for (auto& d : done) EXPECT_OK(d.get());
  EXPECT_EQ(most.load(), 3);
}

}  // namespace
}  // namespace strata
