// Note [Ring pool]
// A call takes a ring from the free list (under the pool's mutex), drives its
// whole transfer on that ring without any lock, and gives it back. Rings are
// created on demand, so there are as many as there have been concurrent
// callers (at most kMaxRings). A ring marked broken (requests that could not
// be reaped; see Note [Timeouts and the caller's buffer] in uring_storage.cc)
// is closed when given back, never lent again.
//
// Note [Registered buffers]
// Host memory registered with a ring as fixed buffers lets the kernel skip
// pinning and mapping the pages of every request that lies inside it. The
// pool keeps the set of regions registered so far and a generation bumped on
// every addition; a ring lent out is brought up to the pool's generation
// first. The kernel takes at most 1 GiB per registered buffer, so larger
// regions are registered as several. A refusal (the memlock limit, most
// often) is logged once and the pool stops trying: requests then use plain
// buffers, which work the same, a little slower.

#include "src/backends/storage/uring_ring.h"

#include <cerrno>

#include <fmt/format.h>

#include "src/backends/storage/storage_util.h"
#include "src/backends/storage/uring_check.h"
#include "src/base/logging.h"

namespace strata::storage::uring {
namespace {

// Rings are made one per concurrent caller; this caps a runaway thread count.
constexpr size_t kMaxRings = 64;
// How long an SQPOLL thread spins without work before it sleeps: long enough
// to span the gaps between a transfer's submits, short enough not to burn a
// core between chunk moves.
constexpr unsigned kSqpollIdleMs = 50;

}  // namespace

Status Ring::Init(uint32_t queue_depth, const std::vector<int>& fds, bool sqpoll) {
  if (sqpoll) {
    // A kernel thread polls the submission queue: no system call per
    // submit, at the cost of a core spinning while I/O flows.
    io_uring_params params{};
    params.flags = IORING_SETUP_SQPOLL;
    params.sq_thread_idle = kSqpollIdleMs;
    int rc = io_uring_queue_init_params(queue_depth, &ring_, &params);
    if (rc == 0) {
      initialized_ = true;
      sqpoll_ = true;
    } else {
      STRATA_LOG_WARNING("nvme.sqpoll: io_uring with SQPOLL refused ({}); using interrupt-driven submission",
                         ErrnoText(-rc));
    }
  }
  if (!initialized_) {
    // COOP_TASKRUN: completions are processed when this thread next enters
    // the kernel (it is about to, to wait) instead of by an interrupt to it;
    // as fio sets up its rings. Kernels before 5.19 refuse the flag.
    int rc = io_uring_queue_init(queue_depth, &ring_, IORING_SETUP_COOP_TASKRUN);
    if (rc == -EINVAL) rc = io_uring_queue_init(queue_depth, &ring_, 0);
    STRATA_URING_CHECK(rc, "a new io_uring", 0);
  }
  initialized_ = true;
  // Registered files save the kernel a file-table lookup and refcount per
  // request. Optional: old kernels or a tight RLIMIT_NOFILE may refuse.
  int rc = io_uring_register_files(&ring_, fds.data(), static_cast<unsigned>(fds.size()));
  fixed_files_ = rc == 0;
  if (!fixed_files_) STRATA_LOG_DEBUG("io_uring_register_files failed ({}); using plain descriptors", ErrnoText(-rc));
  slots_.assign(queue_depth, Request{});
  free_slots_.reserve(queue_depth);
  retry_slots_.reserve(queue_depth);
  return Status::Ok();
}

int Ring::RegisterBuffers(const std::vector<iovec>& iovecs, uint64_t generation) {
  if (!fixed_buffers_.empty()) io_uring_unregister_buffers(&ring_);
  fixed_buffers_.clear();
  buffer_generation_ = generation;
  int rc = io_uring_register_buffers(&ring_, iovecs.data(), static_cast<unsigned>(iovecs.size()));
  if (rc == 0) fixed_buffers_ = iovecs;
  return rc;
}

void RingPool::AddFixedBuffers(const std::vector<iovec>& iovecs) {
  std::lock_guard<std::mutex> lock(mu_);
  fixed_buffers_.insert(fixed_buffers_.end(), iovecs.begin(), iovecs.end());
  ++buffer_generation_;
}

std::string RingPool::DescribeBuffers() const {
  std::lock_guard<std::mutex> lock(mu_);
  if (fixed_buffers_.empty()) return "plain buffers";
  return buffers_refused_.empty() ? fmt::format("{} fixed buffer regions", fixed_buffers_.size())
                                  : "plain buffers (" + buffers_refused_ + ")";
}

Result<RingPool::Lease> RingPool::Acquire(Clock::time_point deadline, uint32_t timeout_ms) {
  STRATA_ASSIGN_OR_RETURN(Lease lease, AcquireRing(deadline, timeout_ms));
  ApplyFixedBuffers(*lease);
  return lease;
}

// Brings a ring's fixed buffers up to the pool's set; see Note [Registered buffers].
void RingPool::ApplyFixedBuffers(Ring& ring) {
  std::vector<iovec> iovecs;
  uint64_t generation = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!buffers_refused_.empty() || ring.buffer_generation() == buffer_generation_) return;
    iovecs = fixed_buffers_;
    generation = buffer_generation_;
  }
  int rc = ring.RegisterBuffers(iovecs, generation);
  if (rc == 0) return;
  std::lock_guard<std::mutex> lock(mu_);
  if (buffers_refused_.empty()) {
    buffers_refused_ = fmt::format("registration refused: {}", ErrnoText(-rc));
    STRATA_LOG_WARNING("nvme: io_uring refused to register {} buffer regions ({}; RLIMIT_MEMLOCK may be too low for "
                       "them); using plain buffers",
                       iovecs.size(), ErrnoText(-rc));
  }
}

Result<RingPool::Lease> RingPool::AcquireRing(Clock::time_point deadline, uint32_t timeout_ms) {
  {
    std::unique_lock<std::mutex> lock(mu_);
    bool available = cv_.wait_until(lock, deadline, [&] { return !free_.empty() || created_ < kMaxRings; });
    if (!available) {
      return Timeout("nvme: all {} io_uring rings stayed busy for nvme.io_timeout_ms = {} ms", kMaxRings, timeout_ms);
    }
    if (!free_.empty()) {
      std::unique_ptr<Ring> ring = std::move(free_.back());
      free_.pop_back();
      return Lease(this, std::move(ring));
    }
    ++created_;  // reserved; the ring is made outside the lock (system calls)
  }
  auto ring = std::make_unique<Ring>();
  Status status = ring->Init(queue_depth_, fds_, sqpoll_);
  if (!status.ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    --created_;
    cv_.notify_one();
    return status;
  }
  return Lease(this, std::move(ring));
}

void RingPool::Release(std::unique_ptr<Ring> ring) {
  std::lock_guard<std::mutex> lock(mu_);
  if (ring->broken()) {
    --created_;
    ring.reset();  // closes the ring; see Note [Timeouts and the caller's buffer]
  } else {
    free_.push_back(std::move(ring));
  }
  cv_.notify_one();
}

}  // namespace strata::storage::uring
