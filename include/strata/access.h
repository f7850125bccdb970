// Access handles: a chunk (or one tensor inside it) pinned on a tier for as
// long as the handle lives. While any handle to a chunk exists the chunk is
// in state compute: it is neither moved nor evicted. Destroying the handle,
// or calling Release(), unpins it. Handles are move-only and must not
// outlive the engine that issued them. A handle is used by one thread at a
// time; handles to one chunk may live in different threads.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <utility>

#include "strata/types.h"

namespace strata {

class Event;

// Implemented by whoever issues handles (the residency manager).
class AccessOwner {
 public:
  // `fence`: null, or the framework's last use of the chunk (ReleaseAfter).
  virtual void ReleaseAccess(ChunkId id, std::shared_ptr<Event> fence) = 0;

 protected:
  ~AccessOwner() = default;
};

class ChunkAccess {
 public:
  ChunkAccess() = default;
  // For AccessOwner implementations: the chunk is already pinned.
  ChunkAccess(AccessOwner* owner, ChunkId id, Tier tier, std::byte* data, uint64_t size_bytes,
              uint64_t generation = 0)
      : owner_(owner), id_(id), tier_(tier), data_(data), size_bytes_(size_bytes), generation_(generation) {}
  ChunkAccess(ChunkAccess&& other) noexcept { *this = std::move(other); }
  ChunkAccess& operator=(ChunkAccess&& other) noexcept {
    if (this != &other) {
      Release();
      owner_ = std::exchange(other.owner_, nullptr);
      id_ = other.id_;
      tier_ = other.tier_;
      data_ = std::exchange(other.data_, nullptr);
      size_bytes_ = std::exchange(other.size_bytes_, 0);
      generation_ = other.generation_;
    }
    return *this;
  }
  ChunkAccess(const ChunkAccess&) = delete;
  ChunkAccess& operator=(const ChunkAccess&) = delete;
  ~ChunkAccess() { Release(); }

  // Address of the chunk on its tier: a device pointer on the device tier
  // (dereferenceable by the host only on the emulated device).
  std::byte* data() const { return data_; }
  uint64_t size_bytes() const { return size_bytes_; }
  Tier tier() const { return tier_; }
  ChunkId id() const { return id_; }
  // Which placement of the chunk this pin was given: its owner gives the
  // chunk a new value whenever it moves, drops, materializes or overwrites
  // the chunk's bytes (writes through handles are not counted). Two pins
  // with the same value were given the same slot, with nothing between.
  uint64_t generation() const { return generation_; }
  bool valid() const { return owner_ != nullptr; }
  void Release() { ReleaseAfter(nullptr); }
  // Release(), for a framework that queues its work on a stream and has not
  // finished with the chunk when it lets it go: `fence` (Device::RecordFence
  // on that stream) completes when it has. Until then strata neither moves,
  // drops, reads nor overwrites the chunk's device bytes; whoever must waits
  // for the fence, and nobody waits when nothing needs the chunk's slot.
  void ReleaseAfter(std::shared_ptr<Event> fence) {
    if (owner_ != nullptr) std::exchange(owner_, nullptr)->ReleaseAccess(id_, std::move(fence));
    data_ = nullptr;
  }

 private:
  AccessOwner* owner_ = nullptr;
  ChunkId id_;
  Tier tier_ = Tier::kDevice;
  std::byte* data_ = nullptr;
  uint64_t size_bytes_ = 0;
  uint64_t generation_ = 0;
};

// A chunk's bytes in host memory as they lay when looked at, neither pinned
// nor marked (Engine::PeekHostChunk): they are the chunk's for as long as its
// generation (Engine::ChunkGeneration) is still `generation`, since whatever
// gives its slot up (a move, a drop, a compaction) gives it a new one first.
struct HostBytes {
  const std::byte* data = nullptr;
  uint64_t generation = 0;
};

// One tensor's copy of one kind (param, grad, master, ...), pinned.
class TensorAccess {
 public:
  TensorAccess() = default;
  TensorAccess(ChunkAccess chunk, uint64_t offset_bytes, uint64_t size_bytes, DType dtype)
      : chunk_(std::move(chunk)), offset_bytes_(offset_bytes), size_bytes_(size_bytes), dtype_(dtype) {}

  void* data() const { return chunk_.data() + offset_bytes_; }
  uint64_t size_bytes() const { return size_bytes_; }
  uint64_t num_elements() const { return size_bytes_ / DTypeSizeBytes(dtype_); }
  DType dtype() const { return dtype_; }
  Tier tier() const { return chunk_.tier(); }
  ChunkId chunk_id() const { return chunk_.id(); }
  bool valid() const { return chunk_.valid(); }
  void Release() { chunk_.Release(); }

 private:
  ChunkAccess chunk_;
  uint64_t offset_bytes_ = 0;
  uint64_t size_bytes_ = 0;
  DType dtype_ = DType::kFloat32;
};

}  // namespace strata
