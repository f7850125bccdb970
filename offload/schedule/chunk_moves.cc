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

const QueuedMove& ChunkMoves::Add(QueuedMove move) {
  std::vector<QueuedMove>& chain = chains_.at(move.chunk.value());
  chain.push_back(std::move(move));
  return chain.back();
}

std::optional<QueuedMove> ChunkMoves::Last(ChunkId chunk, MoveKinds kinds) const {
  const std::vector<QueuedMove>& chain = chains_.at(chunk.value());
  const auto last = std::find_if(chain.rbegin(), chain.rend(), [&](const QueuedMove& m) { return kinds.Has(m.kind); });
  if (last == chain.rend()) return std::nullopt;
  return *last;
}

std::vector<QueuedMove> ChunkMoves::Take(ChunkId chunk, MoveKinds kinds) {
  std::vector<QueuedMove>& chain = chains_.at(chunk.value());
  std::vector<QueuedMove> taken;
  std::erase_if(chain, [&](QueuedMove& m) {
    if (!kinds.Has(m.kind)) return false;
    taken.push_back(std::move(m));
    return true;
  });
  return taken;
}

Status ChunkMoves::DropEnded(MoveKinds kinds, MoveKinds reported) {
  Status first;
  for (std::vector<QueuedMove>& chain : chains_) {
    std::erase_if(chain, [&](const QueuedMove& m) {
      if (!kinds.Has(m.kind) || !m.ended()) return false;
      if (reported.Has(m.kind) && first.ok()) {
        if (Status status = m.done.get(); !status.ok()) {
          first = status.WithContext(fmt::format(fmt::runtime(m.what), m.chunk.value()));
        }
      }
      return true;
    });
  }
  return first;
}

}  // namespace strata::offload
