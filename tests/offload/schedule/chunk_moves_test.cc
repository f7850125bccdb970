#include "offload/schedule/chunk_moves.h"

#include <future>
#include <string>

#include <gtest/gtest.h>

namespace strata::offload {
namespace {

// A move whose end the test decides.
struct Pending {
  std::promise<Status> promise;
  std::shared_future<Status> done = promise.get_future().share();
  QueuedMove Move(uint32_t chunk, MoveKind kind, const char* what = "moving chunk {}") const {
    return {.chunk = ChunkId(chunk), .kind = kind, .done = done, .what = what};
  }
};

TEST(ChunkMovesTest, TheLastMoveOfTheKindsAskedIsTheLatestQueuedForThatChunk) {
  ChunkMoves moves(3);
  Pending eviction, fetch, write_back, other_chunk;
  moves.Add(eviction.Move(1, MoveKind::kEviction));
  moves.Add(fetch.Move(1, MoveKind::kFetch));
  moves.Add(write_back.Move(1, MoveKind::kWriteBack));
  moves.Add(other_chunk.Move(2, MoveKind::kEviction));

  std::optional<QueuedMove> off = moves.Last(ChunkId(1), kMovesOffOrUpdates);
  ASSERT_TRUE(off.has_value());
  EXPECT_EQ(off->kind, MoveKind::kWriteBack);
  EXPECT_EQ(moves.Last(ChunkId(1), {MoveKind::kFetch})->kind, MoveKind::kFetch);
  EXPECT_EQ(moves.Last(ChunkId(1), {MoveKind::kEviction, MoveKind::kFetch})->kind, MoveKind::kFetch);
  EXPECT_FALSE(moves.Has(ChunkId(1), {MoveKind::kUpdate}));
  EXPECT_FALSE(moves.Has(ChunkId(0), MoveKinds::All()));
  EXPECT_EQ(moves.Last(ChunkId(2), MoveKinds::All())->chunk, ChunkId(2));
}

TEST(ChunkMovesTest, TakingKindsRemovesThemAloneAndGivesTheLastOfEachInTheOrderAsked) {
  ChunkMoves moves(1);
  Pending stale_fetch, read, eviction, fetch;
  moves.Add(stale_fetch.Move(0, MoveKind::kFetch));
  moves.Add(read.Move(0, MoveKind::kRead));
  moves.Add(eviction.Move(0, MoveKind::kEviction));
  moves.Add(fetch.Move(0, MoveKind::kFetch));
  stale_fetch.promise.set_value(IoError("a fetch of an iteration that left its plan"));

  const std::vector<QueuedMove> taken = moves.TakeLast(ChunkId(0), {MoveKind::kFetch, MoveKind::kRead});
  ASSERT_EQ(taken.size(), 2u);
  EXPECT_EQ(taken[0].kind, MoveKind::kFetch);
  EXPECT_FALSE(taken[0].ended());  // the last fetch; the one queued before it is forgotten
  EXPECT_EQ(taken[1].kind, MoveKind::kRead);
  EXPECT_FALSE(moves.Has(ChunkId(0), {MoveKind::kFetch, MoveKind::kRead}));
  EXPECT_EQ(moves.Last(ChunkId(0), MoveKinds::All())->kind, MoveKind::kEviction);
  EXPECT_TRUE(moves.TakeLast(ChunkId(0), {MoveKind::kFetch}).empty());
}

TEST(ChunkMovesTest, DroppingEndedMovesReportsTheFirstErrorQueuedOfTheKindsReportedOnce) {
  ChunkMoves moves(3);
  Pending failed_fetch, later_failure, failed_eviction, running_eviction, fine_write_back;
  moves.Add(failed_fetch.Move(0, MoveKind::kFetch));
  moves.Add(failed_eviction.Move(2, MoveKind::kEviction, "evicting chunk {} from the device"));
  moves.Add(later_failure.Move(0, MoveKind::kWriteBack, "writing chunk {} back"));
  moves.Add(running_eviction.Move(1, MoveKind::kEviction));
  moves.Add(fine_write_back.Move(1, MoveKind::kWriteBack));
  failed_fetch.promise.set_value(IoError("the fetch failed"));
  later_failure.promise.set_value(IoError("queued later"));
  failed_eviction.promise.set_value(IoError("the drive is gone"));
  fine_write_back.promise.set_value(Status::Ok());

  // Chunk 2's eviction was queued before chunk 0's write-back: its error is the first.
  const Status dropped = moves.DropEnded(kMovesOffOrUpdates, {MoveKind::kEviction, MoveKind::kWriteBack});
  EXPECT_EQ(dropped.code(), StatusCode::kIoError) << dropped.ToString();
  EXPECT_NE(dropped.message().find("evicting chunk 2 from the device: "), std::string::npos) << dropped.ToString();
  EXPECT_NE(dropped.message().find("the drive is gone"), std::string::npos) << dropped.ToString();
  EXPECT_FALSE(moves.Has(ChunkId(2), MoveKinds::All()));       // ended: dropped
  EXPECT_TRUE(moves.Has(ChunkId(0), {MoveKind::kFetch}));      // not among the kinds dropped
  EXPECT_FALSE(moves.Has(ChunkId(0), {MoveKind::kWriteBack}));  // queued after a move that ended: dropped
  // Chunk 1's write-back ended after an eviction still running: kept, so that
  // the last move off the host stays the write-back, never the older eviction.
  EXPECT_EQ(moves.Last(ChunkId(1), kMovesOffOrUpdates)->kind, MoveKind::kWriteBack);
  EXPECT_TRUE(moves.DropEnded(kMovesOffOrUpdates, {MoveKind::kEviction, MoveKind::kWriteBack}).ok())
      << "each error once";

  // A fetch's error is its access's: dropped unreported.
  EXPECT_TRUE(moves.DropEnded({MoveKind::kFetch}, /*reported=*/{}).ok());
  EXPECT_FALSE(moves.Has(ChunkId(0), {MoveKind::kFetch}));
  running_eviction.promise.set_value(Status::Ok());
  EXPECT_TRUE(moves.DropEnded(MoveKinds::All(), MoveKinds::All()).ok());
  for (uint32_t c = 0; c < 3; ++c) EXPECT_FALSE(moves.Has(ChunkId(c), MoveKinds::All())) << c;
}

TEST(ChunkMovesTest, AWaitForAMoveThatDoesNotEndIsATimeoutNamingTheChunkAndTheWait) {
  Pending fetch;
  const QueuedMove move = fetch.Move(7, MoveKind::kFetch);
  const Status ended = move.Ended(10, "prefetch");
  EXPECT_EQ(ended.code(), StatusCode::kTimeout) << ended.ToString();
  EXPECT_NE(ended.message().find("the prefetch of chunk 7 did not finish within 10 ms"), std::string::npos)
      << ended.ToString();
  EXPECT_FALSE(move.ended());

  fetch.promise.set_value(IoError("short read"));
  EXPECT_TRUE(move.ended());
  EXPECT_TRUE(move.Ended(10, "prefetch").ok());  // it ended: what it returned is not this wait's
  EXPECT_EQ(move.Result(10, "prefetch").code(), StatusCode::kIoError);
}

}  // namespace
}  // namespace strata::offload
