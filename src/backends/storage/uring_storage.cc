// The NVMe tier's storage backend: one preallocated file per directory,
// read and written with io_uring, O_DIRECT by default.
//
// Layout: the linear byte space [0, capacity) is cut into stripes of
// block_size bytes; stripe k lives in file k % ndirs at file offset
// (k / ndirs) * block_size. One request never crosses a stripe, so one
// request is at most one block and a transfer of n blocks keeps every drive
// busy.
//
// This file holds the Storage implementation and its request loop; the rings
// and their pool are uring_ring.{h,cc}, the backing files uring_files.{h,cc}.
// Only these files include <liburing.h>; failed calls go through
// STRATA_URING_CHECK / STRATA_SYSCALL_CHECK (uring_check.h).
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

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <future>
#include <span>
#include <string>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "src/backends/storage/storage_util.h"
#include "src/backends/storage/uring_check.h"
#include "src/backends/storage/uring_files.h"
#include "src/backends/storage/uring_ring.h"
#include "src/base/alignment.h"
#include "src/base/logging.h"
#include "src/base/task_queue.h"
#include "strata/options.h"
#include "strata/storage.h"

namespace strata {
namespace storage {
namespace uring {
namespace {

// See Note [Timeouts and the caller's buffer]: a healthy drive finishes any
// queued request in far less than 5 s.
constexpr uint32_t kCancelGraceMs = 5000;
// user_data of cancel requests. Not ~0: liburing reserves that for its own
// timeout entries on kernels without IORING_FEAT_EXT_ARG.
constexpr uint64_t kCancelUserData = ~uint64_t{0} - 1;
// Pause before retrying a submit refused with EAGAIN/EBUSY while nothing is in
// flight (nothing to wait on instead).
constexpr auto kSubmitRetryPause = std::chrono::milliseconds(1);

enum class Op { kRead, kWrite };

std::string_view OpName(Op op) { return op == Op::kRead ? "read" : "write"; }

__kernel_timespec TimespecUntil(Clock::time_point deadline) {
  int64_t ns = std::chrono::duration_cast<std::chrono::nanoseconds>(deadline - Clock::now()).count();
  ns = std::max<int64_t>(ns, 0);
  __kernel_timespec ts{};
  ts.tv_sec = ns / 1'000'000'000;
  ts.tv_nsec = ns % 1'000'000'000;
  return ts;
}

// Where one transfer on one ring stands: the loop state of RunOnRing.
struct RingTransfer {
  std::span<const IoSegment> segments;
  size_t size_bytes = 0;           // of all segments
  uint64_t offset = 0;             // of the first segment: for messages
  size_t next_segment = 0;         // the segment being cut into requests
  size_t assigned_in_segment = 0;  // bytes of it handed to requests so far
  size_t assigned_bytes = 0;       // bytes of all segments handed to requests so far
  uint32_t prepared = 0;           // SQEs prepared but not yet submitted
  uint32_t in_flight = 0;          // submitted requests whose completion is not reaped yet
  Status first_error;
};

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
  size_t alignment_bytes() const override { return kIoAlignmentBytes; }

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
  // Prepares the requests to retry, then new ones cut from the segments while slots are free.
  void QueueRequests(Ring& ring, Op op, RingTransfer& transfer);
  void Submit(Ring& ring, RingTransfer& transfer);
  // Waits for completions until the deadline and reaps every one ready; false
  // when the transfer must stop: the deadline passed or the ring cannot be reaped.
  bool WaitAndReap(Ring& ring, Op op, RingTransfer& transfer, Clock::time_point deadline);
  Status TimeoutError(Ring& ring, Op op, const RingTransfer& transfer) const;
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
  if (op == Op::kRead && file.direct_io && done < request.remaining_bytes && done % kIoAlignmentBytes != 0) {
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
  ring.ResetSlots();
  RingTransfer transfer;
  transfer.segments = segments;
  transfer.offset = segments.front().offset;
  for (const IoSegment& segment : segments) transfer.size_bytes += segment.size_bytes;
  while (true) {
    if (transfer.first_error.ok()) QueueRequests(ring, op, transfer);
    if (transfer.prepared > 0) Submit(ring, transfer);
    if (transfer.in_flight == 0) {
      if (transfer.prepared == 0) return transfer.first_error;
      // The kernel took nothing (EAGAIN/EBUSY) and there is nothing to wait on.
      if (Clock::now() >= deadline) break;
      std::this_thread::sleep_for(kSubmitRetryPause);
      continue;
    }
    if (!WaitAndReap(ring, op, transfer, deadline)) break;
  }
  // Timed out, or the ring cannot be reaped: see Note [Timeouts and the caller's buffer].
  Status status = transfer.first_error.ok() ? TimeoutError(ring, op, transfer) : transfer.first_error;
  CancelAndDrain(ring, transfer.in_flight, transfer.prepared);
  return status;
}

void UringStorage::QueueRequests(Ring& ring, Op op, RingTransfer& transfer) {
  std::vector<uint32_t>& retry = ring.retry_slots();
  for (uint32_t slot : retry) Prepare(ring, op, slot);
  transfer.prepared += static_cast<uint32_t>(retry.size());
  retry.clear();
  const size_t block = options_.block_size_bytes;
  const size_t num_files = files_.size();
  while (transfer.assigned_bytes < transfer.size_bytes && ring.HasFreeSlot()) {
    const IoSegment& segment = transfer.segments[transfer.next_segment];
    if (transfer.assigned_in_segment == segment.size_bytes) {  // done with it (or it is empty)
      ++transfer.next_segment;
      transfer.assigned_in_segment = 0;
      continue;
    }
    // Cut the next piece at the stripe boundary; see the layout in the file comment.
    uint64_t position = segment.offset + transfer.assigned_in_segment;
    uint64_t stripe = position / block;
    uint64_t within_bytes = position % block;
    size_t length = std::min<size_t>(block - within_bytes, segment.size_bytes - transfer.assigned_in_segment);
    uint32_t slot = ring.TakeSlot();
    Request& request = ring.slot(slot);
    request.file_index = static_cast<uint32_t>(stripe % num_files);
    request.file_offset = (stripe / num_files) * block + within_bytes;
    request.buffer = segment.buffer + transfer.assigned_in_segment;
    request.remaining_bytes = length;
    Prepare(ring, op, slot);
    ++transfer.prepared;
    transfer.assigned_in_segment += length;
    transfer.assigned_bytes += length;
  }
}

void UringStorage::Submit(Ring& ring, RingTransfer& transfer) {
  int submitted = io_uring_submit(ring.get());
  // Note [Counting submissions under SQPOLL]
  // On an SQPOLL ring io_uring_submit reports every entry still waiting
  // in the submission queue, those flushed by earlier calls that the poll
  // thread has not taken yet included; adding that to in_flight counted
  // them twice, and the transfer then waited for completions that would
  // never come (every 256 MiB batch of 64 KiB writes stalled at its end).
  // The poll thread takes every entry flushed, so what was prepared is now
  // in flight.
  if (submitted >= 0 && ring.sqpoll()) {
    transfer.in_flight += transfer.prepared;
    transfer.prepared = 0;
  } else if (submitted >= 0) {
    transfer.prepared -= static_cast<uint32_t>(submitted);
    transfer.in_flight += static_cast<uint32_t>(submitted);
  } else if (submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) {
    // The unsubmitted entries stay in the SQ; a ring in that state is not reused.
    if (transfer.first_error.ok()) {
      transfer.first_error =
          CallError("io_uring_submit", -submitted, files_[0].path, transfer.offset, __FILE__, __LINE__);
    }
    ring.MarkBroken();
    transfer.prepared = 0;
  }
}

bool UringStorage::WaitAndReap(Ring& ring, Op op, RingTransfer& transfer, Clock::time_point deadline) {
  io_uring* uring = ring.get();
  __kernel_timespec timeout = TimespecUntil(deadline);
  io_uring_cqe* cqe = nullptr;
  int rc = io_uring_wait_cqe_timeout(uring, &cqe, &timeout);
  if (rc == -ETIME) return false;
  if (rc == -EINTR) return true;
  if (rc < 0) {
    if (transfer.first_error.ok()) {
      transfer.first_error =
          CallError("io_uring_wait_cqe_timeout", -rc, files_[0].path, transfer.offset, __FILE__, __LINE__);
    }
    return false;  // cannot reap: cancel and drain as after a timeout
  }
  // Reap every completion that is ready, not just the one waited for.
  unsigned head = 0;
  unsigned seen = 0;
  io_uring_for_each_cqe(uring, head, cqe) {
    ++seen;
    if (Complete(ring, op, *cqe, transfer.first_error)) --transfer.in_flight;
  }
  io_uring_cq_advance(uring, seen);
  // A transfer that always has a completion ready never waits, so the
  // deadline is checked here too, not only by the wait.
  bool work_left = transfer.in_flight > 0 ||
                   (transfer.first_error.ok() &&
                    (transfer.assigned_bytes < transfer.size_bytes || !ring.retry_slots().empty()));
  return !(work_left && Clock::now() >= deadline);
}

Status UringStorage::TimeoutError(Ring& ring, Op op, const RingTransfer& transfer) const {
  std::string example;
  for (uint32_t i = 0; i < ring.num_slots() && example.empty(); ++i) {
    const Request& request = ring.slot(i);
    if (request.in_flight) {
      example = fmt::format(", one on {} at offset {}", files_[request.file_index].path, request.file_offset);
    }
  }
  const uint32_t in_flight = transfer.in_flight;
  return Timeout("nvme {} of {} bytes from offset {} did not finish within nvme.io_timeout_ms = {} ms ({} "
                 "request{} still in flight{})",
                 OpName(op), transfer.size_bytes, transfer.offset, options_.io_timeout_ms, in_flight,
                 in_flight == 1 ? "" : "s", example);
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

}  // namespace
}  // namespace uring

Result<std::unique_ptr<Storage>> CreateUringStorageWithOpen(const UringStorageOptions& options, OpenFileFn open_file,
                                                            FileSystem& free_space) {
  STRATA_RETURN_IF_ERROR(uring::ValidateUringOptions(options));
  uring::CreatedFilesGuard created;
  STRATA_ASSIGN_OR_RETURN(std::vector<uring::BackingFile> files,
                          uring::OpenBackingFiles(options, open_file, free_space, created));
  std::vector<int> fds;
  for (const uring::BackingFile& file : files) fds.push_back(file.fd.get());
  auto storage = std::make_unique<uring::UringStorage>(options, std::move(files), std::move(fds));
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

Result<std::unique_ptr<Storage>> CreateUringStorage(const UringStorageOptions& options, FileSystem& free_space) {
  return storage::CreateUringStorageWithOpen(
      options, [](const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }, free_space);
}

}  // namespace strata
