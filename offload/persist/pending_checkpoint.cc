// A save as a whole: begun by every rank together, its files written on a
// thread of its own (StartCheckpoint) or the caller's (SaveCheckpoint), and
// published by rank 0.

#include <condition_variable>
#include <mutex>
#include <random>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"
#include "src/base/logging.h"
#include "strata/options.h"

namespace strata::offload {

using checkpoint::json;
namespace fs = std::filesystem;

// Note [Asynchronous saves]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// StartCheckpoint fixes the step, the optimizer's state and the directory
// with every rank, as SaveCheckpoint does, then writes the files on a
// thread of its own while training goes on; none of the chunks is pinned
// (Note [Writing a chunk from where it lies]). Each chunk group is saved in
// layout order, so a step's update of a group waits (BeforeUpdate, through
// RunTrainStep's fence) only until the save is done with that group (its
// chunks copied out, or their files written from where they lie); forward
// and backward, which change no saved chunk, do not wait. A save or load of
// the engine meanwhile is refused (pending_engines): it would change what
// the save reads.
//
// A stalled drive or file system must not hold the steps: an update waits
// at most CheckpointOptions::update_wait_ms for its group (data parallel,
// at most half of comm.timeout_ms, so that the other ranks' next collective
// does not time out first). Past it the save is abandoned: no chunk is read
// out again (one being copied out is copied to its end first, bounded by
// the tiers' own timeouts), a file being written from where its chunk lies
// is never published, and Wait returns Timeout on this rank, an error on
// every rank. The save's thread is still held by the drive, and so is
// whatever waits for it: Wait, the next save or load, the destructor.
//
// Data parallel, the save leaves the communicator alone until Wait: rank 0
// learns that the other ranks' files are written from the files themselves
// (Note [Publishing a checkpoint]). Wait's agreement is a collective like
// any other: a GradReducer's gathers are drained first (parameters sharded).
// A rank > 0 reports an abandoned save's status, not its files: files
// written from chunks an update changed are never published.

namespace {

// The engines with an asynchronous save not yet waited for.
std::mutex pending_mu;
std::set<const Engine*> pending_engines;  // guarded by pending_mu

void SetSavePending(const Engine& engine, bool pending) {
  std::lock_guard<std::mutex> lock(pending_mu);
  if (pending) {
    pending_engines.insert(&engine);
  } else {
    pending_engines.erase(&engine);
  }
}

}  // namespace

namespace checkpoint {

Status CheckNoSavePending(const Engine& engine) {
  std::lock_guard<std::mutex> lock(pending_mu);
  if (pending_engines.contains(&engine)) {
    return InvalidArgument(
        "checkpoint: an asynchronous save of this engine is in flight: wait for it (PendingCheckpoint::Wait) before "
        "another save or a load");
  }
  return Status::Ok();
}

Status CheckGroup(const Engine& engine, const Communicator* comm) {
  if (engine.world_size() == 1 && comm == nullptr) return Status::Ok();
  if (comm == nullptr || comm->world_size() != engine.world_size() || comm->rank() != engine.rank()) {
    return InvalidArgument(
        "checkpoint: this engine is rank {} of {}: pass its communicator (every rank saves and loads together)",
        engine.rank(), engine.world_size());
  }
  return Status::Ok();
}

}  // namespace checkpoint

// A save's state, shared by the thread that writes it and its caller.
struct PendingCheckpoint::State {
  Engine& engine;
  Communicator* comm;
  FileSystem& files;
  CheckpointOptions options;
  bool asynchronous;  // on a thread of its own, the communicator left alone; else the caller's
  fs::path dir;       // the root
  std::string name;
  fs::path staged;
  json head;  // the manifest but its files
  int64_t step;

  std::mutex mu;  // guards every field below but `thread`
  std::condition_variable released;
  std::map<uint32_t, uint32_t> unread;  // chunk group -> its chunks this rank has yet to read out
  bool reading = false;                 // a chunk is being copied out of the engine (ReadOut)
  std::string abandoned;                // why an update stopped waiting for the save; then no chunk is read again
  bool finished = false;
  Status own = Status::Ok();  // this rank's part (rank 0: the publishing too)
  CheckpointSummary summary;
  std::thread thread;

  void Release(uint32_t group) {
    std::lock_guard<std::mutex> lock(mu);
    if (auto it = unread.find(group); it != unread.end() && --it->second == 0) unread.erase(it);
    released.notify_all();
  }

  // Before each chunk is taken: (asynchronous) only while the save has not been abandoned.
  Status BeginChunk(ChunkId) {
    if (!asynchronous) return Status::Ok();
    std::lock_guard<std::mutex> lock(mu);
    if (!abandoned.empty()) return Timeout("{}", abandoned);
    return Status::Ok();
  }

  // Engine::ReadChunk, (asynchronous) only while the save has not been
  // abandoned, flagged as being read meanwhile.
  Status ReadOut(ChunkId id, std::byte* into) {
    if (asynchronous) {
      std::lock_guard<std::mutex> lock(mu);
      if (!abandoned.empty()) return Timeout("{}", abandoned);
      reading = true;
    }
    const Status status = engine.ReadChunk(id, into);
    std::lock_guard<std::mutex> lock(mu);
    reading = false;
    released.notify_all();
    return status;
  }

  // This rank's files written, and (rank > 0) reported to rank 0: their entries.
  Result<json> WriteOwnFiles() {
    const int rank = engine.rank();
    checkpoint::SpareFiles spares(files, dir, options.recycle);
    Result<json> entries = checkpoint::WriteRankFiles(
        files, engine, staged, spares,
        {[this](ChunkId id) { return BeginChunk(id); }, [this](ChunkId id, std::byte* into) { return ReadOut(id, into); },
         [this](const ChunkInfo& c) { Release(c.group); }},
        summary);
    Status status = entries.status();
    {
      std::lock_guard<std::mutex> lock(mu);
      // Abandoned as its last chunk was read: the update went on, so it is not published either.
      if (status.ok() && !abandoned.empty()) status = Timeout("{}", abandoned);
    }
    if (rank != 0) {
      // Its status, not its files alone (Note [Asynchronous saves]).
      const Status reported = checkpoint::ReportToLead(files, staged, rank, status.ok() ? entries : Result<json>(status));
      if (status.ok()) status = reported;
    }
    // The caller's thread: the ranks' outcomes agreed at once (a rank that
    // failed, even to report, is known now, not after rank 0's wait).
    if (!asynchronous) status = checkpoint::Agree(comm, status, "writing the checkpoint's files");
    if (!status.ok()) return status;
    return entries;
  }

  // Rank 0: the other ranks' entries gathered, the manifest written, the
  // checkpoint published, `latest` pointed at it, the old ones pruned.
  Status PublishAsLead(Status status, json entries) {
    if (status.ok()) {
      status = checkpoint::CollectRankFiles(files, staged, engine.world_size(), engine.options().comm.timeout_ms,
                                            entries);
    }
    uint64_t bytes = 0;  // of every rank's files
    for (const json& file : entries) bytes += file.contains("bytes") ? file["bytes"].get<uint64_t>() : 0;
    if (status.ok()) {
      json manifest = head;
      manifest["files"] = std::move(entries);
      const std::string text = manifest.dump(1);
      status = checkpoint::WriteFileDurably(files, staged / checkpoint::kManifest, text.data(), text.size());
    }
    if (status.ok()) status = files.SyncDirectory(staged.string()).WithContext("checkpoint");
    if (status.ok()) status = checkpoint::Publish(files, dir, name, staged, options.recycle);
    if (!status.ok()) (void)files.RemoveAll(staged.string());  // the last published checkpoint is untouched
    if (status.ok()) status = checkpoint::PointLatestAt(files, dir, name);
    if (status.ok() && options.keep_last > 0) checkpoint::Prune(files, dir, step, options.keep_last, options.recycle);
    if (status.ok()) checkpoint::TrimSpares(files, dir, options.recycle ? bytes : 0);
    return status;
  }

  // Writes this rank's files; rank 0 then publishes.
  void Run() {
    Result<json> entries = WriteOwnFiles();
    Status status = entries.status();
    if (engine.rank() == 0) status = PublishAsLead(status, entries.ok() ? std::move(entries).value() : json::array());
    std::lock_guard<std::mutex> lock(mu);
    own = status;
    finished = true;
    unread.clear();  // a failed save needs nothing more
    released.notify_all();
  }
};

PendingCheckpoint::PendingCheckpoint(std::unique_ptr<State> state) : state_(std::move(state)) {}

PendingCheckpoint::~PendingCheckpoint() {
  WaitLocal();
  if (!outcome_) {
    SetSavePending(state_->engine, false);
    if (!state_->own.ok()) {
      STRATA_LOG_ERROR("checkpoint: the asynchronous save of step {} failed and was never waited for: {}",
                       state_->step, state_->own.ToString());
    }
  }
}

void PendingCheckpoint::WaitLocal() {
  if (state_->thread.joinable()) state_->thread.join();
}

Status PendingCheckpoint::BeforeUpdate(uint32_t group) {
  State& s = *state_;
  std::unique_lock<std::mutex> lock(s.mu);
  const auto ready = [&] { return s.finished || !s.abandoned.empty() || !s.unread.contains(group); };
  uint32_t wait_ms = s.options.update_wait_ms;
  // Data parallel, the other ranks wait in the collective after their update meanwhile: give up well within it.
  if (s.engine.world_size() > 1) wait_ms = std::min(wait_ms, std::max(1u, s.engine.options().comm.timeout_ms / 2));
  if (s.options.update_wait_ms == 0) {
    s.released.wait(lock, ready);
  } else if (!s.released.wait_for(lock, std::chrono::milliseconds(wait_ms), ready)) {
    s.abandoned = fmt::format(
        "checkpoint: the asynchronous save of step {} was abandoned: the update of chunk group {} waited {} ms "
        "(CheckpointOptions::update_wait_ms, at most half of comm.timeout_ms with several ranks) for the save to "
        "read it (the drive or file system stalled); training went on, nothing of this save is published, and the "
        "last published checkpoint is intact",
        s.step, group, wait_ms);
    STRATA_LOG_WARNING("{}", s.abandoned);
    // A chunk being read as the save was abandoned is read to its end first.
    s.released.wait(lock, [&] { return s.finished || !s.reading; });
  }
  return Status::Ok();
}

bool PendingCheckpoint::done() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->finished;
}

Result<CheckpointSummary> PendingCheckpoint::Wait() {
  if (outcome_) return *outcome_;
  WaitLocal();
  State& s = *state_;
  SetSavePending(s.engine, false);
  // Every rank's outcome is every rank's (a rank that failed returns its own error).
  const Status agreed = checkpoint::Agree(s.comm, s.own, "saving the checkpoint");
  if (!s.own.ok()) {
    outcome_ = s.own;
  } else if (!agreed.ok()) {
    outcome_ = agreed;
  } else {
    CheckpointSummary summary = s.summary;
    summary.path = (s.dir / s.name).string();
    summary.step = s.step;
    outcome_ = std::move(summary);
  }
  return *outcome_;
}

namespace {

// The temporary directory every rank writes into, named alike on every rank
// (a token rank 0 broadcasts) and prepared by rank 0.
Result<fs::path> PrepareDirectory(FileSystem& files, const Engine& engine, Communicator* comm, const fs::path& dir,
                                  const std::string& name, bool recycle) {
  uint64_t token = (uint64_t{std::random_device{}()} << 32) | std::random_device{}();
  if (comm != nullptr && comm->world_size() > 1) STRATA_RETURN_IF_ERROR(comm->Broadcast(&token, sizeof token, 0));
  const fs::path staged = dir / fmt::format(".{}.tmp-{:016x}", name, token);
  Status prepared = Status::Ok();
  if (engine.rank() == 0) {
    prepared = files.CreateDirectories(dir.string()).WithContext("checkpoint");
    checkpoint::ClearLeftovers(files, dir, recycle);
    if (prepared.ok()) {
      Result<bool> created = files.CreateDirectory(staged.string());
      if (!created.ok()) prepared = created.status().WithContext("checkpoint");
      if (created.ok() && !*created) prepared = IoError("checkpoint: creating {}: it exists", staged.string());
    }
  }
  STRATA_RETURN_IF_ERROR(checkpoint::Agree(comm, prepared, "preparing the checkpoint directory"));
  return staged;
}

// The part of a save every rank does together, before any file is written:
// the directory prepared and what the manifest says fixed. Then the files,
// on a thread (`asynchronous`) or here.
Result<std::unique_ptr<PendingCheckpoint>> Start(Engine& engine, const optim::Optimizer& optimizer,
                                                 const std::string& root, const CheckpointOptions& options,
                                                 Communicator* comm, FileSystem& files, bool asynchronous) {
  if (!engine.finalized()) return InvalidArgument("checkpoint: the engine is not finalized: nothing to save yet");
  STRATA_RETURN_IF_ERROR(checkpoint::CheckGroup(engine, comm));
  STRATA_RETURN_IF_ERROR(checkpoint::CheckNoSavePending(engine));
  const std::string name = checkpoint::StepName(optimizer.steps_taken());
  STRATA_ASSIGN_OR_RETURN(fs::path staged, PrepareDirectory(files, engine, comm, root, name, options.recycle));
  auto state = std::unique_ptr<PendingCheckpoint::State>(new PendingCheckpoint::State{
      .engine = engine,
      .comm = comm,
      .files = files,
      .options = options,
      .asynchronous = asynchronous,
      .dir = root,
      .name = name,
      .staged = staged,
      .head = checkpoint::ManifestHead(engine, optimizer),
      .step = optimizer.steps_taken(),
  });
  for (const ChunkInfo& c : engine.chunks()) {
    if (checkpoint::Saved(c) && (c.sharded || engine.rank() == 0)) state->unread[c.group]++;
  }
  PendingCheckpoint::State* run = state.get();
  auto pending = std::make_unique<PendingCheckpoint>(std::move(state));
  if (asynchronous) {
    SetSavePending(engine, true);
    run->thread = std::thread([run] { run->Run(); });
  } else {
    run->Run();
  }
  return pending;
}

}  // namespace

Result<std::unique_ptr<PendingCheckpoint>> StartCheckpoint(Engine& engine, const optim::Optimizer& optimizer,
                                                           const std::string& root, const CheckpointOptions& options,
                                                           Communicator* comm, FileSystem& files) {
  return Start(engine, optimizer, root, options, comm, files, /*asynchronous=*/true);
}

Result<CheckpointSummary> SaveCheckpoint(Engine& engine, const optim::Optimizer& optimizer, const std::string& root,
                                         const CheckpointOptions& options, Communicator* comm, FileSystem& files) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PendingCheckpoint> pending,
                          Start(engine, optimizer, root, options, comm, files, /*asynchronous=*/false));
  return pending->Wait();
}

}  // namespace strata::offload
