// PosixFileSystem: the file-system seam over POSIX calls. Positioned reads
// and writes (pread/pwrite) let the threads of a transfer share one
// descriptor; O_DIRECT is asked for where the caller wants it and dropped
// where the file system refuses it (EINVAL: tmpfs before Linux 6.6).

#include <fcntl.h>
#include <stdio.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "src/base/posix_file.h"
#include "strata/file_system.h"

namespace strata {
namespace {

namespace fs = std::filesystem;

Status ErrorCodeError(std::string_view what, std::string_view path, const std::error_code& ec) {
  return IoError("{} {}: {} (errno {})", what, path, ec.message(), ec.value());
}

class PosixFile final : public File {
 public:
  PosixFile(UniqueFd fd, std::string path, bool direct) : fd_(std::move(fd)), path_(std::move(path)), direct_(direct) {}

  const std::string& path() const override { return path_; }
  bool direct() const override { return direct_; }

  Result<uint64_t> Size() override {
    struct stat st{};
    if (::fstat(fd_.get(), &st) != 0) return ErrnoError("reading the size of", path_);
    return static_cast<uint64_t>(st.st_size);
  }
  Status Write(uint64_t offset, const std::byte* data, size_t size_bytes) override {
    return WriteAt(fd_.get(), data, size_bytes, offset, path_);
  }
  Result<size_t> Read(uint64_t offset, std::byte* data, size_t size_bytes) override {
    return ReadAt(fd_.get(), data, size_bytes, offset, path_, direct_);
  }
  Status Allocate(uint64_t size_bytes) override {
    if (size_bytes == 0) return Status::Ok();
    const int error = ::posix_fallocate(fd_.get(), 0, static_cast<off_t>(size_bytes));
    return error == 0 ? Status::Ok() : ErrnoError("allocating", path_, error);
  }
  Status Truncate(uint64_t size_bytes) override {
    if (::ftruncate(fd_.get(), static_cast<off_t>(size_bytes)) != 0) return ErrnoError("truncating", path_);
    return Status::Ok();
  }
  Status Sync() override {
    if (::fsync(fd_.get()) != 0) return ErrnoError("flushing", path_);
    return Status::Ok();
  }
  void Advise(FileAdvice advice) override {
    ::posix_fadvise(fd_.get(), 0, 0, advice == FileAdvice::kSequential ? POSIX_FADV_SEQUENTIAL : POSIX_FADV_DONTNEED);
  }
  Status Close() override { return fd_.Close(path_); }

 private:
  UniqueFd fd_;
  std::string path_;
  bool direct_;
};

class Posix final : public FileSystem {
 public:
  Result<std::unique_ptr<File>> Open(const std::string& path, OpenMode mode, bool direct) override {
    const int flags = mode == OpenMode::kRead    ? O_RDONLY
                      : mode == OpenMode::kWrite ? O_WRONLY | O_CREAT
                                                 : O_WRONLY | O_CREAT | O_TRUNC;
    int fd = direct ? ::open(path.c_str(), flags | O_DIRECT | O_CLOEXEC, 0644) : -1;
    if (direct && fd < 0 && errno == EINVAL) direct = false;  // the file system refuses O_DIRECT
    if (!direct) fd = ::open(path.c_str(), flags | O_CLOEXEC, 0644);
    if (fd < 0) return ErrnoError(mode == OpenMode::kRead ? "opening" : "creating", path);
    return std::unique_ptr<File>(new PosixFile(UniqueFd(fd), path, direct));
  }
  bool Exists(const std::string& path) override {
    std::error_code ec;
    return fs::exists(path, ec);
  }
  Result<std::vector<DirectoryEntry>> List(const std::string& dir) override {
    std::vector<DirectoryEntry> entries;
    std::error_code ec;
    for (const fs::directory_entry& entry : fs::directory_iterator(dir, ec)) {
      std::error_code type;
      const bool regular = entry.is_regular_file(type);
      entries.push_back({entry.path().filename().string(), entry.is_directory(type),
                         regular ? entry.file_size(type) : 0});
    }
    if (ec) return ErrorCodeError("listing", dir, ec);
    return entries;
  }
  Result<bool> CreateDirectory(const std::string& path) override {
    std::error_code ec;
    const bool created = fs::create_directory(path, ec);
    if (ec) return ErrorCodeError("creating", path, ec);
    return created;
  }
  Status CreateDirectories(const std::string& path) override {
    std::error_code ec;
    fs::create_directories(path, ec);
    return ec ? ErrorCodeError("creating", path, ec) : Status::Ok();
  }
  Status Rename(const std::string& from, const std::string& to) override {
    if (::rename(from.c_str(), to.c_str()) != 0) return ErrnoError(fmt::format("renaming {} to", from), to);
    return Status::Ok();
  }
  Status Exchange(const std::string& a, const std::string& b) override {
    if (::renameat2(AT_FDCWD, a.c_str(), AT_FDCWD, b.c_str(), RENAME_EXCHANGE) == 0) return Status::Ok();
    if (errno == EINVAL || errno == ENOSYS) {
      return NotSupported("exchanging {} with {}: the file system lacks RENAME_EXCHANGE ({})", a, b, ErrnoText(errno));
    }
    return ErrnoError(fmt::format("exchanging {} with", a), b);
  }
  Status RemoveAll(const std::string& path) override {
    std::error_code ec;
    fs::remove_all(path, ec);
    return ec ? ErrorCodeError("removing", path, ec) : Status::Ok();
  }
  Status SyncDirectory(const std::string& path) override {
    const UniqueFd fd(::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
    if (!fd) return ErrnoError("opening the directory", path);
    if (::fsync(fd.get()) != 0) return ErrnoError("flushing the directory", path);
    return Status::Ok();
  }
  Result<uint64_t> FreeBytes(const std::string& path) override {
    struct statvfs vfs {};
    if (::statvfs(path.c_str(), &vfs) != 0) return ErrnoError("reading the free space of", path);
    return static_cast<uint64_t>(vfs.f_bavail) * vfs.f_frsize;
  }
};

}  // namespace

FileSystem& PosixFileSystem() {
  static Posix posix;  // holds nothing: its files work on without it
  return posix;
}

}  // namespace strata
