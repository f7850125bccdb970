// The file-system seam: named files opened, read and written at offsets,
// made durable, renamed, listed and removed; what checkpoints and
// safetensors files go through (the NVMe tier's linear space is Storage).
//
// Implementations: PosixFileSystem() (POSIX calls, O_DIRECT where asked and
// the file system takes it), and FaultInjectingFileSystem, a wrapper that
// makes every failure a test needs happen (EIO, ENOSPC, short or corrupted
// transfers, delays, a stall, no RENAME_EXCHANGE).
//
// Contract: failures are IoError naming the operation, the path and errno;
// an operation the file system lacks is NotSupported. Thread-safety: a
// FileSystem may be called from several threads at once, and so may a
// File's methods but Close. A File must not outlive its FileSystem.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/status.h"

namespace strata {

enum class OpenMode {
  kRead,      // an existing file
  kWrite,     // created if missing; its bytes kept until written over
  kTruncate,  // created, or emptied
};

// How a file's bytes will be used: a hint a backend may ignore.
enum class FileAdvice {
  kSequential,  // read from start to end
  kDropCache,   // not read again soon: its pages may leave the page cache
};

class File {
 public:
  virtual ~File() = default;  // closes the file; Close reports what that cannot
  virtual const std::string& path() const = 0;
  // Whether transfers bypass the page cache (O_DIRECT): offsets, sizes and
  // addresses are then multiples of 4096 (kIoAlignmentBytes).
  virtual bool direct() const = 0;
  virtual Result<uint64_t> Size() = 0;
  // Writes all of [data, data + size_bytes) at `offset`.
  virtual Status Write(uint64_t offset, const std::byte* data, size_t size_bytes) = 0;
  // Reads up to `size_bytes` at `offset`: the bytes read, fewer only where the file ends.
  virtual Result<size_t> Read(uint64_t offset, std::byte* data, size_t size_bytes) = 0;
  // Reserves [0, size_bytes) on the device, so that writes there do not extend the file.
  virtual Status Allocate(uint64_t size_bytes) = 0;
  virtual Status Truncate(uint64_t size_bytes) = 0;
  // The file's bytes and size durable (fsync).
  virtual Status Sync() = 0;
  virtual void Advise(FileAdvice advice) = 0;
  virtual Status Close() = 0;
};

struct DirectoryEntry {
  std::string name;  // not the path
  bool directory = false;
  uint64_t size_bytes = 0;  // a regular file's
};

class FileSystem {
 public:
  virtual ~FileSystem() = default;
  // `direct`: O_DIRECT where the file system takes it, else through the page cache (tmpfs).
  virtual Result<std::unique_ptr<File>> Open(const std::string& path, OpenMode mode, bool direct = false) = 0;
  // false also where it cannot be told (a directory that cannot be read).
  virtual bool Exists(const std::string& path) = 0;
  virtual Result<std::vector<DirectoryEntry>> List(const std::string& dir) = 0;
  // Creates one directory: false where it existed already.
  virtual Result<bool> CreateDirectory(const std::string& path) = 0;
  virtual Status CreateDirectories(const std::string& path) = 0;
  // Moves `from` to `to`, replacing a file or an empty directory there.
  virtual Status Rename(const std::string& from, const std::string& to) = 0;
  // Swaps two paths atomically (renameat2's RENAME_EXCHANGE): NotSupported
  // where the file system lacks it (NFS).
  virtual Status Exchange(const std::string& a, const std::string& b) = 0;
  // A file, or a directory and all it holds; nothing there is no error.
  virtual Status RemoveAll(const std::string& path) = 0;
  // The directory's entries (a rename, a new file) durable.
  virtual Status SyncDirectory(const std::string& path) = 0;
  // Bytes an unprivileged writer may still put on the file system holding `path` (statvfs).
  virtual Result<uint64_t> FreeBytes(const std::string& path) = 0;
};

// The machine's file system through POSIX calls. Lives as long as the process.
FileSystem& PosixFileSystem();

// Wraps a FileSystem (not owned; it must outlive the wrapper) and injects
// failures into its files on demand. Each Fail*/Short*/Corrupt* call arms
// the fault for the next `count` matching operations of any file opened
// through it. Faults, delays and the stall touch file reads and writes
// (File::Write, File::Read) unless said otherwise.
class FaultInjectingFileSystem final : public FileSystem {
 public:
  explicit FaultInjectingFileSystem(FileSystem& base);
  ~FaultInjectingFileSystem() override;

  // After `after` more writes succeed, the next `count` writes fail with
  // IoError carrying `error_number` (EIO, ENOSPC), writing nothing.
  void FailWrites(int error_number, int count = 1, int after = 0);
  // The same for reads.
  void FailReads(int error_number, int count = 1, int after = 0);
  // The next `count` File::Sync and SyncDirectory calls fail, syncing nothing.
  void FailSyncs(int error_number, int count = 1);
  // The next `count` writes (after `after` more) store only the first half
  // of their bytes and report success (a short write lost on the way).
  void ShortWrites(int count = 1, int after = 0);
  // The next `count` reads return half the bytes, as if the file ended there.
  void ShortReads(int count = 1, int after = 0);
  // The next `count` writes store, or reads return, one byte flipped.
  void CorruptWrites(int count = 1, int after = 0);
  void CorruptReads(int count = 1, int after = 0);
  // Every read and write sleeps this long first (a slow drive).
  void SetDelayMs(uint32_t delay_ms);
  // After `after` more writes, the next one hangs (a stalled drive) until
  // Unstall, or at most `max_ms`, so that a test that fails ends.
  void StallWrites(int after = 0, uint32_t max_ms = 30'000);
  void Unstall();
  // Exchange answers NotSupported, as on NFS.
  void RefuseExchange(bool refuse = true);
  // Called with the path before each Open for writing (a point in the
  // caller's work, for a test to act at); an error fails the Open.
  void SetOpenHook(std::function<Status(const std::string& path)> hook);
  // FreeBytes answers this for every path (a nearly full drive); nullopt: the base's answer.
  void SetFreeBytes(std::optional<uint64_t> free_bytes);

  int reads() const;
  int writes() const;

  Result<std::unique_ptr<File>> Open(const std::string& path, OpenMode mode, bool direct = false) override;
  bool Exists(const std::string& path) override;
  Result<std::vector<DirectoryEntry>> List(const std::string& dir) override;
  Result<bool> CreateDirectory(const std::string& path) override;
  Status CreateDirectories(const std::string& path) override;
  Status Rename(const std::string& from, const std::string& to) override;
  Status Exchange(const std::string& a, const std::string& b) override;
  Status RemoveAll(const std::string& path) override;
  Status SyncDirectory(const std::string& path) override;
  Result<uint64_t> FreeBytes(const std::string& path) override;

  struct State;  // shared with the files it opened

 private:
  FileSystem& base_;
  std::shared_ptr<State> state_;
};

}  // namespace strata
