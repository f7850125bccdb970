// ChunkMoves: every move the pipeline has queued for a chunk, one chain a
// chunk in the order queued -- a fetch to the device, a read from NVMe ahead
// of a host moment, an eviction, a write-back to NVMe, an overlapped update
// -- until it has ended and been taken or dropped. The pipeline reads a
// chunk's chain to know what a new move of it follows and who reports a
// move's error (Note [One chain of moves per chunk] in pipeline.cc).
//
// Not thread-safe: the training loop's thread alone queues, takes and drops
// moves; a queued move's task holds copies of the futures it waits for.
#pragma once

#include <cstdint>
#include <future>
#include <initializer_list>
#include <optional>
#include <string_view>
#include <vector>

#include "strata/status.h"
#include "strata/types.h"

namespace strata::offload {

enum class MoveKind : uint8_t { kFetch, kRead, kEviction, kWriteBack, kUpdate };

// A set of kinds.
class MoveKinds {
 public:
  MoveKinds(std::initializer_list<MoveKind> kinds);
  bool Has(MoveKind kind) const { return (bits_ >> static_cast<int>(kind)) & 1; }
  static MoveKinds All();

 private:
  uint32_t bits_ = 0;
};

// What a fetch, a read or a write-back queued after a chunk's move off a tier
// or its update follows: the last of these queued.
inline const MoveKinds kMovesOffOrUpdates = {MoveKind::kEviction, MoveKind::kWriteBack, MoveKind::kUpdate};

struct QueuedMove {
  ChunkId chunk;
  MoveKind kind = MoveKind::kFetch;
  std::shared_future<Status> done;
  // How its error reads where it is reported, fmt-style with the chunk's id
  // ("evicting chunk {} from the device"); a string literal.
  const char* what = "moving chunk {}";
  uint64_t order = 0;  // its place among every move queued (ChunkMoves::Add sets it)

  bool ended() const;
  // Waits for the move to end, at most `timeout_ms`: Timeout ("the `waited_as`
  // of chunk C did not finish within T ms") when it has not.
  Status Ended(uint32_t timeout_ms, std::string_view waited_as) const;
  // Ended(), then what the move returned.
  Status Result(uint32_t timeout_ms, std::string_view waited_as) const;
};

class ChunkMoves {
 public:
  explicit ChunkMoves(size_t num_chunks) : chains_(num_chunks) {}

  // Appends a move to its chunk's chain; returns it.
  QueuedMove Add(QueuedMove move);
  // The last move of `kinds` in `chunk`'s chain, if any.
  std::optional<QueuedMove> Last(ChunkId chunk, MoveKinds kinds) const;
  bool Has(ChunkId chunk, MoveKinds kinds) const { return Last(chunk, kinds).has_value(); }
  // Removes `chunk`'s moves of `kinds` and returns the last of each kind, in
  // the order `kinds` lists them: what those return is the caller's to
  // report (a move queued again behind another of its kind is forgotten).
  std::vector<QueuedMove> TakeLast(ChunkId chunk, std::initializer_list<MoveKind> kinds);
  // Removes the moves of `kinds` that have ended, but for those queued after
  // a move of their chunk still running (so that Last never falls back past
  // a move that ended to an earlier one still under way). Returns the first
  // error, in the order queued, of the ended moves of `reported` not
  // reported before, with the move's `what`; the others' results are
  // reported by whoever waits for them (or by nobody: a move nothing used).
  Status DropEnded(MoveKinds kinds, MoveKinds reported);

 private:
  struct Entry {
    QueuedMove move;
    bool reported = false;  // its error went to DropEnded's caller
  };
  std::vector<std::vector<Entry>> chains_;  // by chunk id
  uint64_t queued_ = 0;                     // moves added, for QueuedMove::order
};

}  // namespace strata::offload
