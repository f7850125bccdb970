#include "offload/schedule/pipeline.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <future>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "offload/schedule/pipeline_impl.h"

namespace strata::offload {

// Note [Recording and replaying]
// The first iteration (warm-up) runs on demand and records the trace: the
// chunks of each moment, the non-model memory the caller reports, the compute
// time (the moment's duration less its waits), and the links' bandwidths.
// At its end the planner builds the plan (made again when a link drifts:
// Note [Links measured as they are used]). Later iterations replay it: at the start of each moment the planned
// evictions and fetches for that moment are queued, and they run on queues of
// the pipeline's own, in parallel: NVMe reads (staging an NVMe-homed chunk on
// the host), device->host (evictions, on to NVMe for NVMe-homed chunks) and
// host->device (a fetch, after its victims are off the device and its
// staging is done). An access waits only for its own chunk's transfer, and
// an error of that transfer (a failed NVMe read) is returned by the access
// that needs the chunk; a transfer that found no room on its tier (free space
// in pieces around chunks in use) moved nothing and is made again by the
// access, on demand.
//
// Note [Host moments in the pipeline]
// Host moments (CPU optimizer updates): a host-homed chunk they need goes to
// the host right after its last use on the device; NVMe-homed ones are read
// ahead on a queue of their own as the plan says, within its room for them
// (Engine::host_staging_bytes and the host slots of the chunks on the
// device, kept at run time too: Note [Staging memory at run time]), and
// written back on a fifth queue (NVMe writes) when the moment
// ends. The plan may run an update on the device instead (BeginHostMoment
// says where). The first moment of a replayed iteration waits for the
// evictions that put the device as the plan has it when an iteration begins.
//
// Note [Overlapped updates]
// RunOverlapped begins a host moment marked `overlap` (the planner's Note of that
// name) and, where the plan runs it on the host, queues its compute on a
// queue of its own, the host's lane, which runs one update at a time: the
// update waits there for its chunks' planned moves (a read from NVMe, a
// move off the device, an earlier write-back), pins them in host memory
// and computes, while the training loop goes on with backward. Each chunk's
// next move (a fetch for the next forward, its write-back to NVMe, a read
// ahead of a later host moment) and the next access of it wait for the
// update. The moment ends as RunOverlapped returns. The caller waits for the
// outcome before it reads what the update wrote: the step does before its
// plan, so EndIteration finds every one of them done and the recorded
// trace takes their compute times from them.
//
// Note [One chain of moves per chunk]
// Every move queued for a chunk joins its chain (ChunkMoves), in the order
// queued: a fetch to the device, a read ahead of a host moment, an eviction,
// a write-back to NVMe, an overlapped update. What a new move or an access
// waits for is read off the chain, by kind:
//  - a fetch, a read ahead and a write-back: the last move off a tier or
//    update queued for the chunk; not ending in time is the move's error;
//  - an eviction: the chunk's fetch still queued, and only its end (Note
//    [Waits on queued moves]); not an update, which holds the chunk on the
//    host, where an eviction off the device moves nothing, nor a write-back,
//    which moves it off the host;
//  - an overlapped update: its chunks' planned fetch and read, taken off the
//    chain (their results are the update's), and the last move off a tier
//    or update and the last update queued for each;
//  - an access: takes the planned fetch and read (their results are its
//    own), waits for the end of an update holding the chunk, and, on the
//    host, for the last move off a tier or update queued for it.
// Taking a kind takes the last move of it queued; one queued again behind
// it (a fetch of an iteration that left its plan) is forgotten. Moves that
// have ended leave the chain at an iteration's edges -- fetches, reads and
// updates when it begins, evictions, write-backs and updates when it ends --
// but for those queued after a move of the chunk still running, so that
// "the last queued" never falls back to an earlier move still under way;
// EndIteration returns the first error, in the order queued, of the
// evictions and write-backs that ended.
//
// Note [Divergence]
// An access the plan does not have at that moment (evaluation, dynamic
// control flow, recomputation), or a different number of moments, stops the
// plan for the rest of the iteration (on demand from there, no error), is
// counted, and the next iteration records a new trace.
//
// Note [Policies]
// PipelineOptions::policy, option placement.policy:
//   adaptive  -- the above;
//   static    -- no trace, no plan: a fixed share of the param and grad chunks
//                (placement.device_params, by bytes in model order) stays on
//                the device for the whole run (a host moment takes one to the
//                host and EndMoment brings it back); every other chunk moves
//                on demand; NVMe-homed chunks of host moments are written
//                back after them. The same moves every iteration;
//   on demand -- every chunk on demand with the residency manager's
//                least-recently-used eviction (the baseline of `strata bench replay`).

Result<std::unique_ptr<Pipeline>> Pipeline::Create(Engine& engine, const PipelineOptions& options) {
  if (engine.closed()) {
    return InvalidArgument("pipeline: the engine is closed: Close() gave its memory and files back; create a new engine");
  }
  if (!engine.finalized()) return InvalidArgument("pipeline: the engine is not finalized (call Finalize first)");
  if (options.wait_timeout_ms == 0) return InvalidArgument("pipeline: wait_timeout_ms must be > 0");
  for (double b : options.links.bytes_per_second) {
    if (!(b >= 0) || !std::isfinite(b)) {
      return InvalidArgument("pipeline: a link bandwidth of {} B/s; give > 0, or 0 to measure it", b);
    }
  }
  if (!(options.static_device_params >= 0 && options.static_device_params <= 1)) {
    return InvalidArgument("pipeline: placement.device_params {} is out of range: allowed 0..1",
                           options.static_device_params);
  }
  auto impl = std::make_unique<Impl>(engine, options);
  if (options.policy == Policy::kStatic) {
    // The share, by bytes, of the param and grad chunks in model order.
    uint64_t total = 0, largest = 0;
    for (const ChunkInfo& chunk : engine.chunks()) {
      largest = std::max(largest, chunk.size_bytes);
      if (!IsOptimizerState(chunk.kind)) total += chunk.size_bytes;
    }
    const uint64_t share = static_cast<uint64_t>(options.static_device_params * static_cast<double>(total));
    uint64_t kept = 0;
    for (const ChunkInfo& chunk : engine.chunks()) {
      if (IsOptimizerState(chunk.kind)) continue;
      if (kept + chunk.size_bytes > share) break;
      impl->kept_on_device.push_back(chunk.id);
      kept += chunk.size_bytes;
    }
    const uint64_t budget = engine.options().device.budget_bytes;
    const uint64_t device = options.device_bytes > 0 ? std::min<uint64_t>(options.device_bytes, budget) : budget;
    if (kept + 2 * largest > device) {
      return InvalidArgument(
          "pipeline: placement.device_params {} keeps {} of param and grad chunks on the device, which leaves less "
          "than two {} chunks of the {} device (device.budget) to move the others through: lower "
          "placement.device_params or raise device.budget",
          options.static_device_params, FormatSize(kept), FormatSize(largest), FormatSize(device));
    }
  }
  return std::unique_ptr<Pipeline>(new Pipeline(std::move(impl)));
}

std::string_view PolicyName(Policy policy) {
  switch (policy) {
    case Policy::kAdaptive: return "adaptive";
    case Policy::kStatic: return "static";
    case Policy::kOnDemand: return "on demand";
  }
  return "?";
}

PipelineOptions PipelineOptionsOf(const Options& options) {
  PipelineOptions pipeline;
  pipeline.policy = options.placement.policy == PlacementPolicy::kStatic ? Policy::kStatic : Policy::kAdaptive;
  pipeline.static_device_params = options.placement.device_params;
  pipeline.wait_timeout_ms = EngineWaitTimeoutMs(options);  // as long as the moves it waits for may take
  return pipeline;
}

Pipeline::Pipeline(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}

Status Pipeline::Drain() {
  Impl& p = *impl_;
  // Reads ahead for moments that will not begin now go at once.
  std::vector<uint32_t> reads;
  for (const auto& [c, wanted] : p.host_read_wanted) reads.push_back(c);
  for (uint32_t c : reads) p.WantHostRead(ChunkId(c));
  // Each queue has one worker, in order: a job pushed last ends after every one before it.
  for (TaskQueue* queue :
       {&p.nvme_read, &p.host_read, &p.nvme_write, &p.device_to_host, &p.host_to_device, &p.overlap_lane}) {
    const std::shared_future<Status> last = queue->Push([] { return Status::Ok(); });
    if (last.wait_for(std::chrono::milliseconds(p.options.wait_timeout_ms)) != std::future_status::ready) {
      return Timeout("pipeline: the moves queued before the engine closes did not end within {} ms",
                     p.options.wait_timeout_ms);
    }
  }
  return Status::Ok();
}
Pipeline::~Pipeline() = default;

Status Pipeline::BeginIteration() {
  Impl& p = *impl_;
  if (p.in_moment) return InvalidArgument("pipeline: BeginIteration inside a moment (EndMoment first)");
  p.moment = 0;
  p.diverged = false;
  p.stats.stall_per_moment.clear();
  p.stats.stall_per_link = {};
  p.stats.stall_seconds = 0;
  p.stats.demand_fetches = 0;
  p.stats.prefetch_retries = 0;
  p.stats.reconciled = 0;
  p.DropFinishedFetches();
  p.ForgetStagedElsewhere();
  p.stats_at_start = p.engine.stats();
  p.iteration_start = Clock::now();
  p.timeline.clear();
  p.overlap_runs.clear();
  if (p.options.policy != Policy::kAdaptive) {
    p.mode = Impl::Mode::kOnDemand;
    STRATA_RETURN_IF_ERROR(p.PinStatic());
  } else if (p.plan && !p.need_trace) {
    p.mode = Impl::Mode::kReplaying;
    p.Reconcile();
  } else {
    p.mode = Impl::Mode::kRecording;
    p.recording = Trace{};
  }
  return Status::Ok();
}

Status Pipeline::BeginMoment(uint64_t non_model_bytes) {
  STRATA_RETURN_IF_ERROR(impl_->Begin(TraceMoment{.non_model_bytes = non_model_bytes}).status());
  impl_->RecordTiers();
  return Status::Ok();
}

Result<Tier> Pipeline::BeginHostMoment(std::optional<double> device_compute_seconds) {
  if (device_compute_seconds && !(*device_compute_seconds >= 0 && std::isfinite(*device_compute_seconds))) {
    return InvalidArgument("pipeline: BeginHostMoment with a device compute time of {} s; give >= 0",
                           *device_compute_seconds);
  }
  return impl_->Begin(TraceMoment{.tier = Tier::kHost, .device_compute_seconds = device_compute_seconds});
}

Result<Tier> Pipeline::Impl::Begin(TraceMoment traced) {
  Impl& p = *this;
  if (p.in_moment) return InvalidArgument("pipeline: a moment begins inside a moment (EndMoment first)");
  p.in_moment = true;
  p.moment_stall = 0;
  p.moment_start = Clock::now();
  p.moment_tier = traced.tier;
  p.moments_begun++;
  const bool planned = p.mode == Impl::Mode::kReplaying && !p.diverged && p.moment < p.plan->num_moments;
  {
    std::lock_guard lock(p.staging_mu);  // so that a waiting read cannot miss the change
    p.begun.store(p.moments_begun, std::memory_order_relaxed);  // a count only: no data rides on it
    p.read_room = planned ? p.plan->host_read_room[p.moment] : p.staging_base;
  }
  p.staging_cv.notify_all();
  if (p.mode == Impl::Mode::kRecording) {
    p.recording.moments.push_back(std::move(traced));
  } else if (p.mode == Impl::Mode::kReplaying && !p.diverged) {
    if (p.moment >= p.plan->num_moments) {
      p.Diverge("more moments than the trace");
    } else if (p.planned_trace.moments[p.moment].tier != traced.tier) {
      p.Diverge(traced.tier == Tier::kHost ? "a host moment where the trace has a device one"
                                           : "a device moment where the trace has a host one");
    } else if (p.planned_trace.moments[p.moment].overlap != traced.overlap) {
      p.Diverge(traced.overlap ? "an overlapped update where the trace has one between moments"
                               : "an update between moments where the trace has an overlapped one");
    } else if (!traced.device_compute_seconds && p.plan->compute_tier[p.moment] != traced.tier) {
      p.Diverge("a host moment that cannot run on the device, where the plan runs it");
    } else {
      p.moment_tier = p.plan->compute_tier[p.moment];
      // The caller allocates the moment's non-model memory once this returns:
      // the chunks that make room for it must be off the device by then (a
      // failed eviction is reported at EndIteration; the wait is a stall; one
      // that does not end is this moment's error: Note [Waits on queued moves]).
      std::vector<QueuedMove> room = p.Issue(p.moment);
      room.insert(room.end(), p.reconcile_room.begin(), p.reconcile_room.end());
      p.reconcile_room.clear();
      for (const QueuedMove& r : room) {
        if (Status ended = r.Ended(p.options.wait_timeout_ms, "eviction"); !ended.ok()) {
          p.in_moment = false;  // it did not begin: the caller ends the iteration, which records again
          p.Diverge("room for the moment's non-model memory not made in time");
          return ended.WithContext(fmt::format("making room on the device for moment {}", p.moment));
        }
      }
      p.moment_stall += SecondsSince(p.moment_start);
      p.stats.stall_per_link[static_cast<int>(Link::kDeviceToHost)] += SecondsSince(p.moment_start);  // evictions
    }
  }
  return p.moment_tier;
}

Result<ChunkAccess> Pipeline::Access(ChunkId chunk) {
  Impl& p = *impl_;
  if (!p.in_moment) return InvalidArgument("pipeline: Access of chunk {} outside a moment", chunk.value());
  if (chunk.value() >= p.chunk_bytes.size()) {
    return InvalidArgument("pipeline: chunk {} does not exist ({} chunks)", chunk.value(), p.chunk_bytes.size());
  }
  const Clock::time_point start = Clock::now();
  if (p.mode == Impl::Mode::kReplaying && !p.diverged) {
    const std::vector<ChunkId>& planned = p.planned_trace.moments[p.moment].chunks;
    if (std::find(planned.begin(), planned.end(), chunk) == planned.end()) p.Diverge("an access the trace lacks");
  }
  const Tier tier = p.moment_tier;
  if (tier == Tier::kHost) p.pins.erase(chunk.value());  // kStatic: back on the device at EndMoment
  // Each wait is charged to the link whose transfer it waited for.
  const auto charge = [&](Link link, Clock::time_point since) {
    p.stats.stall_per_link[static_cast<int>(link)] += SecondsSince(since);
  };
  Status prefetched = Status::Ok();
  p.WantHostRead(chunk);  // waited for below
  // Whichever move was planned for it: its result is this access's.
  for (const QueuedMove& planned : p.moves.TakeLast(chunk, {MoveKind::kFetch, MoveKind::kRead})) {
    const Clock::time_point wait = Clock::now();
    if (prefetched.ok()) prefetched = planned.Result(p.options.wait_timeout_ms, "prefetch");
    charge(planned.kind == MoveKind::kFetch ? Link::kHostToDevice : Link::kNvmeRead, wait);
  }
  // Held by an overlapped update: its outcome is its caller's, but until
  // it ends the chunk is pinned on the host and being written.
  if (const std::optional<QueuedMove> update = p.moves.Last(chunk, {MoveKind::kUpdate});
      update && (prefetched.ok() || prefetched.code() == StatusCode::kOutOfMemory)) {
    if (Status ended = update->Ended(p.options.wait_timeout_ms, "overlapped update"); !ended.ok()) prefetched = ended;
  }
  if (tier == Tier::kHost) {  // its eviction to the host, or its write-back from an earlier moment
    if (const std::optional<QueuedMove> off = p.moves.Last(chunk, kMovesOffOrUpdates); off && prefetched.ok()) {
      const Clock::time_point wait = Clock::now();
      prefetched = off->Result(p.options.wait_timeout_ms, "move off the device");
      charge(Link::kDeviceToHost, wait);
    }
  }
  if (prefetched.code() == StatusCode::kOutOfMemory) {
    // The planned move found no room when it ran (the device in pieces
    // around chunks in use then): nothing moved, so it is made now, on demand.
    p.stats.prefetch_retries++;
    prefetched = Status::Ok();
  }
  Result<Tier> now = p.engine.ChunkTier(chunk);
  if (prefetched.ok() && now.ok() && *now != tier) {
    p.stats.demand_fetches++;  // nothing brought it, or something took it away again
  }
  const Clock::time_point demand = Clock::now();
  Result<ChunkAccess> access =
      prefetched.ok() ? p.engine.AccessChunk(chunk, tier)
                      : Result<ChunkAccess>(prefetched.WithContext(fmt::format("prefetching chunk {}", chunk.value())));
  if (now.ok() && *now != tier) {  // moved now: charged to the link it came over last
    charge(*now == Tier::kNvme && tier == Tier::kHost  ? Link::kNvmeRead
           : *now == Tier::kDevice                       ? Link::kDeviceToHost
                                                         : Link::kHostToDevice,
           demand);
  }
  if (tier == Tier::kHost && access.ok() &&
      std::find(p.host_accessed.begin(), p.host_accessed.end(), chunk) == p.host_accessed.end()) {
    p.host_accessed.push_back(chunk);
  }
  p.moment_stall += SecondsSince(start);
  if (p.mode == Impl::Mode::kRecording) {
    std::vector<ChunkId>& chunks = p.recording.moments.back().chunks;
    if (std::find(chunks.begin(), chunks.end(), chunk) == chunks.end()) chunks.push_back(chunk);
  }
  return access;
}

Status Pipeline::EndMoment() {
  Impl& p = *impl_;
  if (!p.in_moment) return InvalidArgument("pipeline: EndMoment without BeginMoment");
  p.in_moment = false;
  const double duration = SecondsSince(p.moment_start);
  if (p.mode == Impl::Mode::kRecording) {
    TraceMoment& recorded = p.recording.moments.back();
    recorded.compute_seconds = std::max(0.0, duration - p.moment_stall);
    // The emulated device's memory is the host's, and an update placed there runs the host's kernel on it:
    // it takes what it took on the host, whatever the caller estimated for a real device.
    if (recorded.device_compute_seconds && p.engine.device().is_emulated()) {
      recorded.device_compute_seconds = recorded.compute_seconds;
    }
  }
  if (p.options.policy == Policy::kOnDemand) {
    p.host_accessed.clear();  // on demand: they stay until the residency manager needs the room
  } else {
    p.QueueWriteBacks();
  }
  Status pinned = Status::Ok();
  if (p.options.policy == Policy::kStatic && p.moment_tier == Tier::kHost) {
    const Clock::time_point start = Clock::now();
    pinned = p.PinStatic().WithContext("bringing the chunks the static policy keeps back to the device");
    p.moment_stall += SecondsSince(start);
    p.stats.stall_per_link[static_cast<int>(Link::kHostToDevice)] += SecondsSince(start);
  }
  p.stats.stall_per_moment.push_back(p.moment_stall);
  p.stats.stall_seconds += p.moment_stall;
  p.moment++;
  return pinned;
}

namespace {

// An overlapped update that runs in its place (another policy, or the
// plan has it on the device): accesses its chunks, computes and ends the
// moment now; the outcome is ready when this returns.
std::shared_future<Status> RunInPlace(Pipeline& pipeline, const std::vector<ChunkId>& chunks, Tier where,
                                      const Pipeline::OverlapCompute& compute) {
  std::vector<ChunkAccess> held;
  Status computed = Status::Ok();
  for (ChunkId c : chunks) {
    Result<ChunkAccess> access = pipeline.Access(c);
    if (!access.ok()) {
      computed = access.status();
      break;
    }
    held.push_back(std::move(access).value());
  }
  if (computed.ok()) computed = compute(where, held);
  held.clear();
  const Status ended = pipeline.EndMoment();
  std::promise<Status> done;
  done.set_value(computed.ok() ? ended : computed);
  return done.get_future().share();
}

// An overlapped update on the host's lane (Note [Overlapped updates]):
// waits for the moves queued before it, pins its chunks in host memory and
// computes; `seconds` gets the compute's time.
Status ComputeOverlapped(Engine& engine, const std::vector<ChunkId>& chunks, const std::vector<QueuedMove>& before,
                         uint32_t timeout_ms, const Pipeline::OverlapCompute& compute, double& seconds) {
  for (const QueuedMove& move : before) {
    const Status moved = move.Result(timeout_ms, "move ahead of an overlapped update");
    // One that found no room moved nothing: the access below moves it.
    if (!moved.ok() && moved.code() != StatusCode::kOutOfMemory) {
      return moved.WithContext(fmt::format("moving chunk {} to the host for its update", move.chunk.value()));
    }
  }
  std::vector<ChunkAccess> held;
  for (ChunkId c : chunks) {
    STRATA_ASSIGN_OR_RETURN(ChunkAccess access, engine.AccessChunk(c, Tier::kHost));
    held.push_back(std::move(access));
  }
  const Clock::time_point start = Clock::now();
  Status computed = compute(Tier::kHost, held);
  seconds = SecondsSince(start);
  return computed;
}

}  // namespace

Result<std::shared_future<Status>> Pipeline::RunOverlapped(const std::vector<ChunkId>& chunks,
                                                           std::optional<double> device_compute_seconds,
                                                           OverlapCompute compute) {
  Impl& p = *impl_;
  for (ChunkId c : chunks) {
    if (c.value() >= p.chunk_bytes.size()) {
      return InvalidArgument("pipeline: RunOverlapped of chunk {}, which does not exist ({} chunks)", c.value(),
                             p.chunk_bytes.size());
    }
  }
  const bool adaptive = p.options.policy == Policy::kAdaptive;
  STRATA_ASSIGN_OR_RETURN(const Tier where, p.Begin(TraceMoment{.tier = Tier::kHost,
                                                               .device_compute_seconds = device_compute_seconds,
                                                               .overlap = adaptive}));
  if (!adaptive || where != Tier::kHost) return RunInPlace(*this, chunks, where, compute);
  // The moves the update waits for, on the update's thread: a planned fetch
  // or read from NVMe (taken: their results are the update's), the last move
  // off a tier or update, and the last update (Note [One chain of moves per chunk]).
  std::vector<QueuedMove> before;
  for (ChunkId c : chunks) {
    if (p.mode == Impl::Mode::kReplaying && !p.diverged) {
      const std::vector<ChunkId>& planned = p.planned_trace.moments[p.moment].chunks;
      if (std::find(planned.begin(), planned.end(), c) == planned.end()) p.Diverge("an access the trace lacks");
    }
    if (p.mode == Impl::Mode::kRecording) p.recording.moments.back().chunks.push_back(c);
    p.WantHostRead(c);  // the update waits for it
    for (QueuedMove& planned : p.moves.TakeLast(c, {MoveKind::kFetch, MoveKind::kRead})) {
      before.push_back(std::move(planned));
    }
    const std::optional<QueuedMove> off = p.moves.Last(c, kMovesOffOrUpdates);
    if (off) before.push_back(*off);
    if (!off || off->kind != MoveKind::kUpdate) {  // else that is its last update
      if (std::optional<QueuedMove> update = p.moves.Last(c, {MoveKind::kUpdate})) before.push_back(*update);
    }
    if (std::find(p.host_accessed.begin(), p.host_accessed.end(), c) == p.host_accessed.end()) {
      p.host_accessed.push_back(c);
    }
  }
  auto seconds = std::make_shared<double>(0.0);
  const uint32_t timeout_ms = p.options.wait_timeout_ms;
  Engine& engine = p.engine;
  std::shared_future<Status> done =
      p.overlap_lane.Push([&engine, chunks, before, timeout_ms, seconds, compute = std::move(compute)]() -> Status {
        return ComputeOverlapped(engine, chunks, before, timeout_ms, compute, *seconds);
      });
  const std::optional<size_t> traced =
      p.mode == Impl::Mode::kRecording ? std::optional<size_t>(p.recording.moments.size() - 1) : std::nullopt;
  p.overlap_runs.push_back({traced, done, seconds});
  for (ChunkId c : chunks) {  // a later fetch, read, write-back or access of it waits for the update
    p.moves.Add({.chunk = c, .kind = MoveKind::kUpdate, .done = done, .what = "the overlapped update of chunk {}"});
  }
  p.QueueWriteBacks();  // each after the update
  p.in_moment = false;
  p.stats.stall_per_moment.push_back(0);
  p.moment++;
  return done;
}

Status Pipeline::EndIteration() {
  Impl& p = *impl_;
  if (p.in_moment) return InvalidArgument("pipeline: EndIteration inside a moment (EndMoment first)");
  p.stats.step_seconds = SecondsSince(p.iteration_start);
  p.stats.iterations++;
  p.RecordTiers();
  p.last_timeline = std::exchange(p.timeline, {});
  const MemoryStats now = p.engine.stats();
  p.stats.forced_evictions = now.evictions - p.stats_at_start.evictions;
  const bool drifted = p.MeasureLinks(now);
  switch (p.mode) {
    case Impl::Mode::kOnDemand:
      break;
    case Impl::Mode::kRecording:
      p.stats.recordings++;
      p.TraceOverlapRuns();
      if (!p.recording.moments.empty()) p.MakePlan();
      break;
    case Impl::Mode::kReplaying:
      if (!p.diverged && p.moment != p.plan->num_moments) p.Diverge("fewer moments than the trace");
      if (p.diverged) {
        p.need_trace = true;
      } else {
        p.stats.planned_iterations++;
        if (drifted) {
          p.stats.replans++;
          p.recording = p.planned_trace;
          p.MakePlan();
        }
      }
      break;
  }
  return p.TakeEvictionError();
}

const Plan* Pipeline::plan() const { return impl_->plan ? &*impl_->plan : nullptr; }
const Trace* Pipeline::trace() const { return impl_->recording.moments.empty() ? nullptr : &impl_->recording; }
const LinkBandwidths& Pipeline::links() const { return impl_->links; }
PipelineStats Pipeline::stats() const { return impl_->stats; }
const std::vector<Pipeline::TierBytes>& Pipeline::last_timeline() const { return impl_->last_timeline; }

std::string Pipeline::StatsJson() const {
  const PipelineStats& s = impl_->stats;
  nlohmann::json j;
  j["policy"] = PolicyName(impl_->options.policy);
  j["iterations"] = s.iterations;
  j["planned_iterations"] = s.planned_iterations;
  j["recordings"] = s.recordings;
  j["divergences"] = s.divergences;
  j["plan_failures"] = s.plan_failures;
  j["replans"] = s.replans;
  if (!s.plan_error.empty()) j["plan_error"] = s.plan_error;
  j["planning_seconds"] = s.planning_seconds;
  j["step_seconds"] = s.step_seconds;
  j["stall_seconds"] = s.stall_seconds;
  j["stall_fraction"] = s.stall_fraction();
  j["stall_per_moment"] = s.stall_per_moment;
  j["demand_fetches"] = s.demand_fetches;
  j["prefetch_retries"] = s.prefetch_retries;
  j["reconciled"] = s.reconciled;
  j["forced_evictions"] = s.forced_evictions;
  for (int l = 0; l < kNumLinks; ++l) {
    const std::string name(LinkName(static_cast<Link>(l)));
    j["bytes_moved"][name] = s.bytes[l];
    j["stall_seconds_per_link"][name] = s.stall_per_link[l];
    j["link_bytes_per_second"][name] = impl_->links.bytes_per_second[l];
  }
  if (impl_->plan) {
    uint32_t updates_on_device = 0;  // host moments the plan runs on the device (Note [Where updates run])
    for (uint32_t k = 0; k < impl_->plan->num_moments; ++k) {
      updates_on_device += impl_->planned_trace.moments[k].tier == Tier::kHost &&
                           impl_->plan->compute_tier[k] == Tier::kDevice;
    }
    j["plan"] = {{"moments", impl_->plan->num_moments},
                 {"updates_on_device", updates_on_device},
                 {"peak_chunk_bytes", impl_->plan->peak_chunk_bytes},
                 {"predicted_step_seconds", impl_->plan->prediction.step_seconds},
                 {"predicted_stall_seconds", impl_->plan->prediction.stall_seconds},
                 {"predicted_stall_per_moment", impl_->plan->prediction.stall_per_moment},
                 {"peak_device_bytes", impl_->plan->peak_device_bytes}};
    for (int l = 0; l < kNumLinks; ++l) {  // beside bytes_moved: what the plan meant to move
      j["plan"]["predicted_bytes_moved"][std::string(LinkName(static_cast<Link>(l)))] =
          impl_->plan->prediction.bytes[l];
    }
  }
  return j.dump(2);
}

}  // namespace strata::offload
