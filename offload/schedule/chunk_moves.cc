#include "offload/schedule/chunk_moves.h"

#include <algorithm>
#include <chrono>

#include <fmt/format.h>

namespace strata::offload {

MoveKinds::MoveKinds(std::initializer_list<MoveKind> kinds) {
  for (MoveKind kind : kinds) bits_ |= uint32_t{1} << static_cast<int>(kind);
}

MoveKinds MoveKinds::All() {
  return {MoveKind::kFetch, MoveKind::kRead, MoveKind::kEviction, MoveKind::kWriteBack, MoveKind::kUpdate};
}

bool QueuedMove::ended() const { return done.wait_for(std::chrono::seconds(0)) == std::future_status::ready; }

Status QueuedMove::Ended(uint32_t timeout_ms, std::string_view waited_as) const {
  if (done.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    return Timeout("pipeline: the {} of chunk {} did not finish within {} ms", waited_as, chunk.value(), timeout_ms);
  }
  return Status::Ok();
}

Status QueuedMove::Result(uint32_t timeout_ms, std::string_view waited_as) const {
  STRATA_RETURN_IF_ERROR(Ended(timeout_ms, waited_as));
  return done.get();
}

QueuedMove ChunkMoves::Add(QueuedMove move) {
  move.order = queued_++;
  chains_.at(move.chunk.value()).push_back({.move = move});
  return move;
}

std::optional<QueuedMove> ChunkMoves::Last(ChunkId chunk, MoveKinds kinds) const {
  const std::vector<Entry>& chain = chains_.at(chunk.value());
  const auto last = std::find_if(chain.rbegin(), chain.rend(), [&](const Entry& e) { return kinds.Has(e.move.kind); });
  if (last == chain.rend()) return std::nullopt;
  return last->move;
}

std::vector<QueuedMove> ChunkMoves::TakeLast(ChunkId chunk, std::initializer_list<MoveKind> kinds) {
  std::vector<QueuedMove> taken;
  for (MoveKind kind : kinds) {
    if (std::optional<QueuedMove> last = Last(chunk, {kind})) taken.push_back(std::move(*last));
  }
  std::erase_if(chains_.at(chunk.value()), [&](const Entry& e) {
    return std::find(kinds.begin(), kinds.end(), e.move.kind) != kinds.end();
  });
  return taken;
}

Status ChunkMoves::DropEnded(MoveKinds kinds, MoveKinds reported) {
  std::optional<QueuedMove> first;
  Status error;
  for (std::vector<Entry>& chain : chains_) {
    bool running_before = false;
    std::erase_if(chain, [&](Entry& e) {
      const bool ended = e.move.ended();  // once: a move that ends meanwhile is reported before it is dropped
      if (ended && kinds.Has(e.move.kind) && reported.Has(e.move.kind) && !e.reported) {
        e.reported = true;
        if (Status status = e.move.done.get(); !status.ok() && (!first || e.move.order < first->order)) {
          first = e.move;
          error = std::move(status);
        }
      }
      const bool drop = ended && kinds.Has(e.move.kind) && !running_before;
      running_before = running_before || !ended;
      return drop;
    });
  }
  if (!first) return Status::Ok();
  return error.WithContext(fmt::format(fmt::runtime(first->what), first->chunk.value()));
}

}  // namespace strata::offload
