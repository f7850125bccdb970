// The placement of chunks within a memory tier: compaction (Note
// [Compaction]) and where a chunk pinned on the device lies (Note [Pins
// against pins]). Part of ResidencyManager (memory/residency.h).

#include <algorithm>
#include <cstring>

#include "memory/residency.h"
#include "src/base/alignment.h"
#include "src/base/logging.h"
#include "strata/options.h"

namespace strata::memory {

// Note [Compaction]
// Chunks differ in size (a parameter larger than the chunk size has a chunk
// of its own), so a memory tier can have the free bytes for a chunk in
// pieces none of which holds it. Evicting until a piece is large enough
// would evict chunks the plan keeps (and count bytes the planner, which
// counts bytes, never predicted). Instead: find the window of the tier's
// address space, as long as the request, made only of free pieces and chunks
// in hold, whose chunks are the fewest bytes; claim its free pieces so
// nothing else lands there; move each of its chunks to a free slot outside
// it (device to device: the device's own bandwidth, not the host link); then
// give the window back and allocate. Where the chunks of the window would not
// all find a slot outside it, nothing moves; if one is taken meanwhile, or
// its slot is taken, the window is given back as it is; either way the caller
// evicts instead. A failed copy is an error (the chunk keeps its slot). Every
// step leaves each chunk whole in one slot.

namespace {

// A piece of a memory tier's address space: a free extent or a chunk's slot.
struct Piece {
  uint64_t offset = 0, size_bytes = 0;
  std::optional<uint32_t> chunk;  // nullopt: free
  bool movable = true;
};

// Pieces [first, last], spanning [begin, end), whose chunks hold chunk_bytes.
struct Window {
  size_t first = 0, last = 0;
  uint64_t begin = 0, end = 0;
  uint64_t chunk_bytes = 0;
};

// The window of least chunk bytes: contiguous pieces, all movable, whose span
// reaches `size` (a slot reserved for a chunk arriving is in no piece: the
// gap ends the window). `pieces` are sorted by offset.
std::optional<Window> CheapestWindow(const std::vector<Piece>& pieces, uint64_t size) {
  std::optional<Window> best;
  for (size_t first = 0; first < pieces.size(); ++first) {
    uint64_t cost = 0;
    for (size_t last = first; last < pieces.size(); ++last) {
      const Piece& p = pieces[last];
      if (!p.movable || (last > first && p.offset != pieces[last - 1].offset + pieces[last - 1].size_bytes)) break;
      if (p.chunk) cost += p.size_bytes;
      if (best && cost >= best->chunk_bytes) break;
      if (p.offset + p.size_bytes - pieces[first].offset >= size) {
        best = Window{first, last, pieces[first].offset, p.offset + p.size_bytes, cost};
        break;
      }
    }
  }
  return best;
}

// Whether every chunk of `window` has a free slot outside it (first fit, as
// the allocator will place them).
bool ChunksFitOutside(const std::vector<Piece>& pieces, const Window& window) {
  std::vector<Extent> outside;
  for (const Piece& p : pieces) {
    if (!p.chunk && (p.offset + p.size_bytes <= window.begin || p.offset >= window.end)) {
      outside.push_back({p.offset, p.size_bytes});
    }
  }
  for (size_t k = window.first; k <= window.last; ++k) {
    if (!pieces[k].chunk) continue;
    auto fit = std::find_if(outside.begin(), outside.end(),
                            [&](const Extent& e) { return e.size_bytes >= pieces[k].size_bytes; });
    if (fit == outside.end()) return false;
    fit->offset += pieces[k].size_bytes;
    fit->size_bytes -= pieces[k].size_bytes;
  }
  return true;
}

}  // namespace

Result<std::optional<Extent>> ResidencyManager::Compact(Lock& lock, Tier tier, uint64_t size_bytes) {
  TierPool* target = pool(tier);
  const uint64_t size = RoundUp(size_bytes, kSlotAlignmentBytes);
  TierUsage usage = target->usage();
  if (usage.capacity_bytes - usage.used_bytes < size) return std::optional<Extent>();

  std::vector<Piece> pieces;
  for (Extent free : target->FreeExtents()) pieces.push_back({free.offset, free.size_bytes});
  for (uint32_t i = 0; i < chunks_.size(); ++i) {
    const Chunk& c = chunks_[i];
    if (c.tier != tier) continue;
    pieces.push_back({c.extent.offset, c.extent.size_bytes, i, !c.in_flight && c.refs == 0 && !c.arriving});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  const std::optional<Window> window = CheapestWindow(pieces, size);
  if (!window || window->chunk_bytes == 0 || !ChunksFitOutside(pieces, *window)) return std::optional<Extent>();

  std::vector<Extent> claimed = target->ClaimFree(window->begin, window->end);
  auto give_back = [&] {
    for (Extent e : claimed) target->Free(e);
  };
  for (size_t k = window->first; k <= window->last; ++k) {
    if (!pieces[k].chunk) continue;
    Result<std::optional<Extent>> vacated = MoveWithinTier(lock, tier, *pieces[k].chunk, pieces[k].offset);
    if (vacated.ok() && vacated.value()) {
      claimed.push_back(*vacated.value());
      continue;
    }
    give_back();  // a failed copy, or the chunk was taken or moved while an earlier one was copied
    if (!vacated.ok()) return vacated.status();
    return std::optional<Extent>();
  }
  give_back();
  return target->Allocate(size_bytes);
}

Result<std::optional<Extent>> ResidencyManager::MoveWithinTier(Lock& lock, Tier tier, uint32_t id,
                                                               uint64_t expected_offset, std::optional<Extent> dst) {
  TierPool* target = pool(tier);
  Chunk& chunk = chunks_[id];
  if (chunk.tier != tier || chunk.in_flight || chunk.refs > 0 || chunk.arriving ||
      chunk.extent.offset != expected_offset) {
    return std::optional<Extent>();
  }
  if (!dst) dst = target->Allocate(chunk.size_bytes);
  if (!dst) return std::optional<Extent>();
  const Extent src = chunk.extent;
  chunk.in_flight = true;
  lock.unlock();
  Status copied = Status::Ok();
  if (tier == Tier::kDevice) {
    copied = config_.device->CopyWithinDevice(Address(tier, *dst), Address(tier, src), chunk.size_bytes);
  } else {
    std::memcpy(Address(tier, *dst), Address(tier, src), chunk.size_bytes);
  }
  lock.lock();
  chunk.in_flight = false;
  moved_.notify_all();
  if (!copied.ok()) {
    // The chunk keeps its slot. A copy that timed out may still be
    // writing its destination: that slot is never handed out again.
    if (copied.code() == StatusCode::kTimeout) {
      STRATA_LOG_ERROR("chunk {}: a copy within the {} tier timed out; its {} destination is quarantined", id,
                       TierName(tier), FormatSize(dst->size_bytes));
    } else {
      target->Free(*dst);
    }
    return copied.WithContext(fmt::format("compacting the {} tier: moving chunk {} within it", TierName(tier), id));
  }
  chunk.extent = *dst;
  chunk.generation++;
  stats_.compactions++;
  stats_.compacted_bytes += chunk.size_bytes;
  return std::optional<Extent>(src);
}

// Note [Pins against pins]
// Compaction moves chunks in hold; a pinned chunk cannot move (the framework
// computes with its address), so pins scattered over the device tier can
// split its room into pieces none of which holds the next chunk, with room
// enough in total: with odd-sized chunks, a tight tier failed so although
// the chunks pinned at once fit it (issue 22). So a chunk lies against a
// pinned chunk or an end of the tier when it is pinned there: one that lies
// against neither moves first (device to device) into a free piece, at the
// piece's end that touches a pinned chunk or the tier's end, the lowest such
// place that holds it. Only free room is used, never an eviction, so this
// costs one copy within the device, and only for a chunk that arrived away
// from the pins.
//
// The guarantee: pins then never split the unpinned part of the tier (free
// room and chunks in hold) into more pieces than the pins released out of
// order leave behind. When pins are released last in, first out — a
// moment's chunks before those pinned across it, as the adapter's moments do
// — and the tier had free room for each such move, the unpinned part is one
// piece, which compaction and eviction clear: every chunk fits whose size
// plus the bytes pinned is within the capacity. Where that sum is over the
// capacity, the OutOfMemory error says so with the figures and the option
// to raise. A pinned chunk that found no free place stays where it is.

namespace {

// Whether a pinned chunk (or an end of the tier) lies at `offset`, reading
// `pinned`: the chunks pinned.
bool AgainstPins(const std::vector<Extent>& pinned, uint64_t capacity, uint64_t offset) {
  return offset == 0 || offset == capacity || std::any_of(pinned.begin(), pinned.end(), [&](const Extent& e) {
           return e.offset == offset || e.offset + e.size_bytes == offset;
         });
}

}  // namespace

Result<bool> ResidencyManager::PlaceAgainstPins(Lock& lock, uint32_t id) {
  TierPool* device = pool(Tier::kDevice);
  const Chunk& chunk = chunks_[id];
  const uint64_t capacity = device->usage().capacity_bytes;
  const uint64_t size = chunk.extent.size_bytes;
  std::vector<Extent> pinned;
  for (const Chunk& c : chunks_) {
    if (c.tier == Tier::kDevice && c.refs > 0) pinned.push_back(c.extent);
  }
  if (AgainstPins(pinned, capacity, chunk.extent.offset) || AgainstPins(pinned, capacity, chunk.extent.offset + size)) {
    return false;
  }
  std::optional<uint64_t> place;
  for (Extent free : device->FreeExtents()) {  // by offset: the first place found is the lowest
    if (free.size_bytes < size) continue;
    if (AgainstPins(pinned, capacity, free.offset)) {
      place = free.offset;
    } else if (AgainstPins(pinned, capacity, free.offset + free.size_bytes)) {
      place = free.offset + free.size_bytes - size;
    }
    if (place) break;
  }
  if (!place) return false;
  std::vector<Extent> claimed = device->ClaimFree(*place, *place + size);
  STRATA_CHECK(claimed.size() == 1 && claimed[0].size_bytes == size, "the free place at {} for chunk {} is in pieces",
               *place, id);
  STRATA_ASSIGN_OR_RETURN(std::optional<Extent> left,
                          MoveWithinTier(lock, Tier::kDevice, id, chunk.extent.offset, claimed[0]));
  device->Free(left ? *left : claimed[0]);
  return left.has_value();
}

Status ResidencyManager::NoRoomError(Tier tier, uint64_t size_bytes) const {
  uint64_t pinned_bytes = 0;
  uint32_t pinned = 0;
  for (const Chunk& c : chunks_) {
    if (c.tier != tier || c.refs == 0) continue;
    pinned_bytes += c.extent.size_bytes;
    pinned++;
  }
  TierPool* target = pool(tier);
  const uint64_t capacity = target->usage().capacity_bytes;
  const uint64_t needed = pinned_bytes + RoundUp(size_bytes, kSlotAlignmentBytes);
  std::string why = fmt::format("every chunk on it is in use or moving ({} in use hold {})", pinned,
                                FormatSize(pinned_bytes));
  if (needed > capacity) {
    why += fmt::format(": the chunks one moment uses at once need {} of the tier's {}; raise {}.budget to at least "
                       "{} or lower chunk.size_elems",
                       FormatSize(needed), FormatSize(capacity), TierName(tier), FormatSize(needed));
  }
  return target->OutOfMemoryError(size_bytes, why);
}

}  // namespace strata::memory
