// Checkpoints: the training state (every chunk but the gradients, the
// optimizer's step count and loss scaler) saved from wherever each chunk
// lives and loaded back, crash-safe, through a FileSystem (the POSIX one
// unless given; it must outlive the call, or an asynchronous save's Wait).
//
//   STRATA_ASSIGN_OR_RETURN(auto saved, offload::SaveCheckpoint(*engine, *optimizer, "ckpt", {.keep_last = 3}));
//   ... a fresh process, the same model registered and finalized ...
//   STRATA_ASSIGN_OR_RETURN(auto loaded, offload::LoadCheckpoint(*engine, *optimizer, "ckpt"));
//
// The layout on disk, the publishing protocol, recycled files and loading
// across world sizes: Notes in checkpoint_*.cc. One saver at a time per root.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/file_system.h"
#include "strata/status.h"
#include "strata/update_fence.h"

namespace strata::optim {
class Optimizer;  // optim/optimizer.h
}  // namespace strata::optim

namespace strata::offload {

struct CheckpointOptions {
  // After publishing, keep only the newest N checkpoints of this step and
  // earlier ones under the root (0: keep all).
  uint32_t keep_last = 0;
  // Write chunk files over the files of removed checkpoints, kept under
  // root/.spare (Note [Recycled chunk files]); a process still reading a
  // removed checkpoint must be done before the next save. false: removed
  // checkpoints and the spares are deleted.
  bool recycle = true;
  // Asynchronous saves: how long a step's update of a chunk group waits for
  // the save (with several ranks, at most half of comm.timeout_ms); 0: no
  // limit. Past it the save is abandoned (Wait returns Timeout; nothing is
  // published) and training goes on (Note [Asynchronous saves]).
  uint32_t update_wait_ms = 60'000;
};

struct LoadOptions {
  // A damaged or unreadable checkpoint: try the next earlier one under the root.
  bool fall_back = false;
};

// What was saved, loaded or verified.
struct CheckpointSummary {
  std::string path;    // the checkpoint's directory
  int64_t step = 0;    // optimizer steps taken when it was saved
  uint64_t bytes = 0;  // of chunk files
  uint32_t files = 0;
  // SaveCheckpoint, of this rank's files: written over a spare, and written
  // twice because their chunk moved while being written from host memory.
  uint32_t recycled = 0, rewritten = 0;
  std::vector<std::string> skipped;  // LoadCheckpoint with fall_back: the later ones that failed, and why
};

// Saves the state as root/step-<N> (N = optimizer.steps_taken(), replacing
// a checkpoint of that step) and points root/latest at it. Between steps
// (no update in flight, no collective running on `comm`). Data parallel,
// every rank calls it with its communicator and the same root, a directory
// every rank sees; the outcome is the same on every rank.
Result<CheckpointSummary> SaveCheckpoint(Engine& engine, const optim::Optimizer& optimizer, const std::string& root,
                                         const CheckpointOptions& options = {}, Communicator* comm = nullptr,
                                         FileSystem& files = PosixFileSystem());

// A save running on a thread of its own (StartCheckpoint): it writes the
// state as it was when it started while training goes on, a step's update
// of a chunk group waiting (BeforeUpdate) only until the save is done with
// that group. A save or load of the engine meanwhile is InvalidArgument.
class PendingCheckpoint : public UpdateFence {
 public:
  struct State;
  explicit PendingCheckpoint(std::unique_ptr<State> state);
  // Waits for this rank's files; the outcome is lost (call Wait for it).
  ~PendingCheckpoint() override;
  PendingCheckpoint(const PendingCheckpoint&) = delete;
  PendingCheckpoint& operator=(const PendingCheckpoint&) = delete;

  // Returns once the save no longer needs `group`'s chunks as they were, or
  // after CheckpointOptions::update_wait_ms, abandoning the save.
  Status BeforeUpdate(uint32_t group) override;
  // Whether this rank's part is finished (written, or failed).
  bool done() const;
  // Waits for this rank's part alone, as the destructor does (rank 0's
  // publishes): for the end of a process that cannot call Wait.
  void WaitLocal();
  // Waits for the save and returns SaveCheckpoint's outcome; later calls
  // return the same. Data parallel it is a collective: every rank calls it
  // at the same point (drain a GradReducer's gathers first).
  Result<CheckpointSummary> Wait();

 private:
  std::unique_ptr<State> state_;
  std::optional<Result<CheckpointSummary>> outcome_;
};

// SaveCheckpoint's work on a thread of its own: returns once the save has
// begun (the step, the optimizer's state and the directory fixed with every
// rank). Data parallel, the save leaves `comm` alone until Wait.
Result<std::unique_ptr<PendingCheckpoint>> StartCheckpoint(Engine& engine, const optim::Optimizer& optimizer,
                                                           const std::string& root,
                                                           const CheckpointOptions& options = {},
                                                           Communicator* comm = nullptr,
                                                           FileSystem& files = PosixFileSystem());

// Loads the checkpoint at `path`: a root (its `latest`) or one checkpoint's
// directory. The engine must be finalized with the same tensors, and the
// optimizer have a loss scaler exactly when the saved one had
// (InvalidArgument before anything is read). Every file's size and CRC32C
// is checked: a damaged one is Corruption naming it, the engine's state then
// partly overwritten. A checkpoint saved by W ranks loads on any number
// (same precision and chunk.size_elems), with comm.shard_params or without.
// Data parallel, every rank calls it with its communicator; the ranks load
// the same checkpoint or all fail.
Result<CheckpointSummary> LoadCheckpoint(Engine& engine, optim::Optimizer& optimizer, const std::string& path,
                                         const LoadOptions& options = {}, Communicator* comm = nullptr,
                                         FileSystem& files = PosixFileSystem());

// Checks every file of the checkpoint at `path` (a root or a checkpoint)
// against its manifest, size and CRC32C, touching no engine.
Result<CheckpointSummary> VerifyCheckpoint(const std::string& path, FileSystem& files = PosixFileSystem());

// The checkpoint at `path` (a root or a checkpoint): its directory and its
// manifest's JSON text (`strata checkpoint inspect --json`).
struct CheckpointManifest {
  std::string path;
  std::string json;
};
Result<CheckpointManifest> ReadCheckpointManifest(const std::string& path, FileSystem& files = PosixFileSystem());
// What `strata checkpoint inspect` prints: the step, world size, optimizer
// state, tensors, and the files' bytes by chunk kind.
Result<std::string> DescribeCheckpoint(const std::string& path, FileSystem& files = PosixFileSystem());

}  // namespace strata::offload
