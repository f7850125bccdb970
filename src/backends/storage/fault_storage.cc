// FaultInjectingStorage: the seam through which tests make storage fail.
//
// Every call first checks the range contract (a malformed call is the
// caller's bug and consumes no armed fault), then counts itself and takes at
// most one armed fault from the plan (fault_plan.h: failure, then short read,
// then corruption; See Note [One fault per call]); the delay and the base call
// run without the lock, so a delayed or slow operation never blocks another.

#include <algorithm>

#include "src/backends/storage/fault_plan.h"
#include "src/backends/storage/storage_util.h"
#include "strata/storage.h"

namespace strata {

using storage::Fault;
using storage::FaultOp;

namespace {

// The byte ShortReads writes over the half it "lost": a pattern that is
// neither zero (a fresh drive) nor likely in real data.
constexpr std::byte kLostDataFill{0xA5};

}  // namespace

struct FaultInjectingStorage::State {
  storage::FaultPlan plan;
};

FaultInjectingStorage::FaultInjectingStorage(std::unique_ptr<Storage> base)
    : base_(std::move(base)), state_(std::make_unique<State>()) {
  STRATA_CHECK(base_ != nullptr, "FaultInjectingStorage needs a base storage");
}

FaultInjectingStorage::~FaultInjectingStorage() = default;

void FaultInjectingStorage::FailWrites(int error_number, int count, int after) {
  state_->plan.Arm(FaultOp::kWrite, Fault::kFail, count, after, error_number);
}

void FaultInjectingStorage::FailReads(int error_number, int count, int after) {
  state_->plan.Arm(FaultOp::kRead, Fault::kFail, count, after, error_number);
}

void FaultInjectingStorage::ShortReads(int count) { state_->plan.Arm(FaultOp::kRead, Fault::kShort, count); }
void FaultInjectingStorage::CorruptWrites(int count) { state_->plan.Arm(FaultOp::kWrite, Fault::kCorrupt, count); }
void FaultInjectingStorage::CorruptReads(int count) { state_->plan.Arm(FaultOp::kRead, Fault::kCorrupt, count); }
void FaultInjectingStorage::SetDelayMs(uint32_t delay_ms) { state_->plan.SetDelayMs(delay_ms); }

int FaultInjectingStorage::reads() const { return state_->plan.count(FaultOp::kRead); }
int FaultInjectingStorage::writes() const { return state_->plan.count(FaultOp::kWrite); }

std::string FaultInjectingStorage::Describe() const { return "fault-injecting(" + base_->Describe() + ")"; }
size_t FaultInjectingStorage::capacity_bytes() const { return base_->capacity_bytes(); }
size_t FaultInjectingStorage::alignment_bytes() const { return base_->alignment_bytes(); }

Status FaultInjectingStorage::Write(uint64_t offset, const std::byte* src, size_t size_bytes) {
  STRATA_RETURN_IF_ERROR(storage::CheckStorageRange(*this, offset, src, size_bytes));
  const storage::FaultTaken taken = state_->plan.Take(FaultOp::kWrite);
  state_->plan.Pause(taken);
  // A failure does not call the base: the stored bytes stay as they were.
  if (taken.fault == Fault::kFail) return storage::InjectedFault("write", offset, taken.error_number);
  if (taken.fault == Fault::kCorrupt && size_bytes > 0) {
    STRATA_ASSIGN_OR_RETURN(const Buffer copy, storage::CorruptedCopy(src, size_bytes, alignment_bytes()));
    return base_->Write(offset, copy.bytes(), size_bytes);
  }
  return base_->Write(offset, src, size_bytes);
}

Status FaultInjectingStorage::Read(uint64_t offset, std::byte* dst, size_t size_bytes) {
  STRATA_RETURN_IF_ERROR(storage::CheckStorageRange(*this, offset, dst, size_bytes));
  const storage::FaultTaken taken = state_->plan.Take(FaultOp::kRead);
  state_->plan.Pause(taken);
  if (taken.fault == Fault::kFail) return storage::InjectedFault("read", offset, taken.error_number);
  STRATA_RETURN_IF_ERROR(base_->Read(offset, dst, size_bytes));
  if (taken.fault == Fault::kShort) {
    // Reported as success with the second half lost: what a backend that
    // ignored a short read would hand up.
    std::fill(dst + size_bytes / 2, dst + size_bytes, kLostDataFill);
  } else if (taken.fault == Fault::kCorrupt) {
    storage::Corrupt(dst, size_bytes);
  }
  return Status::Ok();
}

}  // namespace strata
