// The one conversion from a failed liburing or system call of the io_uring
// backend to a Status: IoError naming the call, the path, the offset, errno
// and file:line. Private to src/backends/storage/.
#pragma once

#include <cstdint>
#include <string_view>

#include "src/backends/storage/storage_util.h"
#include "strata/status.h"

namespace strata::storage::uring {

inline std::string_view Basename(std::string_view file) {
  size_t slash = file.rfind('/');
  return slash == std::string_view::npos ? file : file.substr(slash + 1);
}

inline Status CallError(std::string_view call, int error_number, std::string_view path, uint64_t offset,
                        const char* file, int line) {
  return IoError("{} failed on {} at offset {}: {} (errno {}) [{}:{}]", call, path, offset, ErrnoText(error_number),
                 error_number, Basename(file), line);
}

}  // namespace strata::storage::uring

// liburing convention: `call` returns a negative errno on failure.
#define STRATA_URING_CHECK(call, path, offset)                                                              \
  do {                                                                                                      \
    int strata_uring_rc_ = (call);                                                                          \
    if (strata_uring_rc_ < 0) {                                                                             \
      return ::strata::storage::uring::CallError(#call, -strata_uring_rc_, (path), (offset), __FILE__,      \
                                                 __LINE__);                                                 \
    }                                                                                                       \
  } while (0)

// libc convention: `call` returns -1 and sets errno on failure.
#define STRATA_SYSCALL_CHECK(call, path, offset)                                                            \
  do {                                                                                                      \
    if ((call) == -1) {                                                                                     \
      return ::strata::storage::uring::CallError(#call, errno, (path), (offset), __FILE__, __LINE__);       \
    }                                                                                                       \
  } while (0)
