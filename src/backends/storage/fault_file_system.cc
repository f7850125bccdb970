// FaultInjectingFileSystem: the seam through which tests make files fail.
//
// Every read and write of a file opened through the wrapper first counts
// itself and, under the mutex, takes at most one armed fault; the delay, a
// stall and the base call run without the lock, so a slow or stalled
// operation never blocks another. Precedence when several faults are armed:
// failure, then short transfer, then corruption. One call consumes one fault.

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "src/base/alignment.h"
#include "src/base/posix_file.h"
#include "strata/buffer.h"
#include "strata/file_system.h"

namespace strata {
namespace {

enum class Fault { kNone, kFail, kShort, kCorrupt };

// A fault armed for the next `remaining` operations once `after` more have passed.
struct Armed {
  int remaining = 0;
  int after = 0;
  int error_number = 0;

  void Arm(int count, int skip = 0, int error = 0) {
    remaining = std::max(count, 0);
    after = std::max(skip, 0);
    error_number = error;
  }
  // Whether this operation takes the fault.
  bool Take() {
    if (remaining <= 0) return false;
    if (after > 0) {
      --after;
      return false;
    }
    --remaining;
    return true;
  }
};

Status Injected(std::string_view what, const std::string& path, uint64_t offset, int error_number) {
  return IoError("injected fault: {} {} at offset {}: {} (errno {})", what, path, offset, ErrnoText(error_number),
                 error_number);
}

}  // namespace

struct FaultInjectingFileSystem::State {
  std::mutex mu;  // guards every field below
  std::condition_variable unstalled;
  Armed fail_writes, fail_reads, fail_syncs, short_writes, short_reads, corrupt_writes, corrupt_reads;
  uint32_t delay_ms = 0;
  int stall_after = -1;  // writes that pass before the one that stalls; -1: no stall armed
  uint32_t stall_max_ms = 0;
  bool released = false;  // Unstall was called
  bool refuse_exchange = false;
  std::function<Status(const std::string&)> open_hook;
  int reads = 0;
  int writes = 0;

  // Under `mu`: the fault this transfer takes, failures first.
  static Fault Take(Armed& fail, Armed& cut, Armed& corrupt, int* error_number) {
    if (fail.Take()) {
      *error_number = fail.error_number;
      return Fault::kFail;
    }
    if (cut.Take()) return Fault::kShort;
    return corrupt.Take() ? Fault::kCorrupt : Fault::kNone;
  }
  // Under `mu`: the errno of a sync that fails, or 0.
  int TakeSyncFault() { return fail_syncs.Take() ? fail_syncs.error_number : 0; }
  // Under `mu`: whether this write is the one that stalls.
  bool TakeStall() {
    if (stall_after < 0) return false;
    return stall_after-- == 0;
  }
  // Without `mu`: the delay, then the stall until Unstall or its limit.
  void Pause(uint32_t delay, bool stall) {
    if (delay > 0) std::this_thread::sleep_for(std::chrono::milliseconds(delay));
    if (!stall) return;
    std::unique_lock<std::mutex> lock(mu);
    unstalled.wait_for(lock, std::chrono::milliseconds(stall_max_ms), [this] { return released; });
  }
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
    int error_number = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      error_number = state_->TakeSyncFault();
    }
    if (error_number != 0) return Injected("flushing", path(), 0, error_number);
    return base_->Sync();
  }

  Status Write(uint64_t offset, const std::byte* data, size_t size_bytes) override {
    int error_number = 0;
    Fault fault = Fault::kNone;
    uint32_t delay_ms = 0;
    bool stall = false;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      ++state_->writes;
      delay_ms = state_->delay_ms;
      stall = state_->TakeStall();
      fault = State::Take(state_->fail_writes, state_->short_writes, state_->corrupt_writes, &error_number);
    }
    state_->Pause(delay_ms, stall);
    if (fault == Fault::kFail) return Injected("writing", path(), offset, error_number);  // nothing written
    if (fault == Fault::kShort) {
      // Half, down to the alignment a direct write needs; reported whole.
      const size_t kept = direct() ? size_bytes / 2 / kIoAlignmentBytes * kIoAlignmentBytes : size_bytes / 2;
      return base_->Write(offset, data, kept);
    }
    if (fault == Fault::kCorrupt && size_bytes > 0) {
      // The caller's bytes are const: an aligned copy is flipped instead.
      Buffer copy = AllocateAlignedHost(RoundUp(size_bytes), kIoAlignmentBytes);
      if (!copy) return OutOfMemory("fault injection: a {}-byte copy of a corrupted write", size_bytes);
      std::memcpy(copy.data(), data, size_bytes);
      copy.bytes()[size_bytes / 2] ^= std::byte{0xFF};
      return base_->Write(offset, copy.bytes(), size_bytes);
    }
    return base_->Write(offset, data, size_bytes);
  }

  Result<size_t> Read(uint64_t offset, std::byte* data, size_t size_bytes) override {
    int error_number = 0;
    Fault fault = Fault::kNone;
    uint32_t delay_ms = 0;
    {
      std::lock_guard<std::mutex> lock(state_->mu);
      ++state_->reads;
      delay_ms = state_->delay_ms;
      fault = State::Take(state_->fail_reads, state_->short_reads, state_->corrupt_reads, &error_number);
    }
    state_->Pause(delay_ms, false);
    if (fault == Fault::kFail) return Injected("reading", path(), offset, error_number);
    STRATA_ASSIGN_OR_RETURN(size_t read, base_->Read(offset, data, size_bytes));
    if (fault == Fault::kShort) return read / 2;
    if (fault == Fault::kCorrupt && read > 0) data[read / 2] ^= std::byte{0xFF};
    return read;
  }

 private:
  std::unique_ptr<File> base_;
  std::shared_ptr<State> state_;
};

}  // namespace

FaultInjectingFileSystem::FaultInjectingFileSystem(FileSystem& base)
    : base_(base), state_(std::make_shared<State>()) {}

FaultInjectingFileSystem::~FaultInjectingFileSystem() { Unstall(); }

void FaultInjectingFileSystem::FailWrites(int error_number, int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_writes.Arm(count, after, error_number);
}

void FaultInjectingFileSystem::FailReads(int error_number, int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_reads.Arm(count, after, error_number);
}

void FaultInjectingFileSystem::FailSyncs(int error_number, int count) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->fail_syncs.Arm(count, 0, error_number);
}

void FaultInjectingFileSystem::ShortWrites(int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->short_writes.Arm(count, after);
}

void FaultInjectingFileSystem::ShortReads(int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->short_reads.Arm(count, after);
}

void FaultInjectingFileSystem::CorruptWrites(int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->corrupt_writes.Arm(count, after);
}

void FaultInjectingFileSystem::CorruptReads(int count, int after) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->corrupt_reads.Arm(count, after);
}

void FaultInjectingFileSystem::SetDelayMs(uint32_t delay_ms) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->delay_ms = delay_ms;
}

void FaultInjectingFileSystem::StallWrites(int after, uint32_t max_ms) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->stall_after = std::max(after, 0);
  state_->stall_max_ms = max_ms;
  state_->released = false;
}

void FaultInjectingFileSystem::Unstall() {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->stall_after = -1;
  state_->released = true;
  state_->unstalled.notify_all();
}

void FaultInjectingFileSystem::RefuseExchange(bool refuse) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->refuse_exchange = refuse;
}

void FaultInjectingFileSystem::SetOpenHook(std::function<Status(const std::string& path)> hook) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->open_hook = std::move(hook);
}

int FaultInjectingFileSystem::reads() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->reads;
}

int FaultInjectingFileSystem::writes() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->writes;
}

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
  int error_number = 0;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    error_number = state_->TakeSyncFault();
  }
  if (error_number != 0) return Injected("flushing the directory", path, 0, error_number);
  return base_.SyncDirectory(path);
}

}  // namespace strata
