// The placement of chunks within a memory tier: compaction (Note
// [Compaction]) and where a chunk pinned on a memory tier lies (Note [Pins
// against pins]). Part of ResidencyManager (memory/residency.h).

#include <algorithm>
#include <cstring>
#include <tuple>

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
// step leaves each chunk whole in one slot. No budget needs compaction to
// train: the room a moment needs is kept whole by pins against pins (Note
// [Pins against pins]); compaction saves the evictions the plan did not make.

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

// The pieces of `pool`'s tier, by offset: its free extents and the slots of
// the chunks on it (a table of ResidencyManager::Chunk). A chunk in hold can
// move; one pinned, in flight or arriving cannot.
template <typename Chunks>
std::vector<Piece> PiecesOf(const TierPool& pool, const Chunks& chunks) {
  std::vector<Piece> pieces;
  for (Extent free : pool.FreeExtents()) pieces.push_back({free.offset, free.size_bytes});
  for (uint32_t i = 0; i < chunks.size(); ++i) {
    const auto& c = chunks[i];
    if (c.tier != pool.tier()) continue;
    pieces.push_back({c.extent.offset, c.extent.size_bytes, i, !c.in_flight && c.refs == 0 && !c.arriving});
  }
  std::sort(pieces.begin(), pieces.end(), [](const Piece& a, const Piece& b) { return a.offset < b.offset; });
  return pieces;
}

// The room of [begin, end) a pool holds aside, allocated, while the chunks
// there move out: what is free there is claimed at once and by each Take;
// everything held is given back by GiveBack or when this goes.
class HeldRoom {
 public:
  HeldRoom(TierPool& pool, uint64_t begin, uint64_t end) : pool_(pool), begin_(begin), end_(end) { Take(); }
  ~HeldRoom() { GiveBack(); }
  HeldRoom(const HeldRoom&) = delete;
  HeldRoom& operator=(const HeldRoom&) = delete;

  void Take() {
    for (Extent e : pool_.ClaimFree(begin_, end_)) held_.push_back(e);
  }
  void Add(Extent extent) { held_.push_back(extent); }
  // Keeps what is held allocated for good: its owner has taken it.
  void Keep() { held_.clear(); }
  void GiveBack() {
    for (Extent e : held_) pool_.Free(e);
    held_.clear();
  }

 private:
  TierPool& pool_;
  uint64_t begin_, end_;
  std::vector<Extent> held_;
};

// Allocates `place`, which must be free and whole.
Extent ClaimWhole(TierPool& pool, Extent place) {
  std::vector<Extent> claimed = pool.ClaimFree(place.offset, place.offset + place.size_bytes);
  STRATA_CHECK(claimed.size() == 1 && claimed[0] == place, "the {} tier's free place at {} (+{}) is in pieces",
               TierName(pool.tier()), place.offset, place.size_bytes);
  return claimed[0];
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

  const std::vector<Piece> pieces = PiecesOf(*target, chunks_);
  const std::optional<Window> window = CheapestWindow(pieces, size);
  if (!window || window->chunk_bytes == 0 || !ChunksFitOutside(pieces, *window)) return std::optional<Extent>();

  // Given back on every return: after a failed copy, or when a chunk was
  // taken or moved while an earlier one was copied, as it is.
  HeldRoom held(*target, window->begin, window->end);
  for (size_t k = window->first; k <= window->last; ++k) {
    if (!pieces[k].chunk) continue;
    STRATA_ASSIGN_OR_RETURN(std::optional<Extent> vacated,
                            MoveWithinTier(lock, tier, *pieces[k].chunk, pieces[k].offset));
    if (!vacated) return std::optional<Extent>();
    held.Add(*vacated);
  }
  held.GiveBack();
  return target->Allocate(size_bytes);
}

Result<std::optional<Extent>> ResidencyManager::MoveWithinTier(Lock& lock, Tier tier, uint32_t id,
                                                               uint64_t expected_offset, std::optional<Extent> dst) {
  TierPool* target = pool(tier);
  Chunk& chunk = chunks_[id];
  if (!InHoldAt(tier, id, expected_offset)) return std::optional<Extent>();
  if (!dst) dst = target->Allocate(chunk.size_bytes);
  if (!dst) return std::optional<Extent>();
  const Extent src = chunk.extent;
  chunk.in_flight = true;
  Status copied = AwaitFence(lock, chunk);  // Note [Fences] in residency.cc
  const bool fenced = copied.ok();          // else nothing was written to `dst`
  lock.unlock();
  if (copied.ok() && tier == Tier::kDevice) {
    copied = config_.device->CopyWithinDevice(Address(tier, *dst), Address(tier, src), chunk.size_bytes);
  } else if (copied.ok()) {
    std::memcpy(Address(tier, *dst), Address(tier, src), chunk.size_bytes);
  }
  lock.lock();
  chunk.in_flight = false;
  moved_.notify_all();
  if (!copied.ok()) {
    // The chunk keeps its slot. A copy that timed out may still be
    // writing its destination: that slot is never handed out again.
    if (fenced && copied.code() == StatusCode::kTimeout) {
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
// computes with its address, the CPU optimizer with its host bytes), so pins
// scattered over a memory tier can split its room into pieces none of which
// holds the next chunk, with room enough in total: with chunks of several
// sizes, a tight device tier would fail although the chunks pinned at once fit
// it, and a tight host tier likewise in an optimizer step, which pins a
// group's gradient, parameter and state chunks on the host together. So
// a chunk is pinned on a memory tier (device or host) only where it keeps
// room: where, with it and the chunks pinned, one unpinned piece of the tier
// (free room, chunks in hold or on their way) holds the room to keep, or all
// the room left where that is less. One that lies elsewhere first moves to
// such a place against a pinned chunk or an end of the tier (a place there
// splits no piece), made only of free room and chunks in hold: one its own
// slot does not overlap if any, then the one with the fewest bytes of
// chunks, then the lowest.
//
// The room to keep is the largest chunk's slot, but on a tight tier of
// chunks of several sizes (fewer than kTightTierChunks of its largest
// chunks: a moment may fill it) it is all the room left: pins keep it in
// one piece. A piece for the largest chunk is not enough there: one pin can
// leave a piece too small for the chunks that still come while another
// holds the next one, and the one after finds the room in two pieces (a
// 32KiB host, an 8KiB chunk pinned 4KiB from its start: the group's fourth
// chunk had 8KiB free in two pieces). On a larger tier that split costs
// nothing a moment needs but room it leaves spare, and pins stay where they
// lie (no copy where the tier has room); chunks of one size lie in slots of
// their size, whose pieces hold whole chunks, and stay where they are too.
//
// A chunk that arrives to be pinned is put in such a place when free room
// there holds it. One in hold on the tier moves there within it; if chunks
// lie there (the tier has no free room there), room is made first: each
// moves within the tier to a free slot outside the place, or, with none, is
// evicted one tier down (Note [Eviction]: device to host, host to NVMe; on
// a host without NVMe it stays, and the chunk with it). A chunk whose own
// slot overlaps its place slides into it on the host (copies within host
// memory may overlap); on the device (copies within it must not) it leaves
// for a free slot elsewhere on the device first, or, with none, goes
// through the host. So the cost is nothing where the chunk keeps room where
// it lies or arrives, one copy within the tier where the tier has free room
// for it, and moves or evictions of chunks in hold only where it has not
// (NVMe-homed states read ahead into the host's staging room, Note [Host
// reserve] in placement.cc, move within the host before any is evicted).
// Where no place can be cleared (each holds a chunk pinned or in flight, or
// the tiers below are full), the chunk is pinned where it is; room is made
// once per access, and again after each look below. A chunk there that
// another access takes while room is made (the lock is let go for each
// copy: it moves, evicts or pins it) sends the pin to look again once that
// chunk has landed (Note [Waiting for a place]): a pin that gave up there
// would lie where it splits the room, and a model at the least budget the
// engine names (a tiny Mixtral, whose moments fill the device) would run out
// of room in backward with room enough in total.
//
// The guarantee. Which pieces the tier has depends only on where the pinned
// chunks lie. Released last in, first out, pins go back through layouts the
// tier had before, each of which kept room; so on a tight tier every chunk
// fits whose size plus the bytes pinned is within the capacity, however the
// free room lay before (compaction and eviction clear the piece), and on a
// larger one every chunk fits that a piece of the room to keep holds.
// Released out of order, a pin can leave the room in pieces that the pins
// still held keep apart (a chunk released while one pinned beside it stays
// pinned: a hole), until they are released; a chunk then fits if a piece
// holds it. Where the chunks pinned and the request are over the capacity,
// the OutOfMemory error says so with the figures and the option to raise;
// where the room left is in pieces, it says that.
//
// The adapter releases last in, first out: a module's chunks as it returns,
// a parent's after its children's, a moment's gradient chunks with its
// parameters', an update group's chunks all together; in backward a module
// call lets go of every pin but those of its enclosing calls before it pins
// its own (python/strata/hooks.py).

namespace {

// A memory tier of fewer of its largest chunks than this is tight: a moment
// may fill it, so pins keep its room in one piece (Note [Pins against pins]).
constexpr uint64_t kTightTierChunks = 8;

// Whether pinning `place` besides `pinned` leaves an unpinned piece of the
// tier of `keep` bytes, or all the room left where that is less.
bool KeepsRoom(std::vector<Extent> pinned, uint64_t capacity, Extent place, uint64_t keep) {
  pinned.push_back(place);
  std::sort(pinned.begin(), pinned.end(), [](const Extent& a, const Extent& b) { return a.offset < b.offset; });
  uint64_t pinned_bytes = 0, largest_piece = 0, at = 0;
  for (Extent e : pinned) {
    pinned_bytes += e.size_bytes;
    largest_piece = std::max(largest_piece, e.offset > at ? e.offset - at : 0);
    at = std::max(at, e.offset + e.size_bytes);
  }
  largest_piece = std::max(largest_piece, capacity > at ? capacity - at : 0);
  return pinned_bytes > capacity || largest_piece >= std::min(keep, capacity - pinned_bytes);
}

// A place of a chunk's slot size against pins.
struct Place {
  uint64_t offset = 0;
  uint64_t chunk_bytes = 0;  // of the chunks there but the one placed
  bool overlaps_own = false;  // the placed chunk's own slot is partly there
};

// The place [begin, begin + size), or nullopt where a gap (a slot reserved
// for a chunk arriving) or a chunk that cannot move lies in it; `own`: the
// chunk placed, when it is on the tier. `pieces` are sorted by offset.
std::optional<Place> PlaceAt(const std::vector<Piece>& pieces, uint64_t begin, uint64_t size,
                             std::optional<uint32_t> own) {
  const uint64_t end = begin + size;
  Place place{begin};
  uint64_t covered = begin;  // up to here, made of pieces that can move
  for (const Piece& p : pieces) {
    if (p.offset + p.size_bytes <= begin) continue;
    if (p.offset >= end || std::max(p.offset, begin) != covered || !p.movable) break;
    covered = p.offset + p.size_bytes;
    if (!p.chunk) continue;
    if (p.chunk == own) {
      place.overlaps_own = true;
    } else {
      place.chunk_bytes += p.size_bytes;
    }
  }
  if (covered < end) return std::nullopt;
  return place;
}

// The best place of `size` bytes against `pinned` or an end of the tier
// that keeps a piece of `keep` bytes, by Note [Pins against pins].
std::optional<Place> BestPlaceAgainstPins(const std::vector<Piece>& pieces, const std::vector<Extent>& pinned,
                                          uint64_t capacity, uint64_t size, std::optional<uint32_t> own,
                                          uint64_t keep) {
  if (size > capacity) return std::nullopt;
  std::vector<uint64_t> starts{0, capacity - size};
  for (Extent e : pinned) {
    if (e.offset + e.size_bytes + size <= capacity) starts.push_back(e.offset + e.size_bytes);
    if (e.offset >= size) starts.push_back(e.offset - size);
  }
  const auto key = [](const Place& p) { return std::tuple(p.overlaps_own, p.chunk_bytes, p.offset); };
  std::optional<Place> best;
  for (uint64_t begin : starts) {
    std::optional<Place> place = PlaceAt(pieces, begin, size, own);
    if (!place || !KeepsRoom(pinned, capacity, {begin, size}, keep)) continue;
    if (!best || key(*place) < key(*best)) best = place;
  }
  return best;
}

}  // namespace

uint64_t ResidencyManager::RoomToKeep(Tier tier) const {
  const uint64_t capacity = pool(tier)->usage().capacity_bytes;
  const uint64_t largest = RoundUp(max_chunk_bytes_, kSlotAlignmentBytes);
  const bool one_size = RoundUp(min_chunk_bytes_, kSlotAlignmentBytes) == largest;
  return !one_size && capacity < kTightTierChunks * largest ? capacity : largest;
}

std::vector<Extent> ResidencyManager::PinnedExtents(Tier tier) const {
  std::vector<Extent> pinned;
  for (const Chunk& c : chunks_) {
    if (c.tier == tier && c.refs > 0) pinned.push_back(c.extent);
  }
  return pinned;
}

std::optional<Extent> ResidencyManager::AllocateAgainstPins(Tier tier, uint64_t size_bytes) {
  TierPool* target = pool(tier);
  const std::optional<Place> place =
      BestPlaceAgainstPins(PiecesOf(*target, chunks_), PinnedExtents(tier), target->usage().capacity_bytes,
                           RoundUp(size_bytes, kSlotAlignmentBytes), std::nullopt, RoomToKeep(tier));
  if (!place || place->chunk_bytes > 0) return std::nullopt;
  return ClaimWhole(*target, {place->offset, RoundUp(size_bytes, kSlotAlignmentBytes)});
}

Result<ResidencyManager::PinPlace> ResidencyManager::PlaceAgainstPins(Lock& lock, Tier tier, uint32_t id,
                                                                       bool make_room, int& waits) {
  TierPool* target = pool(tier);
  const Chunk& chunk = chunks_[id];
  const uint64_t capacity = target->usage().capacity_bytes;
  const Extent slot = chunk.extent;
  const std::vector<Extent> pinned = PinnedExtents(tier);
  const uint64_t keep = RoomToKeep(tier);
  if (KeepsRoom(pinned, capacity, slot, keep)) return PinPlace::kHere;
  const std::vector<Piece> pieces = PiecesOf(*target, chunks_);
  const std::optional<Place> place = BestPlaceAgainstPins(pieces, pinned, capacity, slot.size_bytes, id, keep);
  if (!place) {
    std::vector<uint32_t> moving;  // the chunks in flight on the tier or arriving on it, not pinned
    for (uint32_t i = 0; i < chunks_.size(); ++i) {
      const Chunk& c = chunks_[i];
      if (c.refs == 0 && ((c.tier == tier && c.in_flight) || c.arriving == tier)) moving.push_back(i);
    }
    return WaitForAMove(lock, moving, waits);
  }
  const Extent window{place->offset, slot.size_bytes};
  if (place->chunk_bytes > 0 || place->overlaps_own) {
    if (!make_room) return PinPlace::kHere;
    STRATA_ASSIGN_OR_RETURN(std::optional<uint32_t> stopped_by, MakeRoomAgainstPins(lock, tier, id, window));
    if (stopped_by) {  // Note [Waiting for a place]: looks again once it has landed
      STRATA_ASSIGN_OR_RETURN(PinPlace waited, WaitForAMove(lock, {*stopped_by}, waits));
      if (waited == PinPlace::kWaited) return waited;
    }
    return PinPlace::kMoved;
  }
  const Extent dst = ClaimWhole(*target, window);
  STRATA_ASSIGN_OR_RETURN(std::optional<Extent> left, MoveWithinTier(lock, tier, id, slot.offset, dst));
  target->Free(left ? *left : dst);
  return left ? PinPlace::kMoved : PinPlace::kHere;
}

Result<std::optional<uint32_t>> ResidencyManager::MakeRoomAgainstPins(Lock& lock, Tier tier, uint32_t id,
                                                                        Extent window) {
  TierPool* target = pool(tier);
  const uint64_t end = window.offset + window.size_bytes;
  std::vector<Piece> there;  // the other chunks in hold there, as they lie now
  std::optional<uint64_t> own_offset;  // chunk `id`'s, when its slot overlaps the place
  for (const Piece& p : PiecesOf(*target, chunks_)) {
    if (!p.chunk || p.offset >= end || p.offset + p.size_bytes <= window.offset) continue;
    if (*p.chunk == id) {
      own_offset = p.offset;
    } else {
      there.push_back(p);
    }
  }
  // Where a chunk is taken or moved while an earlier one moves, or nothing
  // holds one, the room held is given back and the chunk stays.
  HeldRoom held(*target, window.offset, end);
  for (const Piece& p : there) {
    STRATA_ASSIGN_OR_RETURN(bool moved, MoveOutOfPlace(lock, tier, *p.chunk, p.offset, /*keep=*/false));
    if (!moved) return TakenMeanwhile(tier, *p.chunk, p.offset);
    held.Take();
  }
  if (own_offset && tier == Tier::kHost) {  // slides into its place, the rest of which is held
    if (!InHoldAt(tier, id, *own_offset)) return std::optional<uint32_t>(id);
    held.Take();
    held.Keep();
    SlideWithinHost(lock, id, window);
    return std::optional<uint32_t>();
  }
  // The chunk leaves its place last, so that the chunks there do not lose
  // the free slots outside it to it; from then on the lock is held.
  if (own_offset) {
    STRATA_ASSIGN_OR_RETURN(bool moved, MoveOutOfPlace(lock, tier, id, *own_offset, /*keep=*/true));
    if (!moved) return TakenMeanwhile(tier, id, *own_offset);
    held.Take();
  }
  held.GiveBack();
  STRATA_RETURN_IF_ERROR(MoveIntoPlace(lock, tier, id, ClaimWhole(*target, window)));
  return std::optional<uint32_t>();
}

std::optional<uint32_t> ResidencyManager::TakenMeanwhile(Tier tier, uint32_t id, uint64_t offset) const {
  if (InHoldAt(tier, id, offset)) return std::nullopt;
  return id;
}

Status ResidencyManager::MoveIntoPlace(Lock& lock, Tier tier, uint32_t id, Extent dst) {
  Chunk& chunk = chunks_[id];
  if (const std::optional<Tier> below = TierBelow(tier); below && InHoldAt(*below, id)) {  // out through the tier below
    chunk.in_flight = true;
    std::vector<ChunkId> chain;
    return MoveFlagged(lock, ChunkId(id), tier, chain, dst);
  }
  STRATA_ASSIGN_OR_RETURN(std::optional<Extent> left, MoveWithinTier(lock, tier, id, chunk.extent.offset, dst));
  pool(tier)->Free(left ? *left : dst);
  return Status::Ok();
}

void ResidencyManager::SlideWithinHost(Lock& lock, uint32_t id, Extent window) {
  TierPool* host = pool(Tier::kHost);
  Chunk& chunk = chunks_[id];
  const Extent src = chunk.extent;
  chunk.in_flight = true;
  lock.unlock();
  std::memmove(Address(Tier::kHost, window), Address(Tier::kHost, src), chunk.size_bytes);
  lock.lock();
  chunk.in_flight = false;
  moved_.notify_all();
  // The slots are of one size and overlap: what the old one leaves lies on one side.
  if (src.offset < window.offset) host->Free({src.offset, window.offset - src.offset});
  if (src.offset > window.offset) host->Free({window.offset + window.size_bytes, src.offset - window.offset});
  chunk.extent = window;
  chunk.generation++;
  stats_.compactions++;
  stats_.compacted_bytes += chunk.size_bytes;
}

Result<bool> ResidencyManager::MoveOutOfPlace(Lock& lock, Tier tier, uint32_t id, uint64_t offset, bool keep) {
  if (!InHoldAt(tier, id, offset)) return false;
  STRATA_ASSIGN_OR_RETURN(std::optional<Extent> vacated, MoveWithinTier(lock, tier, id, offset));
  if (vacated) {
    pool(tier)->Free(*vacated);
    return true;
  }
  // No free slot of the tier holds it (the lock was held throughout).
  const std::optional<Tier> below = TierBelow(tier);
  if (!below) return false;
  std::vector<ChunkId> chain;
  if (!keep) {
    Status evicted = Evict(lock, tier, id, chain);
    if (evicted.code() == StatusCode::kOutOfMemory) return false;
    STRATA_RETURN_IF_ERROR(evicted);
    return true;
  }
  Result<Extent> slot = Reserve(lock, *below, chunks_[id].size_bytes, chain);
  if (slot.status().code() == StatusCode::kOutOfMemory) return false;
  STRATA_RETURN_IF_ERROR(slot.status());
  if (!InHoldAt(tier, id, offset)) {  // taken while room was made below
    pool(*below)->Free(*slot);
    return false;
  }
  chunks_[id].in_flight = true;
  STRATA_RETURN_IF_ERROR(MoveFlagged(lock, ChunkId(id), *below, chain, *slot));
  return true;
}

bool ResidencyManager::InHoldAt(Tier tier, uint32_t id, std::optional<uint64_t> offset) const {
  const Chunk& c = chunks_[id];
  return c.tier == tier && !c.in_flight && c.refs == 0 && !c.arriving && (!offset || c.extent.offset == *offset);
}

Status ResidencyManager::NoRoomError(Tier tier, uint64_t size_bytes) const {
  const std::vector<Extent> pins = PinnedExtents(tier);
  uint64_t pinned_bytes = 0;
  for (Extent e : pins) pinned_bytes += e.size_bytes;
  const size_t pinned = pins.size();
  TierPool* target = pool(tier);
  const TierUsage usage = target->usage();
  const uint64_t capacity = usage.capacity_bytes;
  const uint64_t needed = pinned_bytes + RoundUp(size_bytes, kSlotAlignmentBytes);
  std::string why = fmt::format("every chunk on it is in use or moving ({} in use hold {})", pinned,
                                FormatSize(pinned_bytes));
  if (capacity - usage.used_bytes >= size_bytes) {  // Note [Pins against pins]: holes between pins
    why += fmt::format(", its {} free in pieces between them", FormatSize(capacity - usage.used_bytes));
  } else if (needed > capacity) {
    why += fmt::format(": the chunks one moment uses at once need {} of the tier's {}; raise {}.budget to at least "
                       "{} or lower chunk.size_elems",
                       FormatSize(needed), FormatSize(capacity), TierName(tier), FormatSize(needed));
  }
  return target->OutOfMemoryError(size_bytes, why);
}

}  // namespace strata::memory
