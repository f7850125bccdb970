#include "src/backends/storage/fault_plan.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

#include "src/base/alignment.h"
#include "src/base/posix_file.h"

namespace strata::storage {

// Note [One fault per call]
// Each armed fault counts for itself: Arm(op, fault, count, after) lets the
// next `after` operations of `op` pass that fault by and hands it to the `count`
// after them, whatever other faults do meanwhile. One call consumes at most one
// fault, and when several are due the worse wins: a failure (nothing moves),
// then a short transfer, then a corruption; a fault not taken stays armed for
// the next call. Syncs can only fail, and neither sleep nor stall.

bool FaultPlan::Armed::Take() {
  if (remaining <= 0) return false;
  if (after > 0) {
    --after;
    return false;
  }
  --remaining;
  return true;
}

void FaultPlan::Arm(FaultOp op, Fault fault, int count, int after, int error_number) {
  std::lock_guard<std::mutex> lock(mu_);
  OpFaults& faults = Of(op);
  Armed& armed = fault == Fault::kFail ? faults.fail : fault == Fault::kShort ? faults.cut : faults.corrupt;
  armed = Armed{std::max(count, 0), std::max(after, 0), error_number};
}

void FaultPlan::SetDelayMs(uint32_t delay_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  delay_ms_ = delay_ms;
}

void FaultPlan::StallWrites(int after, uint32_t max_ms) {
  std::lock_guard<std::mutex> lock(mu_);
  stall_after_ = std::max(after, 0);
  stall_max_ms_ = max_ms;
  released_ = false;
}

void FaultPlan::Unstall() {
  std::lock_guard<std::mutex> lock(mu_);
  stall_after_ = -1;
  released_ = true;
  unstalled_.notify_all();
}

// See Note [One fault per call].
FaultTaken FaultPlan::Take(FaultOp op) {
  std::lock_guard<std::mutex> lock(mu_);
  OpFaults& faults = Of(op);
  ++faults.taken;
  FaultTaken taken;
  if (op == FaultOp::kSync) {
    if (faults.fail.Take()) taken = {Fault::kFail, faults.fail.error_number};
    return taken;
  }
  taken.delay_ms = delay_ms_;
  if (op == FaultOp::kWrite && stall_after_ >= 0) taken.stall = stall_after_-- == 0;
  if (faults.fail.Take()) {
    taken.fault = Fault::kFail;
    taken.error_number = faults.fail.error_number;
  } else if (faults.cut.Take()) {
    taken.fault = Fault::kShort;
  } else if (faults.corrupt.Take()) {
    taken.fault = Fault::kCorrupt;
  }
  return taken;
}

void FaultPlan::Pause(const FaultTaken& taken) {
  if (taken.delay_ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(taken.delay_ms));
  if (!taken.stall) return;
  std::unique_lock<std::mutex> lock(mu_);
  unstalled_.wait_for(lock, std::chrono::milliseconds(stall_max_ms_), [this] { return released_; });
}

int FaultPlan::count(FaultOp op) const {
  std::lock_guard<std::mutex> lock(mu_);
  return ops_[static_cast<int>(op)].taken;
}

Status InjectedFault(std::string_view what, uint64_t offset, int error_number) {
  return IoError("injected fault: {} at offset {}: {} (errno {})", what, offset, ErrnoText(error_number),
                 error_number);
}

Result<Buffer> CorruptedCopy(const std::byte* data, size_t size_bytes, size_t alignment_bytes) {
  Buffer copy = AllocateAlignedHost(RoundUp(size_bytes, alignment_bytes), alignment_bytes);
  if (!copy) return OutOfMemory("fault injection: a {}-byte copy of a corrupted write", size_bytes);
  std::memcpy(copy.data(), data, size_bytes);
  Corrupt(copy.bytes(), size_bytes);
  return copy;
}

void Corrupt(std::byte* data, size_t size_bytes) {
  if (size_bytes > 0) data[size_bytes / 2] ^= std::byte{0xFF};
}

}  // namespace strata::storage
