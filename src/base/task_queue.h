// TaskQueue: worker threads running queued jobs in the order queued.
//
// Push returns a future of the job's Status. Destruction runs every job
// already queued (each is bounded by its own deadlines), then joins, so no
// future is left without a value. Thread-safety: Push from any thread.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <vector>

#include "strata/status.h"

namespace strata {

class TaskQueue {
 public:
  explicit TaskQueue(uint32_t threads = 1);
  ~TaskQueue();
  TaskQueue(const TaskQueue&) = delete;
  TaskQueue& operator=(const TaskQueue&) = delete;

  std::shared_future<Status> Push(std::function<Status()> job);
  uint32_t threads() const { return static_cast<uint32_t>(workers_.size()); }
  // Whether the calling thread is one of the workers (a job that must not
  // destroy its own queue: destruction joins the workers).
  bool OnWorker() const;

 private:
  void Loop();

  std::mutex mu_;  // guards jobs_ and stopping_
  std::condition_variable cv_;
  std::deque<std::packaged_task<Status()>> jobs_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;  // last: started after the members they use
};

}  // namespace strata
