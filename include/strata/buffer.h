// Buffer: one owned region of memory (device, pinned host or plain host) that
// is released by the deleter given at construction when the Buffer dies.
// Move-only. Not thread-safe; the memory itself is used by whoever holds it.
#pragma once

#include <cstddef>
#include <functional>
#include <utility>

namespace strata {

class Buffer {
 public:
  using Deleter = std::function<void(void* data, size_t size_bytes)>;

  Buffer() = default;
  Buffer(void* data, size_t size_bytes, Deleter deleter)
      : data_(data), size_bytes_(size_bytes), deleter_(std::move(deleter)) {}
  Buffer(Buffer&& other) noexcept { *this = std::move(other); }
  Buffer& operator=(Buffer&& other) noexcept {
    if (this != &other) {
      Reset();
      data_ = std::exchange(other.data_, nullptr);
      size_bytes_ = std::exchange(other.size_bytes_, 0);
      deleter_ = std::move(other.deleter_);
      other.deleter_ = nullptr;
    }
    return *this;
  }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  ~Buffer() { Reset(); }

  void* data() const { return data_; }
  std::byte* bytes() const { return static_cast<std::byte*>(data_); }
  size_t size_bytes() const { return size_bytes_; }
  explicit operator bool() const { return data_ != nullptr; }

  void Reset() {
    if (data_ != nullptr && deleter_) deleter_(data_, size_bytes_);
    data_ = nullptr;
    size_bytes_ = 0;
    deleter_ = nullptr;
  }

 private:
  void* data_ = nullptr;
  size_t size_bytes_ = 0;
  Deleter deleter_;
};

// Host memory aligned to `alignment_bytes` (a power of two, >= sizeof(void*)),
// bound to `numa_node` when the machine has more than one node and the node is
// >= 0. Allocations of 2 MiB or more are 2 MiB-aligned and backed by
// transparent huge pages where the kernel allows (fewer scatter-gather
// segments per direct I/O request; see src/base/buffer.cc), unless turned off.
// Returns an empty Buffer when the allocation fails.
Buffer AllocateAlignedHost(size_t size_bytes, size_t alignment_bytes, int numa_node = -1);

// Host memory for a long-lived region (a tier's arena): page-aligned (2 MiB
// and advised huge pages as above from 2 MiB on), bound to `numa_node` as
// above. Its pages are committed as they are first written and all given
// back to the kernel when the Buffer dies (Note [Reserved regions] in
// src/base/buffer.cc). Returns an empty Buffer when the mapping fails.
Buffer ReserveHostRegion(size_t size_bytes, int numa_node = -1);

// Process-wide switch for the huge-page backing above (option
// host.huge_pages, default on). Thread-safe.
void SetHugePagesEnabled(bool enabled);
bool HugePagesEnabled();

}  // namespace strata
