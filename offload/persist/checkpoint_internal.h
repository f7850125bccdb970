// What the files of a checkpoint's save, load and inspection share; private
// to offload/persist/. Paths are std::filesystem paths here and strings at
// the FileSystem seam. Every function touches the disk only through the
// FileSystem it is given.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <future>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "optim/optimizer.h"
#include "src/base/task_queue.h"
#include "strata/checkpoint.h"
#include "strata/comm.h"
#include "strata/file_system.h"

namespace strata::offload::checkpoint {

namespace fs = std::filesystem;
using nlohmann::json;

// Names of the on-disk layout (Note [Checkpoint layout on disk]).
inline constexpr const char* kFormat = "strata-checkpoint";
inline constexpr int kVersion = 1;
inline constexpr const char* kManifest = "manifest.json";
inline constexpr const char* kLatest = "latest";
inline constexpr const char* kRankFiles = "files.json";   // a rank's manifest entries, merged by rank 0
inline constexpr const char* kRankFailed = "failed.txt";  // or why its files failed
inline constexpr const char* kSpares = ".spare";          // chunk files of removed checkpoints, to be written over

// ---- checkpoint_files.cc: the file engine (Note [Checkpoint file I/O]) ----

// One chunk file's transfer in flight: its pieces written or read by the
// threads of `pool` at once, with O_DIRECT where the file system allows it.
class FileTransfer {
 public:
  static constexpr size_t kPieceBytes = size_t{1} << 20;
  static constexpr uint32_t kThreads = 16;

  // Writes `size` bytes of `data` (4096-aligned, readable up to `size`
  // rounded up to 4096: that tail is written too, and cut off by Finish) to
  // the file at `path`: a new one, or a spare to write over. FlushAll makes it durable.
  static Result<std::unique_ptr<FileTransfer>> StartWrite(FileSystem& files, TaskQueue& pool, const fs::path& path,
                                                          const std::byte* data, size_t size);
  // Opens the file at `path` to read it: Corruption unless it is `size`
  // bytes (checked before anything is sized by `size`); StartReading then
  // reads it into `data` (the same room).
  static Result<std::unique_ptr<FileTransfer>> OpenRead(FileSystem& files, const fs::path& path, size_t size);
  void StartReading(TaskQueue& pool, std::byte* data) { StartPieces(pool, data); }
  // Waits for every piece: the first error. A written file is then cut to its size.
  Status Finish();
  // Never leaves a piece running into a buffer about to be freed.
  ~FileTransfer();

 private:
  FileTransfer(std::unique_ptr<File> file, bool write, size_t size);
  void StartPieces(TaskQueue& pool, std::byte* data);

  std::unique_ptr<File> file_;  // null once Finish closed it
  bool write_;
  size_t size_;
  std::vector<std::shared_future<Status>> pieces_;
};

// fsyncs every file of `paths`, several at once on `pool`, dropping their pages from the page cache.
Status FlushAll(FileSystem& files, TaskQueue& pool, const std::vector<fs::path>& paths);
// Writes `size` bytes to a new file at `path` and fsyncs it.
Status WriteFileDurably(FileSystem& files, const fs::path& path, const void* data, size_t size);
Result<std::string> ReadText(FileSystem& files, const fs::path& path);
// The entries of `dir`; none where it cannot be listed (missing).
std::vector<DirectoryEntry> ListOrNone(FileSystem& files, const fs::path& dir);
// Checks the bytes a transfer read against the manifest's CRC32C.
Status CheckCrc(const fs::path& path, const void* data, uint64_t size, uint32_t crc);

// ---- checkpoint_spares.cc (Note [Recycled chunk files]) ----

// Moves the chunk files of `dir` (a checkpoint or temporary being removed)
// into root/.spare, then removes `dir`; with `recycle` false, only removes it.
void Retire(FileSystem& files, const fs::path& root, const fs::path& dir, bool recycle);
// Keeps at most `keep` bytes of spare files under root/.spare.
void TrimSpares(FileSystem& files, const fs::path& root, uint64_t keep);

// The spare files under root/.spare as a save found them.
class SpareFiles {
 public:
  SpareFiles(FileSystem& files, const fs::path& root, bool recycle);
  // Renames the spare that best fits a file of `bytes` (the smallest that
  // holds them, else the largest) to `path`: whether there was one.
  bool Claim(const fs::path& path, uint64_t bytes);

 private:
  FileSystem& files_;
  std::multimap<uint64_t, fs::path> by_size_;
};

// ---- checkpoint_manifest.cc (Note [Checkpoint layout on disk]) ----

std::string StepName(int64_t step);
// The step of a checkpoint directory's name, or nothing for another name.
std::optional<int64_t> StepOf(const std::string& name);
// Whether a chunk is part of a checkpoint: not the gradients (zero between
// steps) nor a gathered param chunk (its group's masters are saved).
bool Saved(const ChunkInfo& chunk);
json TensorsJson(const std::vector<TensorSpec>& tensors);
// A param group's hyperparameters in a manifest, and back (json exceptions
// for a field missing or of the wrong type: see Guarded).
json GroupJson(const optim::GroupHyperparams& group);
optim::GroupHyperparams GroupOf(const json& saved);
// What the manifest says besides its files, fixed as a save begins.
json ManifestHead(const Engine& engine, const optim::Optimizer& optimizer);
// The manifest of the checkpoint at `dir`, its format and file paths checked.
Result<json> ReadManifest(FileSystem& files, const fs::path& dir);
// The checkpoint directories under `root`, newest first.
std::vector<fs::path> CheckpointsUnder(FileSystem& files, const fs::path& root);
// Which checkpoint `path` means: itself when it holds a manifest, else the
// one its `latest` names. `root` is set in the second case.
Result<fs::path> Resolve(FileSystem& files, const fs::path& path, std::optional<fs::path>* root);
// A checkpoint `name` that a crash left moved aside under `root` (Note
// [Publishing a checkpoint]), when `name` itself is missing.
std::optional<fs::path> FindAside(FileSystem& files, const fs::path& root, const std::string& name);
// The name a published checkpoint `name` is moved aside under while a re-save
// of its step replaces it without RENAME_EXCHANGE, the pid appended.
std::string AsidePrefix(const std::string& name);

// Runs `read` over a manifest's fields: a field of the wrong type or missing is Corruption.
template <typename Read>
auto Guarded(const fs::path& dir, Read read) -> decltype(read()) {
  try {
    return read();
  } catch (const json::exception& error) {
    return Corruption("checkpoint: {}: {}", (dir / kManifest).string(), error.what());
  }
}

// ---- checkpoint_publish.cc (Note [Publishing a checkpoint]) ----

// Rank 0, before a save: what crashed saves left under `root` cleared.
void ClearLeftovers(FileSystem& files, const fs::path& root, bool recycle);
// Publishes the complete checkpoint `staged` as root/name.
Status Publish(FileSystem& files, const fs::path& root, const std::string& name, const fs::path& staged,
               bool recycle);
// Points root/latest at `name`: written beside it, then renamed over it.
Status PointLatestAt(FileSystem& files, const fs::path& root, const std::string& name);
// keep_last: all but the newest `keep_last` checkpoints of `step` and earlier removed.
void Prune(FileSystem& files, const fs::path& root, int64_t step, uint32_t keep_last, bool recycle);
// Rank r > 0 tells rank 0 how its files went: their entries, or why they failed.
Status ReportToLead(FileSystem& files, const fs::path& staged, int rank, const Result<json>& entries);
// Rank 0: every other rank's entries appended to `entries`, as each reports;
// the first rank that failed, or that has not reported `timeout_ms` after
// this call, fails it.
Status CollectRankFiles(FileSystem& files, const fs::path& staged, int world, uint32_t timeout_ms, json& entries);

// ---- checkpoint_save.cc (Note [Writing a chunk from where it lies]) ----

// What writing a rank's files asks of the save it is part of.
struct SaveHooks {
  std::function<Status(ChunkId)> begin_chunk;             // before each chunk is taken
  std::function<Status(ChunkId, std::byte*)> read_chunk;  // Engine::ReadChunk
  std::function<void(const ChunkInfo&)> done;             // once the save no longer needs the chunk as it is
};

// This rank's files of a checkpoint into `staged`/rank<r>: its shards, and
// on rank 0 the whole chunks too, in layout order. Their manifest entries.
Result<json> WriteRankFiles(FileSystem& files, Engine& engine, const fs::path& staged, SpareFiles& spares,
                            const SaveHooks& hooks, CheckpointSummary& summary);

// ---- pending_checkpoint.cc ----

// InvalidArgument unless `comm` is the group `engine` is a rank of.
Status CheckGroup(const Engine& engine, const Communicator* comm);
// InvalidArgument while an asynchronous save of `engine` is in flight.
Status CheckNoSavePending(const Engine& engine);

// AgreeOnStatus, for a checkpoint's `what`.
inline Status Agree(Communicator* comm, const Status& status, const std::string& what, bool* any_invalid = nullptr) {
  return AgreeOnStatus(comm, status, "checkpoint: " + what, any_invalid);
}

// The format of a set of moment chunks, from their kinds and dtype names:
// int8 where any is (the others are the fp32 moments of small tensors),
// else theirs; nullopt without moments.
class MomentsFormat {
 public:
  void Add(std::string_view kind, std::string_view dtype) {
    if (kind != ChunkKindName(ChunkKind::kExpAvg) && kind != ChunkKindName(ChunkKind::kExpAvgSq)) return;
    if (!format_ || dtype == DTypeName(DType::kInt8Block)) format_ = std::string(dtype);
  }
  const std::optional<std::string>& format() const { return format_; }

 private:
  std::optional<std::string> format_;
};

}  // namespace strata::offload::checkpoint
