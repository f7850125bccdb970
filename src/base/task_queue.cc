#include "src/base/task_queue.h"

#include <algorithm>

namespace strata {

TaskQueue::TaskQueue(uint32_t threads) {
  for (uint32_t i = 0; i < std::max<uint32_t>(threads, 1); ++i) workers_.emplace_back([this] { Loop(); });
}

TaskQueue::~TaskQueue() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
}

std::shared_future<Status> TaskQueue::Push(std::function<Status()> job) {
  std::packaged_task<Status()> task(std::move(job));
  std::shared_future<Status> done = task.get_future().share();
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(task));
  }
  cv_.notify_one();
  return done;
}

void TaskQueue::Loop() {
  for (;;) {
    std::packaged_task<Status()> task;
    {
      std::unique_lock lock(mu_);
      cv_.wait(lock, [this] { return stopping_ || !jobs_.empty(); });
      if (jobs_.empty()) return;  // stopping, and everything queued has run
      task = std::move(jobs_.front());
      jobs_.pop_front();
    }
    task();
  }
}

bool TaskQueue::OnWorker() const {
  for (const std::thread& worker : workers_) {
    if (worker.get_id() == std::this_thread::get_id()) return true;
  }
  return false;
}

}  // namespace strata
