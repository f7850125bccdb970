// Note [Eviction]
// A transient chunk (ChunkDesc::transient: a gathered param chunk) has no
// bytes worth keeping below the tier it is on: moved down, or evicted, it is
// dropped (free again) instead of copied. A move copies, then frees the
// source slot, so a failed move (an I/O error, a full disk) leaves the chunk
// where it was. A free chunk is materialized at home by its first Move.
//
// When a tier has no room, a chunk in hold on it is evicted one tier down
// (device -> host -> NVMe), cascading: the least recently used of those not
// at home there, else the least recently used of all. A victim the tier
// below cannot hold (every chunk there in use, or its free space in pieces
// too small) goes one tier further down. A memory tier whose free bytes
// suffice but are in pieces is compacted first (Note [Compaction]), and
// nothing is evicted.
//
// Note [Fences]
// A framework that queues its kernels on a stream (PyTorch on a GPU) lets a
// chunk go before the kernels that read or write it have run: it releases
// it after a fence (ChunkAccess::ReleaseAfter), an event recorded on its
// stream. The chunk is in hold at once, so the plan may evict it and its
// next access may pin it again, but its device bytes are neither moved,
// dropped, read nor overwritten by strata, and its slot not handed to
// another chunk, before the fence completes: whoever is about to do so
// (MoveFlagged, a move within the tier, ReadChunk, WriteChunk, FillIfOn)
// waits for it first, with the chunk marked in flight. Every slot a chunk
// leaves is left by one of those, so a slot freed is a slot the framework
// is done with. Nobody waits for a chunk nothing needs to move: with
// everything resident the host never waits for the device. A chunk keeps a
// fence per release until it is seen complete, so that releases after work
// on several streams are all waited for. A fence that fails or times out
// leaves the chunk where it is.
//
// Timeouts: each step of a move (a copy, an I/O, a wait for room or for a
// bounce buffer) is bounded by wait_timeout_ms; a caller waiting for a chunk
// in flight waits up to kMoveSteps times that. Copies and I/O run without
// the lock, with the chunk marked in flight.

#include "memory/residency.h"

#include <algorithm>
#include <chrono>
#include <cstring>

#include "src/base/alignment.h"
#include "src/base/logging.h"
#include "strata/options.h"

namespace strata::memory {
namespace {

using Clock = std::chrono::steady_clock;

// The most steps one move waits on in a row (room, a bounce buffer, a copy,
// an I/O): a chunk in flight is given that many step timeouts to land.
constexpr uint32_t kMoveSteps = 4;
// A pin waits so many times at most for chunks in flight to make way (Note [Waiting for a place]).
constexpr int kPlaceWaits = 16;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

std::string_view ChunkStateName(ChunkState state) {
  switch (state) {
    case ChunkState::kFree: return "free";
    case ChunkState::kHold: return "hold";
    case ChunkState::kCompute: return "compute";
    case ChunkState::kInFlight: return "in flight";
  }
  return "?";
}

// --- ResidencyManager --------------------------------------------------------

ResidencyManager::ResidencyManager(const ResidencyConfig& config, const std::vector<ChunkDesc>& chunks)
    : config_(config) {
  STRATA_CHECK(config.device != nullptr && config.device_pool != nullptr && config.host_pool != nullptr,
               "residency needs a device, a device pool and a host pool");
  chunks_.resize(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    STRATA_CHECK(chunks[i].id.value() == i, "chunk ids must be dense and in order");
    chunks_[i].size_bytes = chunks[i].size_bytes();
    chunks_[i].transient = chunks[i].transient;
    max_chunk_bytes_ = std::max(max_chunk_bytes_, chunks_[i].size_bytes);
    min_chunk_bytes_ = i == 0 ? chunks_[i].size_bytes : std::min(min_chunk_bytes_, chunks_[i].size_bytes);
  }
  stats_.tier_present = {true, true, config.nvme_pool != nullptr};
  workers_ = std::make_unique<TaskQueue>(std::max<uint32_t>(1, config.transfer_workers));
}

ResidencyManager::~ResidencyManager() {
  workers_.reset();  // runs the moves still queued, then joins
  // A copy that timed out may still be running into a slot or bounce buffer
  // freed below: let the device finish first.
  Status drained = config_.device->Synchronize(config_.wait_timeout_ms);
  if (!drained.ok()) STRATA_LOG_ERROR("residency teardown: the device did not drain: {}", drained.ToString());
  std::lock_guard lock(mu_);
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    Chunk& chunk = chunks_[i];
    STRATA_CHECK(chunk.refs == 0, "chunk {} is still accessed ({} handles) while its engine is destroyed: release "
                 "every ChunkAccess/TensorAccess first", i, chunk.refs);
    if (chunk.tier) pool(*chunk.tier)->Free(chunk.extent);
    chunk.tier.reset();
  }
}

TierPool* ResidencyManager::pool(Tier tier) const {
  switch (tier) {
    case Tier::kDevice: return config_.device_pool;
    case Tier::kHost: return config_.host_pool;
    case Tier::kNvme: return config_.nvme_pool;
  }
  return nullptr;
}

bool ResidencyManager::has_tier(Tier tier) const { return pool(tier) != nullptr; }

std::optional<Tier> ResidencyManager::TierBelow(Tier tier) const {
  if (tier == Tier::kDevice) return Tier::kHost;
  if (tier == Tier::kHost && config_.nvme_pool != nullptr) return Tier::kNvme;
  return std::nullopt;
}

std::byte* ResidencyManager::Address(Tier tier, Extent extent) const {
  STRATA_CHECK(tier != Tier::kNvme, "NVMe slots have no address");
  return static_cast<MemoryTierPool*>(pool(tier))->Address(extent);
}

ChunkState ResidencyManager::state(ChunkId id) const {
  std::lock_guard lock(mu_);
  const Chunk& chunk = chunks_.at(id.value());
  if (chunk.in_flight) return ChunkState::kInFlight;
  if (!chunk.tier) return ChunkState::kFree;
  return chunk.refs > 0 ? ChunkState::kCompute : ChunkState::kHold;
}

std::optional<Tier> ResidencyManager::tier(ChunkId id) const {
  std::lock_guard lock(mu_);
  return chunks_.at(id.value()).tier;
}

void ResidencyManager::SetHome(ChunkId id, Tier tier) {
  std::lock_guard lock(mu_);
  chunks_.at(id.value()).home = tier;
}

Tier ResidencyManager::home(ChunkId id) const {
  std::lock_guard lock(mu_);
  return chunks_.at(id.value()).home;
}

MemoryStats ResidencyManager::stats() const {
  std::lock_guard lock(mu_);
  MemoryStats stats = stats_;
  for (int t = 0; t < kNumTiers; ++t) {
    if (TierPool* p = pool(static_cast<Tier>(t))) stats.tiers[t] = p->usage();
  }
  return stats;
}

Status ResidencyManager::WaitNotInFlight(Lock& lock, ChunkId id) {
  Chunk& chunk = chunks_[id.value()];
  const uint64_t timeout_ms = uint64_t{kMoveSteps} * config_.wait_timeout_ms;
  bool settled = moved_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return !chunk.in_flight; });
  if (!settled) return Timeout("chunk {}: still in flight after {} ms (a stuck copy or drive?)", id.value(), timeout_ms);
  return Status::Ok();
}

// Note [Waiting for a place]
// A chunk in flight (arriving on the tier, or leaving it: a write-back the
// pipeline began) can be neither moved nor evicted, so where such chunks
// stand in every place against the pins, a chunk pinned at once would lie
// where it splits the room. It waits for a move to end instead (each move
// ends or times out, Note [Waiting for room]) and looks again, as it does
// when another access takes a chunk of the place it is making room in
// (Note [Pins against pins]; at once where that chunk has landed); a pin
// waits so at most kPlaceWaits times (or until a move outlasts its
// timeout), then is pinned where it lies.
Result<ResidencyManager::PinPlace> ResidencyManager::WaitForAMove(Lock& lock, const std::vector<uint32_t>& moving,
                                                                   int& waits) {
  if (moving.empty() || waits >= kPlaceWaits) return PinPlace::kHere;
  waits++;
  const uint64_t timeout_ms = uint64_t{kMoveSteps} * config_.wait_timeout_ms;
  const auto one_landed = [&] {
    return std::any_of(moving.begin(), moving.end(), [&](uint32_t i) {
      return !chunks_[i].in_flight && !chunks_[i].arriving;
    });
  };
  // A move that outlasts it is another access's to report: this pin goes on where the chunk lies.
  return moved_.wait_for(lock, std::chrono::milliseconds(timeout_ms), one_landed) ? PinPlace::kWaited
                                                                                  : PinPlace::kHere;
}

Result<ChunkAccess> ResidencyManager::Access(ChunkId id, Tier tier) {
  if (id.value() >= chunks_.size()) {
    return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), chunks_.size());
  }
  if (tier == Tier::kNvme) {
    return InvalidArgument("chunk {}: cannot be accessed on the nvme tier: access it on device or host", id.value());
  }
  Lock lock(mu_);
  Chunk& chunk = chunks_[id.value()];
  bool make_room = true;  // once per access (Note [Pins against pins])
  int waits = 0;          // for chunks in flight to make way (Note [Waiting for a place])
  for (;;) {
    STRATA_RETURN_IF_ERROR(WaitNotInFlight(lock, id));
    if (chunk.tier == tier) {
      if (chunk.refs == 0) {
        STRATA_ASSIGN_OR_RETURN(PinPlace placed, PlaceAgainstPins(lock, tier, id.value(), make_room, waits));
        if (placed != PinPlace::kHere) {
          if (placed == PinPlace::kMoved) make_room = false;
          continue;  // look again
        }
      }
      chunk.refs++;
      chunk.last_use = ++clock_;
      return ChunkAccess(this, id, tier, Address(tier, chunk.extent), chunk.size_bytes, chunk.generation);
    }
    if (chunk.refs > 0) {
      return InvalidArgument("chunk {}: in use on the {} tier; release its accesses before accessing it on {}",
                             id.value(), TierName(*chunk.tier), TierName(tier));
    }
    chunk.in_flight = true;
    std::vector<ChunkId> chain;
    const std::optional<Extent> dst =
        DroppedBy(chunk, tier) ? std::optional<Extent>() : AllocateAgainstPins(tier, chunk.size_bytes);
    STRATA_RETURN_IF_ERROR(MoveFlagged(lock, id, tier, chain, dst));
  }
}

Result<std::optional<uint64_t>> ResidencyManager::FillIfOn(ChunkId id, Tier tier,
                                                           const std::function<Status(std::byte*)>& fill) {
  if (id.value() >= chunks_.size()) {
    return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), chunks_.size());
  }
  Lock lock(mu_);
  Chunk& chunk = chunks_[id.value()];
  if (!chunk.transient) {
    return InvalidArgument("FillIfOn of chunk {}: only a transient chunk (a gathered param chunk) is filled so",
                           id.value());
  }
  if (chunk.in_flight || chunk.tier != tier || chunk.refs > 0) return std::optional<uint64_t>();
  chunk.in_flight = true;  // as ReadChunk: nobody moves, compacts or frees its slot meanwhile; they wait
  std::byte* address = Address(tier, chunk.extent);
  if (Status fenced = AwaitFence(lock, chunk); !fenced.ok()) {  // nothing written: the chunk stays as it is
    chunk.in_flight = false;
    moved_.notify_all();
    return fenced.WithContext(fmt::format("filling chunk {} on {}", id.value(), TierName(tier)));
  }
  lock.unlock();
  const Status status = fill(address);
  lock.lock();
  chunk.generation++;
  if (status.code() == StatusCode::kTimeout) {
    STRATA_LOG_ERROR("chunk {}: a fill timed out; its {} slot is quarantined and the chunk is free", id.value(),
                     TierName(tier));
    chunk.tier.reset();  // transient: nothing to keep; the slot stays allocated for good
  }
  chunk.in_flight = false;
  moved_.notify_all();
  if (!status.ok()) return status.WithContext(fmt::format("filling chunk {} on {}", id.value(), TierName(tier)));
  return std::optional<uint64_t>(chunk.generation);
}

std::optional<ChunkAccess> ResidencyManager::PinIfOn(ChunkId id, Tier tier) {
  std::lock_guard lock(mu_);
  Chunk& chunk = chunks_.at(id.value());
  if (tier == Tier::kNvme || chunk.in_flight || chunk.tier != tier) return std::nullopt;
  chunk.refs++;
  return ChunkAccess(this, id, tier, Address(tier, chunk.extent), chunk.size_bytes, chunk.generation);
}

void ResidencyManager::ReleaseAccess(ChunkId id, std::shared_ptr<Event> fence) {
  std::lock_guard lock(mu_);
  Chunk& chunk = chunks_[id.value()];
  STRATA_CHECK(chunk.refs > 0, "chunk {} released more often than accessed", id.value());
  chunk.refs--;
  if (fence == nullptr || chunk.tier != Tier::kDevice) return;
  std::erase_if(chunk.fences, [](const std::shared_ptr<Event>& f) { return f->Done(); });
  if (!fence->Done()) chunk.fences.push_back(std::move(fence));
}

Status ResidencyManager::AwaitFence(Lock& lock, Chunk& chunk) {
  STRATA_DCHECK(chunk.in_flight, "AwaitFence of a chunk not marked in flight");
  std::erase_if(chunk.fences, [](const std::shared_ptr<Event>& f) { return f->Done(); });
  if (chunk.fences.empty()) return Status::Ok();
  const std::vector<std::shared_ptr<Event>> fences = chunk.fences;  // a release meanwhile may add one
  lock.unlock();
  Status status = Status::Ok();
  for (const std::shared_ptr<Event>& fence : fences) {
    status = fence->Wait(config_.wait_timeout_ms);
    if (!status.ok()) break;
  }
  lock.lock();
  stats_.fence_waits++;
  if (status.ok()) {
    std::erase_if(chunk.fences, [&](const std::shared_ptr<Event>& f) {
      return std::find(fences.begin(), fences.end(), f) != fences.end();
    });
  }
  return status.WithContext("waiting for the framework to finish with a chunk it let go (its fence)");
}

Status ResidencyManager::Move(ChunkId id, Tier tier) { return MoveUnlessPinned(id, tier, /*skip_pinned=*/false); }

Status ResidencyManager::MoveIfOn(ChunkId id, Tier from, Tier to) {
  return MoveUnlessPinned(id, to, /*skip_pinned=*/false, from);
}

Status ResidencyManager::MoveUnlessPinned(ChunkId id, Tier tier, bool skip_pinned, std::optional<Tier> only_from) {
  if (id.value() >= chunks_.size()) {
    return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), chunks_.size());
  }
  if (!has_tier(tier)) {
    return InvalidArgument("chunk {}: cannot move to the {} tier: it is not configured (option nvme.dirs)", id.value(),
                           TierName(tier));
  }
  Lock lock(mu_);
  STRATA_RETURN_IF_ERROR(WaitNotInFlight(lock, id));
  Chunk& chunk = chunks_[id.value()];
  if (chunk.tier == tier) return Status::Ok();
  if (only_from && chunk.tier != only_from) return Status::Ok();
  if (chunk.refs > 0) {
    if (skip_pinned) return Status::Ok();
    return InvalidArgument("chunk {}: in use on the {} tier ({} accesses); release them before moving it", id.value(),
                           TierName(*chunk.tier), chunk.refs);
  }
  chunk.in_flight = true;
  std::vector<ChunkId> chain;
  STRATA_RETURN_IF_ERROR(MoveFlagged(lock, id, tier, chain));
  chunk.last_use = ++clock_;  // asked for: as recent as an access (a prefetch must not be evicted first)
  return Status::Ok();
}

std::shared_future<Status> ResidencyManager::MoveAsync(ChunkId id, Tier tier) {
  return workers_->Push([this, id, tier] { return Move(id, tier); });
}

Status ResidencyManager::ReadChunk(ChunkId id, std::byte* dst) {
  if (id.value() >= chunks_.size()) {
    return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), chunks_.size());
  }
  if (reinterpret_cast<uintptr_t>(dst) % kSlotAlignmentBytes != 0) {
    return InvalidArgument("ReadChunk of chunk {}: the destination is not {}-byte aligned", id.value(),
                           kSlotAlignmentBytes);
  }
  Lock lock(mu_);
  STRATA_RETURN_IF_ERROR(WaitNotInFlight(lock, id));
  Chunk& chunk = chunks_[id.value()];
  if (!chunk.tier) {
    std::memset(dst, 0, chunk.size_bytes);
    return Status::Ok();
  }
  // Marked in flight for the duration, pinned or not (its pins may all be
  // released meanwhile), so nobody moves, compacts or frees its slot while
  // it is read; an access to it waits.
  chunk.in_flight = true;
  Tier from = *chunk.tier;
  Extent extent = chunk.extent;
  if (Status fenced = AwaitFence(lock, chunk); !fenced.ok()) {
    chunk.in_flight = false;
    moved_.notify_all();
    return fenced.WithContext(fmt::format("reading chunk {} on {}", id.value(), TierName(from)));
  }
  lock.unlock();
  Status status;
  if (from == Tier::kNvme) {
    status = config_.nvme_pool->Read(extent, dst, chunk.size_bytes);
  } else if (from == Tier::kHost) {
    std::memcpy(dst, Address(from, extent), chunk.size_bytes);
  } else {
    // Through a bounce buffer: if the copy times out it may go on writing,
    // and it must not write into the caller's memory then.
    Result<Buffer> staging = AcquireStaging();
    status = staging.status();
    if (staging.ok()) {
      Result<std::shared_ptr<Event>> event =
          config_.device->CopyAsync(CopyStream::kDeviceToHost, staging->data(), Address(from, extent), chunk.size_bytes);
      status = event.ok() ? (*event)->Wait(config_.wait_timeout_ms) : event.status();
      if (status.ok()) std::memcpy(dst, staging->data(), chunk.size_bytes);
      ReleaseStaging(std::move(staging).value(), status);
    }
  }
  lock.lock();
  chunk.in_flight = false;
  moved_.notify_all();
  return status.WithContext(fmt::format("reading chunk {} on {}", id.value(), TierName(from)));
}

std::optional<HostBytes> ResidencyManager::PeekHost(ChunkId id) {
  Lock lock(mu_);
  const Chunk& chunk = chunks_[id.value()];
  if (chunk.in_flight || chunk.tier != Tier::kHost) return std::nullopt;
  return HostBytes{Address(Tier::kHost, chunk.extent), chunk.generation};
}

uint64_t ResidencyManager::Generation(ChunkId id) {
  Lock lock(mu_);
  return chunks_[id.value()].generation;
}

Status ResidencyManager::WriteChunk(ChunkId id, const std::byte* src) {
  if (id.value() >= chunks_.size()) {
    return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), chunks_.size());
  }
  if (reinterpret_cast<uintptr_t>(src) % kSlotAlignmentBytes != 0) {
    return InvalidArgument("WriteChunk of chunk {}: the source is not {}-byte aligned", id.value(), kSlotAlignmentBytes);
  }
  Lock lock(mu_);
  STRATA_RETURN_IF_ERROR(WaitNotInFlight(lock, id));
  Chunk& chunk = chunks_[id.value()];
  if (!chunk.tier && chunk.home != Tier::kNvme) {
    chunk.in_flight = true;
    std::vector<ChunkId> chain;
    STRATA_RETURN_IF_ERROR(MoveFlagged(lock, id, chunk.home, chain));
  }
  const Tier to = chunk.tier.value_or(Tier::kNvme);
  chunk.in_flight = true;  // as ReadChunk: nobody moves its slot while it is written
  if (Status fenced = AwaitFence(lock, chunk); !fenced.ok()) {
    chunk.in_flight = false;
    moved_.notify_all();
    return fenced.WithContext(fmt::format("writing chunk {} on {}", id.value(), TierName(to)));
  }
  std::optional<Extent> fresh;
  if (to == Tier::kNvme) {
    std::vector<ChunkId> chain{id};
    Result<Extent> reserved = Reserve(lock, Tier::kNvme, chunk.size_bytes, chain);
    if (reserved.ok()) {
      fresh = *reserved;
    } else if (!chunk.tier) {
      chunk.in_flight = false;
      moved_.notify_all();
      return reserved.status().WithContext(fmt::format("writing chunk {} to its nvme home", id.value()));
    }
  }
  const Extent extent = fresh ? *fresh : chunk.extent;
  const uint64_t size = chunk.size_bytes;
  lock.unlock();
  Status status;
  if (to == Tier::kNvme) {
    status = config_.nvme_pool->Write(extent, src, size);
  } else if (to == Tier::kHost) {
    std::memcpy(Address(to, extent), src, size);
  } else {
    Result<Buffer> staging = AcquireStaging();
    status = staging.status();
    if (staging.ok()) {
      std::memcpy(staging->data(), src, size);
      Result<std::shared_ptr<Event>> event =
          config_.device->CopyAsync(CopyStream::kHostToDevice, Address(to, extent), staging->data(), size);
      status = event.ok() ? (*event)->Wait(config_.wait_timeout_ms) : event.status();
      ReleaseStaging(std::move(staging).value(), status);
    }
  }
  lock.lock();
  if (fresh && status.ok()) {
    if (chunk.tier) pool(Tier::kNvme)->Free(chunk.extent);
    chunk.tier = Tier::kNvme;
    chunk.extent = *fresh;
  } else if (fresh) {
    pool(Tier::kNvme)->Free(*fresh);
  }
  chunk.generation++;  // its bytes replaced (or partly, by a failed write in place)
  chunk.in_flight = false;
  moved_.notify_all();
  return status.WithContext(fmt::format("writing chunk {} on {}", id.value(), TierName(to)));
}

Status ResidencyManager::MoveAllHome() {
  // Down first, from the lowest tier up, so each move finds the room the
  // moves before it made below; then up.
  struct Pass {
    Tier from;
    bool down;
  };
  for (Pass pass : {Pass{Tier::kHost, true}, Pass{Tier::kDevice, true}, Pass{Tier::kNvme, false},
                    Pass{Tier::kHost, false}}) {
    for (uint32_t i = 0; i < chunks_.size(); ++i) {
      ChunkId id(i);
      Tier target = home(id);
      if (tier(id) != pass.from || target == pass.from || (target > pass.from) != pass.down) continue;
      STRATA_RETURN_IF_ERROR(MoveUnlessPinned(id, target, /*skip_pinned=*/true));
    }
  }
  return Status::Ok();
}

Status ResidencyManager::MoveFlagged(Lock& lock, ChunkId id, Tier to, std::vector<ChunkId>& chain,
                                     std::optional<Extent> dst) {
  Chunk& chunk = chunks_[id.value()];
  STRATA_DCHECK(chunk.in_flight, "MoveFlagged of chunk {} that is not marked in flight", id.value());
  auto finish = [&](Status status) {
    chunk.in_flight = false;
    chunk.arriving.reset();
    moved_.notify_all();
    return status;
  };
  if (Status fenced = AwaitFence(lock, chunk); !fenced.ok()) {
    if (dst) pool(to)->Free(*dst);  // the caller's slot, not written yet
    return finish(fenced.WithContext(fmt::format("moving chunk {} to {}", id.value(), TierName(to))));
  }

  if (!dst && DroppedBy(chunk, to)) {
    pool(*chunk.tier)->Free(chunk.extent);
    chunk.tier.reset();
    chunk.generation++;
    stats_.drops++;
    return finish(Status::Ok());
  }
  if (!dst) {
    chain.push_back(id);
    Result<Extent> reserved = Reserve(lock, to, chunk.size_bytes, chain);
    chain.pop_back();
    if (!reserved.ok()) {
      return finish(reserved.status().WithContext(fmt::format("moving chunk {} to {}", id.value(), TierName(to))));
    }
    dst = *reserved;
  }

  std::optional<Tier> from = chunk.tier;
  Extent src = chunk.extent;
  uint64_t size = chunk.size_bytes;
  chunk.arriving = to;
  lock.unlock();
  Clock::time_point start = Clock::now();
  Status status = Transfer(from, src, to, *dst, size);
  double seconds = SecondsSince(start);
  lock.lock();

  if (!status.ok()) {
    // The chunk keeps its old slot and bytes. After a device copy into the
    // new slot timed out, the copy may still be running: leave that slot
    // allocated for good rather than hand it to another chunk while it is
    // being written. (NVMe writes come back only once their I/O has ended.)
    if (status.code() == StatusCode::kTimeout && to != Tier::kNvme) {
      STRATA_LOG_ERROR("chunk {}: move to {} timed out; its {} slot is quarantined", id.value(), TierName(to),
                       FormatSize(dst->size_bytes));
    } else {
      pool(to)->Free(*dst);
    }
    return finish(status.WithContext(fmt::format("moving chunk {} from {} to {}", id.value(),
                                                 from ? TierName(*from) : "free", TierName(to))));
  }
  if (from) {
    pool(*from)->Free(src);
    LinkStats& link = stats_.links[static_cast<int>(*from)][static_cast<int>(to)];
    link.moves++;
    link.bytes += size;
    link.seconds += seconds;
  } else {
    stats_.materializations++;
  }
  chunk.tier = to;
  chunk.extent = *dst;
  chunk.generation++;
  return finish(Status::Ok());
}

// Note [Waiting for room]
// A tier with no room and no chunk in hold to evict may still get room: a
// chunk in flight there may be on its way out, and a chunk arriving there
// (its slot already reserved, its bytes on the way) will be in hold, and
// evictable, once it lands. Waiting for those is right unless the move is
// itself waiting for this reservation — the chunks of `chain` (the chunk this
// thread is moving and the victims it is evicting for it), whose source slots
// free only after this returns. So: wait for chunks leaving or arriving that
// are not in the chain, within the deadline; with none, the answer is
// OutOfMemory at once. Two threads waiting on each other's chains end as
// Timeout, never as a hang.
Result<Extent> ResidencyManager::Reserve(Lock& lock, Tier tier, uint64_t size_bytes, std::vector<ChunkId>& chain) {
  TierPool* target = pool(tier);
  if (size_bytes > target->usage().capacity_bytes) {
    return target->OutOfMemoryError(size_bytes, "the chunk is larger than the whole tier");
  }
  Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(config_.wait_timeout_ms);
  for (;;) {
    if (std::optional<Extent> extent = target->Allocate(size_bytes)) return *extent;
    if (tier != Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(std::optional<Extent> joined, Compact(lock, tier, size_bytes));
      if (joined) return *joined;
    }

    std::optional<Tier> below = TierBelow(tier);
    if (!below) {
      return target->OutOfMemoryError(
          size_bytes, tier == Tier::kHost ? "no NVMe tier to evict to (option nvme.dirs)" : "nothing can be evicted");
    }
    // The least recently used chunk in hold on this tier, preferring chunks
    // that are not at home here (they were only visiting).
    std::optional<uint32_t> victim;
    bool any_leaving = false;  // leaving or arriving, not in the chain: room may come
    auto better = [&](const Chunk& c, const Chunk& than) {
      bool c_visiting = c.home != tier, than_visiting = than.home != tier;
      if (c_visiting != than_visiting) return c_visiting;
      return c.last_use < than.last_use;
    };
    for (uint32_t i = 0; i < chunks_.size(); ++i) {
      const Chunk& c = chunks_[i];
      if (c.in_flight && (c.tier == tier || c.arriving == tier)) {
        any_leaving |= std::find(chain.begin(), chain.end(), ChunkId(i)) == chain.end();
        continue;
      }
      if (c.tier != tier) continue;
      if (c.refs > 0) continue;
      if (!victim || better(c, chunks_[*victim])) victim = i;
    }
    if (!victim) {
      if (!any_leaving) return NoRoomError(tier, size_bytes);
      // A move off this tier may free room: wait for it, within the deadline.
      if (moved_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return Timeout("{} tier: no room for {} bytes after waiting {} ms for moves in flight", TierName(tier),
                       size_bytes, config_.wait_timeout_ms);
      }
      continue;
    }
    STRATA_RETURN_IF_ERROR(Evict(lock, tier, *victim, chain));
  }
}

Status ResidencyManager::Evict(Lock& lock, Tier tier, uint32_t victim, std::vector<ChunkId>& chain) {
  const Tier below = TierBelow(tier).value();
  chunks_[victim].in_flight = true;
  Status evicted = MoveFlagged(lock, ChunkId(victim), below, chain);
  // The tier below may have no slot for it: full of chunks in use, or its
  // free space in pieces too small (slots differ in size). Then the victim
  // goes one tier further down, as it would after a second eviction there
  // (device -> NVMe through a bounce buffer), if it is still here and free.
  const std::optional<Tier> further = TierBelow(below);
  const Chunk& after = chunks_[victim];
  if (evicted.code() == StatusCode::kOutOfMemory && further && after.tier == tier && !after.in_flight &&
      after.refs == 0) {
    chunks_[victim].in_flight = true;
    evicted = MoveFlagged(lock, ChunkId(victim), *further, chain);
  }
  if (!evicted.ok()) return evicted.WithContext(fmt::format("evicting from the {} tier", TierName(tier)));
  stats_.evictions++;
  return Status::Ok();
}

Result<Buffer> ResidencyManager::AcquireStaging() {
  std::unique_lock lock(staging_mu_);
  // One bounce buffer per mover: callers and workers together rarely exceed this.
  const uint32_t limit = workers_->threads() + 2;
  bool available = staging_cv_.wait_for(lock, std::chrono::milliseconds(config_.wait_timeout_ms),
                                        [&] { return !staging_free_.empty() || staging_count_ < limit; });
  if (!available) return Timeout("no staging buffer free after {} ms", config_.wait_timeout_ms);
  if (!staging_free_.empty()) {
    Buffer buffer = std::move(staging_free_.back());
    staging_free_.pop_back();
    return buffer;
  }
  staging_count_++;  // the slot is this caller's from here: every failure below gives it back
  lock.unlock();
  const auto give_back = [&](const Status& failed) {
    {
      std::lock_guard relock(staging_mu_);
      staging_count_--;
    }
    staging_cv_.notify_one();
    return failed;
  };
  Result<Buffer> buffer = config_.device->AllocatePinnedHost(max_chunk_bytes_, kNumaNodeNearDevice);
  if (!buffer.ok()) {
    return give_back(buffer.status().WithContext("allocating a pinned staging buffer for a device<->nvme move"));
  }
  if (config_.nvme_pool != nullptr) {  // device <-> NVMe moves read and write it
    Status registered = config_.nvme_pool->storage().RegisterBuffer(buffer->data(), buffer->size_bytes());
    if (!registered.ok()) {  // the buffer is freed as it goes out of scope
      return give_back(registered.WithContext("registering a pinned staging buffer with the NVMe storage"));
    }
  }
  return buffer;
}

void ResidencyManager::ReleaseStaging(Buffer buffer, const Status& status) {
  {
    std::lock_guard lock(staging_mu_);
    if (status.code() == StatusCode::kTimeout) {
      staging_quarantined_.push_back(std::move(buffer));
      staging_count_--;  // a fresh one may take its place
    } else {
      staging_free_.push_back(std::move(buffer));
    }
  }
  staging_cv_.notify_one();
}

Status ResidencyManager::Transfer(std::optional<Tier> from, Extent src, Tier to, Extent dst, uint64_t size_bytes) {
  Device& device = *config_.device;
  const uint32_t timeout_ms = config_.wait_timeout_ms;
  auto copy = [&](CopyStream stream, std::byte* to_address, const std::byte* from_address) -> Status {
    STRATA_ASSIGN_OR_RETURN(std::shared_ptr<Event> event, device.CopyAsync(stream, to_address, from_address, size_bytes));
    return event->Wait(timeout_ms);
  };
  NvmeTierPool* nvme = config_.nvme_pool;

  if (!from) {  // materialize a free chunk as zeros
    if (to == Tier::kDevice) return device.Memset(Address(to, dst), 0, size_bytes);
    if (to == Tier::kHost) {
      std::memset(Address(to, dst), 0, size_bytes);
      return Status::Ok();
    }
    STRATA_ASSIGN_OR_RETURN(Buffer zeros, AcquireStaging());
    std::memset(zeros.data(), 0, size_bytes);
    Status status = nvme->Write(dst, zeros.bytes(), size_bytes);
    ReleaseStaging(std::move(zeros), status);
    return status;
  }

  switch (static_cast<int>(*from) * kNumTiers + static_cast<int>(to)) {
    case static_cast<int>(Tier::kDevice) * kNumTiers + static_cast<int>(Tier::kHost):
      return copy(CopyStream::kDeviceToHost, Address(to, dst), Address(*from, src));
    case static_cast<int>(Tier::kHost) * kNumTiers + static_cast<int>(Tier::kDevice):
      return copy(CopyStream::kHostToDevice, Address(to, dst), Address(*from, src));
    case static_cast<int>(Tier::kHost) * kNumTiers + static_cast<int>(Tier::kNvme):
      return nvme->Write(dst, Address(*from, src), size_bytes);
    case static_cast<int>(Tier::kNvme) * kNumTiers + static_cast<int>(Tier::kHost):
      return nvme->Read(src, Address(to, dst), size_bytes);
    case static_cast<int>(Tier::kDevice) * kNumTiers + static_cast<int>(Tier::kNvme): {
      STRATA_ASSIGN_OR_RETURN(Buffer staging, AcquireStaging());
      Status status = copy(CopyStream::kDeviceToHost, staging.bytes(), Address(*from, src));
      if (status.ok()) status = nvme->Write(dst, staging.bytes(), size_bytes);
      ReleaseStaging(std::move(staging), status);
      return status;
    }
    case static_cast<int>(Tier::kNvme) * kNumTiers + static_cast<int>(Tier::kDevice): {
      STRATA_ASSIGN_OR_RETURN(Buffer staging, AcquireStaging());
      Status status = nvme->Read(src, staging.bytes(), size_bytes);
      if (status.ok()) status = copy(CopyStream::kHostToDevice, Address(to, dst), staging.bytes());
      ReleaseStaging(std::move(staging), status);
      return status;
    }
  }
  return Internal("no transfer from {} to {}", TierName(*from), TierName(to));
}

}  // namespace strata::memory
