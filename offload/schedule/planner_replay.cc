// The planner's prediction: a schedule replayed on the link model.
#include <algorithm>
#include <array>
#include <functional>
#include <utility>
#include <vector>

#include "offload/schedule/planner_schedule.h"
#include "src/base/link_queue.h"

namespace strata::offload::planning {

// Note [The link model]
// The prediction replays the plan on a model of the links: one queue per
// direction (host->device, device->host, NVMe read, NVMe write), each at its
// measured bandwidth (LinkQueue, the model the emulated device's copies are
// throttled by too, so that the pipeline's tests and the replay benchmark
// run on the links the plan assumes); a moment starts when its compute is requested and
// every chunk it needs has arrived, and the wait is its stall. A trace is a
// sequence of moments; a moment names the chunks its compute needs on the
// device, the device memory in use besides chunks (activations, workspace),
// and how long its compute takes once they are there.

std::vector<std::vector<const Fetch*>> IssuedAt(const Schedule& schedule, uint64_t until) {
  return ByIssue(schedule.fetches, until);
}

namespace {

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
        on_host_(u.input.chunk_bytes.size()) {
    for (int l = 0; l < kNumLinks; ++l) links_[l] = LinkQueue(u.input.links.bytes_per_second[l]);
  }

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
    double busy_until = 0;      // in use by an overlapped update until then
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
    // The host's lane: overlapped updates one after another, and a
    // host moment between device moments (the step's) after all of them.
    double host_end = 0;
    if (u_.on_host(g)) {
      start = std::max(start, host_free_);
      host_end = start + m.compute_seconds;
      WriteBack(g, host_end);
    }
    if (m.overlap) {  // the device's lane goes on at once; the chunks' next moves wait for it
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
    if (Counted(g)) prediction_.bytes[l] += bytes;
    return links_[l].Transfer(ready, bytes);
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
  std::array<LinkQueue, kNumLinks> links_;
  std::vector<double> arrival_;     // on the device
  std::vector<double> host_ready_;  // in host memory, for a host moment
  std::vector<double> written_;     // on NVMe, for a read after
  std::vector<ChunkOnHost> on_host_;
  std::vector<std::pair<double, uint64_t>> releases_;  // a min-heap: (write-back end, bytes) of reads staged
  uint64_t staged_ = 0;
  double end_ = 0;        // end of the previous moment's compute (the device's lane)
  double host_free_ = 0;  // end of the last overlapped update (the host's lane)
  double middle_start_ = 0, middle_end_ = 0;
  Prediction prediction_;
};

}  // namespace

Prediction Replay(const Unrolled& u, const Schedule& schedule) { return LinkReplay(u, schedule).Run(); }

}  // namespace strata::offload::planning
