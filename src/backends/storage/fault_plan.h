// FaultPlan: what the two fault-injecting wrappers (FaultInjectingStorage,
// FaultInjectingFileSystem) share: the faults armed per operation, the delay
// every read and write sleeps, the write that stalls, the counts of reads and
// writes, and the faulty bytes and errors they hand back. Not public API.
// Thread-safe: one mutex guards the plan; Take holds it briefly, Pause sleeps
// and waits without it, so a slow or stalled operation never blocks another.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <string_view>

#include "strata/buffer.h"
#include "strata/status.h"

namespace strata::storage {

enum class FaultOp { kWrite, kRead, kSync };
enum class Fault { kNone, kFail, kShort, kCorrupt };

// What one operation is to suffer, taken under the plan's lock and acted on without it.
struct FaultTaken {
  Fault fault = Fault::kNone;
  int error_number = 0;   // of a kFail
  uint32_t delay_ms = 0;  // slept first (reads and writes)
  bool stall = false;     // this write stalls
};

class FaultPlan {
 public:
  // After `after` more `op`s, the next `count` take `fault` (a kFail carrying
  // `error_number`); replaces what was armed for that fault of `op`.
  void Arm(FaultOp op, Fault fault, int count, int after = 0, int error_number = 0);
  // Every read and write sleeps this long first.
  void SetDelayMs(uint32_t delay_ms);
  // After `after` more writes, the next one stalls in Pause until Unstall, or at most `max_ms`.
  void StallWrites(int after, uint32_t max_ms);
  void Unstall();

  // Counts one `op` and takes at most one armed fault: a failure, then a
  // short transfer, then a corruption. See Note [One fault per call].
  FaultTaken Take(FaultOp op);
  // Sleeps `taken`'s delay, then waits out its stall. Called without the lock.
  void Pause(const FaultTaken& taken);
  // The `op`s taken so far.
  int count(FaultOp op) const;

 private:
  // A fault armed for the next `remaining` operations once `after` more have passed.
  struct Armed {
    int remaining = 0;
    int after = 0;
    int error_number = 0;
    bool Take();
  };
  struct OpFaults {
    Armed fail, cut, corrupt;
    int taken = 0;
  };
  OpFaults& Of(FaultOp op) { return ops_[static_cast<int>(op)]; }

  mutable std::mutex mu_;  // guards every field below
  std::condition_variable unstalled_;
  OpFaults ops_[3];  // by FaultOp
  uint32_t delay_ms_ = 0;
  int stall_after_ = -1;  // writes that pass before the one that stalls; -1: no stall armed
  uint32_t stall_max_ms_ = 0;
  bool released_ = false;  // Unstall was called
};

// IoError "injected fault: <what> at offset <offset>: <errno text> (errno N)".
Status InjectedFault(std::string_view what, uint64_t offset, int error_number);

// A copy of [data, data + size_bytes) with its middle byte flipped, in a
// buffer aligned to and rounded up to `alignment_bytes` (the caller's bytes of
// a write are const); OutOfMemory when it cannot be had.
Result<Buffer> CorruptedCopy(const std::byte* data, size_t size_bytes, size_t alignment_bytes);

// Flips the middle byte of [data, data + size_bytes), if any.
void Corrupt(std::byte* data, size_t size_bytes);

}  // namespace strata::storage
