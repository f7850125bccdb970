#include "strata/engine.h"

#include <algorithm>
#include <filesystem>
#include <limits>
#include <optional>
#include <string>
#include <unordered_set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "memory/chunk_layout.h"
#include "memory/placement.h"
#include "memory/residency.h"
#include "memory/tier_pool.h"
#include "src/base/buffer.h"
#include "src/base/logging.h"

// Note [Engine teardown]
// The engine's parts depend on each other downwards: the residency manager's
// handles and moves use the tier pools, the pools hold memory the device (and
// the storage, for NVMe slots) gave them. So they are destroyed top down,
// explicitly rather than by member order: the residency manager, the NVMe,
// host and device pools, then the storage and its backing files (where the
// engine opened it from nvme.dirs: they hold nothing past the engine, and
// are preallocated to the tier's size), then the device. Close() does all of
// that but the device, whose streams the framework's fences and whoever
// still holds the engine may use (Engine::device() stays valid); ~Engine
// finishes with it. The communicator is the caller's and outlives the
// engine.

// Note [Host budget auto]
// With host.budget auto (0) the host tier is sized at Finalize, once the
// model is known: what its chunks need there (memory::HostBytesNeeded: the
// chunks homed on the host, an eighth more for pieces too small to use
// while pins block compaction, and two of the largest chunks, as the host
// reserve keeps), and at most half the memory available then
// (AvailableHostMemoryBytes: MemAvailable, less under a cgroup limit). The
// other half is the rest of the process's: activations, the data loader,
// the optimizer's stream ring, the emulated device's arena. Chunks are homed
// with that half as the host's capacity, so a model whose states exceed it
// homes the rest on NVMe or, without nvme.dirs, is refused naming both
// figures. Where chunks are homed on NVMe (the rest of a large model, or the
// static policy's states beyond placement.host_states, however small the
// model), the tier also holds staging for them: the placement's, at most
// their bytes (memory::AutoHostSizeFor), so a small model keeps a small
// host tier and a large one takes at most the half. Ranks sharing a machine each see the same available memory: where
// their states together exceed half of it, give host.budget a size. A size
// given is the tier's capacity, allocated at Create.
//
// The arena is reserved, not committed, where nothing pins it (Note
// [Reserved regions] in src/base/buffer.cc): a slot costs memory once
// written. Two things pin it whole, making every page resident at once. The
// CUDA backend page-locks it: DMA needs every page resident and registered,
// and registering slots as they are first used would put a cudaHostRegister
// (milliseconds) in front of the first move of each and split the arena's
// one registration into many. With an NVMe tier, the arena is registered
// with io_uring as fixed buffers (RegisterHostArena): host <-> NVMe moves
// read and write its slots directly (O_DIRECT, no bounce buffer), so the
// whole arena is what the I/O touches, and registering it spares every
// request the kernel's pinning and mapping of its pages. So in both cases
// the arena's size is what keeps the cost down, and auto makes it what the
// model needs: a 1 GiB host tier with nvme.dirs is 1 GiB of RSS at
// Finalize, auto's for four 64 KiB-chunk layers about 2 MiB.

// Note [Ranks]
// With a communicator of more than one rank, Create checks that every rank
// has the same options (but device.index, nvme.dirs and log.level, which
// may differ) and Finalize that every rank registered the same tensors,
// each an InvalidArgument on every rank naming the ranks that differ. Each
// rank's NVMe files go into a subdirectory `rank<r>` of every nvme.dirs
// entry, so ranks sharing a drive never collide. Each rank keeps only its
// shard (1/W) of every group's master and optimizer states
// (ChunkInfo::sharded).

namespace strata {

// Everything the engine owns; see Note [Engine teardown] for the order it dies in.
struct Engine::Impl {
  Options options;
  std::unique_ptr<Device> device;
  std::unique_ptr<Storage> storage;  // null without an NVMe tier
  std::unique_ptr<memory::MemoryTierPool> device_pool;
  std::unique_ptr<memory::MemoryTierPool> host_pool;
  std::unique_ptr<memory::NvmeTierPool> nvme_pool;
  std::vector<TensorSpec> tensors;
  std::unordered_set<std::string> tensor_names;
  std::optional<memory::ChunkLayout> layout;
  std::unique_ptr<memory::ResidencyManager> residency;  // built by Finalize
  uint64_t host_staging_bytes = 0;                      // set by Finalize
  Communicator* comm = nullptr;                         // the data-parallel group, or null
  ComputeSeam* compute = nullptr;                       // EngineSeams::compute
  std::vector<std::string> nvme_dirs;                   // this rank's nvme.dirs
  FileSystem* files = nullptr;                          // where their free space is read
  std::vector<std::string> nvme_files;                  // the backing files of the storage it opened
  std::optional<uint64_t> available_host_bytes;         // EngineSeams::available_host_bytes
  bool closed = false;                                  // Close() has released the tiers

  // io_uring storage over nvme_dirs, `capacity_bytes` in all, as `storage`.
  Status OpenNvme(uint64_t capacity_bytes) {
    UringStorageOptions storage_options;
    storage_options.dirs = nvme_dirs;
    storage_options.capacity_bytes = capacity_bytes;
    storage_options.block_size_bytes = options.nvme.block_size_bytes;
    storage_options.queue_depth = options.nvme.queue_depth;
    storage_options.allow_buffered_io = options.nvme.allow_buffered_io;
    storage_options.io_timeout_ms = options.nvme.io_timeout_ms;
    storage_options.sqpoll = options.nvme.sqpoll;
    STRATA_ASSIGN_OR_RETURN(storage, CreateUringStorage(storage_options, *files));
    for (const std::string& dir : nvme_dirs) {
      nvme_files.push_back((std::filesystem::path(dir) / storage_options.file_name).string());
    }
    return Status::Ok();
  }
  // The host tier, `capacity_bytes`, on the NUMA node nearest the device
  // when asked (hwloc finds the GPU's node; a one-node machine has nothing
  // to choose).
  Status OpenHost(uint64_t capacity_bytes) {
    const int numa_node = options.host.numa_local ? kNumaNodeNearDevice : kNumaNodeUnbound;
    STRATA_ASSIGN_OR_RETURN(host_pool, memory::MemoryTierPool::CreateHost(*device, capacity_bytes, numa_node));
    return RegisterHostArena();
  }
  // The NVMe tier over `storage`.
  Status AttachNvme() {
    nvme_pool = std::make_unique<memory::NvmeTierPool>(*storage);
    return RegisterHostArena();
  }
  // Host <-> NVMe moves read and write the host arena: let the kernel keep
  // it mapped, once both tiers exist (whichever comes second registers it).
  // This pins every page of it (Note [Host budget auto]).
  Status RegisterHostArena() {
    if (host_pool == nullptr || nvme_pool == nullptr) return Status::Ok();
    const Buffer& arena = host_pool->arena();
    return storage->RegisterBuffer(arena.data(), arena.size_bytes());
  }
  // host.budget auto: the most the host tier may take, half the memory
  // available now; the most there is where that cannot be read. See Note
  // [Host budget auto].
  uint64_t AutoHostCapBytes() const {
    const std::optional<uint64_t> available = available_host_bytes ? available_host_bytes : AvailableHostMemoryBytes();
    if (!available) {
      STRATA_LOG_WARNING("host.budget auto: the memory available cannot be read (/proc/meminfo): the host tier takes "
                         "what the model's chunks need, however much that is");
      return std::numeric_limits<uint64_t>::max();
    }
    return *available / 2 / memory::kSlotAlignmentBytes * memory::kSlotAlignmentBytes;
  }
  // host.budget auto, once the chunks are homed under `cap_bytes`: the host
  // tier they need, staging for those homed on NVMe included, at most the
  // cap (memory::AutoHostSizeFor); `placement` keeps the staging it took. The
  // engine's options say what it took.
  Status SizeHost(const std::vector<memory::ChunkDesc>& chunks, memory::Placement& placement, uint64_t cap_bytes) {
    const memory::AutoHostSize wanted = memory::AutoHostSizeFor(chunks, placement);
    STRATA_RETURN_IF_ERROR(OpenHost(std::min(wanted.capacity_bytes, cap_bytes)));
    if (wanted.capacity_bytes <= cap_bytes) placement.host_staging_bytes = wanted.staging_bytes;
    options.host.budget_bytes = host_pool->usage().capacity_bytes;
    STRATA_LOG_DEBUG("host.budget auto: {} (the model's chunks need {}, staging {} of it; at most {})",
                     FormatSize(options.host.budget_bytes), FormatSize(wanted.capacity_bytes),
                     FormatSize(placement.host_staging_bytes), FormatSize(cap_bytes));
    return Status::Ok();
  }
  // See Note [Engine teardown].
  void ReleaseTiers() {
    residency.reset();
    nvme_pool.reset();
    host_pool.reset();
    device_pool.reset();
    storage.reset();
    for (const std::string& path : std::exchange(nvme_files, {})) {
      Status removed = files->RemoveAll(path);
      if (!removed.ok()) STRATA_LOG_WARNING("the NVMe tier's file stays: {}", removed.ToString());
    }
  }
  // nvme.capacity unset: the NVMe tier, sized to what the chunks homed as
  // `homes` need there (Note [NVMe capacity by default] in memory/placement.cc).
  Status SizeNvme(const std::vector<memory::ChunkDesc>& chunks, const std::vector<Tier>& homes) {
    const uint64_t capacity = memory::NvmeBytesNeeded(chunks, homes);
    Status opened = OpenNvme(capacity);
    if (!opened.ok()) {
      return opened.WithContext(fmt::format(
          "nvme.capacity is not set, so the NVMe tier is sized to what the model states need there, {} (the chunks "
          "homed on NVMe and room to move the largest ones); free space there, add nvme.dirs on other drives, "
          "raise host.budget or set nvme.capacity",
          FormatSize(capacity)));
    }
    return AttachNvme();
  }

  Status CheckOpen(std::string_view what) const {
    if (closed) {
      return InvalidArgument("{}: the engine is closed: Close() gave its memory and files back; create a new engine",
                             what);
    }
    return Status::Ok();
  }
  Status CheckFinalized(std::string_view what) const {
    STRATA_RETURN_IF_ERROR(CheckOpen(what));
    if (!residency) return InvalidArgument("{}: the engine is not finalized: call Finalize() after registering tensors", what);
    return Status::Ok();
  }
  // Every rank of the group must register the same tensors.
  Status CheckSameModelOnAllRanks() const {
    if (comm == nullptr || comm->world_size() <= 1) return Status::Ok();
    std::string model;
    for (const TensorSpec& t : tensors) {
      model += fmt::format("{}:{}:{}:{}:{};", t.name, fmt::join(t.shape, "x"), DTypeName(t.dtype), t.trainable, t.module);
    }
    return CheckSameOnAllRanks(*comm, "registered tensors", model);
  }
  // The tiers' capacities; the host's is AutoHostCapBytes() until host.budget auto has sized it.
  memory::TierCapacities Capacities() const {
    memory::TierCapacities capacities;
    capacities.device_bytes = device_pool->usage().capacity_bytes;
    capacities.host_bytes = host_pool ? host_pool->usage().capacity_bytes : AutoHostCapBytes();
    capacities.nvme_bytes = nvme_pool ? nvme_pool->usage().capacity_bytes : 0;
    capacities.has_nvme = nvme_pool != nullptr;
    return capacities;
  }
  std::unique_ptr<memory::ResidencyManager> MakeResidency(const memory::ChunkLayout& chunk_layout,
                                                          const std::vector<Tier>& homes) const {
    memory::ResidencyConfig config;
    config.device = device.get();
    config.device_pool = device_pool.get();
    config.host_pool = host_pool.get();
    config.nvme_pool = nvme_pool.get();
    config.transfer_workers = options.transfer_workers;
    config.wait_timeout_ms = EngineWaitTimeoutMs(options);
    auto manager = std::make_unique<memory::ResidencyManager>(config, chunk_layout.chunks());
    for (size_t i = 0; i < homes.size(); ++i) manager->SetHome(ChunkId(static_cast<uint32_t>(i)), homes[i]);
    return manager;
  }
  Status CheckChunk(ChunkId id) const {
    STRATA_RETURN_IF_ERROR(CheckFinalized("chunk access"));
    if (id.value() >= layout->chunks().size()) {
      return InvalidArgument("chunk {} does not exist: there are {} chunks", id.value(), layout->chunks().size());
    }
    return Status::Ok();
  }
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Engine::~Engine() {
  if (impl_ == nullptr) return;
  // See Note [Engine teardown].
  impl_->ReleaseTiers();
  impl_->device.reset();
}

Status Engine::Close() {
  if (impl_->closed) return Status::Ok();
  if (impl_->residency) {
    std::vector<uint32_t> pinned;
    for (uint32_t i = 0; i < impl_->residency->num_chunks(); ++i) {
      if (impl_->residency->state(ChunkId(i)) == memory::ChunkState::kCompute) pinned.push_back(i);
    }
    if (!pinned.empty()) {
      return InvalidArgument("Close(): {} chunks are still pinned (chunk {}{}): release every ChunkAccess and "
                             "TensorAccess first",
                             pinned.size(), fmt::join(pinned.begin(), pinned.begin() + std::min<size_t>(8, pinned.size()), ", "),
                             pinned.size() > 8 ? ", ..." : "");
    }
  }
  impl_->ReleaseTiers();  // see Note [Engine teardown]
  impl_->closed = true;
  ReturnFreeHeapPages();
  return Status::Ok();
}

bool Engine::closed() const { return impl_->closed; }

namespace {

// The options every rank of a group must share: all but those that name
// this rank's own resources (its GPU, its drives) or its logging.
std::string RankIndependentOptions(const Options& options) {
  std::string text;
  for (const auto& [key, value] : DescribeOptions(options)) {
    if (key == "device.index" || key == "nvme.dirs" || key == "log.level") continue;
    text += key + "=" + value + "\n";
  }
  return text;
}

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Create(const Options& options, EngineSeams seams) {
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));
  SetLogLevel(options.log_level);
  SetHugePagesEnabled(options.host.huge_pages);
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->comm = seams.comm;
  impl->compute = seams.compute;
  std::vector<std::string>& nvme_dirs = impl->nvme_dirs;
  nvme_dirs = options.nvme.dirs;
  impl->files = seams.files != nullptr ? seams.files : &PosixFileSystem();
  impl->available_host_bytes = seams.available_host_bytes;
  const bool ranks = seams.comm != nullptr && seams.comm->world_size() > 1;
  if (ranks) STRATA_RETURN_IF_ERROR(CheckSameOnAllRanks(*seams.comm, "options", RankIndependentOptions(options)));
  for (std::string& dir : nvme_dirs) {
    // Checked now, though the tier may be sized only at Finalize. Only the
    // rank's own level is created: a drive that is not mounted stays an
    // error, not a directory on whatever is below it.
    if (!std::filesystem::is_directory(dir)) {
      return IoError("nvme.dirs: {} is not a directory: create it (a directory on the drive) first", dir);
    }
    if (!ranks) continue;
    dir = (std::filesystem::path(dir) / fmt::format("rank{}", seams.comm->rank())).string();
    std::error_code error;
    std::filesystem::create_directory(dir, error);
    if (error) return IoError("nvme.dirs: cannot create this rank's directory {}: {}", dir, error.message());
  }

  if (seams.device) {
    impl->device = std::move(seams.device);
  } else {
    STRATA_ASSIGN_OR_RETURN(impl->device, CreateDevice(options));
  }
  if (seams.storage) {
    impl->storage = std::move(seams.storage);
  } else if (!nvme_dirs.empty() && options.nvme.capacity_bytes > 0) {
    STRATA_RETURN_IF_ERROR(impl->OpenNvme(options.nvme.capacity_bytes));
  }  // else with nvme.dirs: Finalize sizes the tier

  // device.budget auto on a GPU: what the device took (its capacity); the
  // engine's options say so from here.
  if (options.device.budget_auto && !impl->device->is_emulated()) {
    impl->options.device.budget_bytes = impl->device->capacity_bytes();
  }
  impl->options.device.budget_auto = false;
  STRATA_ASSIGN_OR_RETURN(impl->device_pool,
                          memory::MemoryTierPool::CreateDevice(*impl->device, impl->options.device.budget_bytes));
  // host.budget auto: Finalize sizes the tier (Note [Host budget auto]).
  if (options.host.budget_bytes > 0) STRATA_RETURN_IF_ERROR(impl->OpenHost(options.host.budget_bytes));
  if (impl->storage) STRATA_RETURN_IF_ERROR(impl->AttachNvme());

  auto engine = std::unique_ptr<Engine>(new Engine(std::move(impl)));
  STRATA_LOG_DEBUG("engine created: {}", engine->DescribeBackends());
  return engine;
}

Result<TensorId> Engine::RegisterTensor(const TensorSpec& spec) {
  STRATA_RETURN_IF_ERROR(impl_->CheckOpen("RegisterTensor"));
  if (impl_->residency) {
    return InvalidArgument("tensor '{}': cannot register after Finalize(): register every tensor first", spec.name);
  }
  if (spec.name.empty()) return InvalidArgument("a tensor needs a name (tensor {} has none)", impl_->tensors.size());
  for (size_t d = 0; d < spec.shape.size(); ++d) {
    if (spec.shape[d] <= 0) {
      return InvalidArgument("tensor '{}': dimension {} is {}; every dimension must be > 0", spec.name, d,
                             spec.shape[d]);
    }
  }
  if (!impl_->tensor_names.insert(spec.name).second) {
    return InvalidArgument("tensor '{}' is registered already: names must be unique", spec.name);
  }
  impl_->tensors.push_back(spec);
  return TensorId(static_cast<uint32_t>(impl_->tensors.size() - 1));
}

bool Engine::finalized() const { return impl_->residency != nullptr; }

uint64_t Engine::host_staging_bytes() const { return impl_->host_staging_bytes; }

const Buffer& Engine::device_arena() const {
  static const Buffer kReleased;
  return impl_->device_pool ? impl_->device_pool->arena() : kReleased;
}

Status Engine::Finalize() {
  STRATA_RETURN_IF_ERROR(impl_->CheckOpen("Finalize()"));
  if (impl_->residency) return InvalidArgument("Finalize(): already finalized");
  const Options& o = impl_->options;
  STRATA_RETURN_IF_ERROR(impl_->CheckSameModelOnAllRanks());
  memory::TierCapacities capacities = impl_->Capacities();
  const bool size_host = impl_->host_pool == nullptr;  // host.budget auto
  const bool size_nvme = impl_->nvme_pool == nullptr && !impl_->nvme_dirs.empty();
  if (size_nvme) {  // homes first, with NVMe unbounded; the tier is sized to them below
    capacities.nvme_bytes = std::numeric_limits<uint64_t>::max();
    capacities.has_nvme = true;
  }
  const memory::SearchBounds bounds = memory::SearchBoundsFor(
      impl_->tensors, {o.chunk.search_min_elems, o.chunk.search_max_elems}, capacities.device_bytes,
      size_host ? 0 : capacities.host_bytes,  // auto: a fixed figure (Note [Chunk size bounds])
      o.optimizer.state_dtype);
  STRATA_ASSIGN_OR_RETURN(memory::ChunkLayout layout,
                          memory::ChunkLayout::Build(impl_->tensors, o.chunk.size_elems, bounds.min_elems,
                                                     bounds.max_elems, {rank(), world_size(), o.comm.shard_params},
                                                     o.optimizer.state_dtype));
  Result<memory::Placement> placed = memory::PlaceChunks(layout, capacities, o);
  if (!placed.ok() && size_host) {
    return placed.status().WithContext(fmt::format(
        "host.budget auto takes at most half the memory available now, {} (set host.budget to a size to take more)",
        FormatSize(capacities.host_bytes)));
  }
  STRATA_ASSIGN_OR_RETURN(memory::Placement placement, std::move(placed));
  if (size_host) STRATA_RETURN_IF_ERROR(impl_->SizeHost(layout.chunks(), placement, capacities.host_bytes));
  if (size_nvme) {
    Status sized = impl_->SizeNvme(layout.chunks(), placement.homes);
    if (!sized.ok() && size_host) impl_->host_pool.reset();  // Finalize again sizes it again
    STRATA_RETURN_IF_ERROR(sized);
  }
  impl_->host_staging_bytes = placement.host_staging_bytes;
  impl_->residency = impl_->MakeResidency(layout, placement.homes);
  impl_->layout = std::move(layout);
  const memory::LayoutReport& r = impl_->layout->report();
  STRATA_LOG_INFO("finalized {} tensors into {} chunks ({} groups, chunk size {} elements{}, padding waste {:.2f}%, {})",
                  impl_->tensors.size(), impl_->layout->chunks().size(), impl_->layout->groups().size(),
                  r.chunk_size_elems, r.searched ? " searched" : "", 100 * r.waste_fraction(),
                  FormatSize(r.total_bytes));
  return Status::Ok();
}

Result<TensorAccess> Engine::Access(TensorId tensor, ChunkKind kind, Tier tier) {
  STRATA_RETURN_IF_ERROR(impl_->CheckFinalized("tensor access"));
  if (tensor.value() >= impl_->tensors.size()) {
    return InvalidArgument("tensor {} does not exist: {} tensors are registered", tensor.value(),
                           impl_->tensors.size());
  }
  std::optional<ChunkId> chunk = impl_->layout->ChunkOf(tensor, kind);
  const TensorSpec& spec = impl_->tensors[tensor.value()];
  if (!chunk) {
    return InvalidArgument("tensor '{}' has no {} copy ({})", spec.name, ChunkKindName(kind),
                           spec.trainable ? "its params are fp32, so params are the master copy" : "it is frozen");
  }
  const memory::TensorPlacement& place = impl_->layout->placement(tensor);
  const memory::ChunkDesc& desc = impl_->layout->chunk(*chunk);
  if (place.offset_elems < desc.shard_begin_elems ||
      place.offset_elems + place.num_elems > desc.shard_begin_elems + desc.used_elems) {
    return InvalidArgument(
        "tensor '{}': its {} copy is sharded across {} ranks and rank {} holds elements [{}, {}) of chunk group {}, "
        "not all of the tensor's [{}, {}): access the chunk (AccessChunk) for this rank's shard",
        spec.name, ChunkKindName(kind), world_size(), rank(), desc.shard_begin_elems,
        desc.shard_begin_elems + desc.used_elems, desc.group, place.offset_elems, place.offset_elems + place.num_elems);
  }
  if (desc.dtype == DType::kInt8Block) {
    return InvalidArgument("tensor '{}': its {} copy is 8-bit codes and block scales (optimizer.states int8), "
                           "not elements: access the chunk (AccessChunk) for its bytes",
                           spec.name, ChunkKindName(kind));
  }
  STRATA_ASSIGN_OR_RETURN(ChunkAccess access, impl_->residency->Access(*chunk, tier));
  size_t element = DTypeSizeBytes(desc.dtype);
  return TensorAccess(std::move(access), (place.offset_elems - desc.shard_begin_elems) * element,
                      place.num_elems * element, desc.dtype);
}

Result<ChunkAccess> Engine::AccessChunk(ChunkId chunk, Tier tier) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->Access(chunk, tier);
}

Result<std::optional<ChunkAccess>> Engine::AccessChunkIfOn(ChunkId chunk, Tier tier) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->PinIfOn(chunk, tier);
}

Result<std::optional<uint64_t>> Engine::FillChunkIfOn(ChunkId chunk, Tier tier,
                                                      const std::function<Status(void*)>& fill) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->FillIfOn(chunk, tier, [&](std::byte* data) { return fill(data); });
}

Status Engine::MoveChunk(ChunkId chunk, Tier tier) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->Move(chunk, tier);
}

Status Engine::MoveChunkIfOn(ChunkId chunk, Tier from, Tier to) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->MoveIfOn(chunk, from, to);
}

std::shared_future<Status> Engine::MoveChunkAsync(ChunkId chunk, Tier tier) {
  Status valid = impl_->CheckChunk(chunk);
  if (!valid.ok()) {
    std::promise<Status> failed;
    failed.set_value(valid);
    return failed.get_future().share();
  }
  return impl_->residency->MoveAsync(chunk, tier);
}

Status Engine::ReadChunk(ChunkId chunk, void* dst) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->ReadChunk(chunk, static_cast<std::byte*>(dst));
}

Result<std::optional<HostBytes>> Engine::PeekHostChunk(ChunkId chunk) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->PeekHost(chunk);
}

Result<uint64_t> Engine::ChunkGeneration(ChunkId chunk) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->Generation(chunk);
}

Status Engine::WriteChunk(ChunkId chunk, const void* src) {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->WriteChunk(chunk, static_cast<const std::byte*>(src));
}

Status Engine::OffloadAll() {
  STRATA_RETURN_IF_ERROR(impl_->CheckFinalized("OffloadAll"));
  return impl_->residency->MoveAllHome();
}

Result<Tier> Engine::ChunkTier(ChunkId chunk) const {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  std::optional<Tier> tier = impl_->residency->tier(chunk);
  if (!tier) return InvalidArgument("chunk {} is free: it has no payload until it is first accessed or moved", chunk.value());
  return *tier;
}

Result<Tier> Engine::ChunkHome(ChunkId chunk) const {
  STRATA_RETURN_IF_ERROR(impl_->CheckChunk(chunk));
  return impl_->residency->home(chunk);
}

std::optional<ChunkId> Engine::ChunkOf(TensorId tensor, ChunkKind kind) const {
  if (!impl_->layout || tensor.value() >= impl_->tensors.size()) return std::nullopt;
  return impl_->layout->ChunkOf(tensor, kind);
}

const Options& Engine::options() const { return impl_->options; }
int Engine::rank() const { return impl_->comm != nullptr ? impl_->comm->rank() : 0; }
int Engine::world_size() const { return impl_->comm != nullptr ? impl_->comm->world_size() : 1; }
ComputeSeam* Engine::compute_seam() const { return impl_->compute; }
const std::vector<TensorSpec>& Engine::tensors() const { return impl_->tensors; }

std::vector<ChunkInfo> Engine::chunks() const {
  std::vector<ChunkInfo> infos;
  if (!impl_->layout) return infos;
  for (const memory::ChunkDesc& c : impl_->layout->chunks()) {
    const auto bytes = [&](uint64_t elems) { return ChunkBytes(c.dtype, elems); };
    const memory::ChunkGroup& group = impl_->layout->groups()[c.group];
    ChunkInfo info{c.id,          c.kind, c.dtype, c.group, group.param_group, c.size_bytes(), bytes(c.used_elems),
                   group.tensors, {},     bytes(c.shard_begin_elems), c.sharded, c.transient};
    for (TensorId tensor : info.tensors) {
      info.tensor_offsets_bytes.push_back(bytes(impl_->layout->placement(tensor).offset_elems));
    }
    infos.push_back(std::move(info));
  }
  return infos;
}

LayoutSummary Engine::layout() const {
  LayoutSummary summary;
  if (!impl_->layout) return summary;
  const memory::LayoutReport& r = impl_->layout->report();
  summary.chunk_size_elems = r.chunk_size_elems;
  summary.chunk_size_searched = r.searched;
  summary.padding_waste_fraction = r.waste_fraction();
  summary.total_bytes = r.total_bytes;
  summary.chunks_of_kind = r.chunks_of_kind;
  summary.num_groups = impl_->layout->groups().size();
  return summary;
}

MemoryStats Engine::stats() const {
  if (impl_->residency) return impl_->residency->stats();
  MemoryStats stats;
  if (impl_->closed) return stats;  // no tier left
  stats.tier_present = {true, true, impl_->nvme_pool != nullptr};
  stats.tiers[0] = impl_->device_pool->usage();
  if (impl_->host_pool) stats.tiers[1] = impl_->host_pool->usage();  // else sized at Finalize
  if (impl_->nvme_pool) stats.tiers[2] = impl_->nvme_pool->usage();
  return stats;
}

Device& Engine::device() { return *impl_->device; }

std::string Engine::DescribeBackends() const {
  if (impl_->closed) return fmt::format("device: {}; closed: no tier left", impl_->device->Describe());
  return fmt::format("device: {}; host: {}; nvme: {}{}", impl_->device->Describe(),
                     impl_->host_pool ? FormatSize(impl_->host_pool->usage().capacity_bytes) + " pinned"
                                      : std::string("auto, sized at Finalize"),
                     impl_->storage             ? impl_->storage->Describe()
                     : impl_->nvme_dirs.empty() ? std::string("none (option nvme.dirs)")
                                                : fmt::format("in {}, sized at Finalize", fmt::join(impl_->nvme_dirs, ", ")),
                     impl_->comm != nullptr ? "; " + impl_->comm->Describe() : "");
}

}  // namespace strata
