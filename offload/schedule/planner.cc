#include "offload/schedule/planner.h"

#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <optional>
#include <utility>
#include <vector>

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
// Note [The link model]
// The prediction replays the plan on a model of the links: one queue per
// direction (host->device, device->host, NVMe read, NVMe write), each at its
// measured bandwidth; a moment starts when its compute is requested and
// every chunk it needs has arrived, and the wait is its stall. A trace is a
// sequence of moments; a moment names the chunks its compute needs on the
// device, the device memory in use besides chunks (activations, workspace),
// and how long its compute takes once they are there.
//
// Note [Updates beside backward]
// A host moment marked beside (an optimizer update begun in backward, as
// soon as its group's gradients are complete: Note [Updates beside
// backward] in offload/training/beside_updates.cc) computes on the host's
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

constexpr uint32_t kCopies = 3;
// Moments before a host moment that reads from NVMe at which its other
// chunks leave the device: Note [Offloads that leave the host room].
constexpr uint64_t kOffloadLeadMoments = 4;
constexpr uint64_t kNever = std::numeric_limits<uint64_t>::max();

// Note [The device model].
uint64_t ChunkCapacity(const PlannerInput& input) {
  return input.device_chunk_bytes > 0 ? std::min(input.device_chunk_bytes, input.device_bytes) : input.device_bytes;
}

int LinkIndex(Link link) { return static_cast<int>(link); }

// The trace unrolled kCopies times, with each chunk's uses.
struct Unrolled {
  const PlannerInput& input;
  uint32_t period;
  uint64_t length;
  std::vector<std::vector<uint64_t>> uses;  // by chunk: moments (unrolled) that need it on the device, ascending

  bool ends_with_host_moment = false;  // a host moment after the last device moment
  uint32_t first_device_moment = 0;     // the first device moment's index (period: none)

  explicit Unrolled(const PlannerInput& in)
      : input(in), period(static_cast<uint32_t>(in.trace.moments.size())), length(uint64_t{kCopies} * period) {
    const auto& moments = in.trace.moments;
    const auto last_device = std::find_if(moments.rbegin(), moments.rend(),
                                          [](const TraceMoment& m) { return m.tier == Tier::kDevice; });
    ends_with_host_moment = last_device != moments.rend() && last_device != moments.rbegin();
    first_device_moment = static_cast<uint32_t>(
        std::find_if(moments.begin(), moments.end(), [](const TraceMoment& m) { return m.tier == Tier::kDevice; }) -
        moments.begin());
    uses.resize(in.chunk_bytes.size());
    for (uint64_t g = 0; g < length; ++g) {
      if (!on_host(g)) {
        for (ChunkId c : moment(g).chunks) uses[c.value()].push_back(g);
      }
    }
  }
  bool on_host(uint64_t g) const { return moment(g).tier == Tier::kHost; }
  bool host_chunk_at(ChunkId c, uint64_t g) const {
    const std::vector<ChunkId>& chunks = moment(g).chunks;
    return on_host(g) && std::find(chunks.begin(), chunks.end(), c) != chunks.end();
  }
  bool nvme_homed(ChunkId c) const { return input.home[c.value()] == Tier::kNvme; }
  const TraceMoment& moment(uint64_t g) const { return input.trace.moments[g % period]; }
  uint64_t size(ChunkId c) const { return input.chunk_bytes[c.value()]; }
  // The first use at or after g, kNever when none.
  uint64_t NextUse(ChunkId c, uint64_t g) const {
    const std::vector<uint64_t>& u = uses[c.value()];
    auto it = std::lower_bound(u.begin(), u.end(), g);
    return it == u.end() ? kNever : *it;
  }
  // The last use before g, or none.
  std::optional<uint64_t> LastUseBefore(ChunkId c, uint64_t g) const {
    const std::vector<uint64_t>& u = uses[c.value()];
    auto it = std::lower_bound(u.begin(), u.end(), g);
    if (it == u.begin()) return std::nullopt;
    return *(it - 1);
  }
};

struct Fetch {
  ChunkId chunk;
  uint64_t needed = 0;
  uint64_t issue = 0;
  std::vector<ChunkId> victims;
  uint64_t left_at = 0;  // the moment the chunk last left the device for non-model room (0: never)
};

// An NVMe-homed chunk read into host memory for a host moment.
struct HostRead {
  ChunkId chunk;
  uint64_t needed = 0;
  uint64_t issue = 0;
  uint64_t lower = 0;  // not before: the chunk left the device, or was written back, before this
};

// Stage 1 (and the LRU baseline): demand fetches and their victims.
struct Schedule {
  std::vector<Fetch> fetches;                      // in order of need
  std::vector<HostRead> host_reads;                // in order of need
  std::vector<std::vector<ChunkId>> evictions_at;  // by unrolled moment: room for non-model memory
  std::vector<std::vector<ChunkId>> offloads_at;   // by unrolled moment: off early for a host moment
  std::vector<uint64_t> occupancy;                 // by unrolled moment: chunks resident + non-model
  std::vector<uint64_t> chunk_occupancy;           // by unrolled moment: chunks resident
  std::vector<uint64_t> read_room;                 // by unrolled moment: Note [Room for reads ahead]
};

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

template <typename T>
std::vector<std::vector<const T*>> ByIssue(const std::vector<T>& moves, uint64_t until) {
  std::vector<std::vector<const T*>> issued_at(until);
  for (const T& m : moves) {
    if (m.issue < until) issued_at[m.issue].push_back(&m);
  }
  return issued_at;
}

// The fetches issued at each unrolled moment before `until`, in order.
std::vector<std::vector<const Fetch*>> IssuedAt(const Schedule& schedule, uint64_t until) {
  return ByIssue(schedule.fetches, until);
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

// Replays a schedule on the link model (Note [The link model]); measures the
// middle iteration.
class LinkReplay {
 public:
  LinkReplay(const Unrolled& u, const Schedule& schedule)
      : u_(u),
        schedule_(schedule),
        issued_at_(IssuedAt(schedule, u.length)),
        reads_at_(ByIssue(schedule.host_reads, u.length)),
        first_(u.period),
        last_(2 * uint64_t{u.period}),
        arrival_(u.input.chunk_bytes.size(), 0.0),
        host_ready_(u.input.chunk_bytes.size(), 0.0),
        written_(u.input.chunk_bytes.size(), 0.0),
        on_host_(u.input.chunk_bytes.size()) {}

  Prediction Run() && {
    for (uint64_t g = 0; g < u_.length; ++g) Moment(g);
    prediction_.step_seconds = middle_end_ - middle_start_;
    return std::move(prediction_);
  }

 private:
  // Reads ahead of host moments hold staging memory from their start until
  // their chunk's write-back ends, as at run time (Note [Staging memory at
  // run time] in pipeline_impl.h): each is modelled when its moment comes,
  // once the write-backs before it are known, starting no earlier than it
  // was issued nor before the staging memory has room for it.
  struct ChunkOnHost {
    bool pending = false;       // a read ahead issued, not yet modelled
    double issued = 0;          // when it was
    uint64_t moment = 0;        // at which moment (its bytes count there)
    uint64_t staged_bytes = 0;  // staging memory its read holds until its write-back ends
    double busy_until = 0;      // in use by an update beside backward until then
  };

  void Moment(uint64_t g) {
    const TraceMoment& m = u_.moment(g);
    const double requested = end_;
    const double room_for_activations = MakeRoom(g, requested);
    for (const Fetch* f : issued_at_[g]) FetchChunk(*f, requested, g);
    // Behind the fetches' victims: nothing waits for them but their host moment.
    for (ChunkId c : schedule_.offloads_at[g]) {
      host_ready_[c.value()] = Transfer(Link::kDeviceToHost, requested, u_.size(c), g);
    }
    QueueHostReads(g, requested);
    double start = ChunksReady(g, room_for_activations);
    // The host's lane: updates beside backward one after another, and a
    // host moment between device moments (the step's) after all of them.
    double host_end = 0;
    if (u_.on_host(g)) {
      start = std::max(start, host_free_);
      host_end = start + m.compute_seconds;
      WriteBack(g, host_end);
    }
    if (m.beside) {  // the device's lane goes on at once; the chunks' next moves wait for it
      host_free_ = host_end;
      for (ChunkId c : m.chunks) on_host_[c.value()].busy_until = host_end;
      start = requested;
      end_ = requested;
    } else {
      end_ = start + m.compute_seconds;
    }
    if ((g + 1) % u_.period == 0 && host_free_ > end_) {  // the step needs every update's gradients: a stall
      if (Counted(g)) prediction_.stall_seconds += host_free_ - end_;
      end_ = host_free_;
    }
    if (Counted(g)) {
      prediction_.stall_seconds += start - requested;
      prediction_.stall_per_moment.push_back(start - requested);
      prediction_.compute_seconds += m.compute_seconds;
    }
    if (g + 1 == first_) middle_start_ = end_;
    if (g + 1 == last_) middle_end_ = end_;
  }

  bool Counted(uint64_t g) const { return g >= first_ && g < last_; }

  // Queues `bytes` on `link` once `ready`; returns when they have crossed.
  double Transfer(Link link, double ready, uint64_t bytes, uint64_t g) {
    const int l = LinkIndex(link);
    const double start = std::max(link_free_[l], ready);
    link_free_[l] = start + static_cast<double>(bytes) / u_.input.links.bytes_per_second[l];
    if (Counted(g)) prediction_.bytes[l] += bytes;
    return link_free_[l];
  }

  // A victim leaves over device->host (and on to NVMe when that is its home);
  // its room is free once it is off the device.
  double Evict(ChunkId v, double ready, uint64_t g) {
    const double off_device = Transfer(Link::kDeviceToHost, ready, u_.size(v), g);
    host_ready_[v.value()] = off_device;
    if (u_.nvme_homed(v) && !u_.host_chunk_at(v, g)) {  // a host moment's chunk is written after it
      written_[v.value()] = Transfer(Link::kNvmeWrite, off_device, u_.size(v), g);
    }
    return off_device;
  }

  double Read(ChunkId c, double ready, uint64_t g) {
    return Transfer(Link::kNvmeRead, std::max(ready, written_[c.value()]), u_.size(c), g);
  }

  // The moment's non-model memory waits for the chunks that make its room.
  double MakeRoom(uint64_t g, double requested) {
    double room = requested;
    for (ChunkId v : schedule_.evictions_at[g]) room = std::max(room, Evict(v, requested, g));
    return room;
  }

  void FetchChunk(const Fetch& f, double requested, uint64_t g) {
    double room = requested;
    for (ChunkId v : f.victims) room = std::max(room, Evict(v, requested, g));
    double ready = requested;
    if (u_.nvme_homed(f.chunk)) ready = Read(f.chunk, requested, g);
    arrival_[f.chunk.value()] = Transfer(
        Link::kHostToDevice, std::max({ready, room, on_host_[f.chunk.value()].busy_until}), u_.size(f.chunk), g);
    if (Counted(g)) prediction_.fetches++;
  }

  // After this moment's evictions, as the pipeline queues them: a read of a
  // chunk evicted here follows its write.
  void QueueHostReads(uint64_t g, double requested) {
    for (const HostRead* r : reads_at_[g]) {
      ChunkOnHost& state = on_host_[r->chunk.value()];
      state.pending = true;
      state.issued = requested;
      state.moment = g;
    }
  }

  // When every chunk of moment g is where it computes, not before `not_before`.
  double ChunksReady(uint64_t g, double not_before) {
    const TraceMoment& m = u_.moment(g);
    for (ChunkId c : m.chunks) {
      if (u_.on_host(g) && on_host_[c.value()].pending) host_ready_[c.value()] = StagedRead(c);
    }
    double start = not_before;
    for (ChunkId c : m.chunks) start = std::max(start, u_.on_host(g) ? host_ready_[c.value()] : arrival_[c.value()]);
    return start;
  }

  // A pending read ahead, once the staging memory has room for it.
  double StagedRead(ChunkId c) {
    ChunkOnHost& r = on_host_[c.value()];
    double start = r.issued;
    while (staged_ + u_.size(c) > schedule_.read_room[r.moment] && !releases_.empty()) {
      std::pop_heap(releases_.begin(), releases_.end(), std::greater<>());
      start = std::max(start, releases_.back().first);
      staged_ -= releases_.back().second;
      releases_.pop_back();
    }
    staged_ += u_.size(c);
    r.staged_bytes = u_.size(c);
    r.pending = false;
    return Read(c, start, r.moment);
  }

  // Host moment g's NVMe-homed chunks go back to NVMe once it ends at
  // `host_end`; the staging memory their reads held is free when that lands.
  void WriteBack(uint64_t g, double host_end) {
    for (ChunkId c : u_.moment(g).chunks) {
      if (!u_.nvme_homed(c)) continue;
      written_[c.value()] = Transfer(Link::kNvmeWrite, host_end, u_.size(c), g);
      if (on_host_[c.value()].staged_bytes == 0) continue;
      releases_.emplace_back(written_[c.value()], std::exchange(on_host_[c.value()].staged_bytes, 0));
      std::push_heap(releases_.begin(), releases_.end(), std::greater<>());
    }
  }

  const Unrolled& u_;
  const Schedule& schedule_;
  const std::vector<std::vector<const Fetch*>> issued_at_;
  const std::vector<std::vector<const HostRead*>> reads_at_;
  const uint64_t first_, last_;  // the middle iteration: [first_, last_)
  std::array<double, kNumLinks> link_free_ = {};
  std::vector<double> arrival_;     // on the device
  std::vector<double> host_ready_;  // in host memory, for a host moment
  std::vector<double> written_;     // on NVMe, for a read after
  std::vector<ChunkOnHost> on_host_;
  std::vector<std::pair<double, uint64_t>> releases_;  // a min-heap: (write-back end, bytes) of reads staged
  uint64_t staged_ = 0;
  double end_ = 0;        // end of the previous moment's compute (the device's lane)
  double host_free_ = 0;  // end of the last update beside backward (the host's lane)
  double middle_start_ = 0, middle_end_ = 0;
  Prediction prediction_;
};

Prediction Replay(const Unrolled& u, const Schedule& schedule) { return LinkReplay(u, schedule).Run(); }

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
    if (moment.beside && moment.tier != Tier::kHost) {
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
    m.beside = false;  // in the device's own order, as a GPU's stream runs it
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
