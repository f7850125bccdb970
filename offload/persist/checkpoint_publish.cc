// How a save's files become the published checkpoint: the ranks' reports to
// rank 0, the renames that publish, `latest`, pruning, and the clean-up of
// what a crashed save left.

#include <unistd.h>

#include <chrono>
#include <thread>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"

namespace strata::offload::checkpoint {

// Note [Publishing a checkpoint]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A save writes into a hidden temporary directory of the root
// (.step-<N>.tmp-<token>, named afresh for each save so that a report an
// earlier failed save left is never read), fsyncs each file and directory,
// and only then renames it to step-<N> and replaces `latest` (written
// beside it, then a rename too), so a crash at any moment leaves the last
// published checkpoint intact and `latest` naming a complete one.
//
// A re-save of a step whose checkpoint exists swaps the two atomically
// (renameat2's RENAME_EXCHANGE), so that root/step-<N> is never missing,
// and retires the old one. A file system without the exchange (NFS) gets
// two renames: the old one moved aside to .step-<N>.old-<pid>, then the new
// one into place. A crash between them leaves the old one there, complete:
// Resolve takes it where `latest` names the missing one, and the next save
// puts it back.
//
// Data parallel, every rank writes into rank 0's temporary directory, its
// rank<r>/ never created by rank 0: a rank behind a save that rank 0 has
// given up on and removed fails. Rank r > 0 reports how its files went in
// its directory: their manifest entries (files.json), or why they failed
// (failed.txt), each published by a rename so that rank 0 never reads half
// of one. Rank 0 learns the others are done from these files (waiting at
// most comm.timeout_ms after its own), writes the manifest and publishes.
//
// Temporaries a crashed save left are removed by the next save, which is
// why there is one saver at a time per root. keep_last removes the oldest
// checkpoints only after the new one is published, and only among the new
// step and earlier ones (later ones belong to a run that was rewound,
// loaded from an earlier checkpoint: left to the user); each is hidden by a
// rename first, so that a crash while its files go never leaves a
// checkpoint that looks published but is not whole.

void ClearLeftovers(FileSystem& files, const fs::path& root, bool recycle) {
  // Hidden temporaries go, but a published checkpoint moved aside by a
  // re-save that crashed before its replacement was in place goes back.
  for (const DirectoryEntry& entry : ListOrNone(files, root)) {
    const std::string& name = entry.name;
    const fs::path path = root / name;
    const size_t old = name.find(".old-");
    if (name.rfind(".step-", 0) == 0 && old != std::string::npos) {
      const std::string original = name.substr(1, old - 1);
      if (FindAside(files, root, original) == path && files.Rename(path.string(), (root / original).string()).ok()) {
        continue;
      }
    }
    if (name.rfind(".step-", 0) == 0) {
      Retire(files, root, path, recycle);
    } else if (name.rfind(".latest.", 0) == 0) {
      (void)files.RemoveAll(path.string());
    }
  }
}

namespace {

// Publishes `staged` as `final_path` where a checkpoint of that name exists:
// the old one exchanged with it, or moved aside first, then retired.
Status Replace(FileSystem& files, const fs::path& root, const std::string& name, const fs::path& staged,
               bool recycle) {
  const fs::path final_path = root / name;
  const Status exchanged = files.Exchange(staged.string(), final_path.string());
  if (exchanged.ok()) {
    STRATA_RETURN_IF_ERROR(files.SyncDirectory(root.string()));
    Retire(files, root, staged, recycle);  // the replaced checkpoint
    return Status::Ok();
  }
  if (exchanged.code() != StatusCode::kNotSupported) return exchanged;
  const fs::path aside = root / fmt::format("{}{}", AsidePrefix(name), ::getpid());
  STRATA_RETURN_IF_ERROR(files.Rename(final_path.string(), aside.string()));
  if (const Status renamed = files.Rename(staged.string(), final_path.string()); !renamed.ok()) {
    (void)files.Rename(aside.string(), final_path.string());
    return renamed;
  }
  STRATA_RETURN_IF_ERROR(files.SyncDirectory(root.string()));
  Retire(files, root, aside, recycle);
  return Status::Ok();
}

}  // namespace

Status Publish(FileSystem& files, const fs::path& root, const std::string& name, const fs::path& staged,
               bool recycle) {
  const auto published = [&]() -> Status {
    if (files.Exists((root / name).string())) return Replace(files, root, name, staged, recycle);
    STRATA_RETURN_IF_ERROR(files.Rename(staged.string(), (root / name).string()));
    return files.SyncDirectory(root.string());
  };
  return published().WithContext("checkpoint");
}

Status PointLatestAt(FileSystem& files, const fs::path& root, const std::string& name) {
  const fs::path staged = root / fmt::format(".{}.tmp-{}", kLatest, ::getpid());
  const std::string text = name + "\n";
  STRATA_RETURN_IF_ERROR(WriteFileDurably(files, staged, text.data(), text.size()));
  STRATA_RETURN_IF_ERROR(files.Rename(staged.string(), (root / kLatest).string()).WithContext("checkpoint"));
  return files.SyncDirectory(root.string()).WithContext("checkpoint");
}

void Prune(FileSystem& files, const fs::path& root, int64_t step, uint32_t keep_last, bool recycle) {
  size_t kept = 0;
  for (const fs::path& older : CheckpointsUnder(files, root)) {
    if (*StepOf(older.filename().string()) > step || ++kept <= keep_last) continue;
    const fs::path hidden = root / fmt::format(".{}.pruned-{}", older.filename().string(), ::getpid());
    Retire(files, root, files.Rename(older.string(), hidden.string()).ok() ? hidden : older, recycle);
  }
}

Status ReportToLead(FileSystem& files, const fs::path& staged, int rank, const Result<json>& entries) {
  const fs::path dir = staged / fmt::format("rank{}", rank);
  const std::string text = entries.ok() ? entries->dump() : entries.status().ToString();
  const fs::path report = dir / (entries.ok() ? kRankFiles : kRankFailed);
  const fs::path temporary = dir / ".report.tmp";
  STRATA_RETURN_IF_ERROR(WriteFileDurably(files, temporary, text.data(), text.size()));
  STRATA_RETURN_IF_ERROR(files.Rename(temporary.string(), report.string()).WithContext("checkpoint"));
  return files.SyncDirectory(dir.string()).WithContext("checkpoint");
}

namespace {

// Rank 0: waits for rank r's report until `deadline`: its entries' text, or why it has none.
Result<std::string> AwaitReport(FileSystem& files, const fs::path& dir, int r, uint32_t timeout_ms,
                                std::chrono::steady_clock::time_point deadline) {
  while (!files.Exists((dir / kRankFiles).string())) {
    if (files.Exists((dir / kRankFailed).string())) {
      Result<std::string> why = ReadText(files, dir / kRankFailed);
      return IoError("checkpoint: rank {} failed writing its files: {}", r, why.ok() ? *why : why.status().ToString());
    }
    if (std::chrono::steady_clock::now() > deadline) {
      return Timeout("checkpoint: rank {} had not written its files {} ms after rank 0 had (comm.timeout_ms)", r,
                     timeout_ms);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return ReadText(files, dir / kRankFiles);
}

}  // namespace

Status CollectRankFiles(FileSystem& files, const fs::path& staged, int world, uint32_t timeout_ms, json& entries) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (int r = 1; r < world; ++r) {
    const fs::path dir = staged / fmt::format("rank{}", r);
    STRATA_ASSIGN_OR_RETURN(std::string text, AwaitReport(files, dir, r, timeout_ms, deadline));
    json reported = json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!reported.is_array()) return Corruption("checkpoint: {} is not a JSON array", (dir / kRankFiles).string());
    for (json& entry : reported) entries.push_back(std::move(entry));
  }
  return Status::Ok();
}

}  // namespace strata::offload::checkpoint
