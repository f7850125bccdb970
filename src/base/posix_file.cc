#include "src/base/posix_file.h"

#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/format.h>

#include "src/base/alignment.h"

namespace strata {

void UniqueFd::Reset() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status UniqueFd::Close(std::string_view path) {
  const int fd = std::exchange(fd_, -1);
  if (fd >= 0 && ::close(fd) != 0) return ErrnoError("closing", path);
  return Status::Ok();
}

std::string ErrnoText(int error_number) {
  const char* text = ::strerrordesc_np(error_number);
  return text != nullptr ? text : fmt::format("unknown error {}", error_number);
}

Status ErrnoError(std::string_view what, std::string_view path, int error_number) {
  return IoError("{} {}: {} (errno {})", what, path, ErrnoText(error_number), error_number);
}

Status ErrnoError(std::string_view what, std::string_view path) { return ErrnoError(what, path, errno); }

Status WriteAt(int fd, const void* data, size_t size, uint64_t offset, std::string_view path) {
  const auto* bytes = static_cast<const std::byte*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pwrite(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error_number = errno;
      return ErrnoError(fmt::format("writing bytes {}..{} of", offset + done, offset + size), path, error_number);
    }
    if (n == 0) return IoError("writing {} stopped at byte {}", path, offset + done);
    done += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Result<size_t> ReadAt(int fd, void* data, size_t size, uint64_t offset, std::string_view path, bool direct) {
  auto* bytes = static_cast<std::byte*>(data);
  size_t done = 0;
  while (done < size) {
    const ssize_t n = ::pread(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error_number = errno;
      return ErrnoError(fmt::format("reading bytes {}..{} of", offset + done, offset + size), path, error_number);
    }
    if (n == 0) break;  // the end of the file
    done += static_cast<size_t>(n);
    if (direct && (offset + done) % kIoAlignmentBytes != 0) break;
  }
  return done;
}

}  // namespace strata
