// CapacityLedger: the bytes a device backend has handed out against its
// capacity. Shared (through a shared_ptr) by the device and the deleters of
// the Buffers it returned, so a Buffer freed after its device is still
// accounted safely. Thread-safe.
#pragma once

#include <cstddef>
#include <mutex>

#include "strata/status.h"

namespace strata {

class CapacityLedger {
 public:
  explicit CapacityLedger(size_t capacity_bytes) : capacity_bytes_(capacity_bytes) {}

  // Takes `size_bytes` if they fit; either way reports what was allocated
  // before.
  bool TryReserve(size_t size_bytes, size_t* allocated_before_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    *allocated_before_bytes = allocated_bytes_;
    if (size_bytes > capacity_bytes_ - allocated_bytes_) return false;
    allocated_bytes_ += size_bytes;
    return true;
  }

  void Release(size_t size_bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    STRATA_CHECK(size_bytes <= allocated_bytes_, "releasing {} bytes but only {} are allocated", size_bytes,
                 allocated_bytes_);
    allocated_bytes_ -= size_bytes;
  }

  size_t allocated_bytes() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return allocated_bytes_;
  }
  size_t capacity_bytes() const { return capacity_bytes_; }

 private:
  const size_t capacity_bytes_;
  mutable std::mutex mutex_;  // guards allocated_bytes_
  size_t allocated_bytes_ = 0;
};

}  // namespace strata
