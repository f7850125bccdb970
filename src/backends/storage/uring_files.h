// The backing files of the NVMe backend: checking the options and the
// directories, then opening (creating if needed) and preallocating one file
// per directory. Private to src/backends/storage/. Not thread-safe; run once,
// at setup.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "src/backends/storage/storage_util.h"
#include "strata/file_system.h"
#include "strata/status.h"
#include "strata/storage.h"

namespace strata::storage::uring {

// One io_uring read or write moves at most ~2 GiB (the kernel's MAX_RW_COUNT)
// and takes a 32-bit length; 1 GiB blocks stay well inside both.
inline constexpr size_t kMaxBlockSizeBytes = size_t{1} << 30;

struct BackingFile {
  std::string dir;
  std::string path;
  UniqueFd fd;
  bool direct_io = true;  // false: O_DIRECT was refused and allow_buffered_io accepted page-cache I/O
};

// Removes the backing files this attempt created, unless dismissed: a failed
// start leaves the directories as it found them.
class CreatedFilesGuard {
 public:
  CreatedFilesGuard() = default;
  CreatedFilesGuard(const CreatedFilesGuard&) = delete;
  CreatedFilesGuard& operator=(const CreatedFilesGuard&) = delete;
  ~CreatedFilesGuard();
  void Add(std::string path) { paths_.push_back(std::move(path)); }
  void Dismiss() { paths_.clear(); }

 private:
  std::vector<std::string> paths_;
};

// InvalidArgument naming the option when `options` cannot describe a tier.
Status ValidateUringOptions(const UringStorageOptions& options);

// One open, preallocated file per directory of `options` (validated), in
// order, the free space read through `files`; files it creates are added to
// `created`. IoError for a directory
// that is missing, not writable or listed twice; OutOfMemory when a
// filesystem lacks the space; NotSupported when O_DIRECT is refused and
// buffered I/O is not allowed.
Result<std::vector<BackingFile>> OpenBackingFiles(const UringStorageOptions& options, const OpenFileFn& open_file,
                                                  FileSystem& files, CreatedFilesGuard& created);

}  // namespace strata::storage::uring
