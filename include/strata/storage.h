// The storage backend seam: aligned reads and writes on a linear byte space
// that stands for the NVMe tier. The space is striped over one file per
// configured directory (one directory per drive), so N drives add their
// bandwidth even to a single chunk's transfer.
//
// Implementations: io_uring with O_DIRECT (src/storage/uring_storage.cc), and
// FaultInjectingStorage, a wrapper that makes every failure a test needs
// happen (EIO, ENOSPC, short reads, flipped bytes, delays).
//
// Contract: offsets, sizes and buffer addresses are multiples of
// alignment_bytes(); [offset, offset + size) lies inside capacity_bytes().
// A violation is InvalidArgument. Failures are IoError naming the path, the
// file offset and errno; a request that does not complete in the configured
// time is Timeout. Thread-safety: Read and Write may be called from several
// threads at once.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "strata/file_system.h"
#include "strata/status.h"

namespace strata {

// One piece of a batch: `size_bytes` at `offset`, from or into `buffer`.
struct IoSegment {
  uint64_t offset = 0;
  std::byte* buffer = nullptr;  // only read from by WriteBatch
  size_t size_bytes = 0;
};

class Storage {
 public:
  virtual ~Storage() = default;
  virtual std::string Describe() const = 0;
  virtual size_t capacity_bytes() const = 0;
  virtual size_t alignment_bytes() const = 0;
  // Blocks until the whole range is written (or read) or an error occurs.
  virtual Status Write(uint64_t offset, const std::byte* src, size_t size_bytes) = 0;
  virtual Status Read(uint64_t offset, std::byte* dst, size_t size_bytes) = 0;
  // A hint: I/O from or into [data, data + size_bytes) is frequent (the host
  // arena, bounce buffers), so the backend may register it with the kernel
  // (io_uring fixed buffers). Where that is refused (the memlock limit), the
  // backend logs it once and goes on with plain buffers. The range must stay
  // allocated for the storage's lifetime. The default does nothing.
  virtual Status RegisterBuffer(void* /*data*/, size_t /*size_bytes*/) { return Status::Ok(); }
  // Many segments in one call, with as many requests in flight as the
  // backend allows across all of them (random offsets at full queue depth).
  // Returns the first error; segments may complete in any order. The default
  // runs them one after another.
  virtual Status WriteBatch(std::span<const IoSegment> segments);
  virtual Status ReadBatch(std::span<const IoSegment> segments);
};

struct UringStorageOptions {
  bool sqpoll = false;                        // a kernel thread polls the submission queue (IORING_SETUP_SQPOLL)
  std::vector<std::string> dirs;              // one backing file per directory
  size_t capacity_bytes = size_t{1} << 30;    // all directories together
  size_t block_size_bytes = size_t{1} << 20;  // size of one I/O request; also the stripe unit
  uint32_t queue_depth = 32;                  // requests in flight per ring
  bool allow_buffered_io = false;             // if O_DIRECT is refused: buffered I/O with a warning
  uint32_t io_timeout_ms = 30'000;            // per Read/Write call
  std::string file_name = "strata.nvme";      // name of the backing file in each directory
};

// Creates (or reuses) and preallocates the backing files. Fails early:
// a directory that does not exist or is not writable (IoError), too little
// free space (OutOfMemory with needed and free bytes per directory, as
// `free_space` reports it), a filesystem that refuses O_DIRECT (NotSupported
// unless allow_buffered_io).
Result<std::unique_ptr<Storage>> CreateUringStorage(const UringStorageOptions& options,
                                                    FileSystem& free_space = PosixFileSystem());

// Wraps a Storage and injects failures on demand. Each Fail*/Corrupt*/Short*
// call arms the fault for the next `count` matching operations.
class FaultInjectingStorage final : public Storage {
 public:
  explicit FaultInjectingStorage(std::unique_ptr<Storage> base);
  ~FaultInjectingStorage() override;

  // After `after` more writes succeed, the next `count` writes fail with
  // IoError carrying `error_number` (e.g. EIO, ENOSPC) and leave the stored
  // bytes untouched. (after = N-1: the Nth request fails.)
  void FailWrites(int error_number, int count = 1, int after = 0);
  // The same for reads.
  void FailReads(int error_number, int count = 1, int after = 0);
  // The next `count` reads report success but fill only the first half of
  // the destination (a backend that lost a short read).
  void ShortReads(int count = 1);
  // The next `count` writes store the data with one byte flipped.
  void CorruptWrites(int count = 1);
  // The next `count` reads return the data with one byte flipped.
  void CorruptReads(int count = 1);
  // Every operation sleeps this long first.
  void SetDelayMs(uint32_t delay_ms);

  int reads() const;
  int writes() const;

  std::string Describe() const override;
  size_t capacity_bytes() const override;
  size_t alignment_bytes() const override;
  Status Write(uint64_t offset, const std::byte* src, size_t size_bytes) override;
  Status Read(uint64_t offset, std::byte* dst, size_t size_bytes) override;

 private:
  struct State;
  std::unique_ptr<Storage> base_;
  std::unique_ptr<State> state_;
};

// Plain host memory standing in for a drive: for tests of layers above the
// storage seam that need no files.
Result<std::unique_ptr<Storage>> CreateMemoryStorage(size_t capacity_bytes, size_t alignment_bytes = 4096);

}  // namespace strata
