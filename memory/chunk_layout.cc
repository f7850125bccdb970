// Note [Sharded layout]
// Data parallel (a ShardSpec of more than one rank): a group's master and
// optimizer-state chunks hold only this rank's shard of the group — elements
// ShardOf(used, rank, world) of the param chunk's element space — so each
// rank stores 1/W of them; param and grad chunks stay whole. Every rank's
// layout has the same chunks of the same sizes. With ShardSpec::params
// (ZeRO-3), every group has a master shard, fp32 params too, and that shard
// is the rank's only stored copy of the parameters: the group's param chunk
// is transient (ChunkDesc::transient), a whole chunk gathered from every
// rank's shard while compute uses it, homed on no tier (nothing of it is
// written below the tier it is on). A frozen group's params are sharded too:
// its master shard is in the param dtype (nothing updates it), and it has no
// grad or state chunks.
//
// Note [Chunk size search]
// The chunk size (in elements) is given, or searched between two bounds for
// the least padding waste; sizes within one percentage point of the least
// waste count as equal, and the largest of them wins (fewer transfers).
//
// Note [Chunk size bounds]
// A bound the user does not give is derived from the budgets and the model,
// so that a small model under a small budget gets small chunks unasked. A
// moment touches the param chunks of one module (two where it straddles a
// chunk boundary) and, in backward, their grad chunks; the plan wants as
// many again arriving while it computes, and the tier some slack for chunks
// of differing sizes: so the device tier must hold kDeviceChunksPerKind
// param and grad chunks. A tensor larger than such a chunk gets a chunk of
// its own, and its moment needs its param and grad beside the others: their
// bytes come off the device budget first. The host tier must hold
// kHostChunkGroups whole groups (every kind): about as many as the staging
// of NVMe-homed states reads ahead (Note [Host reserve] in placement.cc).
// The largest size is the least of these and kWidestSearchMaxElems; the
// smallest is a 64th of it (the widest bounds' ratio), at most
// kWidestSearchMinElems and at most the model (a model smaller than that is
// one chunk). On the default budgets (1GiB device, 4GiB host) the largest is
// 21Mi elements for fp32 and 43Mi for bf16. Under host.budget auto the host
// tier is sized after the layout, from the machine's free memory, which a
// resumed run or another rank may not share; the search then assumes
// kAutoHostSearchBytes, so the chunk size depends on the model and the
// options only (a checkpoint names it and refuses another).

#include "memory/chunk_layout.h"

#include <algorithm>
#include <map>
#include <set>

#include "memory/tier_pool.h"
#include "src/base/alignment.h"

namespace strata::memory {
namespace {

uint64_t AlignElems(uint64_t elems) {
  return (elems + kTensorAlignmentElems - 1) / kTensorAlignmentElems * kTensorAlignmentElems;
}

// What tensors must share to share a chunk.
struct ChunkClass {
  DType dtype;
  bool trainable;
  uint32_t param_group;  // 0 for frozen tensors, which no optimizer updates
  bool int8_states;      // moments of 8-bit blocks (Note [8-bit states in chunks] in optim/cpu/cpu_kernels.cc)
  auto operator<=>(const ChunkClass&) const = default;
  // Where its tensors may start: on a block of 8-bit states.
  uint64_t Align(uint64_t elems) const {
    return int8_states ? RoundUp(elems, kInt8BlockElems) : AlignElems(elems);
  }
};

// `int8_states`: optimizer.states int8, under which a trainable tensor
// QuantizesStates or keeps fp32 moments in chunks of its own.
ChunkClass ClassOf(const TensorSpec& t, bool int8_states) {
  const bool quantized =
      int8_states && t.trainable && QuantizesStates(static_cast<uint64_t>(t.num_elements()));
  return {t.dtype, t.trainable, t.trainable ? t.param_group : 0, quantized};
}

struct PlannedChunk {
  ChunkClass cls;
  uint64_t capacity_elems;
  uint64_t used_elems = 0;
  std::vector<std::pair<TensorId, uint64_t>> tensors;  // id, offset
};

// Packs tensors into param chunks of `chunk_elems` (see the header for the
// rules; ClassOf for `int8_states`).
std::vector<PlannedChunk> Pack(const std::vector<TensorSpec>& tensors, uint64_t chunk_elems, bool int8_states) {
  std::vector<PlannedChunk> chunks;
  std::map<ChunkClass, size_t> open_chunk;  // class -> index into chunks

  auto append = [&](size_t index, uint32_t tensor) {
    PlannedChunk& chunk = chunks[index];
    uint64_t offset = chunk.cls.Align(chunk.used_elems);
    chunk.tensors.emplace_back(TensorId(tensor), offset);
    chunk.used_elems = offset + static_cast<uint64_t>(tensors[tensor].num_elements());
  };
  auto open_new = [&](ChunkClass cls, uint64_t capacity) {
    chunks.push_back({cls, cls.Align(capacity)});
    return chunks.size() - 1;
  };

  size_t begin = 0;
  while (begin < tensors.size()) {
    // A run: consecutive tensors of one module (a tensor with no module is a run of its own).
    size_t end = begin + 1;
    while (end < tensors.size() && !tensors[begin].module.empty() && tensors[end].module == tensors[begin].module) {
      ++end;
    }
    std::map<ChunkClass, std::vector<uint32_t>> by_class;
    for (size_t i = begin; i < end; ++i) {
      by_class[ClassOf(tensors[i], int8_states)].push_back(static_cast<uint32_t>(i));
    }
    for (const auto& [cls, members] : by_class) {
      uint64_t run_elems = 0;
      for (uint32_t t : members) run_elems = cls.Align(run_elems) + static_cast<uint64_t>(tensors[t].num_elements());
      auto open = open_chunk.find(cls);
      bool fits_open = open != open_chunk.end() &&
                       cls.Align(chunks[open->second].used_elems) + run_elems <= chunks[open->second].capacity_elems;
      if (fits_open || run_elems <= cls.Align(chunk_elems)) {
        size_t index = fits_open ? open->second : open_new(cls, chunk_elems);
        open_chunk[cls] = index;
        for (uint32_t t : members) append(index, t);
        continue;
      }
      for (uint32_t t : members) {  // the module does not fit in one chunk: tensor by tensor
        uint64_t elems = static_cast<uint64_t>(tensors[t].num_elements());
        if (elems > cls.Align(chunk_elems)) {  // an oversized tensor gets its own chunk; the open one stays open
          append(open_new(cls, elems), t);
          continue;
        }
        auto it = open_chunk.find(cls);
        if (it == open_chunk.end() ||
            cls.Align(chunks[it->second].used_elems) + elems > chunks[it->second].capacity_elems) {
          open_chunk[cls] = open_new(cls, chunk_elems);
        }
        append(open_chunk[cls], t);
      }
    }
    begin = end;
  }
  // Under int8 states the tensors too small for 8-bit blocks are few and small (norms, biases): their chunks
  // are cut to what they hold rather than padded to the chunk size with 16 bytes an element of every kind.
  for (PlannedChunk& chunk : chunks) {
    if (int8_states && chunk.cls.trainable && !chunk.cls.int8_states) {
      chunk.capacity_elems = AlignElems(chunk.used_elems);
    }
  }
  return chunks;
}

uint64_t CapacityOf(const std::vector<PlannedChunk>& chunks) {
  uint64_t capacity = 0;
  for (const PlannedChunk& chunk : chunks) capacity += chunk.capacity_elems;
  return capacity;
}

Status ValidateTensors(const std::vector<TensorSpec>& tensors) {
  std::set<std::string> names;
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorSpec& t = tensors[i];
    if (t.name.empty()) return InvalidArgument("tensor #{}: the name is empty: every tensor needs a unique name", i);
    if (!names.insert(t.name).second) {
      return InvalidArgument("tensor '{}': registered twice: names must be unique", t.name);
    }
    for (int64_t d : t.shape) {
      if (d <= 0) {
        return InvalidArgument("tensor '{}': dimension {} is not allowed: every dimension must be > 0", t.name, d);
      }
    }
  }
  return Status::Ok();
}

// The chunk size in [search_min_elems, search_max_elems] that packs
// `tensors` (of tensor_elems in all) with the least waste; see Note [Chunk
// size search].
Result<uint64_t> SearchChunkSize(const std::vector<TensorSpec>& tensors, uint64_t tensor_elems,
                                 uint64_t search_min_elems, uint64_t search_max_elems, bool int8_states) {
  if (search_min_elems == 0 || search_min_elems > search_max_elems) {
    return InvalidArgument("chunk size search: bounds [{}, {}] are not allowed: expected 0 < min <= max",
                           search_min_elems, search_max_elems);
  }
  // A chunk larger than everything gains nothing: stop there.
  uint64_t upper = std::min(search_max_elems, AlignElems(tensor_elems + kTensorAlignmentElems * tensors.size()));
  // Smaller chunks always waste less at the tail, but every chunk is a
  // transfer: take the largest chunk whose waste is within
  // kWasteToleranceFraction of the least waste found.
  constexpr double kWasteToleranceFraction = 0.01;
  std::vector<std::pair<uint64_t, double>> candidates;  // size, waste fraction
  double least_waste = 1.0;
  for (uint64_t size = AlignElems(search_min_elems); size <= std::max(upper, AlignElems(search_min_elems));
       size += std::max<uint64_t>(kTensorAlignmentElems, AlignElems(size / 64))) {
    const double capacity = static_cast<double>(CapacityOf(Pack(tensors, size, int8_states)));
    double waste = 1.0 - static_cast<double>(tensor_elems) / capacity;
    candidates.emplace_back(size, waste);
    least_waste = std::min(least_waste, waste);
  }
  uint64_t chosen = 0;
  for (const auto& [size, waste] : candidates) {
    if (waste <= least_waste + kWasteToleranceFraction) chosen = size;
  }
  return chosen;
}

// See Note [Chunk size bounds].
constexpr uint64_t kDeviceChunksPerKind = 6;
constexpr uint64_t kHostChunkGroups = 4;

}  // namespace

SearchBounds SearchBoundsFor(const std::vector<TensorSpec>& tensors, SearchBounds given, uint64_t device_bytes,
                             uint64_t host_bytes, DType moment_dtype) {
  const uint64_t fp32_bytes = DTypeSizeBytes(DType::kFloat32);
  uint64_t device_elem_bytes = 1;  // param and grad, of the widest class
  uint64_t host_elem_bytes = 1;    // every kind of a group, of the widest class
  uint64_t largest_elems = 0;
  uint64_t total_elems = 0;
  for (const TensorSpec& t : tensors) {
    const uint64_t param_bytes = DTypeSizeBytes(t.dtype);
    const uint64_t master_bytes = t.dtype == DType::kFloat32 ? 0 : fp32_bytes;
    device_elem_bytes = std::max(device_elem_bytes, t.trainable ? 2 * param_bytes : param_bytes);
    host_elem_bytes =
        std::max(host_elem_bytes,
                 t.trainable ? 2 * param_bytes + master_bytes + 2 * DTypeSizeBytes(moment_dtype) : param_bytes);
    largest_elems = std::max(largest_elems, static_cast<uint64_t>(t.num_elements()));
    total_elems += static_cast<uint64_t>(t.num_elements());
  }
  uint64_t device_max = device_bytes / (kDeviceChunksPerKind * device_elem_bytes);
  if (largest_elems > device_max && largest_elems * device_elem_bytes < device_bytes) {
    device_max = (device_bytes - largest_elems * device_elem_bytes) / (kDeviceChunksPerKind * device_elem_bytes);
  }
  if (host_bytes == 0) host_bytes = kAutoHostSearchBytes;
  const uint64_t host_max = host_bytes / (kHostChunkGroups * host_elem_bytes);
  const uint64_t max_elems =
      std::max(kTensorAlignmentElems, std::min({kWidestSearchMaxElems, device_max, host_max}) /
                                          kTensorAlignmentElems * kTensorAlignmentElems);
  constexpr uint64_t kWidestRatio = kWidestSearchMaxElems / kWidestSearchMinElems;
  const uint64_t min_elems =
      AlignElems(std::max<uint64_t>(1, std::min({kWidestSearchMinElems, max_elems / kWidestRatio, total_elems})));
  SearchBounds bounds;
  bounds.max_elems = given.max_elems > 0 ? given.max_elems : std::max(max_elems, given.min_elems);
  bounds.min_elems = given.min_elems > 0 ? given.min_elems : std::min(min_elems, bounds.max_elems);
  return bounds;
}

DType ChunkKindDType(ChunkKind kind, DType param_dtype, DType moment_dtype) {
  if (kind == ChunkKind::kExpAvg || kind == ChunkKind::kExpAvgSq) return moment_dtype;
  return IsOptimizerState(kind) ? DType::kFloat32 : param_dtype;
}

ShardRange ShardOf(uint64_t n, int rank, int world) {
  ShardRange range;
  range.elems = AlignElems((n + static_cast<uint64_t>(world) - 1) / static_cast<uint64_t>(world));
  range.begin = std::min(n, static_cast<uint64_t>(rank) * range.elems);
  range.end = std::min(n, range.begin + range.elems);
  return range;
}

uint64_t ChunkDesc::size_bytes() const {
  return RoundUp(ChunkBytes(dtype, capacity_elems), kSlotAlignmentBytes);
}

Result<ChunkLayout> ChunkLayout::Build(const std::vector<TensorSpec>& tensors, uint64_t chunk_size_elems,
                                       uint64_t search_min_elems, uint64_t search_max_elems, ShardSpec shard,
                                       DType moment_dtype) {
  STRATA_RETURN_IF_ERROR(ValidateTensors(tensors));
  if (tensors.empty()) return InvalidArgument("chunk layout: no tensors registered: register at least one tensor");
  if (shard.world < 1 || shard.rank < 0 || shard.rank >= shard.world) {
    return InvalidArgument("chunk layout: rank {} of {} ranks is not allowed: expected 0 <= rank < world", shard.rank,
                           shard.world);
  }

  const bool int8_states = moment_dtype == DType::kInt8Block;
  if (int8_states && shard.world > 1) {
    return InvalidArgument("chunk layout: int8 optimizer states across {} ranks: 8-bit states are not sharded for "
                           "data parallelism (use optimizer.states fp32 or bf16 there)",
                           shard.world);
  }
  ChunkLayout layout;
  layout.shard_ = shard;
  layout.moment_dtype_ = moment_dtype;
  uint64_t tensor_elems = 0;
  for (const TensorSpec& t : tensors) tensor_elems += static_cast<uint64_t>(t.num_elements());

  layout.report_.searched = chunk_size_elems == 0;
  uint64_t chosen = AlignElems(chunk_size_elems);
  if (chunk_size_elems == 0) {
    STRATA_ASSIGN_OR_RETURN(chosen,
                            SearchChunkSize(tensors, tensor_elems, search_min_elems, search_max_elems, int8_states));
  }
  layout.report_.chunk_size_elems = chosen;

  std::vector<PlannedChunk> planned = Pack(tensors, chosen, int8_states);
  layout.placements_.resize(tensors.size());
  for (uint32_t g = 0; g < planned.size(); ++g) {
    const PlannedChunk& p = planned[g];
    ChunkGroup group;
    group.param_dtype = p.cls.dtype;
    group.trainable = p.cls.trainable;
    group.param_group = p.cls.param_group;
    for (const auto& [tensor, offset] : p.tensors) {
      group.tensors.push_back(tensor);
      layout.placements_[tensor.value()] = {g, offset, static_cast<uint64_t>(tensors[tensor.value()].num_elements())};
    }
    for (int k = 0; k < kNumChunkKinds; ++k) {
      auto kind = static_cast<ChunkKind>(k);
      const bool params_sharded = shard.params && shard.world > 1;
      bool exists = kind == ChunkKind::kParam || (kind == ChunkKind::kMaster && params_sharded) ||
                    (p.cls.trainable && (kind != ChunkKind::kMaster || p.cls.dtype != DType::kFloat32));
      if (!exists) continue;
      // Under int8 states, tensors too small for 8-bit blocks keep fp32 moments.
      const DType moments = p.cls.int8_states || !int8_states ? moment_dtype : DType::kFloat32;
      const DType dtype =
          kind == ChunkKind::kMaster && !p.cls.trainable ? p.cls.dtype : ChunkKindDType(kind, p.cls.dtype, moments);
      ChunkDesc desc{ChunkId(static_cast<uint32_t>(layout.chunks_.size())), kind, dtype, g, p.capacity_elems,
                     p.used_elems};
      desc.transient = params_sharded && kind == ChunkKind::kParam;
      desc.trainable = p.cls.trainable;
      if (shard.world > 1 && IsOptimizerState(kind)) {
        const ShardRange range = ShardOf(p.used_elems, shard.rank, shard.world);
        desc.capacity_elems = range.elems;
        desc.used_elems = range.end - range.begin;
        desc.shard_begin_elems = range.begin;
        desc.sharded = true;
      }
      group.chunk_of_kind[k] = desc.id;
      if (!desc.transient) layout.report_.total_bytes += desc.size_bytes();
      layout.report_.chunks_of_kind[k]++;
      layout.chunks_.push_back(desc);
    }
    layout.report_.capacity_elems += p.capacity_elems;
    layout.groups_.push_back(std::move(group));
  }
  layout.report_.tensor_elems = tensor_elems;
  return layout;
}

std::optional<ChunkId> ChunkLayout::ChunkOf(TensorId tensor, ChunkKind kind) const {
  return groups_.at(placements_.at(tensor.value()).group).chunk_of_kind[static_cast<int>(kind)];
}

}  // namespace strata::memory
