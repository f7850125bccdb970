// ChunkLayout: which chunk, and where in it, every registered tensor lives,
// for every chunk kind.
//
// Tensors are packed in registration order into param chunks of one class
// (dtype, trainable, and the param group of trainable ones, so that a chunk's
// update uses one group's hyperparameters): the tensors of one module go into one chunk where they
// fit, a module that does not fit starts a new chunk, and a tensor larger
// than the chunk size gets a chunk of its own. Every param chunk of a
// trainable class has a group of state chunks that mirror it — the same
// tensors at the same element offsets — so an optimizer walks one group at a
// time: grad (param dtype), master (fp32, only when the param dtype is not
// fp32), exp_avg and exp_avg_sq (fp32, bf16 or int8: optimizer.states;
// under int8, a trainable tensor's class also says whether its moments are
// 8-bit: Build). Frozen tensors get param chunks only
// (and, parameters sharded, a master shard: below).
//
// Data parallel (a ShardSpec of more than one rank): a group's master and
// optimizer-state chunks hold only this rank's shard of the group; with
// ShardSpec::params the param chunks are transient, gathered from the
// shards. Every rank's layout has the same chunks of the same sizes. See
// Note [Sharded layout] in chunk_layout.cc.
//
// The chunk size is given, or searched between two bounds for the least
// padding waste (Note [Chunk size search]); bounds not given are derived from
// the tier budgets and the tensors (Note [Chunk size bounds]).
//
// Immutable once built; thread-safe to read.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "strata/status.h"
#include "strata/tensor.h"
#include "strata/types.h"

namespace strata::memory {

// Element offsets of tensors inside a chunk are multiples of this, so every
// tensor starts 64-byte aligned in 2-byte and in 4-byte chunks (a full
// AVX-512 register, and a multiple of the 16 bytes of a GPU vector load).
inline constexpr uint64_t kTensorAlignmentElems = 32;

struct TensorPlacement {
  uint32_t group = 0;           // index of the chunk group (= the param chunk)
  uint64_t offset_elems = 0;    // start inside every chunk of the group
  uint64_t num_elems = 0;
};

// Rank `rank`'s shard of a group of `n` elements shared by `world` ranks:
// elements [begin, end). Every rank's shard is `elems` long (a multiple of
// kTensorAlignmentElems, so shards start aligned); the last ranks' ranges
// may be short or empty.
struct ShardRange {
  uint64_t begin = 0;
  uint64_t end = 0;
  uint64_t elems = 0;
};
ShardRange ShardOf(uint64_t n, int rank, int world);

struct ShardSpec {
  int rank = 0;
  int world = 1;
  bool params = false;  // params sharded too, frozen ones included (with world > 1)
};

struct ChunkDesc {
  ChunkId id;
  ChunkKind kind = ChunkKind::kParam;
  DType dtype = DType::kFloat32;
  uint32_t group = 0;
  // Chunk size, or the tensor's size for an oversized tensor (a shard's size when sharded).
  uint64_t capacity_elems = 0;
  uint64_t used_elems = 0;      // end of the last tensor (of this rank's range when sharded)
  // Sharded chunks: the element of the group's param-chunk space this chunk
  // starts at (its elements are [shard_begin_elems, shard_begin_elems +
  // used_elems) of that space); 0 for whole chunks.
  uint64_t shard_begin_elems = 0;
  bool sharded = false;
  // A param chunk of a group whose params are sharded (ShardSpec::params):
  // no home of its own; its bytes are gathered from the master shards.
  bool transient = false;
  bool trainable = true;  // its group's
  uint64_t size_bytes() const;  // capacity in bytes, rounded up to the 4KiB slot alignment
};

// An optimizer state proper: a trainable group's master or moments. A
// frozen group's master shard (parameters sharded) is its parameters, and
// is homed and counted like them.
inline bool IsStateChunk(const ChunkDesc& chunk) { return IsOptimizerState(chunk.kind) && chunk.trainable; }

struct ChunkGroup {
  DType param_dtype = DType::kFloat32;
  bool trainable = true;
  uint32_t param_group = 0;  // its tensors' TensorSpec::param_group (0 when frozen)
  std::vector<TensorId> tensors;  // in layout order
  // Chunk of each kind in this group; nullopt for kinds the group lacks.
  std::array<std::optional<ChunkId>, kNumChunkKinds> chunk_of_kind;
};

struct LayoutReport {
  uint64_t chunk_size_elems = 0;
  bool searched = false;
  uint64_t tensor_elems = 0;    // sum over param chunks of their tensors
  uint64_t capacity_elems = 0;  // sum over param chunks of their capacity
  double waste_fraction() const {
    return capacity_elems == 0 ? 0.0 : 1.0 - static_cast<double>(tensor_elems) / static_cast<double>(capacity_elems);
  }
  uint64_t total_bytes = 0;  // all chunks of all kinds, as stored (transient param chunks are not)
  std::array<uint64_t, kNumChunkKinds> chunks_of_kind{};
};

// Bounds of the chunk size search, in elements; 0: not given.
struct SearchBounds {
  uint64_t min_elems = 0;
  uint64_t max_elems = 0;
};

// The widest bounds a derived search takes (the search's fixed bounds
// before they were derived).
inline constexpr uint64_t kWidestSearchMinElems = uint64_t{1} << 20;
inline constexpr uint64_t kWidestSearchMaxElems = uint64_t{1} << 26;

// The host tier the search assumes under host.budget auto (host_bytes 0),
// whose size follows the machine's free memory: a fixed figure, so that a
// resumed run and every rank build the same layout (the default host budget
// the search used before auto).
inline constexpr uint64_t kAutoHostSearchBytes = uint64_t{4} << 30;

// `given`'s bounds where set; the others derived so that the device tier of
// `device_bytes` holds several chunks of each kind compute touches (beside
// the largest tensor when it gets a chunk of its own) and the host tier of
// `host_bytes` (0: host.budget auto, kAutoHostSearchBytes) several chunk
// groups, their moments of `moment_dtype`. Never min > max.
SearchBounds SearchBoundsFor(const std::vector<TensorSpec>& tensors, SearchBounds given, uint64_t device_bytes,
                             uint64_t host_bytes, DType moment_dtype = DType::kFloat32);

class ChunkLayout {
 public:
  // chunk_size_elems == 0 searches [search_min_elems, search_max_elems].
  // The chunk size search and the packing are the same for every shard.
  // `moment_dtype`: the exp_avg and exp_avg_sq chunks' (optimizer.states).
  // kInt8Block (int8 states): tensors that QuantizesStates share chunks
  // with their like only, each starting on a block, and the others keep
  // fp32 moments; InvalidArgument when sharded across ranks.
  static Result<ChunkLayout> Build(const std::vector<TensorSpec>& tensors, uint64_t chunk_size_elems,
                                   uint64_t search_min_elems, uint64_t search_max_elems, ShardSpec shard = {},
                                   DType moment_dtype = DType::kFloat32);

  const std::vector<ChunkDesc>& chunks() const { return chunks_; }
  const std::vector<ChunkGroup>& groups() const { return groups_; }
  const ChunkDesc& chunk(ChunkId id) const { return chunks_.at(id.value()); }
  const TensorPlacement& placement(TensorId id) const { return placements_.at(id.value()); }
  // The chunk holding `tensor`'s copy of `kind`; NotSupported-free: nullopt
  // when that kind does not exist for the tensor (frozen, or fp32 master).
  std::optional<ChunkId> ChunkOf(TensorId tensor, ChunkKind kind) const;
  const LayoutReport& report() const { return report_; }
  const ShardSpec& shard() const { return shard_; }
  // Build's moment_dtype (optimizer.states), which small tensors' chunks under int8 states do not have.
  DType moment_dtype() const { return moment_dtype_; }

 private:
  std::vector<ChunkDesc> chunks_;
  std::vector<ChunkGroup> groups_;
  std::vector<TensorPlacement> placements_;
  LayoutReport report_;
  ShardSpec shard_;
  DType moment_dtype_ = DType::kFloat32;
};

// Element type of a chunk kind for a group whose params are `param_dtype`
// and whose moments are `moment_dtype`.
DType ChunkKindDType(ChunkKind kind, DType param_dtype, DType moment_dtype = DType::kFloat32);

}  // namespace strata::memory
