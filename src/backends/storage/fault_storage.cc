// FaultInjectingStorage: the seam through which tests make storage fail.
//
// Every call first checks the range contract (a malformed call is the
// caller's bug and consumes no armed fault), then, under the mutex, counts
// itself and takes at most one armed fault; the delay and the base call run
// without the lock, so a delayed or slow operation never blocks another.
//
// Precedence when several faults are armed: for writes, a failure before a
// corruption; for reads, failure, then short read, then corruption. One call
// consumes one fault.

#include <algorithm>
#include <chrono>
#include <cstring>
#include <mutex>
#include <thread>

#include "src/backends/storage/storage_util.h"
#include "strata/buffer.h"
#include "strata/storage.h"

namespace strata {
namespace {

// The byte ShortReads writes over the half it "lost": a pattern that is
// neither zero (a fresh drive) nor likely in real data.
constexpr std::byte kLostDataFill{0xA5};

enum class Fault { kNone, kFail, kShort, kCorrupt };

}  // namespace

struct FaultInjectingStorage::State {
  std::mutex mu;  // guards every field below
  int fail_writes_remaining = 0;
  int fail_writes_errno = 0;
  int fail_writes_after = 0;  // writes that still succeed before the failures start
  int fail_reads_remaining = 0;
  int fail_reads_errno = 0;
  int fail_reads_after = 0;
  int short_reads_remaining = 0;
  int corrupt_writes_remaining = 0;
  int corrupt_reads_remaining = 0;
  uint32_t delay_ms = 0;
  int reads = 0;   // Read calls that passed the range check
  int writes = 0;  // Write calls that passed the range check
};

FaultInjectingStorage::FaultInjectingStorage(std::unique_ptr<Storage> base)
    : base_(std::move(base)), state_(std::make_unique<State>()) {
  STRATA_CHECK(base_ != nullptr, "FaultInjectingStorage needs a base storage");
}

FaultInjectingStorage::~FaultInjectingStorage() = default;

void FaultInjectingStorage::FailWrites(int error_number, int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_writes_errno = error_number;
  state_->fail_writes_remaining = std::max(count, 0);
  state_->fail_writes_after = std::max(after, 0);
}

void FaultInjectingStorage::FailReads(int error_number, int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_reads_errno = error_number;
  state_->fail_reads_remaining = std::max(count, 0);
  state_->fail_reads_after = std::max(after, 0);
}

void FaultInjectingStorage::ShortReads(int count) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->short_reads_remaining = std::max(count, 0);
}

void FaultInjectingStorage::CorruptWrites(int count) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->corrupt_writes_remaining = std::max(count, 0);
}

void FaultInjectingStorage::CorruptReads(int count) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->corrupt_reads_remaining = std::max(count, 0);
}

void FaultInjectingStorage::SetDelayMs(uint32_t delay_ms) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->delay_ms = delay_ms;
}

int FaultInjectingStorage::reads() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->reads;
}

int FaultInjectingStorage::writes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->writes;
}

std::string FaultInjectingStorage::Describe() const { return "fault-injecting(" + base_->Describe() + ")"; }
size_t FaultInjectingStorage::capacity_bytes() const { return base_->capacity_bytes(); }
size_t FaultInjectingStorage::alignment_bytes() const { return base_->alignment_bytes(); }

Status FaultInjectingStorage::Write(uint64_t offset, const std::byte* src, size_t size_bytes) {
  STRATA_RETURN_IF_ERROR(storage::CheckStorageRange(*this, offset, src, size_bytes));
  Fault fault = Fault::kNone;
  int error_number = 0;
  uint32_t delay_ms = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->writes;
    delay_ms = state_->delay_ms;
    if (state_->fail_writes_remaining > 0 && state_->fail_writes_after > 0) {
      --state_->fail_writes_after;
    } else if (state_->fail_writes_remaining > 0) {
      --state_->fail_writes_remaining;
      fault = Fault::kFail;
      error_number = state_->fail_writes_errno;
    } else if (state_->corrupt_writes_remaining > 0) {
      --state_->corrupt_writes_remaining;
      fault = Fault::kCorrupt;
    }
  }
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));

  if (fault == Fault::kFail) {
    // The base is not called: the stored bytes stay as they were.
    return IoError("injected fault: write at offset {}: {} (errno {})", offset, ErrnoText(error_number),
                   error_number);
  }
  if (fault == Fault::kCorrupt && size_bytes > 0) {
    // The caller's buffer is const: corrupt an aligned copy instead.
    Buffer copy = AllocateAlignedHost(size_bytes, alignment_bytes());
    if (!copy) {
      return OutOfMemory("fault injection: cannot allocate {} bytes of host memory for a corrupted write copy",
                         size_bytes);
    }
    std::memcpy(copy.data(), src, size_bytes);
    copy.bytes()[size_bytes / 2] ^= std::byte{0xFF};
    return base_->Write(offset, copy.bytes(), size_bytes);
  }
  return base_->Write(offset, src, size_bytes);
}

Status FaultInjectingStorage::Read(uint64_t offset, std::byte* dst, size_t size_bytes) {
  STRATA_RETURN_IF_ERROR(storage::CheckStorageRange(*this, offset, dst, size_bytes));
  Fault fault = Fault::kNone;
  int error_number = 0;
  uint32_t delay_ms = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    ++state_->reads;
    delay_ms = state_->delay_ms;
    if (state_->fail_reads_remaining > 0 && state_->fail_reads_after > 0) {
      --state_->fail_reads_after;
    } else if (state_->fail_reads_remaining > 0) {
      --state_->fail_reads_remaining;
      fault = Fault::kFail;
      error_number = state_->fail_reads_errno;
    } else if (state_->short_reads_remaining > 0) {
      --state_->short_reads_remaining;
      fault = Fault::kShort;
    } else if (state_->corrupt_reads_remaining > 0) {
      --state_->corrupt_reads_remaining;
      fault = Fault::kCorrupt;
    }
  }
  if (delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));

  if (fault == Fault::kFail) {
    return IoError("injected fault: read at offset {}: {} (errno {})", offset, ErrnoText(error_number),
                   error_number);
  }
  STRATA_RETURN_IF_ERROR(base_->Read(offset, dst, size_bytes));
  if (fault == Fault::kShort) {
    // Reported as success with the second half lost: what a backend that
    // ignored a short read would hand up.
    std::fill(dst + size_bytes / 2, dst + size_bytes, kLostDataFill);
  } else if (fault == Fault::kCorrupt && size_bytes > 0) {
    dst[size_bytes / 2] ^= std::byte{0xFF};
  }
  return Status::Ok();
}

}  // namespace strata
