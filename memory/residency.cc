#include "memory/residency.h"

#include <chrono>
#include <cstring>

#include "strata/logging.h"
#include "strata/options.h"

namespace strata::memory {
namespace {

using Clock = std::chrono::steady_clock;

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
    max_chunk_bytes_ = std::max(max_chunk_bytes_, chunks_[i].size_bytes);
  }
  stats_.tier_present = {true, true, config.nvme_pool != nullptr};
  uint32_t workers = std::max<uint32_t>(1, config.transfer_workers);
  for (uint32_t i = 0; i < workers; ++i) workers_.emplace_back([this] { WorkerLoop(); });
}

ResidencyManager::~ResidencyManager() {
  {
    std::lock_guard lock(queue_mu_);
    stopping_ = true;
  }
  queue_cv_.notify_all();
  for (std::thread& worker : workers_) worker.join();
  std::lock_guard lock(mu_);
  for (Chunk& chunk : chunks_) {
    if (chunk.refs > 0) STRATA_LOG_WARNING("residency: destroyed while a chunk is still accessed ({} refs)", chunk.refs);
    if (chunk.tier) pool(*chunk.tier)->Free(chunk.extent);
    chunk.tier.reset();
  }
}

void ResidencyManager::WorkerLoop() {
  for (;;) {
    std::packaged_task<Status()> task;
    {
      std::unique_lock lock(queue_mu_);
      queue_cv_.wait(lock, [this] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and the queue is drained
      task = std::move(queue_.front());
      queue_.pop_front();
    }
    task();
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
  bool settled = moved_.wait_for(lock, std::chrono::milliseconds(config_.wait_timeout_ms),
                                 [&] { return !chunk.in_flight; });
  if (!settled) {
    return Timeout("chunk {}: still in flight after {} ms (a stuck copy or drive?)", id.value(),
                   config_.wait_timeout_ms);
  }
  return Status::Ok();
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
  for (;;) {
    STRATA_RETURN_IF_ERROR(WaitNotInFlight(lock, id));
    if (chunk.tier == tier) {
      chunk.refs++;
      chunk.last_use = ++clock_;
      return ChunkAccess(this, id, tier, Address(tier, chunk.extent), chunk.size_bytes);
    }
    if (chunk.refs > 0) {
      return InvalidArgument("chunk {}: in use on the {} tier; release its accesses before accessing it on {}",
                             id.value(), TierName(*chunk.tier), TierName(tier));
    }
    chunk.in_flight = true;
    STRATA_RETURN_IF_ERROR(MoveFlagged(lock, id, tier));
  }
}

void ResidencyManager::ReleaseAccess(ChunkId id) {
  std::lock_guard lock(mu_);
  Chunk& chunk = chunks_[id.value()];
  STRATA_CHECK(chunk.refs > 0, "chunk {} released more often than accessed", id.value());
  chunk.refs--;
}

Status ResidencyManager::Move(ChunkId id, Tier tier) {
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
  if (chunk.refs > 0) {
    return InvalidArgument("chunk {}: in use on the {} tier ({} accesses); release them before moving it", id.value(),
                           TierName(*chunk.tier), chunk.refs);
  }
  chunk.in_flight = true;
  return MoveFlagged(lock, id, tier);
}

std::shared_future<Status> ResidencyManager::MoveAsync(ChunkId id, Tier tier) {
  std::packaged_task<Status()> task([this, id, tier] { return Move(id, tier); });
  std::shared_future<Status> future = task.get_future().share();
  {
    std::lock_guard lock(queue_mu_);
    queue_.push_back(std::move(task));
  }
  queue_cv_.notify_one();
  return future;
}

Status ResidencyManager::ReadChunk(ChunkId id, std::byte* dst) {
  if (id.value() >= chunks_.size()) {
    return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), chunks_.size());
  }
  Lock lock(mu_);
  STRATA_RETURN_IF_ERROR(WaitNotInFlight(lock, id));
  Chunk& chunk = chunks_[id.value()];
  if (!chunk.tier) {
    std::memset(dst, 0, chunk.size_bytes);
    return Status::Ok();
  }
  // In flight for the duration: nobody moves or frees the slot while we read it.
  chunk.in_flight = true;
  Tier from = *chunk.tier;
  Extent extent = chunk.extent;
  lock.unlock();
  Status status;
  if (from == Tier::kNvme) {
    status = config_.nvme_pool->Read(extent, dst, chunk.size_bytes);
  } else if (from == Tier::kHost) {
    std::memcpy(dst, Address(from, extent), chunk.size_bytes);
  } else {
    Result<std::shared_ptr<Event>> event =
        config_.device->CopyAsync(CopyStream::kDeviceToHost, dst, Address(from, extent), chunk.size_bytes);
    status = event.ok() ? (*event)->Wait(config_.wait_timeout_ms) : event.status();
  }
  lock.lock();
  chunk.in_flight = false;
  moved_.notify_all();
  return status.WithContext(fmt::format("reading chunk {} on {}", id.value(), TierName(from)));
}

Status ResidencyManager::MoveAllHome() {
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    ChunkId id(i);
    ChunkState now = state(id);
    if (now == ChunkState::kCompute || now == ChunkState::kFree) continue;
    STRATA_RETURN_IF_ERROR(Move(id, home(id)));
  }
  return Status::Ok();
}

Status ResidencyManager::MoveFlagged(Lock& lock, ChunkId id, Tier to) {
  Chunk& chunk = chunks_[id.value()];
  STRATA_DCHECK(chunk.in_flight, "MoveFlagged of chunk {} that is not marked in flight", id.value());
  auto finish = [&](Status status) {
    chunk.in_flight = false;
    moved_.notify_all();
    return status;
  };

  Result<Extent> dst = Reserve(lock, to, chunk.size_bytes);
  if (!dst.ok()) return finish(dst.status().WithContext(fmt::format("moving chunk {} to {}", id.value(), TierName(to))));

  std::optional<Tier> from = chunk.tier;
  Extent src = chunk.extent;
  uint64_t size = chunk.size_bytes;
  lock.unlock();
  Clock::time_point start = Clock::now();
  Status status = Transfer(from, src, to, *dst, size);
  double seconds = SecondsSince(start);
  lock.lock();

  if (!status.ok()) {
    // The chunk keeps its old slot and bytes. After a Timeout the copy may
    // still be running into the new slot: leave that slot allocated for good
    // rather than hand it to another chunk while it is being written.
    if (status.code() == StatusCode::kTimeout) {
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
  return finish(Status::Ok());
}

Result<Extent> ResidencyManager::Reserve(Lock& lock, Tier tier, uint64_t size_bytes) {
  TierPool* target = pool(tier);
  if (size_bytes > target->usage().capacity_bytes) {
    return target->OutOfMemoryError(size_bytes, "the chunk is larger than the whole tier");
  }
  Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(config_.wait_timeout_ms);
  for (;;) {
    if (std::optional<Extent> extent = target->Allocate(size_bytes)) return *extent;

    std::optional<Tier> below = TierBelow(tier);
    if (!below) {
      return target->OutOfMemoryError(
          size_bytes, tier == Tier::kHost ? "no NVMe tier to evict to (option nvme.dirs)" : "nothing can be evicted");
    }
    // The least recently used chunk in hold on this tier.
    std::optional<uint32_t> victim;
    bool any_in_flight = false;
    for (uint32_t i = 0; i < chunks_.size(); ++i) {
      const Chunk& c = chunks_[i];
      if (c.tier != tier) continue;
      if (c.in_flight) {
        any_in_flight = true;
        continue;
      }
      if (c.refs > 0) continue;
      if (!victim || c.last_use < chunks_[*victim].last_use) victim = i;
    }
    if (!victim) {
      if (!any_in_flight) return target->OutOfMemoryError(size_bytes, "every chunk on it is in use");
      // Another move on this tier may free room: wait for it, within the deadline.
      if (moved_.wait_until(lock, deadline) == std::cv_status::timeout) {
        return Timeout("{} tier: no room for {} bytes after waiting {} ms for moves in flight", TierName(tier),
                       size_bytes, config_.wait_timeout_ms);
      }
      continue;
    }
    chunks_[*victim].in_flight = true;
    Status evicted = MoveFlagged(lock, ChunkId(*victim), *below);
    if (!evicted.ok()) return evicted.WithContext(fmt::format("evicting from the {} tier", TierName(tier)));
    stats_.evictions++;
  }
}

Result<Buffer> ResidencyManager::AcquireStaging() {
  std::unique_lock lock(staging_mu_);
  // One bounce buffer per mover: callers and workers together rarely exceed this.
  const uint32_t limit = static_cast<uint32_t>(workers_.size()) + 2;
  bool available = staging_cv_.wait_for(lock, std::chrono::milliseconds(config_.wait_timeout_ms),
                                        [&] { return !staging_free_.empty() || staging_count_ < limit; });
  if (!available) return Timeout("no staging buffer free after {} ms", config_.wait_timeout_ms);
  if (!staging_free_.empty()) {
    Buffer buffer = std::move(staging_free_.back());
    staging_free_.pop_back();
    return buffer;
  }
  staging_count_++;
  lock.unlock();
  Result<Buffer> buffer = config_.device->AllocatePinnedHost(max_chunk_bytes_, kNumaNodeNearDevice);
  if (!buffer.ok()) {
    std::lock_guard relock(staging_mu_);
    staging_count_--;
    staging_cv_.notify_one();
    return buffer.status().WithContext("allocating a pinned staging buffer for a device<->nvme move");
  }
  return buffer;
}

void ResidencyManager::ReleaseStaging(Buffer buffer) {
  {
    std::lock_guard lock(staging_mu_);
    staging_free_.push_back(std::move(buffer));
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
    ReleaseStaging(std::move(zeros));
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
      ReleaseStaging(std::move(staging));
      return status;
    }
    case static_cast<int>(Tier::kNvme) * kNumTiers + static_cast<int>(Tier::kDevice): {
      STRATA_ASSIGN_OR_RETURN(Buffer staging, AcquireStaging());
      Status status = nvme->Read(src, staging.bytes(), size_bytes);
      if (status.ok()) status = copy(CopyStream::kHostToDevice, Address(to, dst), staging.bytes());
      ReleaseStaging(std::move(staging));
      return status;
    }
  }
  return Internal("no transfer from {} to {}", TierName(*from), TierName(to));
}

}  // namespace strata::memory
