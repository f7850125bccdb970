#include "offload/pipeline.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <functional>
#include <future>
#include <unordered_map>

#include <nlohmann/json.hpp>

#include "src/task_queue.h"
#include "strata/logging.h"

namespace strata::offload {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

Status WaitFor(const std::shared_future<Status>& done, uint32_t timeout_ms, ChunkId chunk, std::string_view what) {
  if (done.wait_for(std::chrono::milliseconds(timeout_ms)) != std::future_status::ready) {
    return Timeout("pipeline: the {} of chunk {} did not finish within {} ms", what, chunk.value(), timeout_ms);
  }
  return done.get();
}

}  // namespace

struct Pipeline::Impl {
  enum class Mode { kOnDemand, kRecording, kReplaying };

  ~Impl() {
    // Transfers not started yet return at once; the queues (destroyed
    // next, as the last members) then drain quickly.
    cancelled.store(true, std::memory_order_relaxed);  // a flag only: no data rides on it
  }

  Impl(Engine& e, const PipelineOptions& o) : engine(e), options(o) {
    for (const ChunkInfo& chunk : engine.chunks()) {
      chunk_bytes.push_back(chunk.size_bytes);
      Result<Tier> home = engine.ChunkHome(chunk.id);
      homes.push_back(home.ok() ? *home : Tier::kHost);
    }
    links = options.links;
  }

  Engine& engine;
  const PipelineOptions options;
  std::vector<uint64_t> chunk_bytes;
  std::vector<Tier> homes;
  LinkBandwidths links;

  Mode mode = Mode::kOnDemand;
  bool need_trace = true;          // the next adaptive iteration records
  std::optional<Plan> plan;
  Trace planned_trace;             // the trace the plan was made from
  Trace recording;                 // being recorded (or the last recorded)
  std::unordered_map<uint32_t, std::shared_future<Status>> pending;  // planned fetch by chunk
  std::unordered_map<uint32_t, std::shared_future<Status>> leaving;  // last queued eviction by chunk
  std::vector<std::pair<ChunkId, std::shared_future<Status>>> evictions;  // not yet checked for an error
  std::atomic<bool> cancelled{false};
  uint32_t moment = 0;
  bool diverged = false;
  bool in_moment = false;
  Clock::time_point iteration_start, moment_start;
  double moment_stall = 0;
  MemoryStats stats_at_start;
  PipelineStats stats;
  // Last: the queues' threads start after everything they touch exists, and
  // stop (finishing what is queued) before it goes.
  TaskQueue nvme_read, device_to_host, host_to_device;  // one worker each: one link direction

  Status Cancelled() const { return Internal("pipeline: cancelled (the pipeline is being destroyed)"); }

  // Moves `chunk` off the device to its home, unless it is not there or in
  // use (a caller still holds it: the plan's eviction is skipped).
  Status Evict(ChunkId chunk) {
    if (cancelled.load(std::memory_order_relaxed)) return Cancelled();
    Result<Tier> tier = engine.ChunkTier(chunk);
    if (!tier.ok() || *tier != Tier::kDevice) return Status::Ok();
    Status moved = engine.MoveChunk(chunk, homes[chunk.value()]);
    if (moved.code() == StatusCode::kInvalidArgument) return Status::Ok();  // pinned by the caller
    return moved;
  }

  // Queues the eviction of `v`. Moves of one chunk happen in the order they
  // are queued, across queues: the eviction waits for a fetch of the same
  // chunk still under way, and a later fetch waits for the eviction.
  std::shared_future<Status> QueueEviction(ChunkId v) {
    std::optional<std::shared_future<Status>> arriving;
    if (auto it = pending.find(v.value()); it != pending.end()) arriving = it->second;
    std::shared_future<Status> done = device_to_host.Push([this, v, arriving]() -> Status {
      if (arriving) arriving->wait_for(std::chrono::milliseconds(options.wait_timeout_ms));
      return Evict(v);
    });
    leaving[v.value()] = done;
    evictions.emplace_back(v, done);
    return done;
  }

  // Queues the fetch of `c` to the device after `room` (its victims leaving).
  void QueueFetch(ChunkId c, std::vector<std::shared_future<Status>> room) {
    if (auto it = leaving.find(c.value()); it != leaving.end()) room.push_back(it->second);
    std::optional<std::shared_future<Status>> staged;
    if (homes[c.value()] == Tier::kNvme) {
      staged = nvme_read.Push([this, c, room]() -> Status {
        if (cancelled.load(std::memory_order_relaxed)) return Cancelled();
        for (const std::shared_future<Status>& r : room) r.wait_for(std::chrono::milliseconds(options.wait_timeout_ms));
        Result<Tier> tier = engine.ChunkTier(c);
        if (!tier.ok() || *tier != Tier::kNvme) return Status::Ok();
        return engine.MoveChunk(c, Tier::kHost);
      });
    }
    pending[c.value()] = host_to_device.Push([this, c, room, staged]() -> Status {
      if (cancelled.load(std::memory_order_relaxed)) return Cancelled();
      // A victim that could not leave only costs room (the move below
      // evicts by itself; the eviction's error is reported at EndIteration).
      // A failed staging read is this chunk's error.
      for (const std::shared_future<Status>& r : room) r.wait_for(std::chrono::milliseconds(options.wait_timeout_ms));
      if (staged) STRATA_RETURN_IF_ERROR(WaitFor(*staged, options.wait_timeout_ms, c, "NVMe read"));
      return engine.MoveChunk(c, Tier::kDevice);
    });
  }

  // Queues moment k's moves; returns the evictions that make room for its
  // non-model memory, which the moment must wait for before it allocates.
  std::vector<std::shared_future<Status>> Issue(uint32_t k) {
    std::vector<std::shared_future<Status>> room_for_activations;
    for (ChunkId v : plan->evictions_at[k]) room_for_activations.push_back(QueueEviction(v));
    for (const PlannedFetch& f : plan->fetches_at[k]) {
      std::vector<std::shared_future<Status>> room;
      for (ChunkId v : f.victims) room.push_back(QueueEviction(v));
      QueueFetch(f.chunk, std::move(room));
    }
    return room_for_activations;
  }

  // The first error of an eviction that has finished, once; those still
  // running are checked later.
  Status TakeEvictionError() {
    Status first;
    std::erase_if(evictions, [&](const std::pair<ChunkId, std::shared_future<Status>>& e) {
      if (e.second.wait_for(std::chrono::seconds(0)) != std::future_status::ready) return false;
      Status status = e.second.get();
      if (!status.ok() && first.ok()) {
        first = status.WithContext(fmt::format("evicting chunk {} from the device", e.first.value()));
      }
      return true;
    });
    std::erase_if(leaving, [](const auto& entry) {
      return entry.second.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    });
    return first;
  }

  // Fetches queued for an iteration that did not use them (it diverged):
  // done ones are dropped, so they neither hold back reconciliation nor hand
  // their result to an unrelated access later.
  void DropFinishedFetches() {
    std::erase_if(pending, [](const auto& entry) {
      return entry.second.wait_for(std::chrono::seconds(0)) == std::future_status::ready;
    });
  }

  // The device as the plan has it when an iteration begins: chunks it does
  // not have there leave, the ones it has and the device lacks come, in the
  // order the iteration first needs them.
  void Reconcile() {
    std::vector<bool> expected(chunk_bytes.size(), false);
    for (ChunkId c : plan->resident_at_start) expected[c.value()] = true;
    std::vector<std::shared_future<Status>> room;
    for (uint32_t c = 0; c < chunk_bytes.size(); ++c) {
      if (expected[c] || pending.count(c) > 0) continue;
      Result<Tier> tier = engine.ChunkTier(ChunkId(c));
      if (!tier.ok() || *tier != Tier::kDevice) continue;
      room.push_back(QueueEviction(ChunkId(c)));
      stats.reconciled++;
    }
    std::vector<bool> queued(chunk_bytes.size(), false);
    for (const TraceMoment& m : planned_trace.moments) {
      for (ChunkId c : m.chunks) {
        if (!expected[c.value()] || queued[c.value()] || pending.count(c.value()) > 0) continue;
        queued[c.value()] = true;
        Result<Tier> tier = engine.ChunkTier(c);
        if (tier.ok() && *tier == Tier::kDevice) continue;
        QueueFetch(c, room);
        stats.reconciled++;
      }
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

  void MeasureLinks(const MemoryStats& now) {
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
    for (int l = 0; l < kNumLinks; ++l) {
      stats.bytes[l] = observed[l][0].bytes + observed[l][1].bytes;
      if (options.links.bytes_per_second[l] > 0) continue;  // given
      const LinkStats& alone = observed[l][0];
      if (mode == Mode::kRecording && alone.bytes > 0 && alone.seconds > 0) {
        links.bytes_per_second[l] = static_cast<double>(alone.bytes) / alone.seconds;
      } else if (links.bytes_per_second[l] <= 0) {
        links.bytes_per_second[l] = kAssumed[l];
      }
    }
  }

  void MakePlan() {
    PlannerInput input;
    input.trace = recording;
    input.chunk_bytes = chunk_bytes;
    input.home = homes;
    input.device_bytes = options.device_bytes > 0 ? options.device_bytes : engine.options().device_budget_bytes;
    input.links = links;
    const Clock::time_point start = Clock::now();
    Result<Plan> built = BuildPlan(input);
    stats.planning_seconds = SecondsSince(start);
    if (!built.ok()) {
      stats.plan_failures++;
      plan.reset();
      STRATA_LOG_WARNING("pipeline: no plan from this trace, the next iteration runs on demand and records again: {}",
                         built.status().ToString());
      return;
    }
    plan = std::move(built).value();
    planned_trace = recording;
    need_trace = false;
  }
};

Result<std::unique_ptr<Pipeline>> Pipeline::Create(Engine& engine, const PipelineOptions& options) {
  if (!engine.finalized()) return InvalidArgument("pipeline: the engine is not finalized (call Finalize first)");
  if (options.wait_timeout_ms == 0) return InvalidArgument("pipeline: wait_timeout_ms must be > 0");
  for (double b : options.links.bytes_per_second) {
    if (!(b >= 0) || !std::isfinite(b)) {
      return InvalidArgument("pipeline: a link bandwidth of {} B/s; give > 0, or 0 to measure it", b);
    }
  }
  return std::unique_ptr<Pipeline>(new Pipeline(std::make_unique<Impl>(engine, options)));
}

Pipeline::Pipeline(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Pipeline::~Pipeline() = default;

Status Pipeline::BeginIteration() {
  Impl& p = *impl_;
  if (p.in_moment) return InvalidArgument("pipeline: BeginIteration inside a moment (EndMoment first)");
  p.moment = 0;
  p.diverged = false;
  p.stats.stall_per_moment.clear();
  p.stats.stall_seconds = 0;
  p.stats.demand_fetches = 0;
  p.stats.reconciled = 0;
  p.DropFinishedFetches();
  p.stats_at_start = p.engine.stats();
  p.iteration_start = Clock::now();
  if (!p.options.adaptive) {
    p.mode = Impl::Mode::kOnDemand;
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
  Impl& p = *impl_;
  if (p.in_moment) return InvalidArgument("pipeline: BeginMoment inside a moment (EndMoment first)");
  p.in_moment = true;
  p.moment_stall = 0;
  p.moment_start = Clock::now();
  if (p.mode == Impl::Mode::kRecording) {
    p.recording.moments.push_back(TraceMoment{.non_model_bytes = non_model_bytes});
  } else if (p.mode == Impl::Mode::kReplaying && !p.diverged) {
    if (p.moment >= p.plan->num_moments) {
      p.Diverge("more moments than the trace");
    } else {
      // The caller allocates the moment's non-model memory once this returns:
      // the chunks that make room for it must be off the device by then (a
      // failed eviction is reported at EndIteration; the wait is a stall).
      for (const std::shared_future<Status>& room : p.Issue(p.moment)) {
        room.wait_for(std::chrono::milliseconds(p.options.wait_timeout_ms));
      }
      p.moment_stall += SecondsSince(p.moment_start);
    }
  }
  return Status::Ok();
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
  Status prefetched = Status::Ok();
  if (auto it = p.pending.find(chunk.value()); it != p.pending.end()) {
    std::shared_future<Status> done = it->second;
    p.pending.erase(it);
    prefetched = WaitFor(done, p.options.wait_timeout_ms, chunk, "prefetch");
  }
  if (Result<Tier> tier = p.engine.ChunkTier(chunk); prefetched.ok() && tier.ok() && *tier != Tier::kDevice) {
    p.stats.demand_fetches++;  // nothing brought it, or something took it away again
  }
  Result<ChunkAccess> access =
      prefetched.ok() ? p.engine.AccessChunk(chunk, Tier::kDevice)
                      : Result<ChunkAccess>(prefetched.WithContext(fmt::format("prefetching chunk {}", chunk.value())));
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
    p.recording.moments.back().compute_seconds = std::max(0.0, duration - p.moment_stall);
  }
  p.stats.stall_per_moment.push_back(p.moment_stall);
  p.stats.stall_seconds += p.moment_stall;
  p.moment++;
  return Status::Ok();
}

Status Pipeline::EndIteration() {
  Impl& p = *impl_;
  if (p.in_moment) return InvalidArgument("pipeline: EndIteration inside a moment (EndMoment first)");
  p.stats.step_seconds = SecondsSince(p.iteration_start);
  p.stats.iterations++;
  const MemoryStats now = p.engine.stats();
  p.stats.forced_evictions = now.evictions - p.stats_at_start.evictions;
  p.MeasureLinks(now);
  switch (p.mode) {
    case Impl::Mode::kOnDemand:
      break;
    case Impl::Mode::kRecording:
      p.stats.recordings++;
      if (!p.recording.moments.empty()) p.MakePlan();
      break;
    case Impl::Mode::kReplaying:
      if (!p.diverged && p.moment != p.plan->num_moments) p.Diverge("fewer moments than the trace");
      if (p.diverged) {
        p.need_trace = true;
      } else {
        p.stats.planned_iterations++;
      }
      break;
  }
  return p.TakeEvictionError();
}

const Plan* Pipeline::plan() const { return impl_->plan ? &*impl_->plan : nullptr; }
const Trace* Pipeline::trace() const { return impl_->recording.moments.empty() ? nullptr : &impl_->recording; }
const LinkBandwidths& Pipeline::links() const { return impl_->links; }
PipelineStats Pipeline::stats() const { return impl_->stats; }

std::string Pipeline::StatsJson() const {
  const PipelineStats& s = impl_->stats;
  nlohmann::json j;
  j["iterations"] = s.iterations;
  j["planned_iterations"] = s.planned_iterations;
  j["recordings"] = s.recordings;
  j["divergences"] = s.divergences;
  j["plan_failures"] = s.plan_failures;
  j["planning_seconds"] = s.planning_seconds;
  j["step_seconds"] = s.step_seconds;
  j["stall_seconds"] = s.stall_seconds;
  j["stall_fraction"] = s.stall_fraction();
  j["stall_per_moment"] = s.stall_per_moment;
  j["demand_fetches"] = s.demand_fetches;
  j["reconciled"] = s.reconciled;
  j["forced_evictions"] = s.forced_evictions;
  for (int l = 0; l < kNumLinks; ++l) {
    const std::string name(LinkName(static_cast<Link>(l)));
    j["bytes_moved"][name] = s.bytes[l];
    j["link_bytes_per_second"][name] = impl_->links.bytes_per_second[l];
  }
  if (impl_->plan) {
    j["plan"] = {{"moments", impl_->plan->num_moments},
                 {"predicted_step_seconds", impl_->plan->prediction.step_seconds},
                 {"predicted_stall_seconds", impl_->plan->prediction.stall_seconds},
                 {"predicted_stall_per_moment", impl_->plan->prediction.stall_per_moment},
                 {"peak_device_bytes", impl_->plan->peak_device_bytes}};
  }
  return j.dump(2);
}

}  // namespace strata::offload
