// The NVMe tier's storage backend: one preallocated file per directory,
// read and written with io_uring, O_DIRECT by default.
//
// Layout: the linear byte space [0, capacity) is cut into stripes of
// block_size bytes; stripe k lives in file k % ndirs at file offset
// (k / ndirs) * block_size. One request never crosses a stripe, so one
// request is at most one block and a transfer of n blocks keeps every drive
// busy.
//
// Concurrency: a pool of rings. A call takes a ring from the free list (under
// the pool's mutex), drives its whole transfer on that ring without any lock,
// and gives it back. Rings are created on demand, so there are as many as
// there have been concurrent callers (at most kMaxRings).
//
// This is the only file that includes <liburing.h>; its calls and the system
// calls of setup go through STRATA_URING_CHECK / STRATA_SYSCALL_CHECK, which
// turn a failure into IoError with the call, the path, the offset, errno and
// file:line.
//
// Note [Timeouts and the caller's buffer]
// When a call runs past io_timeout_ms, requests may still be in flight, and
// the kernel may still write into (read) or read from (write) the caller's
// buffer. Returning at once would let the caller free that buffer under a
// DMA. So a timed-out call cancels what is in flight and waits up to
// kCancelGraceMs more for the ring to let go of the buffer; only then does it
// return Timeout. If even that wait expires the drive is stuck: the ring is
// abandoned (closed, never reused) and an error is logged, since nothing in
// user space can recall a request the device has accepted.

#include <fcntl.h>
#include <liburing.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <filesystem>
#include <functional>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "src/backends/storage/storage_util.h"
#include "src/base/alignment.h"
#include "src/base/logging.h"
#include "src/base/task_queue.h"
#include "strata/options.h"
#include "strata/storage.h"

namespace strata {
namespace storage {
namespace {

using Clock = std::chrono::steady_clock;

constexpr size_t kAlignmentBytes = kIoAlignmentBytes;
// One io_uring read or write moves at most ~2 GiB (the kernel's MAX_RW_COUNT)
// and takes a 32-bit length; 1 GiB blocks stay well inside both.
constexpr size_t kMaxBlockSizeBytes = size_t{1} << 30;
// Far above any useful depth for one caller, far below the kernel's ring limit
// (32768 entries).
constexpr uint32_t kMaxQueueDepth = 4096;
// Rings are made one per concurrent caller; this caps a runaway thread count.
constexpr size_t kMaxRings = 64;
// See Note [Timeouts and the caller's buffer]: a healthy drive finishes any
// queued request in far less than 5 s.
constexpr uint32_t kCancelGraceMs = 5000;
// user_data of cancel requests. Not ~0: liburing reserves that for its own
// timeout entries on kernels without IORING_FEAT_EXT_ARG.
constexpr uint64_t kCancelUserData = ~uint64_t{0} - 1;
// Pause before retrying a submit refused with EAGAIN/EBUSY while nothing is in
// flight (nothing to wait on instead).
constexpr auto kSubmitRetryPause = std::chrono::milliseconds(1);
// How long an SQPOLL thread spins without work before it sleeps: long enough
// to span the gaps between a transfer's submits, short enough not to burn a
// core between chunk moves.
constexpr unsigned kSqpollIdleMs = 50;

std::string_view Basename(std::string_view file) {
  size_t slash = file.rfind('/');
  return slash == std::string_view::npos ? file : file.substr(slash + 1);
}

// The one conversion from a failed liburing or system call to a Status.
Status CallError(std::string_view call, int error_number, std::string_view path, uint64_t offset, const char* file,
                 int line) {
  return IoError("{} failed on {} at offset {}: {} (errno {}) [{}:{}]", call, path, offset, ErrnoText(error_number),
                 error_number, Basename(file), line);
}

}  // namespace
}  // namespace storage
}  // namespace strata

// liburing convention: `call` returns a negative errno on failure.
#define STRATA_URING_CHECK(call, path, offset)                                                  \
  do {                                                                                          \
    int strata_uring_rc_ = (call);                                                              \
    if (strata_uring_rc_ < 0) {                                                                 \
      return ::strata::storage::CallError(#call, -strata_uring_rc_, (path), (offset), __FILE__, \
                                          __LINE__);                                            \
    }                                                                                           \
  } while (0)

// libc convention: `call` returns -1 and sets errno on failure.
#define STRATA_SYSCALL_CHECK(call, path, offset)                                                \
  do {                                                                                          \
    if ((call) == -1) {                                                                         \
      return ::strata::storage::CallError(#call, errno, (path), (offset), __FILE__, __LINE__);  \
    }                                                                                           \
  } while (0)

namespace strata {
namespace storage {
namespace {

// Owns one file descriptor.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  void Reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

struct BackingFile {
  std::string dir;
  std::string path;
  UniqueFd fd;
  bool direct_io = true;  // false: O_DIRECT was refused and allow_buffered_io accepted page-cache I/O
};

enum class Op { kRead, kWrite };

std::string_view OpName(Op op) { return op == Op::kRead ? "read" : "write"; }

// One in-flight piece of a transfer: a part of one stripe.
struct Request {
  uint32_t file_index = 0;
  uint64_t file_offset = 0;
  std::byte* buffer = nullptr;
  size_t remaining_bytes = 0;
  bool in_flight = false;
};

// Owns one io_uring and the per-request bookkeeping of the transfer that runs
// on it. Used by one thread at a time (whoever holds its lease).
class Ring {
 public:
  Ring() = default;
  Ring(const Ring&) = delete;
  Ring& operator=(const Ring&) = delete;
  ~Ring() {
    if (initialized_) io_uring_queue_exit(&ring_);
  }

  Status Init(uint32_t queue_depth, const std::vector<int>& fds, bool sqpoll) {
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

  io_uring* get() { return &ring_; }
  bool fixed_files() const { return fixed_files_; }
  bool sqpoll() const { return sqpoll_; }

  // Registers `iovecs` as this ring's fixed buffers (replacing any earlier
  // set); returns 0 or a negative errno. See Note [Registered buffers].
  int RegisterBuffers(const std::vector<iovec>& iovecs, uint64_t generation) {
    if (!fixed_buffers_.empty()) io_uring_unregister_buffers(&ring_);
    fixed_buffers_.clear();
    buffer_generation_ = generation;
    int rc = io_uring_register_buffers(&ring_, iovecs.data(), static_cast<unsigned>(iovecs.size()));
    if (rc == 0) fixed_buffers_ = iovecs;
    return rc;
  }
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
  std::vector<Request> slots_;           // indexed by the SQE's user_data
  std::vector<uint32_t> free_slots_;     // slots with no request
  std::vector<uint32_t> retry_slots_;    // slots whose request must be submitted again
};

// Hands rings to callers; see the file comment.
class RingPool {
 public:
  RingPool(uint32_t queue_depth, std::vector<int> fds, bool sqpoll)
      : queue_depth_(queue_depth), fds_(std::move(fds)), sqpoll_(sqpoll) {}

  // A ring held by one caller; returns it to the pool (or destroys it, if
  // broken) when it dies.
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
  void AddFixedBuffers(const std::vector<iovec>& iovecs) {
    std::lock_guard<std::mutex> lock(mu_);
    fixed_buffers_.insert(fixed_buffers_.end(), iovecs.begin(), iovecs.end());
    ++buffer_generation_;
  }
  // "fixed buffers", "plain buffers" or why registration was refused.
  std::string DescribeBuffers() const {
    std::lock_guard<std::mutex> lock(mu_);
    if (fixed_buffers_.empty()) return "plain buffers";
    return buffers_refused_.empty() ? fmt::format("{} fixed buffer regions", fixed_buffers_.size())
                                    : "plain buffers (" + buffers_refused_ + ")";
  }

  Result<Lease> Acquire(Clock::time_point deadline, uint32_t timeout_ms) {
    STRATA_ASSIGN_OR_RETURN(Lease lease, AcquireRing(deadline, timeout_ms));
    ApplyFixedBuffers(*lease);
    return lease;
  }

 private:
  // Brings a ring's fixed buffers up to the pool's set. A refusal (the
  // memlock limit, most often) is logged once and the pool stops trying:
  // requests then use plain buffers, which work the same, a little slower.
  void ApplyFixedBuffers(Ring& ring) {
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

  Result<Lease> AcquireRing(Clock::time_point deadline, uint32_t timeout_ms) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      bool available = cv_.wait_until(lock, deadline, [&] { return !free_.empty() || created_ < kMaxRings; });
      if (!available) {
        return Timeout("nvme: all {} io_uring rings stayed busy for nvme.io_timeout_ms = {} ms", kMaxRings,
                       timeout_ms);
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

  void Release(std::unique_ptr<Ring> ring) {
    std::lock_guard<std::mutex> lock(mu_);
    if (ring->broken()) {
      --created_;
      ring.reset();  // closes the ring; see Note [Timeouts and the caller's buffer]
    } else {
      free_.push_back(std::move(ring));
    }
    cv_.notify_one();
  }

  const uint32_t queue_depth_;
  const std::vector<int> fds_;
  const bool sqpoll_;
  mutable std::mutex mu_;  // guards free_, created_ and the fixed-buffer set below  // guards free_ and created_
  std::condition_variable cv_;
  std::vector<std::unique_ptr<Ring>> free_;
  size_t created_ = 0;  // rings alive: in free_ or leased
  std::vector<iovec> fixed_buffers_;  // every region registered so far
  uint64_t buffer_generation_ = 0;    // bumped on every addition
  std::string buffers_refused_;       // non-empty once registration failed
};

__kernel_timespec TimespecUntil(Clock::time_point deadline) {
  int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
  ns = std::max<int64_t>(ns, 0);
  __kernel_timespec ts{};
  ts.tv_sec = ns / 1'000'000'000;
  ts.tv_nsec = ns % 1'000'000'000;
  return ts;
}

// Note [One worker per drive]
// With several directories a transfer is split by drive: the stripes of each
// backing file become that drive's share, run on a ring of its own by that
// drive's worker (the calling thread takes the first drive's share itself).
// Each drive then has its own submission and completion loop, so one busy
// reaping thread never paces the others, and N drives add their bandwidth.
// Every share runs under the call's deadline (and the cancel grace of
// Note [Timeouts and the caller's buffer]), so waiting for the workers is
// bounded; the call returns only when no request of it is left in flight.
class UringStorage final : public Storage {
 public:
  UringStorage(UringStorageOptions options, std::vector<BackingFile> files, std::vector<int> fds)
      : options_(std::move(options)), files_(std::move(files)), pool_(options_.queue_depth, std::move(fds), options_.sqpoll) {
    // The calling thread serves the first drive; see Note [One worker per drive].
    for (size_t i = 1; i < files_.size(); ++i) workers_.push_back(std::make_unique<TaskQueue>(1));
  }

  std::string Describe() const override {
    size_t direct = static_cast<size_t>(
        std::count_if(files_.begin(), files_.end(), [](const BackingFile& file) { return file.direct_io; }));
    std::string mode = direct == files_.size() ? "O_DIRECT"
                       : direct == 0           ? "buffered"
                                               : fmt::format("O_DIRECT on {} of {} dirs, buffered on the rest", direct,
                                                             files_.size());
    std::string dirs;
    for (const BackingFile& file : files_) dirs += (dirs.empty() ? "" : ", ") + file.dir;
    return fmt::format("io_uring {}, {} dir{} ({}), {}, block {}, qd {}, {}", mode, files_.size(),
                       files_.size() == 1 ? "" : "s", dirs, FormatSize(options_.capacity_bytes),
                       FormatSize(options_.block_size_bytes), options_.queue_depth, pool_.DescribeBuffers());
  }
  size_t capacity_bytes() const override { return options_.capacity_bytes; }
  size_t alignment_bytes() const override { return kAlignmentBytes; }

  // Makes the first ring (and keeps it in the pool).
  Status WarmUp() {
    Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
    STRATA_ASSIGN_OR_RETURN(RingPool::Lease lease, pool_.Acquire(deadline, options_.io_timeout_ms));
    return Status::Ok();
  }

  Status Write(uint64_t offset, const std::byte* src, size_t size_bytes) override {
    // The write path only ever passes the buffer to io_uring_prep_write.
    IoSegment segment{offset, const_cast<std::byte*>(src), size_bytes};
    return Transfer(Op::kWrite, {&segment, 1});
  }
  Status Read(uint64_t offset, std::byte* dst, size_t size_bytes) override {
    IoSegment segment{offset, dst, size_bytes};
    return Transfer(Op::kRead, {&segment, 1});
  }
  Status RegisterBuffer(void* data, size_t size_bytes) override {
    if (data == nullptr || size_bytes == 0) return InvalidArgument("nvme: RegisterBuffer of an empty range");
    // The kernel takes at most 1 GiB per registered buffer: split larger regions.
    constexpr size_t kMaxRegionBytes = size_t{1} << 30;
    std::vector<iovec> iovecs;
    for (size_t done = 0; done < size_bytes; done += kMaxRegionBytes) {
      iovecs.push_back({static_cast<std::byte*>(data) + done, std::min(kMaxRegionBytes, size_bytes - done)});
    }
    pool_.AddFixedBuffers(iovecs);
    // Apply it to one ring now, so that a refusal is known (and logged) at once.
    Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
    STRATA_ASSIGN_OR_RETURN(RingPool::Lease lease, pool_.Acquire(deadline, options_.io_timeout_ms));
    return Status::Ok();
  }
  Status WriteBatch(std::span<const IoSegment> segments) override { return Transfer(Op::kWrite, segments); }
  Status ReadBatch(std::span<const IoSegment> segments) override { return Transfer(Op::kRead, segments); }

 private:
  Status Transfer(Op op, std::span<const IoSegment> segments);
  // One drive's share of a transfer, on a ring of its own.
  Status RunShare(Op op, std::span<const IoSegment> segments, Clock::time_point deadline);
  Status RunOnRing(Ring& ring, Op op, std::span<const IoSegment> segments, Clock::time_point deadline);
  void Prepare(Ring& ring, Op op, uint32_t slot);
  // Handles one completion; returns false for a completion that is not a request's (a cancel's).
  bool Complete(Ring& ring, Op op, const io_uring_cqe& cqe, Status& first_error);
  // `prepared`: entries still in the SQ, which the cancel's submit flushes.
  void CancelAndDrain(Ring& ring, uint32_t in_flight, uint32_t prepared);
  Status RequestError(Op op, const Request& request, int error_number, int line) const {
    return CallError(fmt::format("io_uring {} of {} bytes", OpName(op), request.remaining_bytes), error_number,
                     files_[request.file_index].path, request.file_offset, __FILE__, line);
  }

  const UringStorageOptions options_;
  const std::vector<BackingFile> files_;  // immutable after construction: read by all threads without a lock
  RingPool pool_;                         // declared after files_: rings close before the files do
  std::vector<std::unique_ptr<TaskQueue>> workers_;  // one thread per drive 1..N-1; last: they stop first
};

Status UringStorage::Transfer(Op op, std::span<const IoSegment> segments) {
  size_t total_bytes = 0;
  for (const IoSegment& segment : segments) {
    STRATA_RETURN_IF_ERROR(CheckStorageRange(*this, segment.offset, segment.buffer, segment.size_bytes));
    total_bytes += segment.size_bytes;
  }
  if (total_bytes == 0) return Status::Ok();
  Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options_.io_timeout_ms);
  const size_t num_files = files_.size();
  if (num_files == 1) return RunShare(op, segments, deadline);

  // Cut every segment at stripe boundaries and deal the pieces to their drives.
  const uint64_t block = options_.block_size_bytes;
  std::vector<std::vector<IoSegment>> shares(num_files);
  for (const IoSegment& segment : segments) {
    uint64_t done = 0;
    while (done < segment.size_bytes) {
      uint64_t position = segment.offset + done;
      uint64_t length = std::min<uint64_t>(block - position % block, segment.size_bytes - done);
      shares[(position / block) % num_files].push_back({position, segment.buffer + done, length});
      done += length;
    }
  }
  std::vector<std::shared_future<Status>> others;
  for (size_t drive = 1; drive < num_files; ++drive) {
    if (shares[drive].empty()) continue;
    others.push_back(workers_[drive - 1]->Push(
        [this, op, share = std::span<const IoSegment>(shares[drive]), deadline] { return RunShare(op, share, deadline); }));
  }
  Status status = shares[0].empty() ? Status::Ok() : RunShare(op, shares[0], deadline);
  // Bounded: every share ends by its deadline plus the cancel grace.
  for (std::shared_future<Status>& other : others) {
    Status share_status = other.get();
    if (status.ok()) status = std::move(share_status);
  }
  return status;
}

Status UringStorage::RunShare(Op op, std::span<const IoSegment> segments, Clock::time_point deadline) {
  STRATA_ASSIGN_OR_RETURN(RingPool::Lease lease, pool_.Acquire(deadline, options_.io_timeout_ms));
  return RunOnRing(*lease, op, segments, deadline);
}

void UringStorage::Prepare(Ring& ring, Op op, uint32_t slot) {
  Request& request = ring.slot(slot);
  // The SQ has queue_depth entries and at most queue_depth requests are
  // in flight, so an entry is free once the kernel has taken the ones
  // submitted. With SQPOLL its thread frees them when it commits a batch,
  // which can come after the completion of the batch's first request (seen
  // once in CI): then wait for it to do so.
  io_uring_sqe* sqe = io_uring_get_sqe(ring.get());
  for (int tries = 0; sqe == nullptr && tries < 1000; ++tries) {
    io_uring_sqring_wait(ring.get());  // returns at once without SQPOLL
    sqe = io_uring_get_sqe(ring.get());
  }
  STRATA_CHECK(sqe != nullptr, "io_uring submission queue full with {} slots", ring.num_slots());
  int fd = ring.fixed_files() ? static_cast<int>(request.file_index) : files_[request.file_index].fd.get();
  auto length = static_cast<unsigned>(request.remaining_bytes);  // <= block size <= kMaxBlockSizeBytes
  const int buffer_index = ring.FixedBufferIndex(request.buffer, length);
  if (buffer_index >= 0) {  // the kernel skips pinning and mapping the pages of this request
    if (op == Op::kRead) {
      io_uring_prep_read_fixed(sqe, fd, request.buffer, length, request.file_offset, buffer_index);
    } else {
      io_uring_prep_write_fixed(sqe, fd, request.buffer, length, request.file_offset, buffer_index);
    }
  } else if (op == Op::kRead) {
    io_uring_prep_read(sqe, fd, request.buffer, length, request.file_offset);
  } else {
    io_uring_prep_write(sqe, fd, request.buffer, length, request.file_offset);
  }
  if (ring.fixed_files()) io_uring_sqe_set_flags(sqe, IOSQE_FIXED_FILE);
  io_uring_sqe_set_data64(sqe, slot);
  request.in_flight = true;
}

bool UringStorage::Complete(Ring& ring, Op op, const io_uring_cqe& cqe, Status& first_error) {
  // Cancels, and on kernels without IORING_FEAT_EXT_ARG liburing's own
  // timeout entries, carry user_data beyond the slots.
  if (cqe.user_data >= ring.num_slots()) return false;
  auto slot = static_cast<uint32_t>(cqe.user_data);
  Request& request = ring.slot(slot);
  request.in_flight = false;
  const int res = cqe.res;
  auto fail = [&](Status status) {
    if (first_error.ok()) first_error = std::move(status);
    ring.FreeSlot(slot);
  };
  if (res == -EAGAIN || res == -EINTR) {
    // Transient: the same request again (bounded by the call's deadline).
    if (first_error.ok()) {
      ring.retry_slots().push_back(slot);
    } else {
      ring.FreeSlot(slot);
    }
    return true;
  }
  if (res < 0) {
    fail(RequestError(op, request, -res, __LINE__));
    return true;
  }
  const BackingFile& file = files_[request.file_index];
  if (res == 0) {
    fail(op == Op::kRead ? IoError("short read: {} at offset {} returned 0 of {} bytes (end of file: was the "
                                   "backing file truncated?)",
                                   file.path, request.file_offset, request.remaining_bytes)
                         : IoError("short write: {} at offset {} accepted 0 of {} bytes", file.path,
                                   request.file_offset, request.remaining_bytes));
    return true;
  }
  const auto done = static_cast<size_t>(res);
  if (op == Op::kRead && file.direct_io && done < request.remaining_bytes && done % kAlignmentBytes != 0) {
    // O_DIRECT returns whole blocks except where the file ends: resubmitting
    // at the unaligned rest would only fail with EINVAL.
    fail(IoError("short read: {} at offset {} returned {} of {} bytes (the file ends inside the request: was the "
                 "backing file truncated?)",
                 file.path, request.file_offset, done, request.remaining_bytes));
    return true;
  }
  request.file_offset += done;
  request.buffer += done;
  request.remaining_bytes -= done;
  if (request.remaining_bytes == 0 || !first_error.ok()) {
    ring.FreeSlot(slot);
  } else {
    ring.retry_slots().push_back(slot);  // a short transfer: submit the rest
  }
  return true;
}

Status UringStorage::RunOnRing(Ring& ring, Op op, std::span<const IoSegment> segments,
                               Clock::time_point deadline) {
  io_uring* uring = ring.get();
  ring.ResetSlots();
  const size_t block = options_.block_size_bytes;
  const size_t num_files = files_.size();
  const uint64_t offset = segments.front().offset;  // for messages
  size_t size_bytes = 0;
  for (const IoSegment& segment : segments) size_bytes += segment.size_bytes;
  size_t next_segment = 0;    // the segment being cut into requests
  size_t assigned_in_segment = 0;  // bytes of it handed to requests so far
  size_t assigned_bytes = 0;  // bytes of all segments handed to requests so far
  uint32_t prepared = 0;      // SQEs prepared but not yet submitted
  uint32_t in_flight = 0;     // submitted requests whose completion is not reaped yet
  Status first_error;
  bool timed_out = false;

  while (true) {
    if (first_error.ok()) {
      std::vector<uint32_t>& retry = ring.retry_slots();
      for (uint32_t slot : retry) Prepare(ring, op, slot);
      prepared += static_cast<uint32_t>(retry.size());
      retry.clear();
      while (assigned_bytes < size_bytes && ring.HasFreeSlot()) {
        const IoSegment& segment = segments[next_segment];
        if (assigned_in_segment == segment.size_bytes) {  // done with it (or it is empty)
          ++next_segment;
          assigned_in_segment = 0;
          continue;
        }
        // Cut the next piece at the stripe boundary; see the layout in the file comment.
        uint64_t position = segment.offset + assigned_in_segment;
        uint64_t stripe = position / block;
        uint64_t within_bytes = position % block;
        size_t length = std::min<size_t>(block - within_bytes, segment.size_bytes - assigned_in_segment);
        uint32_t slot = ring.TakeSlot();
        Request& request = ring.slot(slot);
        request.file_index = static_cast<uint32_t>(stripe % num_files);
        request.file_offset = (stripe / num_files) * block + within_bytes;
        request.buffer = segment.buffer + assigned_in_segment;
        request.remaining_bytes = length;
        Prepare(ring, op, slot);
        ++prepared;
        assigned_in_segment += length;
        assigned_bytes += length;
      }
    }
    if (prepared > 0) {
      int submitted = io_uring_submit(uring);
      // Note [Counting submissions under SQPOLL]
      // On an SQPOLL ring io_uring_submit reports every entry still waiting
      // in the submission queue, those flushed by earlier calls that the poll
      // thread has not taken yet included; adding that to in_flight counted
      // them twice, and the transfer then waited for completions that would
      // never come (every 256 MiB batch of 64 KiB writes stalled at its end).
      // The poll thread takes every entry flushed, so what was prepared is now
      // in flight.
      if (submitted >= 0 && ring.sqpoll()) {
        in_flight += prepared;
        prepared = 0;
      } else if (submitted >= 0) {
        prepared -= static_cast<uint32_t>(submitted);
        in_flight += static_cast<uint32_t>(submitted);
      } else if (submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) {
        // The unsubmitted entries stay in the SQ; a ring in that state is not reused.
        if (first_error.ok()) {
          first_error = CallError("io_uring_submit", -submitted, files_[0].path, offset, __FILE__, __LINE__);
        }
        ring.MarkBroken();
        prepared = 0;
      }
    }
    if (in_flight == 0) {
      if (prepared == 0) break;
      // The kernel took nothing (EAGAIN/EBUSY) and there is nothing to wait on.
      if (Clock::now() >= deadline) {
        timed_out = true;
        break;
      }
      std::this_thread::sleep_for(kSubmitRetryPause);
      continue;
    }

    __kernel_timespec timeout = TimespecUntil(deadline);
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe_timeout(uring, &cqe, &timeout);
    if (rc == -ETIME) {
      timed_out = true;
      break;
    }
    if (rc == -EINTR) continue;
    if (rc < 0) {
      if (first_error.ok()) {
        first_error = CallError("io_uring_wait_cqe_timeout", -rc, files_[0].path, offset, __FILE__, __LINE__);
      }
      timed_out = true;  // cannot reap: cancel and drain as after a timeout
      break;
    }
    // Reap every completion that is ready, not just the one waited for.
    unsigned head = 0;
    unsigned seen = 0;
    io_uring_for_each_cqe(uring, head, cqe) {
      ++seen;
      if (Complete(ring, op, *cqe, first_error)) --in_flight;
    }
    io_uring_cq_advance(uring, seen);
    // A transfer that always has a completion ready never waits, so the
    // deadline is checked here too, not only by the wait.
    bool work_left =
        in_flight > 0 || (first_error.ok() && (assigned_bytes < size_bytes || !ring.retry_slots().empty()));
    if (work_left && Clock::now() >= deadline) {
      timed_out = true;
      break;
    }
  }

  if (timed_out) {
    Status status = first_error;
    if (status.ok()) {
      std::string example;
      for (uint32_t i = 0; i < ring.num_slots() && example.empty(); ++i) {
        const Request& request = ring.slot(i);
        if (request.in_flight) {
          example = fmt::format(", one on {} at offset {}", files_[request.file_index].path, request.file_offset);
        }
      }
      status = Timeout("nvme {} of {} bytes from offset {} did not finish within nvme.io_timeout_ms = {} ms ({} "
                       "request{} still in flight{})",
                       OpName(op), size_bytes, offset, options_.io_timeout_ms, in_flight, in_flight == 1 ? "" : "s",
                       example);
    }
    CancelAndDrain(ring, in_flight, prepared);
    return status;
  }
  return first_error;
}

// See Note [Timeouts and the caller's buffer].
void UringStorage::CancelAndDrain(Ring& ring, uint32_t in_flight, uint32_t prepared) {
  io_uring* uring = ring.get();
  // The entries not yet submitted go to the kernel with the first submit
  // below, ahead of the cancels that target them.
  uint32_t outstanding = in_flight + prepared;
  if (outstanding == 0) return;
  bool submit_failed = false;
  auto submit = [&] {
    if (io_uring_submit(uring) < 0) submit_failed = true;
  };
  // One cancel per request by its user_data: works on every kernel with
  // io_uring (IORING_ASYNC_CANCEL_ANY needs 5.19).
  for (uint32_t i = 0; i < ring.num_slots(); ++i) {
    if (!ring.slot(i).in_flight) continue;
    io_uring_sqe* sqe = io_uring_get_sqe(uring);
    if (sqe == nullptr) {
      submit();
      sqe = io_uring_get_sqe(uring);
      if (sqe == nullptr) break;
    }
    io_uring_prep_cancel64(sqe, i, 0);
    io_uring_sqe_set_data64(sqe, kCancelUserData);
  }
  submit();
  if (submit_failed) {
    // Unknown which entries reached the kernel: wait for those known to have,
    // and never reuse the ring (the rest die with it).
    ring.MarkBroken();
    outstanding = in_flight;
  }

  Clock::time_point grace_deadline = Clock::now() + std::chrono::milliseconds(kCancelGraceMs);
  while (outstanding > 0) {
    __kernel_timespec timeout = TimespecUntil(grace_deadline);
    io_uring_cqe* cqe = nullptr;
    int rc = io_uring_wait_cqe_timeout(uring, &cqe, &timeout);
    if (rc == -EINTR) continue;
    if (rc < 0) {
      STRATA_LOG_ERROR(
          "nvme: {} io_uring request{} did not finish {} ms after being cancelled; abandoning the ring (the drive "
          "may still access the caller's buffer)",
          outstanding, outstanding == 1 ? "" : "s", kCancelGraceMs);
      ring.MarkBroken();
      return;
    }
    unsigned head = 0;
    unsigned seen = 0;
    io_uring_for_each_cqe(uring, head, cqe) {
      ++seen;
      // Completions of cancelled requests: any result, the call already failed.
      if (cqe->user_data < ring.num_slots()) {
        auto slot = static_cast<uint32_t>(cqe->user_data);
        ring.slot(slot).in_flight = false;
        ring.FreeSlot(slot);
        if (outstanding > 0) --outstanding;  // after a failed submit the count is a lower bound
      }
    }
    io_uring_cq_advance(uring, seen);
  }
}

Status ValidateUringOptions(const UringStorageOptions& options) {
  if (options.dirs.empty()) {
    return InvalidArgument("nvme.dirs is empty: list at least one directory (one per drive) for the backing files");
  }
  for (const std::string& dir : options.dirs) {
    if (dir.empty()) return InvalidArgument("nvme.dirs has an empty entry: every entry must name a directory");
  }
  if (options.capacity_bytes == 0) {
    return InvalidArgument("nvme.capacity is 0: must be > 0 bytes (all directories together)");
  }
  if (options.block_size_bytes == 0 || options.block_size_bytes % kAlignmentBytes != 0 ||
      options.block_size_bytes > kMaxBlockSizeBytes) {
    return InvalidArgument("nvme.block_size is {} bytes: must be a multiple of {} bytes between {} and {}",
                           options.block_size_bytes, kAlignmentBytes, FormatSize(kAlignmentBytes),
                           FormatSize(kMaxBlockSizeBytes));
  }
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    return InvalidArgument("nvme.queue_depth is {}: must be between 1 and {}", options.queue_depth, kMaxQueueDepth);
  }
  if (options.io_timeout_ms == 0) {
    return InvalidArgument("nvme.io_timeout_ms is 0: must be > 0 milliseconds");
  }
  if (options.file_name.empty() || options.file_name.find('/') != std::string::npos || options.file_name == "." ||
      options.file_name == "..") {
    return InvalidArgument("backing file name '{}' must be a plain file name (no '/')", options.file_name);
  }
  return Status::Ok();
}

// Removes the backing files this attempt created, unless setup succeeded: a
// failed start leaves the directories as it found them.
class CreatedFilesGuard {
 public:
  CreatedFilesGuard() = default;
  CreatedFilesGuard(const CreatedFilesGuard&) = delete;
  CreatedFilesGuard& operator=(const CreatedFilesGuard&) = delete;
  ~CreatedFilesGuard() {
    for (const std::string& path : paths_) ::unlink(path.c_str());
  }
  void Add(std::string path) { paths_.push_back(std::move(path)); }
  void Dismiss() { paths_.clear(); }

 private:
  std::vector<std::string> paths_;
};

// Every directory must exist, be a directory, be writable, and appear once.
Status CheckDirectories(const std::vector<std::string>& dirs, std::vector<struct stat>& dir_stats) {
  dir_stats.clear();
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string& dir = dirs[i];
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      int error_number = errno;
      return IoError("nvme.dirs entry '{}' cannot be used: {} (errno {})", dir, ErrnoText(error_number),
                     error_number);
    }
    if (!S_ISDIR(st.st_mode)) {
      return IoError("nvme.dirs entry '{}' is not a directory: {} (errno {})", dir, ErrnoText(ENOTDIR), ENOTDIR);
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      int error_number = errno;
      return IoError("nvme.dirs entry '{}' is not writable: {} (errno {})", dir, ErrnoText(error_number),
                     error_number);
    }
    for (size_t j = 0; j < i; ++j) {
      if (dir_stats[j].st_dev == st.st_dev && dir_stats[j].st_ino == st.st_ino) {
        // Both entries would open the same file and overwrite each other's stripes.
        return InvalidArgument("nvme.dirs lists the same directory twice ('{}' and '{}')", dirs[j], dir);
      }
    }
    dir_stats.push_back(st);
  }
  return Status::Ok();
}

// Fails early, before any file grows, when a filesystem cannot hold its
// directories' backing files. Directories on one filesystem share its free
// space, so needs are summed per filesystem.
Status CheckFreeSpace(const UringStorageOptions& options, const std::vector<struct stat>& dir_stats,
                      uint64_t file_size_bytes) {
  struct Filesystem {
    uint64_t needed_bytes = 0;
    uint64_t free_bytes = 0;
    std::vector<std::string> dirs;
  };
  std::map<dev_t, Filesystem> filesystems;
  for (size_t i = 0; i < options.dirs.size(); ++i) {
    const std::string& dir = options.dirs[i];
    struct statvfs vfs {};
    STRATA_SYSCALL_CHECK(::statvfs(dir.c_str(), &vfs), dir, 0);
    Filesystem& fs = filesystems[dir_stats[i].st_dev];
    fs.free_bytes = static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
    fs.dirs.push_back(dir);
    // Space an existing backing file already holds counts as available.
    uint64_t held_bytes = 0;
    std::string path = (std::filesystem::path(dir) / options.file_name).string();
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      held_bytes = std::min<uint64_t>(static_cast<uint64_t>(st.st_blocks) * 512, file_size_bytes);
    }
    fs.needed_bytes += file_size_bytes - held_bytes;
  }
  for (const auto& [device, fs] : filesystems) {
    if (fs.needed_bytes > fs.free_bytes) {
      std::string dirs;
      for (const std::string& dir : fs.dirs) dirs += (dirs.empty() ? "'" : ", '") + dir + "'";
      return OutOfMemory(
          "nvme tier: not enough free space for the backing files in {}: needed {} ({} bytes; {} per directory for "
          "nvme.capacity = {} over {} director{}), free {} ({} bytes); lower nvme.capacity or add directories on "
          "other drives",
          dirs, FormatSize(fs.needed_bytes), fs.needed_bytes, FormatSize(file_size_bytes),
          FormatSize(options.capacity_bytes), options.dirs.size(), options.dirs.size() == 1 ? "y" : "ies",
          FormatSize(fs.free_bytes), fs.free_bytes);
    }
  }
  return Status::Ok();
}

// Opens (creating if needed) one backing file and reserves its share.
Status OpenBackingFile(const UringStorageOptions& options, const std::string& dir, uint64_t file_size_bytes,
                       const OpenFileFn& open_file, CreatedFilesGuard& created, BackingFile& file) {
  file.dir = dir;
  file.path = (std::filesystem::path(dir) / options.file_name).string();
  const char* path = file.path.c_str();
  struct stat existing {};
  if (::lstat(path, &existing) != 0) created.Add(file.path);

  constexpr int kFlags = O_RDWR | O_CREAT | O_CLOEXEC;
  constexpr mode_t kMode = 0600;  // spilled training state: nobody else's business
  int fd = open_file(path, kFlags | O_DIRECT, kMode);
  if (fd < 0 && errno == EINVAL) {
    // The filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE and
    // network filesystems).
    if (!options.allow_buffered_io) {
      return NotSupported(
          "nvme.dirs entry '{}': the filesystem refuses O_DIRECT (open of {} returned EINVAL); put the NVMe tier on "
          "a filesystem that supports it (ext4 or xfs on an NVMe drive), or set nvme.allow_buffered_io = true to "
          "accept page-cache I/O (slower, and it competes with the host tier for memory)",
          dir, file.path);
    }
    STRATA_LOG_WARNING(
        "nvme.dirs entry '{}': the filesystem refuses O_DIRECT; using buffered I/O because nvme.allow_buffered_io is "
        "set (slower, and the page cache competes with the host tier for memory)",
        dir);
    file.direct_io = false;
    fd = open_file(path, kFlags, kMode);
  }
  if (fd < 0) {
    return CallError(file.direct_io ? "open(O_DIRECT)" : "open", errno, file.path, 0, __FILE__, __LINE__);
  }
  file.fd = UniqueFd(fd);

  struct stat st {};
  STRATA_SYSCALL_CHECK(::fstat(fd, &st), file.path, 0);
  if (!S_ISREG(st.st_mode)) {
    return IoError("backing file {} is not a regular file (mode {:o}); remove it or choose another directory",
                   file.path, st.st_mode);
  }
  // Mode 0 allocates and extends the size; existing data is kept, a larger
  // file (from a larger nvme.capacity) is left as it is.
  if (::fallocate(fd, 0, 0, static_cast<off_t>(file_size_bytes)) != 0) {
    int error_number = errno;
    if (error_number == ENOSPC) {
      return OutOfMemory("nvme tier: {} ran out of space while reserving {} for the backing file (needed {} bytes)",
                         file.path, FormatSize(file_size_bytes), file_size_bytes);
    }
    if (error_number != EOPNOTSUPP) {
      return CallError("fallocate", error_number, file.path, 0, __FILE__, __LINE__);
    }
    STRATA_LOG_WARNING("{}: the filesystem cannot preallocate (fallocate: {}); the file is sparse, and a full disk "
                       "will show up as write errors later",
                       file.path, ErrnoText(error_number));
    if (static_cast<uint64_t>(st.st_size) < file_size_bytes) {
      STRATA_SYSCALL_CHECK(::ftruncate(fd, static_cast<off_t>(file_size_bytes)), file.path, file_size_bytes);
    }
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<Storage>> CreateUringStorageWithOpen(const UringStorageOptions& options,
                                                            OpenFileFn open_file) {
  STRATA_RETURN_IF_ERROR(ValidateUringOptions(options));
  const uint64_t num_dirs = options.dirs.size();
  const uint64_t block = options.block_size_bytes;
  // Each file holds every num_dirs-th stripe: ceil(capacity / num_dirs),
  // rounded up to whole blocks.
  const uint64_t share_bytes = (options.capacity_bytes + num_dirs - 1) / num_dirs;
  const uint64_t file_size_bytes = (share_bytes + block - 1) / block * block;

  std::vector<struct stat> dir_stats;
  STRATA_RETURN_IF_ERROR(CheckDirectories(options.dirs, dir_stats));
  STRATA_RETURN_IF_ERROR(CheckFreeSpace(options, dir_stats, file_size_bytes));

  CreatedFilesGuard created;
  std::vector<BackingFile> files(options.dirs.size());
  std::vector<int> fds;
  for (size_t i = 0; i < options.dirs.size(); ++i) {
    STRATA_RETURN_IF_ERROR(OpenBackingFile(options, options.dirs[i], file_size_bytes, open_file, created, files[i]));
    fds.push_back(files[i].fd.get());
  }
  auto storage = std::make_unique<UringStorage>(options, std::move(files), std::move(fds));
  // One ring now, so that a kernel without io_uring (or with it disabled)
  // fails at startup rather than on the first eviction.
  Status ring_status = storage->WarmUp();
  if (!ring_status.ok()) {
    return NotSupported("the nvme tier needs io_uring, which failed here: {}", ring_status.message());
  }
  created.Dismiss();
  STRATA_LOG_DEBUG("nvme storage: {}", storage->Describe());
  return std::unique_ptr<Storage>(std::move(storage));
}

}  // namespace storage

Result<std::unique_ptr<Storage>> CreateUringStorage(const UringStorageOptions& options) {
  return storage::CreateUringStorageWithOpen(
      options, [](const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); });
}

}  // namespace strata
