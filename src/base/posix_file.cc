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

namespace {

// Note [Finishing a transfer]
// pread and pwrite may move fewer bytes than asked (a signal, a pipe, the
// end of a file) or fail with EINTR; neither means the transfer is over. One
// loop, shared by reads and writes, calls `step(done)` -- one pread or pwrite
// of the bytes from `done` on -- again until `size` bytes have moved. It stops
// early at a call that moves nothing (the end of a file being read; for a
// write, a fault WriteAt reports) and, with `direct`, at a transfer that ends
// off the O_DIRECT alignment, which only the end of a file gives. The bytes
// moved, or IoError "<verb> bytes <from>..<to> of <path>: <errno text>".
template <typename Step>
Result<size_t> TransferAll(std::string_view verb, size_t size, uint64_t offset, std::string_view path, bool direct,
                           Step step) {
  size_t done = 0;
  while (done < size) {
    const ssize_t n = step(done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int error_number = errno;
      return ErrnoError(fmt::format("{} bytes {}..{} of", verb, offset + done, offset + size), path, error_number);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
    if (direct && (offset + done) % kIoAlignmentBytes != 0) break;
  }
  return done;
}

}  // namespace

// See Note [Finishing a transfer].
Status WriteAt(int fd, const void* data, size_t size, uint64_t offset, std::string_view path) {
  const auto* bytes = static_cast<const std::byte*>(data);
  const auto write = [&](size_t done) {
    return ::pwrite(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
  };
  STRATA_ASSIGN_OR_RETURN(const size_t written, TransferAll("writing", size, offset, path, /*direct=*/false, write));
  if (written < size) return IoError("writing {} stopped at byte {}", path, offset + written);
  return Status::Ok();
}

// See Note [Finishing a transfer].
Result<size_t> ReadAt(int fd, void* data, size_t size, uint64_t offset, std::string_view path, bool direct) {
  auto* bytes = static_cast<std::byte*>(data);
  const auto read = [&](size_t done) {
    return ::pread(fd, bytes + done, size - done, static_cast<off_t>(offset + done));
  };
  return TransferAll("reading", size, offset, path, direct, read);
}

}  // namespace strata
