// Helpers shared by the storage backends (src/storage/*.cc) and their tests;
// not part of the public API. Pure functions, thread-safe.
//
// CheckStorageRange enforces the contract of strata/storage.h in one place so
// that every backend (io_uring, memory, the fault injector) rejects the same
// calls with the same messages.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "src/base/posix_file.h"
#include "strata/file_system.h"
#include "strata/status.h"
#include "strata/storage.h"

namespace strata::storage {

// InvalidArgument unless offset, size and buffer address are multiples of
// storage.alignment_bytes() and [offset, offset + size) lies inside
// storage.capacity_bytes(). A zero-size range is valid (and transfers nothing).
inline Status CheckStorageRange(const Storage& storage, uint64_t offset, const void* buffer, size_t size_bytes) {
  const size_t alignment = storage.alignment_bytes();
  const size_t capacity = storage.capacity_bytes();
  if (offset % alignment != 0) {
    return InvalidArgument("storage offset {} is not a multiple of the alignment, {} bytes", offset, alignment);
  }
  if (size_bytes % alignment != 0) {
    return InvalidArgument("storage transfer size {} bytes is not a multiple of the alignment, {} bytes", size_bytes,
                           alignment);
  }
  if (buffer == nullptr && size_bytes > 0) {
    return InvalidArgument("storage transfer of {} bytes at offset {} has a null buffer", size_bytes, offset);
  }
  if (reinterpret_cast<uintptr_t>(buffer) % alignment != 0) {
    return InvalidArgument("storage buffer address {} is not a multiple of the alignment, {} bytes", buffer, alignment);
  }
  // Written so that offset + size cannot overflow.
  if (offset > capacity || size_bytes > capacity - offset) {
    return InvalidArgument("storage range at offset {} of {} bytes runs past the capacity of {} bytes", offset,
                           size_bytes, capacity);
  }
  return Status::Ok();
}

// The seam through which tests reach the one thing of the io_uring backend's
// setup they cannot make happen on this machine: a filesystem that refuses
// O_DIRECT (tmpfs accepts it since Linux 6.6). Same contract as ::open(2):
// a descriptor, or -1 with errno set.
using OpenFileFn = std::function<int(const char* path, int flags, mode_t mode)>;

// CreateUringStorage with `open_file` in place of ::open. Defined in
// uring_storage.cc.
Result<std::unique_ptr<Storage>> CreateUringStorageWithOpen(const UringStorageOptions& options, OpenFileFn open_file,
                                                            FileSystem& free_space = PosixFileSystem());

}  // namespace strata::storage
