// Spare chunk files: the files of removed checkpoints, kept under
// root/.spare for the next save to write over.

#include <random>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"

namespace strata::offload::checkpoint {

// Note [Recycled chunk files]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// A direct write into a new file ran at half the drive's bandwidth on ext4
// (2.5-3.4 GB/s, against 6.5-7 GB/s over blocks already written, on the same
// disk in the same minute; docs/benchmarks.md): each write into a new file
// allocates blocks, or converts the unwritten extents fallocate left, under
// the inode's lock and in the journal, while a write over written blocks is
// a plain overwrite. A save therefore writes its chunk files over the files
// of removed checkpoints: where a checkpoint would be deleted (pruned by
// keep_last, replaced by a re-save of its step, left by a crashed save), its
// chunk files are moved into root/.spare instead, and a later save renames
// one of about the right size into its temporary directory (a rename: two
// ranks cannot both take one) and writes over it, cutting it to its size.
// Nothing a published checkpoint holds is ever written over: a pruned one is
// renamed to a hidden name before its files are moved. After each published
// save, rank 0 trims the spares to the bytes that save wrote, which the next
// save takes back from them: at rest the spares hold at most one more
// checkpoint's room, and a save's peak use of the disk is what it was without them.
// The cost: a process still reading a removed checkpoint's files (an
// uploader copying it away) reads the next save's bytes once that save
// writes over them. It must finish first, or the saves run with recycle off
// (CheckpointOptions::recycle false: removed checkpoints are deleted, and so
// are the spares).

namespace {

// The chunk files of a checkpoint directory: rank<r>/*.bin.
std::vector<fs::path> ChunkFilesOf(FileSystem& files, const fs::path& dir) {
  std::vector<fs::path> found;
  for (const DirectoryEntry& rank : ListOrNone(files, dir)) {
    if (!rank.directory) continue;
    for (const DirectoryEntry& file : ListOrNone(files, dir / rank.name)) {
      if (!file.directory && fs::path(file.name).extension() == ".bin") found.push_back(dir / rank.name / file.name);
    }
  }
  return found;
}

}  // namespace

void Retire(FileSystem& files, const fs::path& root, const fs::path& dir, bool recycle) {
  if (recycle) {
    const std::vector<fs::path> chunk_files = ChunkFilesOf(files, dir);
    (void)files.CreateDirectory((root / kSpares).string());
    thread_local std::mt19937_64 names{std::random_device{}()};
    for (const fs::path& file : chunk_files) {
      (void)files.Rename(file.string(), (root / kSpares / fmt::format("{:016x}.bin", names())).string());
    }
    // Durable before any save writes over them: a crash must not bring a
    // removed checkpoint back holding a later save's bytes.
    (void)files.SyncDirectory((root / kSpares).string());
  }
  (void)files.RemoveAll(dir.string());
}

void TrimSpares(FileSystem& files, const fs::path& root, uint64_t keep) {
  const fs::path spares = root / kSpares;
  if (keep == 0) {
    (void)files.RemoveAll(spares.string());
    return;
  }
  uint64_t kept = 0;
  for (const DirectoryEntry& file : ListOrNone(files, spares)) {
    if (!file.directory && file.size_bytes > 0 && kept + file.size_bytes <= keep) {
      kept += file.size_bytes;
    } else {
      (void)files.RemoveAll((spares / file.name).string());
    }
  }
}

SpareFiles::SpareFiles(FileSystem& files, const fs::path& root, bool recycle) : files_(files) {
  if (!recycle) return;
  for (const DirectoryEntry& file : ListOrNone(files, root / kSpares)) {
    if (!file.directory && file.size_bytes > 0) by_size_.emplace(file.size_bytes, root / kSpares / file.name);
  }
}

bool SpareFiles::Claim(const fs::path& path, uint64_t bytes) {
  while (!by_size_.empty()) {
    auto fit = by_size_.lower_bound(bytes);
    if (fit == by_size_.end()) fit = std::prev(by_size_.end());
    const fs::path spare = std::move(fit->second);
    by_size_.erase(fit);
    if (files_.Rename(spare.string(), path.string()).ok()) return true;  // else another rank took it
  }
  return false;
}

}  // namespace strata::offload::checkpoint
