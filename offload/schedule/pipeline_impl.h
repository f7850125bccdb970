// Internal to the pipeline (pipeline.cc includes it; nothing else may): Pipeline::Impl, the
// state of an iteration and the executor of the plan -- the queues that run its fetches,
// evictions, host reads and write-backs, the reconciling of the device with the plan, the
// links measured as they are used and the planning itself. pipeline.cc holds the moment
// protocol over it (Begin/EndIteration, Begin/EndMoment, Access) and the Notes on both.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "offload/schedule/chunk_moves.h"
#include "offload/schedule/pipeline.h"
#include "src/base/logging.h"
#include "src/base/task_queue.h"

namespace strata::offload {
namespace pipeline_detail {


using Clock = std::chrono::steady_clock;

// Note [Links measured as they are used]
// The plan is only as good as its bandwidths. The warm-up measures each link
// it used, but may not use all of them (optimizer states are first touched
// in host memory, so nothing is read from NVMe) and assumed figures stand in.
// So every replayed iteration measures again (a link's moves that used it
// alone, at least kMinMeasuredBytes of them), and when a link differs from
// the plan's figure by more than kBandwidthDrift the plan is made again from
// the same trace with the new figure: no re-recording, one planner run.
inline constexpr uint64_t kMinMeasuredBytes = 16 << 20;
inline constexpr double kBandwidthDrift = 0.25;
// How often a read ahead waiting for the host tier's room looks again
// (Note [Staging memory at run time]): a few percent of an NVMe read of a chunk.
inline constexpr std::chrono::milliseconds kHostRoomPoll{1};

inline double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// Note [Waits on queued moves]
// A queued move that has not ended within wait_timeout_ms is never taken as
// done. Where it was waited for, the wait is a Timeout naming the chunk, the
// move and the time waited (QueuedMove::Ended), and nothing moves on its account:
//  - a move of a chunk queued behind that chunk's last move or update (a
//    fetch or a read ahead behind an eviction, a write-back or an update
//    beside backward; a write-back behind the update) returns the Timeout,
//    which reaches the access that needs the chunk, or EndIteration for a
//    write-back; the chunk stays where the move before leaves it;
//  - BeginMoment waiting for room for the moment's non-model memory fails:
//    nothing else makes that room, and the caller would allocate into
//    memory still held;
//  - an access waiting for an overlapped update fails: until the
//    update ends it holds the chunk pinned on the host and writes it.
// Three waits go on after their timeout, because going on is safe there:
//  - a fetch waiting for its victims to leave (WaitForRoom): they only make
//    room, and the fetch's own move makes room by itself (the residency
//    manager evicts, or waits within its own deadline for chunks in flight:
//    Note [Waiting for room] in memory/residency.cc);
//  - an eviction waiting for the fetch of its chunk: the residency manager
//    moves one chunk at a time, so the eviction moves the chunk off the
//    device if it is there or moves nothing (the chunk then stays on the
//    device, costing room, never bytes), and the fetch is reported by the
//    access that waits for it;
//  - a read ahead waiting for staging memory (Note [Staging memory at run
//    time]): it waits for the training loop to reach a moment, not for a
//    transfer, so a loop that pauses (an evaluation) is no fault; past the
//    timeout it reads beyond the bound, which costs host room (the residency
//    manager evicts homed chunks for it), never bytes.
// What an ended move returned is reported by its own waiter
// (QueuedMove::Result): a wait that only orders moves, or room, takes its end
// alone (QueuedMove::Ended).


}  // namespace pipeline_detail

using pipeline_detail::Clock;
using pipeline_detail::kBandwidthDrift;
using pipeline_detail::kHostRoomPoll;
using pipeline_detail::kMinMeasuredBytes;
using pipeline_detail::SecondsSince;

struct Pipeline::Impl {
  enum class Mode { kOnDemand, kRecording, kReplaying };

  ~Impl() {
    // Transfers not started yet return at once; the queues (destroyed
    // next, as the last members) then drain quickly.
    {
      std::lock_guard lock(staging_mu);  // so that a waiting read cannot miss the change
      cancelled.store(true, std::memory_order_relaxed);  // a flag only: no data rides on it
    }
    staging_cv.notify_all();
  }

  Impl(Engine& e, const PipelineOptions& o) : engine(e), options(o), moves(e.chunks().size()) {
    for (const ChunkInfo& chunk : engine.chunks()) {
      chunk_bytes.push_back(chunk.size_bytes);
      largest_chunk_bytes = std::max(largest_chunk_bytes, chunk.size_bytes);
      Result<Tier> home = engine.ChunkHome(chunk.id);
      homes.push_back(home.ok() ? *home : Tier::kHost);
    }
    links = options.links;
  }

  Engine& engine;
  const PipelineOptions options;
  std::vector<uint64_t> chunk_bytes;
  uint64_t largest_chunk_bytes = 0;
  std::vector<Tier> homes;
  LinkBandwidths links;

  Mode mode = Mode::kOnDemand;
  bool need_trace = true;          // the next adaptive iteration records
  // kStatic: the chunks kept on the device, and the pins that keep them
  // there (none while a host moment has the chunk on the host).
  std::vector<ChunkId> kept_on_device;
  std::unordered_map<uint32_t, ChunkAccess> pins;
  std::vector<QueuedMove> reconcile_room;  // evictions Reconcile queued; the first moment waits
  std::optional<Plan> plan;
  Trace planned_trace;             // the trace the plan was made from
  Trace recording;                 // being recorded (or the last recorded)
  // Each chunk's queued moves (Note [One chain of moves per chunk] in pipeline.cc).
  ChunkMoves moves;
  // By chunk, for each read in its chain: its place on the host_read
  // queue, and a flag set once something waits for it or for a read behind
  // it (WantHostRead), which then goes at once (Note [Staging memory at run time]).
  struct WantedRead {
    uint64_t place;
    std::shared_ptr<std::atomic<bool>> wanted;
  };
  std::unordered_map<uint32_t, WantedRead> host_read_wanted;
  uint64_t host_reads_queued = 0;
  std::atomic<bool> cancelled{false};
  // Bytes of evictions to the host queued and not yet ended; a count only,
  // which the reads ahead look at (HostHasRoomFor): no data rides on it.
  std::atomic<uint64_t> coming_to_host{0};
  // Bytes of fetches and write-backs moving off the host now: room they
  // free there (WaitForHostRoom). A count only.
  std::atomic<uint64_t> leaving_host{0};
  // Fetches to the device and write-backs to NVMe queued, and ended (each
  // queue has one worker, so they end in the order queued): an eviction to a
  // full host waits for those queued before it (WaitForHostRoom). Counts only.
  uint64_t fetches_queued = 0, writes_queued = 0;  // the training loop's
  std::atomic<uint64_t> fetches_ended{0}, writes_ended{0};
  // Note [Staging memory at run time]
  // The plan bounds the host memory held by chunks read ahead of host
  // moments, at the granularity of moments (Plan::host_read_room: Note [Room
  // for reads ahead] in planner.cc); at run time a write-back may finish
  // later than the plan's model says, and reads would then find the host
  // full (and the residency manager evict homed chunks to make room). So the
  // bound is kept at run time too, the room of the moment begun last: a read
  // ahead waits until the chunks read ahead and not yet written back leave
  // it room and the host tier has the room in fact (the plan counts on
  // fetches that may not have landed yet, and evictions from the device must
  // still find their place), or until the moment that needs it has begun and
  // no chunk of an earlier moment is still being written back (then it must
  // be read, even beyond the bound: a moment may need more than the bound
  // holds). Reads are queued in the order they are needed, so the
  // write-backs waited for never wait for them. A read that something waits
  // for (an access, an overlapped update, Drain) is due at once, and so
  // is every read queued before it: that waiter may be the training loop,
  // which begins no later moment (and frees no room) until the read ends, so
  // a read waiting (or queued behind one waiting) for its moment or for room
  // would wait for itself. The other way round, an
  // eviction to a full host waits while a fetch or a write-back queued before
  // it has still to move a chunk off it (Note [Evictions waiting for the
  // host's room]): evictions run ahead of the fetches whose room they make,
  // and the residency manager would push a homed chunk (a read ahead) down
  // to NVMe, to be read again.
  std::mutex staging_mu;  // guards staged_due, writing, staged_bytes, staging_base and read_room
  std::condition_variable staging_cv;
  std::unordered_map<uint32_t, uint64_t> staged_due;  // read ahead, not yet written back: when needed
  std::unordered_set<uint32_t> writing;               // of those, the ones whose write-back is queued
  uint64_t staged_bytes = 0;
  uint64_t staging_base = 0;  // the plan's host_staging_bytes: the room off the plan
  uint64_t read_room = 0;     // the room of the moment begun last (Plan::host_read_room)
  std::atomic<uint64_t> begun{0};       // moments begun since the pipeline was made
  uint64_t moments_begun = 0;           // the same, for the training loop's thread
  uint32_t moment = 0;
  bool diverged = false;
  bool in_moment = false;
  Tier moment_tier = Tier::kDevice;   // where the current moment computes
  std::vector<ChunkId> host_accessed;  // by the current moment, on the host
  Clock::time_point iteration_start, moment_start;
  double moment_stall = 0;
  MemoryStats stats_at_start;
  PipelineStats stats;
  std::vector<Pipeline::TierBytes> timeline, last_timeline;  // Pipeline::last_timeline
  // This iteration's overlapped updates: their trace moment (when
  // recording), their outcome, and their compute time once done.
  struct OverlapRun {
    std::optional<size_t> traced;
    std::shared_future<Status> done;
    std::shared_ptr<double> seconds;
  };
  std::vector<OverlapRun> overlap_runs;

  void RecordTiers() {
    const MemoryStats now = engine.stats();
    Pipeline::TierBytes used{};
    for (int t = 0; t < kNumTiers; ++t) used[t] = now.tiers[t].used_bytes;
    timeline.push_back(used);
  }
  // Last: the queues' threads start after everything they touch exists, and
  // stop (finishing what is queued) before it goes.
  // One worker each: a link direction. Reads ahead of host moments have a
  // queue of their own: one waiting for staging room must not hold back a
  // device fetch's read behind it.
  TaskQueue nvme_read, host_read, nvme_write, device_to_host, host_to_device;
  TaskQueue overlap_lane;  // the host's lane: overlapped updates, one at a time

  // kStatic: the chunks kept on the device are there and pinned.
  Status PinStatic() {
    for (ChunkId c : kept_on_device) {
      if (pins.count(c.value()) > 0) continue;
      Result<Tier> tier = engine.ChunkTier(c);
      if (!tier.ok() || *tier != Tier::kDevice) stats.reconciled++;
      STRATA_ASSIGN_OR_RETURN(ChunkAccess pin, engine.AccessChunk(c, Tier::kDevice));
      pins.emplace(c.value(), std::move(pin));
    }
    return Status::Ok();
  }

  // BeginMoment and BeginHostMoment: `traced` as the trace would record it.
  Result<Tier> Begin(TraceMoment traced);

  Status Cancelled() const { return Internal("pipeline: cancelled (the pipeline is being destroyed)"); }

  // Moves `chunk` from `from` to `to`, unless it is not on `from` or in use
  // (a caller still holds it: the plan's move is skipped).
  Status MoveOff(ChunkId chunk, Tier from, Tier to) {
    if (cancelled.load(std::memory_order_relaxed)) return Cancelled();
    Status moved = engine.MoveChunkIfOn(chunk, from, to);
    if (moved.code() == StatusCode::kInvalidArgument) return Status::Ok();  // pinned by the caller
    return moved;
  }

  // Queues the eviction of `v` off the device, to its home or to `to`. Moves
  // of one chunk happen in the order they are queued, across queues: the
  // eviction waits for a fetch of the same chunk still under way, and a
  // later fetch waits for the eviction.
  QueuedMove QueueEviction(ChunkId v, std::optional<Tier> to = std::nullopt) {
    const std::optional<QueuedMove> arriving = moves.Last(v, {MoveKind::kFetch});
    const Tier target = to.value_or(homes[v.value()]);
    const uint64_t to_host = target == Tier::kHost ? chunk_bytes[v.value()] : 0;
    coming_to_host.fetch_add(to_host, std::memory_order_relaxed);
    const HostLeavers before_this{fetches_queued, writes_queued};
    std::shared_future<Status> done = device_to_host.Push([this, v, arriving, target, to_host, before_this]() -> Status {
      if (arriving && !arriving->Ended(options.wait_timeout_ms, "fetch").ok()) {
        // Still under way: the eviction goes on (Note [Waits on queued moves]).
        STRATA_LOG_INFO("pipeline: evicting chunk {} while its fetch is still under way after {} ms", v.value(),
                        options.wait_timeout_ms);
      }
      if (to_host > 0) WaitForHostRoom(to_host, before_this);
      Status moved = MoveOff(v, Tier::kDevice, target);
      coming_to_host.fetch_sub(to_host, std::memory_order_relaxed);
      return moved;
    });
    return moves.Add({.chunk = v,
                      .kind = MoveKind::kEviction,
                      .done = done,
                      .what = target == Tier::kHost ? "moving chunk {} from the device to the host for a host moment"
                                                    : "evicting chunk {} from the device"});
  }

  // Queues the read of NVMe-homed `r.chunk` into host memory for the host
  // moment `r.needed`, after whatever was queued for it before (Note [Host
  // moments] in planner.cc), once the staging memory has room for it or
  // that moment has begun (Note [Staging memory at run time]).
  // `due`: the count of moments begun (`begun`) once the moment that needs it has begun.
  void QueueHostRead(const PlannedRead& r, uint64_t due) {
    const ChunkId c = r.chunk;
    const std::optional<QueuedMove> before = moves.Last(c, kMovesOffOrUpdates);
    auto wanted = std::make_shared<std::atomic<bool>>(false);
    host_read_wanted[c.value()] = {host_reads_queued++, wanted};
    std::shared_future<Status> done = host_read.Push([this, c, before, due, wanted]() -> Status {
      if (before) STRATA_RETURN_IF_ERROR(before->Ended(options.wait_timeout_ms, "last move or update"));
      {
        std::unique_lock lock(staging_mu);
        const auto ready = [&] {
          if (cancelled.load(std::memory_order_relaxed)) return true;
          if (staged_bytes + chunk_bytes[c.value()] <= read_room && HostHasRoomFor(c)) return true;
          // Due: its moment has begun, or something waits for it.
          if (!wanted->load(std::memory_order_relaxed) && begun.load(std::memory_order_relaxed) < due) return false;
          return std::none_of(writing.begin(), writing.end(), [&](uint32_t w) { return staged_due.at(w) < due; });
        };
        // Nothing signals the host's room as other moves free it: looked at again every kHostRoomPoll.
        // Past the timeout the read goes on beyond the bound (Note [Waits on queued moves]).
        const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options.wait_timeout_ms);
        bool room = ready();
        while (!room && Clock::now() < deadline) {
          staging_cv.wait_for(lock, kHostRoomPoll);
          room = ready();
        }
        if (!room) {
          STRATA_LOG_INFO("pipeline: chunk {} is read ahead beyond the staging memory after {} ms of waiting for room",
                          c.value(), options.wait_timeout_ms);
        }
        if (staged_due.emplace(c.value(), due).second) staged_bytes += chunk_bytes[c.value()];
      }
      Status read = MoveOff(c, Tier::kNvme, Tier::kHost);
      if (!read.ok()) Unstage(c);
      return read;
    });
    moves.Add({.chunk = c, .kind = MoveKind::kRead, .done = std::move(done), .what = "reading chunk {} ahead"});
  }

  // Something is about to wait for the read ahead of `c` queued last (the
  // training loop, an overlapped update): it, and the reads queued
  // before it on the one-worker host_read queue, stop waiting for room or
  // for their moment (Note [Staging memory at run time]). Training loop only.
  void WantHostRead(ChunkId c) {
    auto it = host_read_wanted.find(c.value());
    if (it == host_read_wanted.end()) return;
    const uint64_t place = it->second.place;
    {
      std::lock_guard lock(staging_mu);  // so that a waiting read cannot miss the change
      for (const auto& [chunk, read] : host_read_wanted) {
        if (read.place <= place) read.wanted->store(true, std::memory_order_relaxed);  // a flag only
      }
    }
    staging_cv.notify_all();
    std::erase_if(host_read_wanted, [&](const auto& entry) { return entry.second.place <= place; });
  }

  // The fetches and write-backs queued before an eviction.
  struct HostLeavers {
    uint64_t fetches = 0, writes = 0;
  };

  // Note [Evictions waiting for the host's room]
  // An eviction to the host waits until the host tier has `bytes` free while
  // moves off the host may free it: the fetches and write-backs queued before
  // it (`before`) that have not ended, and any such move under way; at most
  // wait_timeout_ms, then it goes on and the residency manager makes the room
  // (Note [Staging memory at run time]). Only moves queued before it: each
  // waits only for moves queued before itself (its victims, its chunk's last
  // move, the reads of an overlapped update, which that update marks
  // wanted), never for this eviction or the training loop, so the wait cannot
  // wait for itself; a fetch queued after it may wait for it (as a victim).
  // A fetch queued before it frees its room even when it has not started yet.
  void WaitForHostRoom(uint64_t bytes, HostLeavers before) const {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options.wait_timeout_ms);
    const auto may_free = [&] {
      return leaving_host.load(std::memory_order_relaxed) > 0 ||
             fetches_ended.load(std::memory_order_relaxed) < before.fetches ||
             writes_ended.load(std::memory_order_relaxed) < before.writes;
    };
    while (!cancelled.load(std::memory_order_relaxed) && Clock::now() < deadline && may_free()) {
      const TierUsage host = engine.stats().tiers[static_cast<int>(Tier::kHost)];
      if (host.used_bytes + bytes <= host.capacity_bytes) return;
      std::this_thread::sleep_for(kHostRoomPoll);
    }
  }

  // Counts a fetch or write-back as ended when its task returns, whichever way.
  struct CountEnd {
    std::atomic<uint64_t>& ended;
    ~CountEnd() { ended.fetch_add(1, std::memory_order_relaxed); }
  };

  // Moves `chunk` off the host (to `to`) counting it in leaving_host while
  // it moves; only then, so that an eviction waiting for that room never
  // waits for a move that waits for something else (an update beside
  // backward, the eviction itself).
  Status MoveOffHost(ChunkId chunk, Tier to) {
    const uint64_t bytes = chunk_bytes[chunk.value()];
    leaving_host.fetch_add(bytes, std::memory_order_relaxed);
    Status moved = to == Tier::kNvme ? MoveOff(chunk, Tier::kHost, to) : engine.MoveChunk(chunk, to);
    leaving_host.fetch_sub(bytes, std::memory_order_relaxed);
    return moved;
  }

  // Whether the host tier holds `c` now beside the chunks queued to come
  // down from the device, and still has the slack the host reserve keeps
  // (two of the largest chunks: Note [Host reserve] in memory/placement.cc)
  // for evictions queued after the read, which land before the fetches that
  // free their room (Note [Staging memory at run time]).
  bool HostHasRoomFor(ChunkId c) const {
    const TierUsage host = engine.stats().tiers[static_cast<int>(Tier::kHost)];
    const uint64_t coming = coming_to_host.load(std::memory_order_relaxed);
    return host.used_bytes + coming + chunk_bytes[c.value()] + 2 * largest_chunk_bytes <= host.capacity_bytes;
  }

  // Chunks read ahead that no longer hold staging memory stop counting
  // against it: moved on by something else, or left on the host by a host
  // moment that never came (its moment a whole iteration past). A read still
  // under way (in its chunk's chain after DropFinishedFetches) keeps its place.
  void ForgetStagedElsewhere() {
    std::vector<std::pair<uint32_t, uint64_t>> chunks;
    {
      std::lock_guard lock(staging_mu);
      for (const auto& [c, due] : staged_due) chunks.emplace_back(c, due);
    }
    const uint64_t period = plan ? plan->num_moments : 0;
    for (const auto& [c, due] : chunks) {
      if (moves.Has(ChunkId(c), {MoveKind::kRead})) continue;
      Result<Tier> tier = engine.ChunkTier(ChunkId(c));
      if (!tier.ok() || *tier != Tier::kHost || due + period < moments_begun) Unstage(ChunkId(c));
    }
  }

  void Unstage(ChunkId c) {
    {
      std::lock_guard lock(staging_mu);
      if (staged_due.erase(c.value()) > 0) staged_bytes -= chunk_bytes[c.value()];
      writing.erase(c.value());
    }
    staging_cv.notify_all();
  }

  // After a host moment: its NVMe-homed chunks go back to the drive.
  void QueueWriteBacks() {
    for (ChunkId c : host_accessed) {
      if (homes[c.value()] != Tier::kNvme) continue;
      // kStatic: a chunk kept on the device goes back there, not to its home.
      if (std::find(kept_on_device.begin(), kept_on_device.end(), c) != kept_on_device.end()) continue;
      {
        std::lock_guard lock(staging_mu);
        if (staged_due.count(c.value()) > 0) writing.insert(c.value());
      }
      // After an overlapped update that holds it.
      const std::optional<QueuedMove> in_use = moves.Last(c, kMovesOffOrUpdates);
      writes_queued++;
      std::shared_future<Status> done = nvme_write.Push([this, c, in_use]() -> Status {
        const CountEnd end{writes_ended};
        Status written = in_use ? in_use->Ended(options.wait_timeout_ms, "last move or update") : Status::Ok();
        if (written.ok()) written = MoveOffHost(c, Tier::kNvme);
        Unstage(c);  // off the host, or staying there after a failed write: either way no longer a read ahead
        return written;
      });
      moves.Add({.chunk = c,
                 .kind = MoveKind::kWriteBack,
                 .done = std::move(done),
                 .what = "writing chunk {} back to NVMe after its host moment"});
    }
    host_accessed.clear();
  }

  // Waits for a move's victims to leave, at most wait_timeout_ms in all;
  // then it goes on (Note [Waits on queued moves]).
  void WaitForRoom(const std::vector<QueuedMove>& room) const {
    const Clock::time_point deadline = Clock::now() + std::chrono::milliseconds(options.wait_timeout_ms);
    for (const QueuedMove& r : room) {
      if (r.done.wait_until(deadline) != std::future_status::ready) return;
    }
  }

  // Queues the fetch of `c` to the device after `room` (its victims leaving)
  // and after its own last move.
  void QueueFetch(ChunkId c, std::vector<QueuedMove> room) {
    const std::optional<QueuedMove> before = moves.Last(c, kMovesOffOrUpdates);
    const auto after_before = [this, before]() -> Status {
      return before ? before->Ended(options.wait_timeout_ms, "last move or update") : Status::Ok();
    };
    std::optional<QueuedMove> staged;  // part of the fetch, not a move of its own in the chain
    if (homes[c.value()] == Tier::kNvme) {
      staged = QueuedMove{.chunk = c, .kind = MoveKind::kRead};
      staged->done = nvme_read.Push([this, c, room, after_before]() -> Status {
        if (cancelled.load(std::memory_order_relaxed)) return Cancelled();
        STRATA_RETURN_IF_ERROR(after_before());
        WaitForRoom(room);
        return MoveOff(c, Tier::kNvme, Tier::kHost);
      });
    }
    fetches_queued++;
    std::shared_future<Status> done = host_to_device.Push([this, c, room, staged, after_before]() -> Status {
      const CountEnd end{fetches_ended};
      // A victim that could not leave only costs room (the move below
      // evicts by itself; the eviction's error is reported at EndIteration).
      // A failed staging read is this chunk's error.
      if (cancelled.load(std::memory_order_relaxed)) return Cancelled();
      if (!staged) STRATA_RETURN_IF_ERROR(after_before());  // else the staging read waited for it
      WaitForRoom(room);
      if (staged) STRATA_RETURN_IF_ERROR(staged->Result(options.wait_timeout_ms, "NVMe read"));
      return MoveOffHost(c, Tier::kDevice);
    });
    moves.Add({.chunk = c, .kind = MoveKind::kFetch, .done = std::move(done), .what = "fetching chunk {}"});
  }

  // Queues moment k's moves; returns the evictions that make room for its
  // non-model memory, which the moment must wait for before it allocates.
  std::vector<QueuedMove> Issue(uint32_t k) {
    std::vector<QueuedMove> room_for_activations;
    const std::vector<ChunkId>& traced = planned_trace.moments[k].chunks;
    const bool on_host = plan->compute_tier[k] == Tier::kHost;
    for (ChunkId v : plan->evictions_at[k]) {
      // A host moment's own chunks stop on the host; the moment waits for them at its access.
      const bool for_host = on_host && std::find(traced.begin(), traced.end(), v) != traced.end();
      if (for_host) {
        QueueEviction(v, Tier::kHost);
      } else {
        room_for_activations.push_back(QueueEviction(v));
      }
    }
    for (const PlannedFetch& f : plan->fetches_at[k]) {
      std::vector<QueuedMove> room;
      for (ChunkId v : f.victims) room.push_back(QueueEviction(v));
      QueueFetch(f.chunk, std::move(room));
    }
    // Behind the fetches' victims: only a later host moment waits for them.
    for (ChunkId c : plan->offloads_at[k]) QueueEviction(c, Tier::kHost);
    // After the evictions queued here, so that a read waits for its chunk's.
    for (const PlannedRead& r : plan->host_reads_at[k]) {
      QueueHostRead(r, moments_begun + (r.needed >= k ? r.needed - k : plan->num_moments - k + r.needed));
    }
    return room_for_activations;
  }

  // The first error of an eviction or a write-back that has ended, once;
  // those still running are checked later. Ended updates leave the chains too.
  Status TakeEvictionError() {
    return moves.DropEnded(kMovesOffOrUpdates, {MoveKind::kEviction, MoveKind::kWriteBack});
  }

  // Fetches queued for an iteration that did not use them (it diverged):
  // done ones are dropped, so they neither hold back reconciliation nor hand
  // their result to an unrelated access later; and ended reads and updates.
  void DropFinishedFetches() {
    (void)moves.DropEnded({MoveKind::kFetch, MoveKind::kRead, MoveKind::kUpdate}, /*reported=*/{});
    std::erase_if(host_read_wanted,
                  [&](const auto& entry) { return !moves.Has(ChunkId(entry.first), {MoveKind::kRead}); });
  }

  // The device as the plan has it when an iteration begins: chunks it does
  // not have there leave, the ones it has and the device lacks come, in the
  // order the iteration first needs them.
  void Reconcile() {
    std::vector<bool> expected(chunk_bytes.size(), false);
    for (ChunkId c : plan->resident_at_start) expected[c.value()] = true;
    std::vector<QueuedMove> room;
    for (uint32_t c = 0; c < chunk_bytes.size(); ++c) {
      if (expected[c] || moves.Has(ChunkId(c), {MoveKind::kFetch})) continue;
      Result<Tier> tier = engine.ChunkTier(ChunkId(c));
      if (!tier.ok() || *tier != Tier::kDevice) continue;
      room.push_back(QueueEviction(ChunkId(c)));
      stats.reconciled++;
    }
    reconcile_room = room;  // the first moment waits for them too, before it allocates
    // Reads the plan issues in the iteration before for host moments of this one.
    for (uint32_t k = 0; k < plan->num_moments; ++k) {
      for (const PlannedRead& r : plan->host_reads_at[k]) {
        if (r.needed >= k || moves.Has(r.chunk, {MoveKind::kRead})) continue;
        Result<Tier> tier = engine.ChunkTier(r.chunk);
        if (!tier.ok() || *tier != Tier::kNvme) continue;
        QueueHostRead(r, moments_begun + 1 + r.needed);
        stats.reconciled++;
      }
    }
    std::vector<bool> queued(chunk_bytes.size(), false);
    for (const TraceMoment& m : planned_trace.moments) {
      for (ChunkId c : m.chunks) {
        if (!expected[c.value()] || queued[c.value()] || moves.Has(c, {MoveKind::kFetch})) continue;
        queued[c.value()] = true;
        Result<Tier> tier = engine.ChunkTier(c);
        if (tier.ok() && *tier == Tier::kDevice) continue;
        QueueFetch(c, room);
        stats.reconciled++;
      }
    }
  }

  // Recording: each overlapped update's compute time into the trace,
  // once it is done (the step waited for it).
  void TraceOverlapRuns() {
    for (const OverlapRun& run : overlap_runs) {
      if (!run.traced) continue;
      if (run.done.wait_for(std::chrono::milliseconds(options.wait_timeout_ms)) != std::future_status::ready) {
        continue;  // still running: its time stays unknown (0)
      }
      TraceMoment& m = recording.moments[*run.traced];
      m.compute_seconds = *run.seconds;
      if (m.device_compute_seconds && engine.device().is_emulated()) m.device_compute_seconds = m.compute_seconds;
    }
  }

  void Diverge(std::string_view why) {
    if (diverged) return;
    diverged = true;
    stats.divergences++;
    STRATA_LOG_INFO(
        "pipeline: the iteration left its plan at moment {} ({}); on demand until it ends, and the next iteration "
        "records a new trace",
        moment, why);
  }

  // Sets stats.bytes and the links' bandwidths from the moves since the
  // iteration began; true when a replayed iteration measured a link the
  // plan had wrong (Note [Links measured as they are used]).
  bool MeasureLinks(const MemoryStats& now) {
    const auto delta = [&](Tier from, Tier to) {
      const LinkStats& a = now.links[static_cast<int>(from)][static_cast<int>(to)];
      const LinkStats& b = stats_at_start.links[static_cast<int>(from)][static_cast<int>(to)];
      return LinkStats{.moves = a.moves - b.moves, .bytes = a.bytes - b.bytes, .seconds = a.seconds - b.seconds};
    };
    // Bytes: every move that used the link (device<->NVMe moves pass
    // through the host, so they count on both). Bandwidth: only the moves
    // that used that link alone.
    const std::array<std::array<LinkStats, 2>, kNumLinks> observed = {{
        {delta(Tier::kHost, Tier::kDevice), delta(Tier::kNvme, Tier::kDevice)},
        {delta(Tier::kDevice, Tier::kHost), delta(Tier::kDevice, Tier::kNvme)},
        {delta(Tier::kNvme, Tier::kHost), delta(Tier::kNvme, Tier::kDevice)},
        {delta(Tier::kHost, Tier::kNvme), delta(Tier::kDevice, Tier::kNvme)},
    }};
    constexpr std::array<double, kNumLinks> kAssumed = {25e9, 25e9, 3e9, 2e9};
    bool drifted = false;
    for (int l = 0; l < kNumLinks; ++l) {
      stats.bytes[l] = observed[l][0].bytes + observed[l][1].bytes;
      if (options.links.bytes_per_second[l] > 0) continue;  // given
      const LinkStats& alone = observed[l][0];
      const double measured =
          alone.bytes >= kMinMeasuredBytes && alone.seconds > 0 ? static_cast<double>(alone.bytes) / alone.seconds : 0;
      if (mode == Mode::kRecording && measured > 0) {
        links.bytes_per_second[l] = measured;
      } else if (links.bytes_per_second[l] <= 0) {
        links.bytes_per_second[l] = kAssumed[l];
      } else if (mode == Mode::kReplaying && measured > 0 &&
                 std::abs(measured / links.bytes_per_second[l] - 1) > kBandwidthDrift) {
        links.bytes_per_second[l] = measured;
        drifted = true;
      }
    }
    return drifted;
  }

  void MakePlan() {
    PlannerInput input;
    input.trace = recording;
    input.chunk_bytes = chunk_bytes;
    input.home = homes;
    input.device_bytes = options.device_bytes > 0 ? options.device_bytes : engine.options().device.budget_bytes;
    input.device_chunk_bytes = engine.options().device.budget_bytes;  // Note [The device model] in planner.cc
    input.links = links;
    input.host_staging_bytes =
        options.host_staging_bytes > 0 ? options.host_staging_bytes : engine.host_staging_bytes();
    {
      std::lock_guard lock(staging_mu);
      staging_base = input.host_staging_bytes;
      read_room = staging_base;
    }
    const Clock::time_point start = Clock::now();
    Result<Plan> built = BuildPlan(input);
    stats.planning_seconds = SecondsSince(start);
    const std::string previous_error = std::exchange(stats.plan_error, "");
    if (!built.ok()) {
      stats.plan_failures++;
      stats.plan_error = built.status().ToString();
      plan.reset();
      if (stats.plan_error != previous_error) {  // once, not every iteration it repeats
        STRATA_LOG_WARNING("pipeline: no plan from this trace, the next iteration runs on demand and records again: {}",
                           stats.plan_error);
      }
      return;
    }
    plan = std::move(built).value();
    planned_trace = recording;
    need_trace = false;
  }
};

}  // namespace strata::offload
