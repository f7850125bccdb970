// Residency: where every chunk's bytes are, and moving them.
//
// Every chunk has a home tier and a current tier, and is in one of four
// states: free (no payload yet: reads as zeros), hold (resident, not in use),
// compute (pinned by ChunkAccess handles) or in flight (being moved; everyone
// else waits). A payload lives on one tier at a time, so a failed move
// leaves the chunk where it was, intact. A tier without room evicts chunks
// in hold one tier down (Note [Eviction] in residency.cc); when nothing can
// be evicted the result is OutOfMemory naming the tier, the request, what is
// in use and the capacity. Each step of a move is bounded by wait_timeout_ms.
// Handles must not outlive the manager (checked at destruction).
//
// Thread-safety: every method may be called from any thread. One mutex
// guards the chunk table; it is never held while bytes move. Asynchronous
// moves run on `transfer_workers` threads owned by the manager.
#pragma once

#include <array>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <vector>

#include "memory/chunk_layout.h"
#include "memory/tier_pool.h"
#include "src/base/task_queue.h"
#include "strata/access.h"
#include "strata/device.h"
#include "strata/stats.h"
#include "strata/status.h"

namespace strata::memory {

enum class ChunkState : uint8_t { kFree, kHold, kCompute, kInFlight };
std::string_view ChunkStateName(ChunkState state);

struct ResidencyConfig {
  Device* device = nullptr;              // required
  MemoryTierPool* device_pool = nullptr;  // required
  MemoryTierPool* host_pool = nullptr;    // required
  NvmeTierPool* nvme_pool = nullptr;      // optional: no NVMe tier when null
  uint32_t transfer_workers = 2;
  uint32_t wait_timeout_ms = 60'000;  // any single wait: a copy, an I/O, a chunk in flight
};

class ResidencyManager final : public AccessOwner {
 public:
  // The pools and the device must outlive the manager.
  ResidencyManager(const ResidencyConfig& config, const std::vector<ChunkDesc>& chunks);
  ~ResidencyManager();
  ResidencyManager(const ResidencyManager&) = delete;
  ResidencyManager& operator=(const ResidencyManager&) = delete;

  // Makes `id` resident on `tier` (device or host) and pins it there.
  // Accessing a chunk that is pinned on another tier is InvalidArgument.
  Result<ChunkAccess> Access(ChunkId id, Tier tier);
  // A transient chunk resident on `tier` in hold (not in flight, not
  // pinned): `fill` writes its bytes (at their address on `tier`) while the
  // chunk is marked in flight, so that an access, a move or an eviction
  // waits for the fill. Returns the chunk's new generation
  // (ChunkAccess::generation), or nullopt when the chunk was not there so
  // (nothing ran, nothing moved, no room taken); `fill`'s error otherwise.
  // After a fill that timed out the chunk is free and its slot never handed
  // out again. InvalidArgument for a chunk that is not transient.
  Result<std::optional<uint64_t>> FillIfOn(ChunkId id, Tier tier, const std::function<Status(std::byte*)>& fill);
  // The chunk pinned where it lies, if that is `tier` (device or host) and
  // it is not in flight; nothing moves (no placement against pins, no room
  // made). nullopt otherwise.
  std::optional<ChunkAccess> PinIfOn(ChunkId id, Tier tier);

  // Moves a chunk that is not pinned to `tier` (a free chunk is materialized
  // there as zeros). Synchronous, and on a transfer worker.
  Status Move(ChunkId id, Tier tier);
  // Move(), only if the chunk is on `from` when the move would begin (checked
  // under the lock, so nothing moves it between the check and the move);
  // otherwise nothing happens.
  Status MoveIfOn(ChunkId id, Tier from, Tier to);
  std::shared_future<Status> MoveAsync(ChunkId id, Tier tier);

  // Copies a chunk's bytes, wherever they are, into host memory at `dst`
  // (chunk_size_bytes, 4096-aligned) without moving it: zeros for a free
  // chunk. A pinned chunk is read as it is; whoever holds it must not be
  // writing it.
  Status ReadChunk(ChunkId id, std::byte* dst);
  // The chunk's bytes where they lie in host memory, unpinned (HostBytes),
  // or nullopt when it is elsewhere or in flight. They stay valid while
  // Generation is unchanged.
  std::optional<HostBytes> PeekHost(ChunkId id);
  // ChunkAccess::generation of the chunk's placement now.
  uint64_t Generation(ChunkId id);
  // Overwrites a chunk's bytes (chunk_size_bytes from `src`, 4096-aligned
  // host memory) where they are, without reading them first: on the host a
  // copy, on the device a copy through a staging buffer, on NVMe a write to
  // a fresh slot that replaces the old one once written (in place when the
  // tier has no room for both: a failed write then leaves the slot failing
  // its CRC). A free chunk homed on NVMe is written there; another free
  // chunk is materialized at home first. A pinned chunk is written where it
  // is pinned; whoever holds it sees the new bytes.
  Status WriteChunk(ChunkId id, const std::byte* src);

  // Moves every chunk that is not pinned and not free to its home tier:
  // first the ones going down, so that the ones coming up find room.
  Status MoveAllHome();
  void SetHome(ChunkId id, Tier tier);
  Tier home(ChunkId id) const;

  uint64_t chunk_size_bytes(ChunkId id) const { return chunks_.at(id.value()).size_bytes; }
  ChunkState state(ChunkId id) const;
  std::optional<Tier> tier(ChunkId id) const;  // nullopt when free
  bool has_tier(Tier tier) const;
  MemoryStats stats() const;
  // `fence` (ChunkAccess::ReleaseAfter): see Note [Fences] in residency.cc.
  void ReleaseAccess(ChunkId id, std::shared_ptr<Event> fence) override;
  size_t num_chunks() const { return chunks_.size(); }

 private:
  struct Chunk {
    uint64_t size_bytes = 0;
    Tier home = Tier::kHost;
    std::optional<Tier> tier;  // nullopt: free
    Extent extent;
    uint32_t refs = 0;
    bool in_flight = false;  // being moved or read: nobody else touches it
    std::optional<Tier> arriving;  // in flight with a slot reserved on this tier, bytes on the way
    uint64_t last_use = 0;  // LRU clock value of the last access
    bool transient = false;
    uint64_t generation = 0;  // ChunkAccess::generation: bumped by every new slot or overwrite
    // The framework's uses of its device bytes not yet seen complete: one
    // fence per release, the completed ones dropped (Note [Fences]).
    std::vector<std::shared_ptr<Event>> fences;
  };
  using Lock = std::unique_lock<std::mutex>;

  TierPool* pool(Tier tier) const;
  // Whether a move of `chunk` to `to` drops it rather than copying it (a
  // transient chunk going down: Note [Eviction]).
  static bool DroppedBy(const Chunk& chunk, Tier to) { return chunk.transient && chunk.tier && to > *chunk.tier; }
  std::optional<Tier> TierBelow(Tier tier) const;
  Status WaitNotInFlight(Lock& lock, ChunkId id);
  // Waits for `chunk`'s fences not yet complete, with the lock
  // let go (the chunk is marked in flight by the caller: nobody else touches
  // it meanwhile). Note [Fences].
  Status AwaitFence(Lock& lock, Chunk& chunk);
  // Move(), but a chunk pinned meanwhile is skipped rather than an error.
  Status MoveUnlessPinned(ChunkId id, Tier tier, bool skip_pinned, std::optional<Tier> only_from = std::nullopt);
  // Moves chunk `id`, already marked in flight by the caller, to `to`; clears the mark.
  // `chain`: the chunks whose moves are waiting, in this thread, for this one
  // (see Note [Waiting for room] in residency.cc). `dst`: a slot on `to` the
  // caller allocated, of the chunk's slot size, into which the chunk is
  // copied (never dropped); afterwards it is the chunk's, or freed, or
  // quarantined after a copy that timed out.
  Status MoveFlagged(Lock& lock, ChunkId id, Tier to, std::vector<ChunkId>& chain,
                     std::optional<Extent> dst = std::nullopt);
  // A slot on `tier`, evicting chunks in hold there (LRU) as needed.
  Result<Extent> Reserve(Lock& lock, Tier tier, uint64_t size_bytes, std::vector<ChunkId>& chain);
  // Evicts chunk `victim`, in hold on `tier`, one tier down (or two, where
  // the tier below has no slot for it).
  Status Evict(Lock& lock, Tier tier, uint32_t victim, std::vector<ChunkId>& chain);
  // A slot on a memory tier whose free bytes suffice but are in pieces, made
  // by moving chunks in hold within the tier (Note [Compaction]); nullopt
  // when no such move makes one.
  Result<std::optional<Extent>> Compact(Lock& lock, Tier tier, uint64_t size_bytes);
  // Moves chunk `id`, in hold at `expected_offset` on `tier`, to `dst` (a
  // slot the caller allocated, of the chunk's slot size) or else to a free
  // slot of the tier; returns the slot it left, or nullopt when the chunk is
  // no longer there so or the tier has no slot for it (nothing moved; `dst`
  // is still the caller's).
  Result<std::optional<Extent>> MoveWithinTier(Lock& lock, Tier tier, uint32_t id, uint64_t expected_offset,
                                               std::optional<Extent> dst = std::nullopt);
  // Before chunk `id`, in hold on memory tier `tier`, is pinned there: where
  // it lies it would split the room left (Note [Pins against pins]), moves it
  // against a pinned chunk or an end of the tier where it keeps the room:
  // into free room there, or else, with `make_room`, into room made there by
  // moving or evicting chunks in hold. Where chunks in flight (arriving or
  // leaving) stand in every such place, waits for one of them to land
  // instead, counting in `waits` (Note [Waiting for a place]). kHere: pin it
  // where it lies; else the lock was let go meanwhile and the caller looks
  // at the chunk again (kMoved: room was made or it moved).
  enum class PinPlace { kHere, kMoved, kWaited };
  Result<PinPlace> PlaceAgainstPins(Lock& lock, Tier tier, uint32_t id, bool make_room, int& waits);
  // Waits for one of `moving` (chunks in flight on a tier) to land, unless
  // `waits` reached its bound: kWaited, or kHere.
  Result<PinPlace> WaitForAMove(Lock& lock, const std::vector<uint32_t>& moving, int& waits);
  // A free slot of `size_bytes` on memory tier `tier` against a pinned chunk
  // or an end of the tier where a chunk pinned keeps the room, allocated, or
  // nullopt when free room there holds none.
  std::optional<Extent> AllocateAgainstPins(Tier tier, uint64_t size_bytes);
  // Clears `window`, a slot of `tier` against the pins, of chunks in hold and
  // moves chunk `id` there; leaves things as they are where that cannot be
  // done. Returns the chunk that stopped it by being taken meanwhile (moved,
  // pinned or moving: another access's, while the lock was let go), to be
  // waited for; nullopt where it is done or nothing holds a chunk there.
  Result<std::optional<uint32_t>> MakeRoomAgainstPins(Lock& lock, Tier tier, uint32_t id, Extent window);
  // Moves chunk `id`, in hold on `tier` at `offset`, out of it: to a free
  // slot of the tier, else, with `keep`, to the tier below (copied, never
  // dropped), or else evicted. False when it did not move (it is no longer
  // there so, or nothing holds it).
  Result<bool> MoveOutOfPlace(Lock& lock, Tier tier, uint32_t id, uint64_t offset, bool keep);
  // Chunk `id` when it is no longer in hold on `tier` at `offset` (another
  // access took it while the lock was let go); nullopt where it still is.
  std::optional<uint32_t> TakenMeanwhile(Tier tier, uint32_t id, uint64_t offset) const;
  // Moves chunk `id`, in hold on `tier` or the tier below, into `dst`, a
  // slot of `tier` the caller allocated, of its slot size.
  Status MoveIntoPlace(Lock& lock, Tier tier, uint32_t id, Extent dst);
  // Moves chunk `id`, in hold on the host, to `window`, which its own slot
  // overlaps and whose rest the caller holds allocated for it (copies
  // within host memory may overlap); frees what its slot leaves.
  void SlideWithinHost(Lock& lock, uint32_t id, Extent window);
  // Whether chunk `id` is in hold on `tier` (not pinned, in flight or
  // arriving), at `offset` if given.
  bool InHoldAt(Tier tier, uint32_t id, std::optional<uint64_t> offset = std::nullopt) const;
  // The bytes of the unpinned piece pins on memory tier `tier` keep whole
  // (Note [Pins against pins]): the largest chunk's slot, or the capacity
  // (all the room left) on a tight tier of chunks of several sizes.
  uint64_t RoomToKeep(Tier tier) const;
  // The slots of the chunks pinned on `tier`.
  std::vector<Extent> PinnedExtents(Tier tier) const;
  // The OutOfMemory error of a tier whose every chunk is in use or moving,
  // with what the chunks in use hold.
  Status NoRoomError(Tier tier, uint64_t size_bytes) const;
  // Copies bytes between slots; runs without the lock.
  Status Transfer(std::optional<Tier> from, Extent src, Tier to, Extent dst, uint64_t size_bytes);
  std::byte* Address(Tier tier, Extent extent) const;
  Result<Buffer> AcquireStaging();
  // Returns a bounce buffer to the pool; after a Timeout the late copy may
  // still write into it, so it is quarantined instead (freed at teardown).
  void ReleaseStaging(Buffer buffer, const Status& status);

  ResidencyConfig config_;
  uint64_t max_chunk_bytes_ = 0;
  uint64_t min_chunk_bytes_ = 0;

  mutable std::mutex mu_;         // guards everything below up to the workers
  std::condition_variable moved_;  // signalled whenever a chunk leaves the in-flight state
  std::vector<Chunk> chunks_;
  uint64_t clock_ = 0;
  MemoryStats stats_;

  std::mutex staging_mu_;  // guards staging_free_ and staging_count_
  std::condition_variable staging_cv_;
  std::vector<Buffer> staging_free_;  // pinned bounce buffers for device<->NVMe moves
  std::vector<Buffer> staging_quarantined_;  // written by a copy that timed out
  uint32_t staging_count_ = 0;

  std::unique_ptr<TaskQueue> workers_;  // asynchronous moves
};

}  // namespace strata::memory
