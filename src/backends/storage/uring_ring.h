// The io_uring rings of the NVMe backend and the pool that lends them.
// Private to src/backends/storage/.
//
// A Ring owns one io_uring and the bookkeeping of the requests of the one
// transfer running on it; it is used by one thread at a time (whoever holds
// its lease). RingPool is thread-safe: it makes rings on demand, up to a
// cap, and lends each to one caller at a time. See Note [Ring pool] in
// uring_ring.cc.
#pragma once

#include <liburing.h>

#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "strata/status.h"

namespace strata::storage::uring {

using Clock = std::chrono::steady_clock;

// One in-flight piece of a transfer: a part of one stripe.
struct Request {
  uint32_t file_index = 0;
  uint64_t file_offset = 0;
  std::byte* buffer = nullptr;
  size_t remaining_bytes = 0;
  bool in_flight = false;
};

class Ring {
 public:
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (initialized_) io_uring_queue_exit(&ring_);
  }

  // Sets up the ring with `queue_depth` entries and slots and registers
  // `fds` as its fixed files where the kernel allows. `sqpoll` asks for a
  // kernel polling thread; refused, the ring falls back to interrupts.
  Status Init(uint32_t queue_depth, const std::vector<int>& fds, bool sqpoll);

  io_uring* get() { return &ring_; }
  bool fixed_files() const { return fixed_files_; }
  bool sqpoll() const { return sqpoll_; }

  // Registers `iovecs` as this ring's fixed buffers (replacing any earlier
  // set); returns 0 or a negative errno. See Note [Registered buffers].
  int RegisterBuffers(const std::vector<iovec>& iovecs, uint64_t generation);
  uint64_t buffer_generation() const { return buffer_generation_; }
  // The index of the fixed buffer holding [data, data + size), or -1.
  int FixedBufferIndex(const std::byte* data, size_t size) const {
    for (size_t i = 0; i < fixed_buffers_.size(); ++i) {
      const auto* base = static_cast<const std::byte*>(fixed_buffers_[i].iov_base);
      if (data >= base && data + size <= base + fixed_buffers_[i].iov_len) return static_cast<int>(i);
    }
    return -1;
  }
  // A ring whose requests could not be reaped must not be reused.
  bool broken() const { return broken_; }
  void MarkBroken() { broken_ = true; }

  // Request slots, indexed by the SQE's user_data.
  void ResetSlots() {
    free_slots_.clear();
    for (uint32_t i = static_cast<uint32_t>(slots_.size()); i > 0; --i) {
      slots_[i - 1] = Request{};
      free_slots_.push_back(i - 1);
    }
    retry_slots_.clear();
  }
  bool HasFreeSlot() const { return !free_slots_.empty(); }
  uint32_t TakeSlot() {
    uint32_t slot = free_slots_.back();
    free_slots_.pop_back();
    return slot;
  }
  void FreeSlot(uint32_t slot) {
    slots_[slot] = Request{};
    free_slots_.push_back(slot);
  }
  Request& slot(uint32_t index) { return slots_[index]; }
  uint32_t num_slots() const { return static_cast<uint32_t>(slots_.size()); }
  std::vector<uint32_t>& retry_slots() { return retry_slots_; }

 private:
  io_uring ring_{};
  bool initialized_ = false;
  bool fixed_files_ = false;
  bool sqpoll_ = false;
  bool broken_ = false;
  std::vector<iovec> fixed_buffers_;  // registered with this ring
  uint64_t buffer_generation_ = 0;    // of the pool's registration set last applied
  std::vector<Request> slots_;         // indexed by the SQE's user_data
  std::vector<uint32_t> free_slots_;   // slots with no request
  std::vector<uint32_t> retry_slots_;  // slots whose request must be submitted again
};

class RingPool {
 public:
  // Every ring gets `queue_depth` entries and registers `fds`.
  RingPool(uint32_t queue_depth, std::vector<int> fds, bool sqpoll)
      : queue_depth_(queue_depth), fds_(std::move(fds)), sqpoll_(sqpoll) {}

  // A ring held by one caller; returns it to the pool (or destroys it, if
  // broken) when it dies. Must not outlive the pool.
  class Lease {
   public:
    Lease(RingPool* pool, std::unique_ptr<Ring> ring) : pool_(pool), ring_(std::move(ring)) {}
    Lease(Lease&& other) noexcept : pool_(std::exchange(other.pool_, nullptr)), ring_(std::move(other.ring_)) {}
    Lease& operator=(Lease&&) = delete;
    Lease(const Lease&) = delete;
    Lease& operator=(const Lease&) = delete;
    ~Lease() {
      if (pool_ != nullptr && ring_ != nullptr) pool_->Release(std::move(ring_));
    }
    Ring& operator*() const { return *ring_; }

   private:
    RingPool* pool_;
    std::unique_ptr<Ring> ring_;
  };

  // Adds host memory to the set every ring registers as fixed buffers.
  void AddFixedBuffers(const std::vector<iovec>& iovecs);
  // "N fixed buffer regions", "plain buffers" or why registration was refused.
  std::string DescribeBuffers() const;

  // A free ring (made if none is free and the cap allows one more), its
  // fixed buffers brought up to date. Timeout when every ring stays busy
  // until `deadline` (`timeout_ms` is for the message).
  Result<Lease> Acquire(Clock::time_point deadline, uint32_t timeout_ms);

 private:
  void ApplyFixedBuffers(Ring& ring);
  Result<Lease> AcquireRing(Clock::time_point deadline, uint32_t timeout_ms);
  void Release(std::unique_ptr<Ring> ring);

  const uint32_t queue_depth_;
  const std::vector<int> fds_;
  const bool sqpoll_;
  mutable std::mutex mu_;  // guards free_, created_ and the fixed-buffer set below
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Ring>> free_;
  size_t created_ = 0;                // rings alive: in free_ or leased
  std::vector<iovec> fixed_buffers_;  // every region registered so far
  uint64_t buffer_generation_ = 0;    // bumped on every addition
  std::string buffers_refused_;       // non-empty once registration failed
};

}  // namespace strata::storage::uring
