// MemoryStorage: host memory standing in for a drive, for tests of the layers
// above the storage seam. Same contract as the io_uring backend (alignment,
// bounds, a fresh "drive" reads as zeros), no files, no timeouts (a memcpy
// cannot hang).
//
// Thread-safety: Read and Write take no lock. Calls on disjoint ranges are
// independent; calls on overlapping ranges race, as they would on a drive,
// and a race detector reports them: that is a bug in the caller.

#include <cstring>

#include "src/backends/storage/storage_util.h"
#include "strata/buffer.h"
#include "strata/storage.h"

namespace strata {
namespace {

class MemoryStorage final : public Storage {
 public:
  MemoryStorage(Buffer memory, size_t capacity_bytes, size_t alignment_bytes)
      : memory_(std::move(memory)), capacity_bytes_(capacity_bytes), alignment_bytes_(alignment_bytes) {}

  std::string Describe() const override {
    return fmt::format("host memory, {} bytes, alignment {} bytes", capacity_bytes_, alignment_bytes_);
  }
  size_t capacity_bytes() const override { return capacity_bytes_; }
  size_t alignment_bytes() const override { return alignment_bytes_; }

  Status Write(uint64_t offset, const std::byte* src, size_t size_bytes) override {
    STRATA_RETURN_IF_ERROR(storage::CheckStorageRange(*this, offset, src, size_bytes));
    if (size_bytes > 0) std::memcpy(memory_.bytes() + offset, src, size_bytes);
    return Status::Ok();
  }
  Status Read(uint64_t offset, std::byte* dst, size_t size_bytes) override {
    STRATA_RETURN_IF_ERROR(storage::CheckStorageRange(*this, offset, dst, size_bytes));
    if (size_bytes > 0) std::memcpy(dst, memory_.bytes() + offset, size_bytes);
    return Status::Ok();
  }

 private:
  const Buffer memory_;  // capacity_bytes_ bytes; the pointer never changes, the bytes do
  const size_t capacity_bytes_;
  const size_t alignment_bytes_;
};

}  // namespace

Result<std::unique_ptr<Storage>> CreateMemoryStorage(size_t capacity_bytes, size_t alignment_bytes) {
  if (capacity_bytes == 0) return InvalidArgument("memory storage capacity is 0 bytes: must be > 0");
  bool power_of_two = alignment_bytes != 0 && (alignment_bytes & (alignment_bytes - 1)) == 0;
  if (!power_of_two || alignment_bytes < sizeof(void*)) {
    return InvalidArgument("memory storage alignment is {} bytes: must be a power of two >= {}", alignment_bytes,
                           sizeof(void*));
  }
  Buffer memory = AllocateAlignedHost(capacity_bytes, alignment_bytes);
  if (!memory) {
    return OutOfMemory("memory storage: cannot allocate {} bytes of host memory (alignment {} bytes)", capacity_bytes,
                       alignment_bytes);
  }
  // A fresh drive (a freshly fallocated file) reads as zeros; so does this one.
  std::memset(memory.data(), 0, capacity_bytes);
  return std::unique_ptr<Storage>(std::make_unique<MemoryStorage>(std::move(memory), capacity_bytes, alignment_bytes));
}

}  // namespace strata
