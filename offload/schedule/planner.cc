#include "offload/schedule/planner.h"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

#include "offload/schedule/planner_schedule.h"
#include "strata/options.h"

namespace strata::offload {

// Note [Planning in two stages]
// Which chunks to move and when to move them are decided apart. Stage 1
// replays the moments with demand paging: a moment fetches the chunks it
// lacks, and when the device is full the resident chunk whose next use is
// furthest away (and is not needed now) makes room. For chunks of one size
// this would be Belady's MIN (no schedule fetches fewer) if the victim were
// always the furthest next use; Note [Victims that leave room for a lead]
// trades a little of that for lead time. Stage 2 keeps those
// fetches and victims and only moves each fetch earlier: to the first moment
// after its victims' last use before the fetch's own use, such that device
// memory holds the fetched chunk (and no longer the victims) at every moment
// from there to its use. Fetches are hoisted in the order they are needed and
// never ahead of the one before, so the host->device queue carries them in
// order of need; none is hoisted a whole iteration or more. Stage 2 moves no
// extra bytes; the lead a transfer gets is as long as memory allows.
//
// Note [Victims that leave room for a lead]
// Stage 2 can start a fetch only once its victims are dead, so MIN's choice
// alone gives no lead in a backward pass: the chunk with the furthest next
// use is the gradient just written, dead only since the moment before. So a
// victim is chosen in two classes: chunks whose next use is at least half an
// iteration away ("far": in a layer-by-layer pass they are not needed again
// before they would be evicted anyway) go first, the longest unused of them
// first, which lets the fetch start that much earlier; only when no chunk is
// far does MIN's furthest next use decide. On a GPT-style replay (8 layers,
// a 40 MiB device) this took the planned stall from 38% to 28% of the step
// at the same bytes moved.
//
// The trace repeats, so both stages run over three iterations back to back
// and keep the middle one: the first fills the device from cold, the third
// gives the middle one its view of what comes next.
//
// Note [Host moments]
// A moment computing on the host (a CPU optimizer update) needs its chunks
// off the device, and they may not come back before the moment ends. A
// host-homed chunk there goes to the host after its last use on the device
// (an offload: nothing waits for it but the host moment; its device room is
// counted until the host moment all the same; Note [Offloads that leave the
// host room] says when); an NVMe-homed one is
// evicted to the host when the moment begins, and written to NVMe after it. An
// NVMe-homed chunk not on the device is read into host memory ahead of the
// moment, as early as the host's room for reads allows (chunks read ahead and
// in use never hold more, except those a moment needs now; one being written
// back holds its room until the write ends, which the pipeline waits for at
// run time), after the chunk last left the device or was last written back;
// each is written back when its moment ends. The link model holds each read
// to that room in time too: a read starts once the write-backs before it
// have freed the room it needs, as at run time.
//
// Note [Room for reads ahead]
// The room for reads ahead at a moment is `host_staging_bytes` and the host
// slots of the host-homed chunks on the device then: a payload lives on one
// tier at a time, so while forward and backward hold chunks on the device,
// the host tier has their room free. Counting it lets the reads of the first
// updates' states run during forward and backward, where counting the
// staging memory alone (a quarter of the host) left most of them to the
// updates after backward, which then waited for the drive. A moment's room
// is taken after the chunks it evicts are back on the host and before the
// chunks it fetches have left it, so that a move within the moment never
// finds the host fuller than the plan has it.
//
// A read ahead for a host moment after a device moment is not issued among
// the host moments that end the iteration before its own (the updates after
// backward), only from the iteration's first moment on: there the drive
// serves those updates' own reads and writes, which then wait for it, and a
// read held from there would take the room they need.
//
// Note [Offloads that leave the host room]
// A host moment that reads NVMe-homed chunks takes its host-homed ones off
// the device only kOffloadLeadMoments before it, not right after their last
// use there: until then they leave their host slots free for reads ahead
// (Note [Room for reads ahead]). After backward, where every update reads its
// states, the host then has the room of every group not yet updated (its
// params and grads still on the device) for the states of the updates to
// come, instead of the staging memory alone. The lead lets each offload
// cross while the updates before it run; a host moment that reads nothing
// offloads right after the last use, as the host's room buys it nothing.
//
// Note [Overlapped updates]
// A host moment marked `overlap` (an optimizer update begun in backward, as
// soon as its group's gradients are complete: Note [Overlapped updates] in
// offload/training/overlap_updates.cc) computes on the host's
// lane, beside the device moments after it: it starts once its chunks are in
// host memory and the update before it on that lane is done, the device's
// lane goes on at once, and a chunk it holds moves again (a fetch for the
// next forward, its write-back to NVMe) only once it ends. A host moment
// between device moments (the step's updates after backward) waits for the
// host's lane too, and so does the iteration's end: the step's norm needs
// every group's gradients. An update the plan moves to the device runs in
// the device's order, as a GPU's stream would run it.
//
// Note [Where updates run]
// An update moment may run on the device. The plan with every update on the
// host comes first; the device bytes it never uses at its peak are the
// margin; updates are placed on the device in trace order while the chunks
// they would add (those no device moment uses: the optimizer states) fit in
// what is left of the margin; then the plan is made again, and kept if it
// predicts a step no longer than the first. So a model whose states fit
// beside everything else updates on the device, and a device that streams
// its chunks keeps every byte of it for prefetching.
//
// Note [The device model]
// device.budget bounds the chunks on the device, nothing else: it is the
// device tier's capacity, which the residency manager holds them to. The
// framework's non-model memory (activations, workspace) lives beside it, in
// device memory strata does not own. So the plan keeps two bounds at every
// moment: chunks within device_chunk_bytes (the budget), and chunks and
// non-model memory together within device_bytes (what the device has for
// both: on a GPU, the budget and the memory free beside it when the engine
// took it). Activations evict chunks only where the two together exceed the
// device, never because they exceed the budget.

namespace {

using planning::ByIssue;
using planning::ChunkCapacity;
using planning::Fetch;
using planning::HostRead;
using planning::IssuedAt;
using planning::kCopies;
using planning::kNever;
using planning::kOffloadLeadMoments;
using planning::LinkIndex;
using planning::Replay;
using planning::Schedule;
using planning::Unrolled;

enum class Victims { kFurthestNextUse, kLeastRecentlyUsed };

// Stage 1's replay of the unrolled trace with demand paging: what is
// resident, and the schedule of what moved.
class DemandPager {
 public:
  DemandPager(const Unrolled& u, Victims policy)
      : u_(u),
        policy_(policy),
        resident_(u.input.chunk_bytes.size(), false),
        last_use_(u.input.chunk_bytes.size(), 0),
        left_for_room_(u.input.chunk_bytes.size(), 0),
        last_left_(u.input.chunk_bytes.size(), 0) {
    schedule_.evictions_at.resize(u.length);
    schedule_.offloads_at.resize(u.length);
    schedule_.occupancy.resize(u.length);
    schedule_.chunk_occupancy.resize(u.length);
  }

  Schedule Run() && {
    for (uint64_t g = 0; g < u_.length; ++g) Moment(g);
    return std::move(schedule_);
  }

 private:
  void Moment(uint64_t g) {
    const uint64_t capacity = u_.input.device_bytes;
    const uint64_t chunk_capacity = ChunkCapacity(u_.input);
    const TraceMoment& m = u_.moment(g);
    std::vector<bool> needed_now(resident_.size(), false);
    if (!u_.on_host(g)) {
      for (ChunkId c : m.chunks) needed_now[c.value()] = true;
    }
    if (u_.on_host(g)) LeaveForHostMoment(g, m);
    // Room for this moment's non-model memory.
    while (used_ + m.non_model_bytes > capacity) {
      const ChunkId victim = EvictVictim(g, needed_now);
      schedule_.evictions_at[g].push_back(victim);
      left_for_room_[victim.value()] = g;
    }
    if (!u_.on_host(g)) {
      for (ChunkId c : m.chunks) {
        if (resident_[c.value()]) continue;
        Fetch fetch{.chunk = c, .needed = g, .issue = g, .left_at = left_for_room_[c.value()]};
        while (used_ + u_.size(c) + m.non_model_bytes > capacity || used_ + u_.size(c) > chunk_capacity) {
          fetch.victims.push_back(EvictVictim(g, needed_now));
        }
        resident_[c.value()] = true;
        used_ += u_.size(c);
        schedule_.fetches.push_back(std::move(fetch));
      }
      for (ChunkId c : m.chunks) last_use_[c.value()] = g;
    }
    schedule_.occupancy[g] = used_ + m.non_model_bytes;
    schedule_.chunk_occupancy[g] = used_;
  }

  // A host moment's chunks leave the device, or are read from NVMe (Note [Host moments]).
  void LeaveForHostMoment(uint64_t g, const TraceMoment& m) {
    // Note [Offloads that leave the host room]
    const bool reads = std::any_of(m.chunks.begin(), m.chunks.end(),
                                   [&](ChunkId c) { return u_.nvme_homed(c) && !resident_[c.value()]; });
    const uint64_t not_before = reads && g > kOffloadLeadMoments ? g - kOffloadLeadMoments : 0;
    for (ChunkId c : m.chunks) {
      if (resident_[c.value()] && !u_.nvme_homed(c)) {
        // Off to the host after its last use on the device; its room is
        // counted until this moment all the same.
        Evict(c, g);
        schedule_.offloads_at[std::min<uint64_t>(std::max(last_use_[c.value()] + 1, not_before), g)].push_back(c);
      } else if (resident_[c.value()]) {
        Evict(c, g);
        schedule_.evictions_at[g].push_back(c);
      } else if (u_.nvme_homed(c)) {
        schedule_.host_reads.push_back({.chunk = c, .needed = g, .issue = g, .lower = last_left_[c.value()]});
      }
      left_for_room_[c.value()] = g + 1;  // back on the device only after the moment
      last_left_[c.value()] = g + 1;      // written back as it ends
    }
  }

  // Evicts the victim that makes room at moment g (not needed by it) and
  // returns it. See Note [Victims that leave room for a lead].
  ChunkId EvictVictim(uint64_t g, const std::vector<bool>& needed_now) {
    const uint64_t far = g + u_.period / 2;
    std::optional<ChunkId> best;
    std::pair<uint64_t, uint64_t> best_key{0, 0};
    for (uint32_t c = 0; c < resident_.size(); ++c) {
      if (!resident_[c] || needed_now[c]) continue;
      std::pair<uint64_t, uint64_t> key;  // a larger key wins
      if (policy_ == Victims::kLeastRecentlyUsed) {
        key = {kNever - last_use_[c], 0};
      } else {
        const uint64_t next = u_.NextUse(ChunkId(c), g);
        // Far: longest unused first; near: furthest next use first.
        key = next >= far ? std::pair{uint64_t{1}, kNever - last_use_[c]} : std::pair{uint64_t{0}, next};
      }
      if (!best || key > best_key) {
        best = ChunkId(c);
        best_key = key;
      }
    }
    STRATA_CHECK(best.has_value(), "planner: moment {} cannot fit although validated", g % u_.period);
    Evict(*best, g);
    return *best;
  }

  void Evict(ChunkId v, uint64_t g) {
    resident_[v.value()] = false;
    used_ -= u_.size(v);
    last_left_[v.value()] = g;
  }

  const Unrolled& u_;
  const Victims policy_;
  std::vector<bool> resident_;
  std::vector<uint64_t> last_use_;
  std::vector<uint64_t> left_for_room_;
  std::vector<uint64_t> last_left_;  // off the device (or written back) from here
  uint64_t used_ = 0;
  Schedule schedule_;
};

Result<Schedule> DemandSchedule(const Unrolled& u, Victims policy) { return DemandPager(u, policy).Run(); }

// Stage 2: each fetch (with its victims) as early as its victims and device
// memory allow, in order of need.
void Hoist(const Unrolled& u, Schedule& schedule) {
  const uint64_t capacity = u.input.device_bytes;
  const uint64_t chunk_capacity = ChunkCapacity(u.input);
  uint64_t previous_issue = 0;
  for (Fetch& f : schedule.fetches) {
    // Not before the fetch before it, a whole iteration ahead, or the moment
    // the chunk itself left for non-model room (a fetch of a chunk still
    // there would be a no-op and its eviction would follow it).
    uint64_t lower = std::max({previous_issue, f.needed >= u.period ? f.needed - u.period + 1 : 0, f.left_at});
    uint64_t victim_bytes = 0;
    for (ChunkId v : f.victims) {
      victim_bytes += u.size(v);
      if (std::optional<uint64_t> last = u.LastUseBefore(v, f.needed)) lower = std::max(lower, *last + 1);
    }
    // Walk back from the use while the moment before can hold the chunk
    // instead of the victims (they are resident there, unused until evicted).
    const uint64_t size = u.size(f.chunk);
    uint64_t issue = f.needed;
    while (issue > lower && schedule.occupancy[issue - 1] + size <= capacity + victim_bytes &&
           schedule.chunk_occupancy[issue - 1] + size <= chunk_capacity + victim_bytes) {
      --issue;
    }
    for (uint64_t j = issue; j < f.needed; ++j) {
      schedule.occupancy[j] = schedule.occupancy[j] + size - victim_bytes;
      schedule.chunk_occupancy[j] = schedule.chunk_occupancy[j] + size - victim_bytes;
    }
    f.issue = issue;
    previous_issue = issue;
  }
}

// Host reads as early as the room for them allows, in order of need
// (Notes [Host moments], [Room for reads ahead]).
void HoistHostReads(const Unrolled& u, Schedule& schedule) {
  std::vector<uint64_t> staged(u.length, 0);  // bytes read ahead and not yet used, by moment
  uint64_t previous_issue = 0;
  for (HostRead& r : schedule.host_reads) {
    // Not among the host moments that end the iteration before (Note [Room for reads ahead]).
    const uint64_t iteration_start = r.needed - r.needed % u.period;
    const bool after_device_moment = r.needed % u.period > u.first_device_moment;
    const uint64_t lower =
        std::max({previous_issue, r.lower, r.needed >= u.period ? r.needed - u.period + 1 : 0,
                  u.ends_with_host_moment && after_device_moment ? iteration_start : 0});
    const uint64_t size = u.size(r.chunk);
    uint64_t issue = r.needed;
    while (issue > lower && staged[issue - 1] + size <= schedule.read_room[issue - 1]) --issue;
    // Held from its read until its write-back, which runs as the next moment
    // begins; the read of a later chunk may count on that room (at run time
    // it waits for the write to end: Note [Staging memory at run time]).
    for (uint64_t j = issue; j <= r.needed; ++j) staged[j] += size;
    r.issue = issue;
    previous_issue = issue;
  }
}


// Sets schedule.read_room: host_staging_bytes and, at each moment, the
// host-homed chunks on the device once its evictions, offloads and victims
// have left and before its fetches have (Note [Room for reads ahead]).
void SetReadRoom(const Unrolled& u, Schedule& schedule) {
  const std::vector<std::vector<const Fetch*>> issued_at = IssuedAt(schedule, u.length);
  std::vector<bool> held(u.input.chunk_bytes.size(), false);  // host-homed, on the device
  uint64_t held_bytes = 0;
  const auto leave = [&](ChunkId c) {
    if (!held[c.value()]) return;
    held[c.value()] = false;
    held_bytes -= u.size(c);
  };
  schedule.read_room.assign(u.length, 0);
  for (uint64_t g = 0; g < u.length; ++g) {
    for (ChunkId v : schedule.evictions_at[g]) leave(v);
    for (ChunkId v : schedule.offloads_at[g]) leave(v);
    for (const Fetch* f : issued_at[g]) {
      for (ChunkId v : f->victims) leave(v);
    }
    schedule.read_room[g] = u.input.host_staging_bytes + held_bytes;
    for (const Fetch* f : issued_at[g]) {
      if (u.nvme_homed(f->chunk) || held[f->chunk.value()]) continue;
      held[f->chunk.value()] = true;
      held_bytes += u.size(f->chunk);
    }
  }
}

// The schedule, applied in issue order, has every chunk of every device
// moment on the device when the moment computes and every chunk of a host
// moment off it (NVMe-homed ones read for it, within their bounds, or
// evicted to the host by it), fetches only chunks that are not there and
// evicts only chunks that are: Internal naming the first breach (a planner
// bug, never the caller's).
Status CheckSchedule(const Unrolled& u, const Schedule& schedule) {
  std::vector<bool> resident(u.input.chunk_bytes.size(), false);
  // NVMe-homed chunks of host moments: the moment they are read for (kNever: none pending).
  std::vector<uint64_t> read_for(u.input.chunk_bytes.size(), kNever);
  const std::vector<std::vector<const Fetch*>> issued_at = IssuedAt(schedule, u.length);
  const std::vector<std::vector<const HostRead*>> reads_at = ByIssue(schedule.host_reads, u.length);
  const auto leave = [&](ChunkId v, uint64_t g) -> Status {
    if (!resident[v.value()]) return Internal("planner: moment {} evicts chunk {}, which is not on the device", g, v.value());
    resident[v.value()] = false;
    return Status::Ok();
  };
  for (uint64_t g = 0; g < u.length; ++g) {
    for (ChunkId v : schedule.evictions_at[g]) STRATA_RETURN_IF_ERROR(leave(v, g));
    for (ChunkId v : schedule.offloads_at[g]) STRATA_RETURN_IF_ERROR(leave(v, g));
    for (const Fetch* f : issued_at[g]) {
      for (ChunkId v : f->victims) STRATA_RETURN_IF_ERROR(leave(v, g));
      if (resident[f->chunk.value()] || read_for[f->chunk.value()] != kNever) {
        return Internal("planner: moment {} fetches chunk {}, which is already on the device or read for the host", g,
                        f->chunk.value());
      }
      resident[f->chunk.value()] = true;
    }
    for (const HostRead* r : reads_at[g]) {
      if (resident[r->chunk.value()] || r->issue < r->lower || r->issue > r->needed) {
        return Internal("planner: moment {} reads chunk {} for moment {} (not before {}) while it is {}", g,
                        r->chunk.value(), r->needed, r->lower, resident[r->chunk.value()] ? "on the device" : "early");
      }
      read_for[r->chunk.value()] = r->needed;
    }
    for (ChunkId c : u.moment(g).chunks) {
      if (resident[c.value()] == u.on_host(g)) {
        return Internal("planner: moment {} needs chunk {} {} the device, and the plan has it {}", g, c.value(),
                        u.on_host(g) ? "off" : "on", u.on_host(g) ? "there" : "elsewhere");
      }
      if (!u.on_host(g) || !u.nvme_homed(c)) continue;
      // An NVMe-homed chunk of a host moment is read for it, or evicted to the host by it.
      const auto& evicted = schedule.evictions_at[g];
      if (read_for[c.value()] != g && std::find(evicted.begin(), evicted.end(), c) == evicted.end()) {
        return Internal("planner: host moment {} needs NVMe-homed chunk {}, which the plan neither reads nor evicts "
                        "to the host for it", g, c.value());
      }
      read_for[c.value()] = kNever;
    }
  }
  return Status::Ok();
}


Status Validate(const PlannerInput& input) {
  const size_t chunks = input.chunk_bytes.size();
  if (input.trace.moments.empty()) return InvalidArgument("planner: the trace has no moments");
  if (input.home.size() != chunks) {
    return InvalidArgument("planner: {} chunk sizes but {} home tiers", chunks, input.home.size());
  }
  for (size_t c = 0; c < chunks; ++c) {
    if (input.home[c] == Tier::kDevice) {
      return InvalidArgument("planner: chunk {} has its home on the device; homes are host or nvme", c);
    }
  }
  for (int l = 0; l < kNumLinks; ++l) {
    if (!(input.links.bytes_per_second[l] > 0)) {
      return InvalidArgument("planner: the {} link has bandwidth {} B/s; it must be > 0",
                             LinkName(static_cast<Link>(l)), input.links.bytes_per_second[l]);
    }
  }
  for (size_t m = 0; m < input.trace.moments.size(); ++m) {
    const TraceMoment& moment = input.trace.moments[m];
    if (!(moment.compute_seconds >= 0) || !std::isfinite(moment.compute_seconds)) {
      return InvalidArgument("planner: moment {} computes for {} s", m, moment.compute_seconds);
    }
    if (moment.tier != Tier::kDevice && moment.tier != Tier::kHost) {
      return InvalidArgument("planner: moment {} computes on {}; a moment computes on the device or the host", m,
                             TierName(moment.tier));
    }
    if (moment.overlap && moment.tier != Tier::kHost) {
      return InvalidArgument("planner: moment {} computes beside the others on {}; only a host moment does", m,
                             TierName(moment.tier));
    }
    if (moment.device_compute_seconds &&
        (moment.tier != Tier::kHost || !(*moment.device_compute_seconds >= 0) ||
         !std::isfinite(*moment.device_compute_seconds))) {
      return InvalidArgument("planner: moment {} may move to the device ({} s there) but {}", m,
                             *moment.device_compute_seconds,
                             moment.tier != Tier::kHost ? "is not a host moment" : "that time is not >= 0");
    }
    uint64_t chunk_bytes = 0;
    std::vector<bool> seen(chunks, false);
    for (ChunkId c : moment.chunks) {
      if (c.value() >= chunks) return InvalidArgument("planner: moment {} names chunk {} of {}", m, c.value(), chunks);
      if (seen[c.value()]) return InvalidArgument("planner: moment {} names chunk {} twice", m, c.value());
      seen[c.value()] = true;
      if (moment.tier == Tier::kDevice) chunk_bytes += input.chunk_bytes[c.value()];
    }
    if (chunk_bytes > ChunkCapacity(input)) {
      return OutOfMemory("planner: moment {} needs {} of chunks on the device, {} more than the {} chunks may take "
                         "there (device.budget)",
                         m, FormatSize(chunk_bytes), FormatSize(chunk_bytes - ChunkCapacity(input)),
                         FormatSize(ChunkCapacity(input)));
    }
    const uint64_t bytes = chunk_bytes + moment.non_model_bytes;
    if (bytes > input.device_bytes) {
      return OutOfMemory("planner: moment {} needs {} on the device ({} of non-model memory and {} chunks), {} more "
                         "than the device's {}",
                         m, FormatSize(bytes), FormatSize(moment.non_model_bytes), moment.chunks.size(),
                         FormatSize(bytes - input.device_bytes), FormatSize(input.device_bytes));
    }
  }
  return Status::Ok();
}

}  // namespace

std::string_view LinkName(Link link) {
  switch (link) {
    case Link::kHostToDevice: return "host->device";
    case Link::kDeviceToHost: return "device->host";
    case Link::kNvmeRead: return "nvme read";
    case Link::kNvmeWrite: return "nvme write";
  }
  return "?";
}

uint64_t Prediction::bytes_moved() const {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  return total;
}

namespace {

// The plan for the trace as it is, every moment where it says.
Result<Plan> PlanAsTraced(const PlannerInput& input) {
  STRATA_RETURN_IF_ERROR(Validate(input));
  const Unrolled unrolled(input);
  STRATA_ASSIGN_OR_RETURN(Schedule schedule, DemandSchedule(unrolled, Victims::kFurthestNextUse));
  Hoist(unrolled, schedule);
  SetReadRoom(unrolled, schedule);
  HoistHostReads(unrolled, schedule);
  STRATA_RETURN_IF_ERROR(CheckSchedule(unrolled, schedule));
  Plan plan;
  plan.num_moments = unrolled.period;
  plan.fetches_at.resize(unrolled.period);
  plan.evictions_at.resize(unrolled.period);
  const uint64_t first = unrolled.period, last = 2 * uint64_t{unrolled.period};
  for (const Fetch& f : schedule.fetches) {
    if (f.issue < first || f.issue >= last) continue;
    plan.fetches_at[f.issue - first].push_back(PlannedFetch{.chunk = f.chunk,
                                                            .issue = static_cast<uint32_t>(f.issue % unrolled.period),
                                                            .needed = static_cast<uint32_t>(f.needed % unrolled.period),
                                                            .victims = f.victims});
  }
  plan.offloads_at.resize(unrolled.period);
  for (uint64_t g = first; g < last; ++g) {
    plan.evictions_at[g - first] = schedule.evictions_at[g];
    plan.offloads_at[g - first] = schedule.offloads_at[g];
  }
  plan.host_reads_at.resize(unrolled.period);
  for (const HostRead& r : schedule.host_reads) {
    if (r.issue >= first && r.issue < last) {
      plan.host_reads_at[r.issue - first].push_back({r.chunk, static_cast<uint32_t>(r.needed % unrolled.period)});
    }
  }
  plan.host_read_room.assign(schedule.read_room.begin() + first, schedule.read_room.begin() + last);
  for (const TraceMoment& m : input.trace.moments) plan.compute_tier.push_back(m.tier);
  // The device as the middle iteration begins: every move issued before it.
  std::vector<bool> resident(input.chunk_bytes.size(), false);
  const std::vector<std::vector<const Fetch*>> issued_at = IssuedAt(schedule, first);
  for (uint64_t g = 0; g < first; ++g) {
    for (ChunkId v : schedule.evictions_at[g]) resident[v.value()] = false;
    for (ChunkId v : schedule.offloads_at[g]) resident[v.value()] = false;
    for (const Fetch* f : issued_at[g]) {
      for (ChunkId v : f->victims) resident[v.value()] = false;
      resident[f->chunk.value()] = true;
    }
  }
  for (uint32_t c = 0; c < resident.size(); ++c) {
    if (resident[c]) plan.resident_at_start.push_back(ChunkId(c));
  }
  for (uint64_t g = 0; g < unrolled.length; ++g) {
    STRATA_CHECK(schedule.occupancy[g] <= input.device_bytes, "planner: moment {} would hold {} of {} bytes", g,
                 schedule.occupancy[g], input.device_bytes);
    STRATA_CHECK(schedule.chunk_occupancy[g] <= ChunkCapacity(input), "planner: moment {} would hold {} of {} "
                 "bytes of chunks", g, schedule.chunk_occupancy[g], ChunkCapacity(input));
    if (g >= first && g < last) {
      plan.peak_device_bytes = std::max(plan.peak_device_bytes, schedule.occupancy[g]);
      plan.peak_chunk_bytes = std::max(plan.peak_chunk_bytes, schedule.chunk_occupancy[g]);
    }
  }
  plan.prediction = Replay(unrolled, schedule);
  return plan;
}

}  // namespace

Result<Plan> BuildPlan(const PlannerInput& input) {
  STRATA_ASSIGN_OR_RETURN(Plan on_host, PlanAsTraced(input));
  // Note [Where updates run]
  std::vector<bool> on_device(input.chunk_bytes.size(), false);
  for (const TraceMoment& m : input.trace.moments) {
    if (m.tier != Tier::kDevice) continue;
    for (ChunkId c : m.chunks) on_device[c.value()] = true;
  }
  uint64_t margin = std::min(input.device_bytes - on_host.peak_device_bytes,
                             ChunkCapacity(input) - on_host.peak_chunk_bytes);
  PlannerInput placed = input;
  bool any = false;
  for (TraceMoment& m : placed.trace.moments) {
    if (!m.device_compute_seconds) continue;
    uint64_t added = 0;
    for (ChunkId c : m.chunks) {
      if (!on_device[c.value()]) added += input.chunk_bytes[c.value()];
    }
    if (added > margin) continue;
    margin -= added;
    for (ChunkId c : m.chunks) on_device[c.value()] = true;
    m.tier = Tier::kDevice;
    m.compute_seconds = *m.device_compute_seconds;
    m.device_compute_seconds.reset();
    m.overlap = false;  // in the device's own order, as a GPU's stream runs it
    any = true;
  }
  if (!any) return on_host;
  Result<Plan> on_device_plan = PlanAsTraced(placed);
  if (!on_device_plan.ok() || on_device_plan->prediction.step_seconds > on_host.prediction.step_seconds) return on_host;
  return on_device_plan;
}

Result<Prediction> PredictLru(const PlannerInput& input) {
  STRATA_RETURN_IF_ERROR(Validate(input));
  const Unrolled unrolled(input);
  STRATA_ASSIGN_OR_RETURN(Schedule schedule, DemandSchedule(unrolled, Victims::kLeastRecentlyUsed));
  SetReadRoom(unrolled, schedule);
  return Replay(unrolled, schedule);
}

}  // namespace strata::offload
