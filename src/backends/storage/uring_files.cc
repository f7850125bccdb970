// Note [Backing files]
// One preallocated file per directory (one directory per drive), each
// holding every ndirs-th stripe of the tier's byte space (see the layout in
// uring_storage.cc), so its size is ceil(capacity / ndirs) rounded up to
// whole blocks. Setup fails before any file grows when a directory cannot be
// used or a filesystem cannot hold its directories' files, and files it
// created are removed again when a later step fails (CreatedFilesGuard).

#include "src/backends/storage/uring_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "src/backends/storage/uring_check.h"
#include "src/base/alignment.h"
#include "src/base/logging.h"

namespace strata::storage::uring {
namespace {

// Far above any useful depth for one caller, far below the kernel's ring limit
// (32768 entries).
constexpr uint32_t kMaxQueueDepth = 4096;

// Every directory must exist, be a directory, be writable, and appear once.
Status CheckDirectories(const std::vector<std::string>& dirs, std::vector<struct stat>& dir_stats) {
  dir_stats.clear();
  for (size_t i = 0; i < dirs.size(); ++i) {
    const std::string& dir = dirs[i];
    struct stat st {};
    if (::stat(dir.c_str(), &st) != 0) {
      int error_number = errno;
      return IoError("nvme.dirs entry '{}' cannot be used: {} (errno {})", dir, ErrnoText(error_number),
                     error_number);
    }
    if (!S_ISDIR(st.st_mode)) {
      return IoError("nvme.dirs entry '{}' is not a directory: {} (errno {})", dir, ErrnoText(ENOTDIR), ENOTDIR);
    }
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      int error_number = errno;
      return IoError("nvme.dirs entry '{}' is not writable: {} (errno {})", dir, ErrnoText(error_number),
                     error_number);
    }
    for (size_t j = 0; j < i; ++j) {
      if (dir_stats[j].st_dev == st.st_dev && dir_stats[j].st_ino == st.st_ino) {
        // Both entries would open the same file and overwrite each other's stripes.
        return InvalidArgument("nvme.dirs lists the same directory twice ('{}' and '{}')", dirs[j], dir);
      }
    }
    dir_stats.push_back(st);
  }
  return Status::Ok();
}

// Fails early, before any file grows, when a filesystem cannot hold its
// directories' backing files. Directories on one filesystem share its free
// space, so needs are summed per filesystem.
Status CheckFreeSpace(const UringStorageOptions& options, const std::vector<struct stat>& dir_stats,
                      uint64_t file_size_bytes, FileSystem& files) {
  struct Filesystem {
    uint64_t needed_bytes = 0;
    uint64_t free_bytes = 0;
    std::vector<std::string> dirs;
  };
  std::map<dev_t, Filesystem> filesystems;
  for (size_t i = 0; i < options.dirs.size(); ++i) {
    const std::string& dir = options.dirs[i];
    Filesystem& fs = filesystems[dir_stats[i].st_dev];
    STRATA_ASSIGN_OR_RETURN(fs.free_bytes, files.FreeBytes(dir));
    fs.dirs.push_back(dir);
    // Space an existing backing file already holds counts as available.
    uint64_t held_bytes = 0;
    std::string path = (std::filesystem::path(dir) / options.file_name).string();
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode)) {
      held_bytes = std::min<uint64_t>(static_cast<uint64_t>(st.st_blocks) * 512, file_size_bytes);
    }
    fs.needed_bytes += file_size_bytes - held_bytes;
  }
  for (const auto& [device, fs] : filesystems) {
    if (fs.needed_bytes > fs.free_bytes) {
      std::string dirs;
      for (const std::string& dir : fs.dirs) dirs += (dirs.empty() ? "'" : ", '") + dir + "'";
      return OutOfMemory(
          "nvme tier: not enough free space for the backing files in {}: needed {} ({} bytes; {} per directory for "
          "nvme.capacity = {} over {} director{}), free {} ({} bytes); lower nvme.capacity or add directories on "
          "other drives",
          dirs, FormatSize(fs.needed_bytes), fs.needed_bytes, FormatSize(file_size_bytes),
          FormatSize(options.capacity_bytes), options.dirs.size(), options.dirs.size() == 1 ? "y" : "ies",
          FormatSize(fs.free_bytes), fs.free_bytes);
    }
  }
  return Status::Ok();
}

// Opens (creating if needed) one backing file and reserves its share.
Status OpenBackingFile(const UringStorageOptions& options, const std::string& dir, uint64_t file_size_bytes,
                       const OpenFileFn& open_file, CreatedFilesGuard& created, BackingFile& file) {
  file.dir = dir;
  file.path = (std::filesystem::path(dir) / options.file_name).string();
  const char* path = file.path.c_str();
  struct stat existing {};
  if (::lstat(path, &existing) != 0) created.Add(file.path);

  constexpr int kFlags = O_RDWR | O_CREAT | O_CLOEXEC;
  constexpr mode_t kMode = 0600;  // spilled training state: nobody else's business
  int fd = open_file(path, kFlags | O_DIRECT, kMode);
  if (fd < 0 && errno == EINVAL) {
    // The filesystem refuses O_DIRECT (tmpfs before Linux 6.6, some FUSE and
    // network filesystems).
    if (!options.allow_buffered_io) {
      return NotSupported(
          "nvme.dirs entry '{}': the filesystem refuses O_DIRECT (open of {} returned EINVAL); put the NVMe tier on "
          "a filesystem that supports it (ext4 or xfs on an NVMe drive), or set nvme.allow_buffered_io = true to "
          "accept page-cache I/O (slower, and it competes with the host tier for memory)",
          dir, file.path);
    }
    STRATA_LOG_WARNING(
        "nvme.dirs entry '{}': the filesystem refuses O_DIRECT; using buffered I/O because nvme.allow_buffered_io is "
        "set (slower, and the page cache competes with the host tier for memory)",
        dir);
    file.direct_io = false;
    fd = open_file(path, kFlags, kMode);
  }
  if (fd < 0) {
    return CallError(file.direct_io ? "open(O_DIRECT)" : "open", errno, file.path, 0, __FILE__, __LINE__);
  }
  file.fd = UniqueFd(fd);

  struct stat st {};
  STRATA_SYSCALL_CHECK(::fstat(fd, &st), file.path, 0);
  if (!S_ISREG(st.st_mode)) {
    return IoError("backing file {} is not a regular file (mode {:o}); remove it or choose another directory",
                   file.path, st.st_mode);
  }
  // Mode 0 allocates and extends the size; existing data is kept, a larger
  // file (from a larger nvme.capacity) is left as it is.
  if (::fallocate(fd, 0, 0, static_cast<off_t>(file_size_bytes)) != 0) {
    int error_number = errno;
    if (error_number == ENOSPC) {
      return OutOfMemory("nvme tier: {} ran out of space while reserving {} for the backing file (needed {} bytes)",
                         file.path, FormatSize(file_size_bytes), file_size_bytes);
    }
    if (error_number != EOPNOTSUPP) {
      return CallError("fallocate", error_number, file.path, 0, __FILE__, __LINE__);
    }
    STRATA_LOG_WARNING("{}: the filesystem cannot preallocate (fallocate: {}); the file is sparse, and a full disk "
                       "will show up as write errors later",
                       file.path, ErrnoText(error_number));
    if (static_cast<uint64_t>(st.st_size) < file_size_bytes) {
      STRATA_SYSCALL_CHECK(::ftruncate(fd, static_cast<off_t>(file_size_bytes)), file.path, file_size_bytes);
    }
  }
  return Status::Ok();
}

}  // namespace

CreatedFilesGuard::~CreatedFilesGuard() {
  for (const std::string& path : paths_) ::unlink(path.c_str());
}

Status ValidateUringOptions(const UringStorageOptions& options) {
  if (options.dirs.empty()) {
    return InvalidArgument("nvme.dirs is empty: list at least one directory (one per drive) for the backing files");
  }
  for (const std::string& dir : options.dirs) {
    if (dir.empty()) return InvalidArgument("nvme.dirs has an empty entry: every entry must name a directory");
  }
  if (options.capacity_bytes == 0) {
    return InvalidArgument("nvme.capacity is 0: must be > 0 bytes (all directories together)");
  }
  if (options.block_size_bytes == 0 || options.block_size_bytes % kIoAlignmentBytes != 0 ||
      options.block_size_bytes > kMaxBlockSizeBytes) {
    return InvalidArgument("nvme.block_size is {} bytes: must be a multiple of {} bytes between {} and {}",
                           options.block_size_bytes, kIoAlignmentBytes, FormatSize(kIoAlignmentBytes),
                           FormatSize(kMaxBlockSizeBytes));
  }
  if (options.queue_depth == 0 || options.queue_depth > kMaxQueueDepth) {
    return InvalidArgument("nvme.queue_depth is {}: must be between 1 and {}", options.queue_depth, kMaxQueueDepth);
  }
  if (options.io_timeout_ms == 0) {
    return InvalidArgument("nvme.io_timeout_ms is 0: must be > 0 milliseconds");
  }
  if (options.file_name.empty() || options.file_name.find('/') != std::string::npos || options.file_name == "." ||
      options.file_name == "..") {
    return InvalidArgument("backing file name '{}' must be a plain file name (no '/')", options.file_name);
  }
  return Status::Ok();
}

Result<std::vector<BackingFile>> OpenBackingFiles(const UringStorageOptions& options, const OpenFileFn& open_file,
                                                  FileSystem& files, CreatedFilesGuard& created) {
  const uint64_t num_dirs = options.dirs.size();
  // See Note [Backing files].
  const uint64_t share_bytes = (options.capacity_bytes + num_dirs - 1) / num_dirs;
  const uint64_t file_size_bytes = RoundUp(share_bytes, options.block_size_bytes);

  std::vector<struct stat> dir_stats;
  STRATA_RETURN_IF_ERROR(CheckDirectories(options.dirs, dir_stats));
  STRATA_RETURN_IF_ERROR(CheckFreeSpace(options, dir_stats, file_size_bytes, files));
  std::vector<BackingFile> backing(options.dirs.size());
  for (size_t i = 0; i < options.dirs.size(); ++i) {
    STRATA_RETURN_IF_ERROR(OpenBackingFile(options, options.dirs[i], file_size_bytes, open_file, created, backing[i]));
  }
  return backing;
}

}  // namespace strata::storage::uring
