// One direction of a link, as the planner's prediction models it and as the
// emulated device throttles its copies (Note [The link model] in
// offload/schedule/planner_replay.cc): transfers cross one at a time, in the
// order queued, at a fixed rate, each starting once it is ready and the link
// is free. Times are seconds on the owner's clock, modelled or real.
//
// Thread-safety: none; its owner's.
#pragma once

#include <algorithm>
#include <cstdint>

namespace strata {

class LinkQueue {
 public:
  // 0 bytes a second: unthrottled (a transfer crosses the moment it starts).
  explicit LinkQueue(double bytes_per_second = 0) : bytes_per_second_(bytes_per_second) {}

  // Queues `bytes`, ready at `ready`; returns when they have crossed.
  double Transfer(double ready, uint64_t bytes) {
    const double start = std::max(free_at_, ready);
    free_at_ = start + (bytes_per_second_ > 0 ? static_cast<double>(bytes) / bytes_per_second_ : 0.0);
    return free_at_;
  }
  double free_at() const { return free_at_; }

 private:
  double bytes_per_second_;
  double free_at_ = 0;
};

}  // namespace strata
