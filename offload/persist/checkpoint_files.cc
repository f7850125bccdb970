// The checkpoint's file engine: chunk files written and read in pieces by a
// pool of threads, small files written durably, all through the FileSystem seam.

#include <algorithm>

#include <fmt/format.h>

#include "offload/persist/checkpoint_internal.h"
#include "src/base/alignment.h"
#include "src/base/crc32c.h"

namespace strata::offload::checkpoint {

// Note [Checkpoint file I/O]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~
// A chunk file is written or read in 1 MiB pieces (kPieceBytes) by a pool
// of 16 threads (kThreads) at once: the drive keeps many requests in flight,
// as bench io's queue depth does. Files are opened with O_DIRECT where the
// file system allows it (a chunk-sized request then goes to the drive
// without a copy into the page cache), else without (tmpfs). A file being
// written is allocated up front: direct writes that extend a file are
// serialized by the file system. Its last piece is written rounded up to
// 4096 bytes (the room a buffer or slot has) and the file then cut to its
// size. A read stops at the end of the file: another direct read from its
// unaligned end may be EINVAL. Once a rank's files are all written they are
// fsynced together (the file system commits them at once), and their pages
// dropped from the page cache (a file system without O_DIRECT): a
// checkpoint is not read back soon.

FileTransfer::FileTransfer(std::unique_ptr<File> file, bool write, size_t size)
    : file_(std::move(file)), write_(write), size_(size) {}

FileTransfer::~FileTransfer() { (void)Finish(); }

Result<std::unique_ptr<FileTransfer>> FileTransfer::StartWrite(FileSystem& files, TaskQueue& pool,
                                                               const fs::path& path, const std::byte* data,
                                                               size_t size) {
  Result<std::unique_ptr<File>> file = files.Open(path.string(), OpenMode::kWrite, /*direct=*/true);
  if (!file.ok()) return file.status().WithContext("checkpoint");
  // (A rank's shard of a small group may be empty: nothing to allocate.)
  if (const Status allocated = (*file)->Allocate(RoundUp(size)); !allocated.ok()) {
    return allocated.WithContext("checkpoint");
  }
  auto transfer = std::unique_ptr<FileTransfer>(new FileTransfer(std::move(file).value(), /*write=*/true, size));
  transfer->StartPieces(pool, const_cast<std::byte*>(data));  // only read from
  return transfer;
}

Result<std::unique_ptr<FileTransfer>> FileTransfer::OpenRead(FileSystem& files, const fs::path& path, size_t size) {
  Result<std::unique_ptr<File>> file = files.Open(path.string(), OpenMode::kRead, /*direct=*/true);
  if (!file.ok()) return file.status().WithContext("checkpoint");
  Result<uint64_t> actual = (*file)->Size();
  if (!actual.ok()) return actual.status().WithContext("checkpoint");
  if (*actual != size) return Corruption("checkpoint: {} is {} bytes, its manifest says {}", path.string(), *actual, size);
  return std::unique_ptr<FileTransfer>(new FileTransfer(std::move(file).value(), /*write=*/false, size));
}

void FileTransfer::StartPieces(TaskQueue& pool, std::byte* data) {
  const size_t rounded = RoundUp(size_);
  for (size_t begin = 0; begin < rounded; begin += kPieceBytes) {
    const size_t end = std::min(rounded, begin + kPieceBytes);
    pieces_.push_back(pool.Push([file = file_.get(), write = write_, data, begin, end, size = size_]() -> Status {
      if (write) return file->Write(begin, data + begin, end - begin);
      STRATA_ASSIGN_OR_RETURN(size_t read, file->Read(begin, data + begin, end - begin));
      if (begin + read < std::min(end, size)) {
        return Corruption("{} ended at byte {} of {}", file->path(), begin + read, size);
      }
      return Status::Ok();
    }));
  }
}

Status FileTransfer::Finish() {
  Status first = Status::Ok();
  for (const std::shared_future<Status>& piece : pieces_) {
    const Status status = piece.get();
    if (first.ok() && !status.ok()) first = status;
  }
  pieces_.clear();
  if (!file_) return first;
  if (first.ok() && write_) first = file_->Truncate(size_);
  const Status closed = file_->Close();
  if (first.ok()) first = closed;
  file_.reset();
  return first.WithContext("checkpoint");
}

Status FlushAll(FileSystem& files, TaskQueue& pool, const std::vector<fs::path>& paths) {
  std::vector<std::shared_future<Status>> flushed;
  for (const fs::path& path : paths) {
    flushed.push_back(pool.Push([&files, path]() -> Status {
      STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file, files.Open(path.string(), OpenMode::kRead));
      STRATA_RETURN_IF_ERROR(file->Sync());
      file->Advise(FileAdvice::kDropCache);
      return file->Close();
    }));
  }
  Status first = Status::Ok();
  for (const std::shared_future<Status>& done : flushed) {
    if (const Status status = done.get(); first.ok() && !status.ok()) first = status;
  }
  return first.WithContext("checkpoint");
}

Status WriteFileDurably(FileSystem& files, const fs::path& path, const void* data, size_t size) {
  const auto written = [&]() -> Status {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file, files.Open(path.string(), OpenMode::kTruncate));
    STRATA_RETURN_IF_ERROR(file->Write(0, static_cast<const std::byte*>(data), size));
    STRATA_RETURN_IF_ERROR(file->Sync());
    return file->Close();
  };
  return written().WithContext("checkpoint");
}

Result<std::string> ReadText(FileSystem& files, const fs::path& path) {
  const auto read = [&]() -> Result<std::string> {
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<File> file, files.Open(path.string(), OpenMode::kRead));
    STRATA_ASSIGN_OR_RETURN(uint64_t size, file->Size());
    std::string text(size, '\0');
    STRATA_ASSIGN_OR_RETURN(size_t got, file->Read(0, reinterpret_cast<std::byte*>(text.data()), size));
    text.resize(got);
    return text;
  };
  Result<std::string> text = read();
  if (!text.ok()) return text.status().WithContext("checkpoint");
  return text;
}

std::vector<DirectoryEntry> ListOrNone(FileSystem& files, const fs::path& dir) {
  Result<std::vector<DirectoryEntry>> entries = files.List(dir.string());
  return entries.ok() ? std::move(entries).value() : std::vector<DirectoryEntry>{};
}

Status CheckCrc(const fs::path& path, const void* data, uint64_t size, uint32_t crc) {
  const uint32_t found = Crc32c(data, size);
  if (found != crc) {
    return Corruption("checkpoint: {} does not match its CRC32C: the manifest says {:08x}, the bytes give {:08x}",
                      path.string(), crc, found);
  }
  return Status::Ok();
}

}  // namespace strata::offload::checkpoint
