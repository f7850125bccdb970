// POSIX file helpers shared by the storage backends and the file system
// seam: one owner of a descriptor, one errno-to-Status conversion, and the
// loops around pread/pwrite that finish a transfer. Thread-safe (the
// helpers hold no state; a UniqueFd is used by one owner).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "strata/status.h"

namespace strata {

// Owns one file descriptor, closed when it goes.
class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  UniqueFd(UniqueFd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) {
      Reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;
  ~UniqueFd() { Reset(); }

  int get() const { return fd_; }
  explicit operator bool() const { return fd_ >= 0; }
  // Closes the descriptor, dropping any error.
  void Reset();
  // Closes the descriptor: IoError naming `path` when close(2) fails.
  Status Close(std::string_view path);

 private:
  int fd_ = -1;
};

// "No space left on device": strerror without its thread-safety problem
// (strerrordesc_np returns a constant string and never writes a shared buffer).
std::string ErrnoText(int error_number);

// IoError "<what> <path>: <errno text> (errno N)", of `error_number`
// (errno as it is now where left out).
Status ErrnoError(std::string_view what, std::string_view path, int error_number);
Status ErrnoError(std::string_view what, std::string_view path);

// Writes all of [data, data + size) at `offset` (pwrite, again after a short
// write or EINTR); IoError naming `path` and the byte it stopped at.
Status WriteAt(int fd, const void* data, size_t size, uint64_t offset, std::string_view path);

// Reads up to `size` bytes at `offset` (pread, again after a short read or
// EINTR): the bytes read, fewer only where the file ends. With `direct`
// (O_DIRECT) it stops at a read that ends off the alignment, which only the
// end of the file gives: another direct read from there may be EINVAL.
Result<size_t> ReadAt(int fd, void* data, size_t size, uint64_t offset, std::string_view path, bool direct = false);

}  // namespace strata
