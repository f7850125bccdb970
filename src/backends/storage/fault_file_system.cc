// FaultInjectingFileSystem: the seam through which tests make files fail.
//
// Every read and write of a file opened through the wrapper first counts
// itself and takes at most one armed fault from the plan (fault_plan.h:
// failure, then short transfer, then corruption; See Note [One fault per
// call]); the delay, a stall and the base call run without the lock, so a slow
// or stalled operation never blocks another.

#include <mutex>

#include <fmt/format.h>

#include "src/backends/storage/fault_plan.h"
#include "src/base/alignment.h"
#include "strata/file_system.h"

namespace strata {

using storage::Fault;
using storage::FaultOp;

struct FaultInjectingFileSystem::State {
  storage::FaultPlan plan;
  std::mutex mu;  // guards the three below
  bool refuse_exchange = false;
  std::function<Status(const std::string&)> open_hook;
  std::optional<uint64_t> free_bytes;
};

namespace {

// A file of the base file system, its transfers passed through the faults.
class FaultyFile final : public File {
 public:
  using State = FaultInjectingFileSystem::State;
  FaultyFile(std::unique_ptr<File> base, std::shared_ptr<State> state)
      : base_(std::move(base)), state_(std::move(state)) {}

  const std::string& path() const override { return base_->path(); }
  bool direct() const override { return base_->direct(); }
  Result<uint64_t> Size() override { return base_->Size(); }
  Status Allocate(uint64_t size_bytes) override { return base_->Allocate(size_bytes); }
  Status Truncate(uint64_t size_bytes) override { return base_->Truncate(size_bytes); }
  void Advise(FileAdvice advice) override { base_->Advise(advice); }
  Status Close() override { return base_->Close(); }

  Status Sync() override {
    const storage::FaultTaken taken = state_->plan.Take(FaultOp::kSync);
    if (taken.fault == Fault::kFail) return Injected("flushing", 0, taken.error_number);
    return base_->Sync();
  }

  Status Write(uint64_t offset, const std::byte* data, size_t size_bytes) override {
    const storage::FaultTaken taken = state_->plan.Take(FaultOp::kWrite);
    state_->plan.Pause(taken);
    if (taken.fault == Fault::kFail) return Injected("writing", offset, taken.error_number);  // nothing written
    if (taken.fault == Fault::kShort) {
      // Half, down to the alignment a direct write needs; reported whole.
      const size_t kept = direct() ? size_bytes / 2 / kIoAlignmentBytes * kIoAlignmentBytes : size_bytes / 2;
      return base_->Write(offset, data, kept);
    }
    if (taken.fault == Fault::kCorrupt && size_bytes > 0) {
      STRATA_ASSIGN_OR_RETURN(const Buffer copy, storage::CorruptedCopy(data, size_bytes, kIoAlignmentBytes));
      return base_->Write(offset, copy.bytes(), size_bytes);
    }
    return base_->Write(offset, data, size_bytes);
  }

  Result<size_t> Read(uint64_t offset, std::byte* data, size_t size_bytes) override {
    const storage::FaultTaken taken = state_->plan.Take(FaultOp::kRead);
    state_->plan.Pause(taken);
    if (taken.fault == Fault::kFail) return Injected("reading", offset, taken.error_number);
    STRATA_ASSIGN_OR_RETURN(size_t read, base_->Read(offset, data, size_bytes));
    if (taken.fault == Fault::kShort) return read / 2;
    if (taken.fault == Fault::kCorrupt) storage::Corrupt(data, read);
    return read;
  }

 private:
  // IoError "injected fault: <what> <path> at offset ...".
  Status Injected(std::string_view what, uint64_t offset, int error_number) const {
    return storage::InjectedFault(fmt::format("{} {}", what, path()), offset, error_number);
  }

  std::unique_ptr<File> base_;
  std::shared_ptr<State> state_;
};

}  // namespace

FaultInjectingFileSystem::FaultInjectingFileSystem(FileSystem& base)
    : base_(base), state_(std::make_shared<State>()) {}

FaultInjectingFileSystem::~FaultInjectingFileSystem() { Unstall(); }

void FaultInjectingFileSystem::FailWrites(int error_number, int count, int after) {
  state_->plan.Arm(FaultOp::kWrite, Fault::kFail, count, after, error_number);
}

void FaultInjectingFileSystem::FailReads(int error_number, int count, int after) {
  state_->plan.Arm(FaultOp::kRead, Fault::kFail, count, after, error_number);
}

void FaultInjectingFileSystem::FailSyncs(int error_number, int count) {
  state_->plan.Arm(FaultOp::kSync, Fault::kFail, count, 0, error_number);
}

void FaultInjectingFileSystem::ShortWrites(int count, int after) {
  state_->plan.Arm(FaultOp::kWrite, Fault::kShort, count, after);
}

void FaultInjectingFileSystem::ShortReads(int count, int after) {
  state_->plan.Arm(FaultOp::kRead, Fault::kShort, count, after);
}

void FaultInjectingFileSystem::CorruptWrites(int count, int after) {
  state_->plan.Arm(FaultOp::kWrite, Fault::kCorrupt, count, after);
}

void FaultInjectingFileSystem::CorruptReads(int count, int after) {
  state_->plan.Arm(FaultOp::kRead, Fault::kCorrupt, count, after);
}

void FaultInjectingFileSystem::SetDelayMs(uint32_t delay_ms) { state_->plan.SetDelayMs(delay_ms); }
void FaultInjectingFileSystem::StallWrites(int after, uint32_t max_ms) { state_->plan.StallWrites(after, max_ms); }
void FaultInjectingFileSystem::Unstall() { state_->plan.Unstall(); }

void FaultInjectingFileSystem::RefuseExchange(bool refuse) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->refuse_exchange = refuse;
}

void FaultInjectingFileSystem::SetOpenHook(std::function<Status(const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->open_hook = std::move(hook);
}

void FaultInjectingFileSystem::SetFreeBytes(std::optional<uint64_t> free_bytes) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->free_bytes = free_bytes;
}

int FaultInjectingFileSystem::reads() const { return state_->plan.count(FaultOp::kRead); }
int FaultInjectingFileSystem::writes() const { return state_->plan.count(FaultOp::kWrite); }

Result<std::unique_ptr<File>> FaultInjectingFileSystem::Open(const std::string& path, OpenMode mode, bool direct) {
  std::function<Status(const std::string&)> hook;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (mode != OpenMode::kRead) hook = state_->open_hook;
  }
  if (hook) STRATA_RETURN_IF_ERROR(hook(path));  // called without the lock: it may take its time
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file, base_.Open(path, mode, direct));
  return std::unique_ptr<File>(new FaultyFile(std::move(file), state_));
}

bool FaultInjectingFileSystem::Exists(const std::string& path) { return base_.Exists(path); }

Result<std::vector<DirectoryEntry>> FaultInjectingFileSystem::List(const std::string& dir) { return base_.List(dir); }

Result<bool> FaultInjectingFileSystem::CreateDirectory(const std::string& path) { return base_.CreateDirectory(path); }

Status FaultInjectingFileSystem::CreateDirectories(const std::string& path) { return base_.CreateDirectories(path); }

Status FaultInjectingFileSystem::Rename(const std::string& from, const std::string& to) {
  return base_.Rename(from, to);
}

Status FaultInjectingFileSystem::Exchange(const std::string& a, const std::string& b) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->refuse_exchange) {
      return NotSupported("exchanging {} with {}: injected fault: the file system lacks RENAME_EXCHANGE", a, b);
    }
  }
  return base_.Exchange(a, b);
}

Status FaultInjectingFileSystem::RemoveAll(const std::string& path) { return base_.RemoveAll(path); }

Status FaultInjectingFileSystem::SyncDirectory(const std::string& path) {
  const storage::FaultTaken taken = state_->plan.Take(FaultOp::kSync);
  if (taken.fault == Fault::kFail) {
    return storage::InjectedFault(fmt::format("flushing the directory {}", path), 0, taken.error_number);
  }
  return base_.SyncDirectory(path);
}

Result<uint64_t> FaultInjectingFileSystem::FreeBytes(const std::string& path) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    if (state_->free_bytes) return *state_->free_bytes;
  }
  return base_.FreeBytes(path);
}

}  // namespace strata
