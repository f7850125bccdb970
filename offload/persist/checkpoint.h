// Checkpoints: the training state saved from wherever each chunk lives and
// loaded back, crash-safe.
//
//   STRATA_ASSIGN_OR_RETURN(auto saved, offload::SaveCheckpoint(*engine, *optimizer, "ckpt", {.keep_last = 3}));
//   ... a fresh process, the same model registered and finalized ...
//   STRATA_ASSIGN_OR_RETURN(auto loaded, offload::LoadCheckpoint(*engine, *optimizer, "ckpt"));
//
// On disk, under a root directory:
//   step-00000010/manifest.json      what the checkpoint holds (below)
//   step-00000010/rank0/chunk-7.bin  chunk 7's bytes (ChunkInfo::used_bytes), as the engine holds them
//   step-00000010/rank1/chunk-9.bin  data parallel: rank 1's shard of a group's master or moments
//   latest                           "step-00000010": the newest complete checkpoint
// A checkpoint holds every chunk but the gradients and the transient
// (gathered) param chunks: the parameters, the fp32 masters and the
// optimizer moments, with the optimizer's step count and the loss scaler's
// state. A chunk in host memory is written from where it lies, unpinned
// (written again from a copy should it move meanwhile); another is read
// from its tier (Engine::ReadChunk: an NVMe-resident chunk is not moved)
// into one of three chunk-sized buffers, so the model is never staged in
// host memory. A load reads a file straight into its chunk where the chunk
// lies in host memory. Files are written (three at a time) and read with
// O_DIRECT in 1 MiB pieces by a pool of threads. The manifest (JSON) names
// the format and version, the step, the world size, the optimizer state,
// the options, the registered tensors (name, shape, dtype, trainable), and
// for every file its chunk (id, kind, dtype, group, rank, shard offset),
// size and CRC32C.
//
// Crash safety: a save writes into a hidden temporary directory, fsyncs each
// file and directory, and only then renames it to step-<N> and replaces
// `latest` (a rename too), so a crash at any moment leaves the last
// published checkpoint intact and `latest` naming a complete one;
// temporaries a crashed save left are removed by the next save. keep_last
// removes the oldest checkpoints only after the new one is published, and
// only among the new step and earlier ones (later ones are a rewound run's).
// The chunk files of removed checkpoints are kept under root/.spare (at
// most as many bytes as the last save wrote) and written over by the next
// save (CheckpointOptions::recycle). One saver at a time per root.
//
// Loading checks every file's size and CRC32C as it reads it: a damaged
// file is Corruption naming it (the engine's state is then partly
// overwritten: load another checkpoint); with fall_back the loader goes on
// to the checkpoints of earlier steps under the root. A checkpoint of
// another model (its registered tensors), or whose files do not tile this
// engine's chunks, is InvalidArgument before anything is read.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "offload/training/train_step.h"
#include "optim/optimizer.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata::offload {

struct CheckpointOptions {
  // After publishing, keep only the newest N checkpoints of this step and
  // earlier ones under the root (0: keep all).
  uint32_t keep_last = 0;
  // Write a save's chunk files over the files of removed checkpoints (pruned
  // by keep_last, replaced by a re-save of their step, left by a crashed
  // save), which are kept under root/.spare for it, trimmed after each save
  // to that save's bytes: on ext4 a write over written blocks ran twice as
  // fast as one into a new file. A process still reading a removed
  // checkpoint (an uploader) must be done before the next save writes over
  // its files. false: removed checkpoints are deleted, and so are the spares.
  bool recycle = true;
  // Asynchronous saves: how long a step's update of a chunk group waits for
  // the save to read that group out (with several ranks, at most half of
  // comm.timeout_ms, so that the others' next collective does not time out
  // first); 0: no limit. Past it the save is abandoned (its Wait returns
  // Timeout on this rank, an error on every rank; nothing is published) and
  // training goes on: a stalled drive or file system holds the steps no
  // longer. It still holds whatever waits for the save's thread: Wait, the
  // next save or load, the PendingCheckpoint's destructor.
  uint32_t update_wait_ms = 60'000;
  // Tests: called on the saving thread before each chunk is read out (a
  // slow or failing drive's stand-in); an error fails the save.
  std::function<Status(ChunkId)> before_chunk;
  // Tests: false publishes a re-save of a step as on a file system without
  // renameat2's RENAME_EXCHANGE (NFS): the old directory moved aside, then
  // the new one renamed in place.
  bool exchange = true;
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
  // SaveCheckpoint, of this rank's files: those written over a spare
  // (CheckpointOptions::recycle), and those written twice because their
  // chunk moved while its file was written from host memory.
  uint32_t recycled = 0, rewritten = 0;
  std::vector<std::string> skipped;  // LoadCheckpoint with fall_back: the later ones that failed, and why
};

// Saves the engine's chunks and the optimizer's state as root/step-<N>
// (N = optimizer.steps_taken()) and points root/latest at it. Between
// steps (no update in flight, no collective running on `comm`). A
// checkpoint of the same step is replaced.
//
// Data parallel, every rank calls it with its engine's communicator and
// the same root, a directory every rank sees (one node, or a shared file
// system): each writes its shards into rank<r>/, rank 0 the whole chunks
// too (every rank holds the same), and rank 0 merges the ranks' entries
// into the manifest and publishes; the outcome is the same on every rank.
Result<CheckpointSummary> SaveCheckpoint(Engine& engine, const optim::Optimizer& optimizer, const std::string& root,
                                         const CheckpointOptions& options = {}, Communicator* comm = nullptr);

// A save running on a thread of its own (StartCheckpoint): it writes the
// state as it was when it started while training goes on. Each chunk group
// is saved in layout order, so a step's update of a group waits
// (BeforeUpdate, through RunTrainStep's fence) only until the save is done
// with that group (its chunks copied out, or their files written from where
// they lie); forward and backward, which change no saved chunk, do not
// wait. Nothing else may change saved chunks until Wait: a save or load of
// the engine meanwhile is InvalidArgument.
class PendingCheckpoint : public UpdateFence {
 public:
  struct State;
  explicit PendingCheckpoint(std::unique_ptr<State> state);
  // Waits for this rank's files; the outcome is lost (call Wait for it).
  ~PendingCheckpoint() override;
  PendingCheckpoint(const PendingCheckpoint&) = delete;
  PendingCheckpoint& operator=(const PendingCheckpoint&) = delete;

  // Returns once the save no longer needs `group`'s chunks as they were, or
  // after CheckpointOptions::update_wait_ms, abandoning the save (a chunk
  // being copied out then is copied to its end first, bounded by the tiers'
  // own timeouts; a file being written from where its chunk lies is never
  // published).
  Status BeforeUpdate(uint32_t group) override;
  // Whether this rank's part is finished (written, or failed).
  bool done() const;
  // Waits for this rank's part alone, as the destructor does (rank 0's
  // publishes): for the end of a process that cannot call Wait.
  void WaitLocal();
  // Waits for the save and returns its outcome, SaveCheckpoint's. Data
  // parallel it is a collective: every rank calls it at the same point (its
  // next save, or the end of the run). Later calls return the same outcome.
  Result<CheckpointSummary> Wait();

 private:
  std::unique_ptr<State> state_;
  std::optional<Result<CheckpointSummary>> outcome_;
};

// SaveCheckpoint's work on a thread of its own: returns once the save has
// begun (the step, the optimizer's state and the directory are fixed here,
// with every rank, as SaveCheckpoint fixes them). Chunks are written as
// SaveCheckpoint writes them, none pinned: training may move them meanwhile
// (a chunk that moved while its file was written from host memory is
// written again from a copy). Data parallel, every rank calls
// it with its communicator, which the save then leaves alone until Wait:
// rank 0 learns that the other ranks' files are written from the files
// themselves (waiting at most comm.timeout_ms after its own), and publishes.
// Wait's agreement is a collective like any other: drain a GradReducer's
// gathers first (parameters sharded).
Result<std::unique_ptr<PendingCheckpoint>> StartCheckpoint(Engine& engine, const optim::Optimizer& optimizer,
                                                           const std::string& root,
                                                           const CheckpointOptions& options = {},
                                                           Communicator* comm = nullptr);

// `path`: a root (its `latest` names the checkpoint) or one checkpoint's
// directory. The engine must be finalized with the same tensors; the
// optimizer must have a loss scaler exactly when the saved one had. Each
// chunk is filled from the files covering its range of its group, so a
// checkpoint saved by W ranks loads on any number (with the same precision
// and chunk.size_elems), with comm.shard_params or without: a checkpoint
// saved with it holds masters but no params (the params are then the
// masters rounded to their dtype, as the update rounds them; a frozen
// group's master shards are its params), and one of an fp32 run without it
// params but no masters (its params are the masters; a frozen group's
// params are its master shards).
// Data parallel, every rank calls it with its communicator; the ranks load
// the same checkpoint or all fail (with fall_back, all go on to the same
// older one).
Result<CheckpointSummary> LoadCheckpoint(Engine& engine, optim::Optimizer& optimizer, const std::string& path,
                                         const LoadOptions& options = {}, Communicator* comm = nullptr);

// Checks every file of the checkpoint at `path` (a root or a checkpoint)
// against its manifest, size and CRC32C, touching no engine.
Result<CheckpointSummary> VerifyCheckpoint(const std::string& path);

// The checkpoint at `path` (a root or a checkpoint): its directory and its
// manifest's JSON text (`strata checkpoint inspect --json`).
struct CheckpointManifest {
  std::string path;
  std::string json;
};
Result<CheckpointManifest> ReadCheckpointManifest(const std::string& path);
// What `strata checkpoint inspect` prints: the step, world size, optimizer
// state, tensors, and the files' bytes by chunk kind.
Result<std::string> DescribeCheckpoint(const std::string& path);

}  // namespace strata::offload
