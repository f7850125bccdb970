// Engine: the front door of strata's C++ API.
//
//   strata::Options options;                     // or ApplyOptionsFile(...)
//   STRATA_ASSIGN_OR_RETURN(auto engine, strata::Engine::Create(options));
//   STRATA_ASSIGN_OR_RETURN(TensorId w, engine->RegisterTensor({"fc.weight", {4096, 4096}}));
//   ...                                          // every tensor, in model order
//   STRATA_RETURN_IF_ERROR(engine->Finalize());  // packs chunks, checks capacity
//   STRATA_ASSIGN_OR_RETURN(TensorAccess p, engine->Access(w, ChunkKind::kParam, Tier::kDevice));
//   ... use p.data() on the device ...           // p pins the chunk until it dies
//
// The engine owns the device backend, the storage backend, the three tier
// pools and the residency manager. Create() fails early on bad options, a
// device budget the device cannot give, NVMe directories without enough free
// space or refusing O_DIRECT (with nvme.capacity unset, Finalize sizes the
// NVMe tier and checks the free space; with host.budget auto, the host
// tier). Close() gives every tier's memory and files back before the engine
// dies. Thread-safety: RegisterTensor and Finalize from one thread before
// anything else; after Finalize, Access, MoveChunk and stats may be called
// from any thread; Close from one thread once nothing else uses the engine.
#pragma once

#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "strata/access.h"
#include "strata/buffer.h"
#include "strata/comm.h"
#include "strata/compute_seam.h"
#include "strata/device.h"
#include "strata/options.h"
#include "strata/stats.h"
#include "strata/status.h"
#include "strata/storage.h"
#include "strata/tensor.h"
#include "strata/types.h"

namespace strata {

// Backends to use instead of the ones the options name.
struct EngineSeams {
  std::unique_ptr<Device> device;    // null: CreateDevice(options)
  std::unique_ptr<Storage> storage;  // null: io_uring over options.nvme.dirs (if any)
  // The NVMe dirs' free space is read and the tier's files removed through
  // it (borrowed: it must outlive the engine; null: PosixFileSystem()).
  FileSystem* files = nullptr;
  // The data-parallel group this engine is one rank of (borrowed: it must
  // outlive the engine; null: a single rank). Every rank must have the same
  // options and register the same tensors (else InvalidArgument on every
  // rank); each keeps its NVMe files under `rank<r>` of every nvme.dirs
  // entry and only its shard of the states. See Note [Ranks] in engine.cc.
  Communicator* comm = nullptr;
  // Host memory available, as host.budget auto reads it (nullopt: this
  // machine's, MemAvailable or less under a cgroup limit).
  std::optional<uint64_t> available_host_bytes;
  // Runs instead of the optimizer's update kernels (borrowed: it must
  // outlive the engine; null: the kernels). See strata/compute_seam.h.
  ComputeSeam* compute = nullptr;
};

// One chunk as the API describes it.
struct ChunkInfo {
  ChunkId id;
  ChunkKind kind = ChunkKind::kParam;
  DType dtype = DType::kFloat32;
  uint32_t group = 0;         // chunks of one group mirror one param chunk
  uint32_t param_group = 0;   // the optimizer's param group of its tensors (TensorSpec::param_group; 0 when frozen)
  uint64_t size_bytes = 0;    // slot size
  uint64_t used_bytes = 0;    // up to the end of its last tensor
  std::vector<TensorId> tensors;             // in layout order
  std::vector<uint64_t> tensor_offsets_bytes;  // where each of `tensors` starts in the group's whole chunk
  // Data parallel: a master or optimizer-state chunk holds only this rank's
  // shard of its group, bytes [shard_offset_bytes, shard_offset_bytes +
  // used_bytes) of the whole chunk (memory::ShardOf); so a tensor's byte at
  // o of the whole chunk is at o - shard_offset_bytes of this one. 0 and
  // false for whole chunks.
  uint64_t shard_offset_bytes = 0;
  bool sharded = false;
  // Parameters sharded (option comm.shard_params): a param chunk homed
  // nowhere, valid only once gathered from the ranks' master shards and
  // until the next update; moved off the device it is dropped, and never
  // gathered it reads as zeros.
  bool transient = false;
};

// Parameters sharded: how many gathered param chunks may stay pinned on the
// device beyond a plan; Finalize requires device room for them and two more
// of the largest param chunk.
inline constexpr size_t kKeptGatheredChunks = 2;

struct LayoutSummary {
  uint64_t chunk_size_elems = 0;
  bool chunk_size_searched = false;
  double padding_waste_fraction = 0;  // of param chunk capacity
  uint64_t total_bytes = 0;           // all chunks of all kinds
  std::array<uint64_t, kNumChunkKinds> chunks_of_kind{};
  uint64_t num_groups = 0;
};

class Engine {
 public:
  static Result<std::unique_ptr<Engine>> Create(const Options& options, EngineSeams seams = {});
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Registers a tensor (before Finalize). Names must be unique.
  Result<TensorId> RegisterTensor(const TensorSpec& spec);
  // Packs the registered tensors into chunks and sets each chunk's home tier
  // (host while it has room, then NVMe: Note [Homes] in memory/placement.cc);
  // with nvme.capacity unset, sizes the NVMe tier to what they need there.
  // OutOfMemory, naming the options to change, when the chunks do not fit.
  Status Finalize();
  bool finalized() const;
  // Host memory Finalize kept free of homes as staging for NVMe-homed chunks
  // read ahead of a CPU update; 0 when the host holds every chunk or there
  // is no NVMe tier (Note [Host reserve] in memory/placement.cc).
  uint64_t host_staging_bytes() const;

  // Pins `tensor`'s copy of `kind` on `tier` (device or host), moving its
  // chunk there first. A kind the tensor lacks (grad of a frozen tensor,
  // master of an fp32 one), or a sharded state copy this rank holds only
  // part of, is InvalidArgument.
  Result<TensorAccess> Access(TensorId tensor, ChunkKind kind, Tier tier);
  Result<ChunkAccess> AccessChunk(ChunkId chunk, Tier tier);
  // `chunk` pinned where it lies, if that is `tier` and it is not moving:
  // nothing moves, nothing is made room for; nullopt otherwise (a reader
  // then takes ReadChunk).
  Result<std::optional<ChunkAccess>> AccessChunkIfOn(ChunkId chunk, Tier tier);
  // A transient chunk resident on `tier` now, neither moving nor pinned:
  // `fill` writes its bytes (their address on `tier`) while whoever else
  // wants the chunk waits; its new generation (ChunkAccess::generation), or
  // nullopt when the chunk was not there so (nothing moved or waited for).
  Result<std::optional<uint64_t>> FillChunkIfOn(ChunkId chunk, Tier tier, const std::function<Status(void*)>& fill);
  // Moves a chunk that is not pinned; synchronous or on a transfer worker.
  Status MoveChunk(ChunkId chunk, Tier tier);
  // MoveChunk, only if the chunk is on `from` as the move begins (else nothing happens).
  Status MoveChunkIfOn(ChunkId chunk, Tier from, Tier to);
  std::shared_future<Status> MoveChunkAsync(ChunkId chunk, Tier tier);
  // Copies a chunk's bytes into host memory at `dst` (ChunkInfo::size_bytes,
  // 4096-aligned) from wherever the chunk is, without moving it.
  Status ReadChunk(ChunkId chunk, void* dst);
  // A chunk's bytes where they lie in host memory now, neither pinned nor
  // held in place (HostBytes: valid while ChunkGeneration is unchanged), or
  // nullopt when it is not on the host or is in flight.
  Result<std::optional<HostBytes>> PeekHostChunk(ChunkId chunk);
  // The generation of the chunk's placement now (ChunkAccess::generation).
  Result<uint64_t> ChunkGeneration(ChunkId chunk);
  // Overwrites a chunk's bytes (ChunkInfo::size_bytes from `src`,
  // 4096-aligned) where the chunk is, without reading them first: an
  // NVMe-resident chunk (or a free one homed there) is written to a fresh
  // NVMe slot that then replaces its old one.
  Status WriteChunk(ChunkId chunk, const void* src);
  // Sends every unpinned chunk that has a payload back to its home tier.
  Status OffloadAll();
  // Releases every tier now: the residency manager, the pools' memory and
  // the NVMe files. InvalidArgument, releasing nothing, while a chunk is
  // pinned. Idempotent. After it every call that needs the tiers is
  // InvalidArgument saying the engine is closed; device() stays valid until
  // the engine dies.
  Status Close();
  bool closed() const;

  Result<Tier> ChunkTier(ChunkId chunk) const;  // InvalidArgument when the chunk is free (no payload yet)
  Result<Tier> ChunkHome(ChunkId chunk) const;
  // ChunkOf(tensor, kind): the chunk holding that copy, if the tensor has it.
  std::optional<ChunkId> ChunkOf(TensorId tensor, ChunkKind kind) const;

  const Options& options() const;
  // This engine's place in its data-parallel group (EngineSeams::comm); 0 of 1 alone.
  int rank() const;
  int world_size() const;
  ComputeSeam* compute_seam() const;  // EngineSeams::compute
  const std::vector<TensorSpec>& tensors() const;
  std::vector<ChunkInfo> chunks() const;
  LayoutSummary layout() const;
  MemoryStats stats() const;
  Device& device();
  // The device tier's memory: one arena, allocated by Create, in which every
  // chunk pinned on the device lies (ChunkAccess::data() - arena.data() is
  // its offset). A framework may view it once and slice pinned chunks out.
  const Buffer& device_arena() const;
  std::string DescribeBackends() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace strata
