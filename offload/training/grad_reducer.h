// GradReducer: data parallel, the reduce-scatter of each chunk group's
// gradients on a thread of its own, started as soon as the group's
// gradients are complete (Submit) so that it overlaps the rest of backward;
// each group's reduced shard is taken when it is needed (Take). Parameters
// sharded (comm.shard_params, ZeRO-3), Gather fills a transient param chunk
// from every rank's master shard on the same queue. See Note [Reductions on a
// queue] and Note [Gathers kept and ahead] in grad_reducer.cc.
//
// While anything is queued the reducer's thread uses the communicator: its
// owner runs no other collective before Drain() (one begun meanwhile is
// CommError). Every rank must submit the same groups, and gather the same
// chunks, in the same order; a rank whose peers did otherwise gets
// InvalidArgument naming them.
//
// Thread-safety: Submit, Take, Gather and Drain from one thread (the training loop).
#pragma once

#include <cstdint>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "memory/chunk_layout.h"
#include "strata/access.h"
#include "strata/buffer.h"
#include "strata/comm.h"
#include "strata/engine.h"
#include "strata/status.h"

namespace strata {
class TaskQueue;
}

namespace strata::offload {

class GradReducer {
 public:
  GradReducer(Engine& engine, Communicator& comm);
  ~GradReducer();  // waits for what is queued
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Copies `grad` (a grad chunk, from wherever it is) and queues its
  // reduce-scatter. Submitting it again before Take (a gradient that
  // arrived late) replaces the earlier reduction.
  Status Submit(ChunkId grad);
  bool submitted(ChunkId grad) const { return pending_.count(grad.value()) != 0; }
  // Take: this rank's range (memory::ShardOf) of the mean of every rank's
  // gradients of `grad`, in fp32 (`shard`, ShardRange::elems long), and the
  // bytes its reduce-scatter sent; submits the chunk first if it was not.
  // Waits for it (counted in wait_seconds()).
  struct Reduced {
    std::vector<float> shard;
    uint64_t bytes = 0;
  };
  Result<Reduced> Take(ChunkId grad);
  // An overlapped update's hold on the reduction of `grad` submitted
  // last: `done` is its outcome, and once it is ready `shard` is this rank's
  // range of it (Take's), valid while the hold lives, a later Submit of the
  // chunk notwithstanding, until Take moves it out (so the holder is done
  // with it before Take). Null when the chunk is not submitted. Any thread
  // may read a Hold; HoldReduction is the training loop's.
  struct Hold {
    std::shared_future<Status> done;
    std::shared_ptr<const std::vector<float>> shard;
  };
  std::optional<Hold> HoldReduction(ChunkId grad) const;
  // Gives a taken shard's memory back for the next reductions (Note
  // [Recycled shards]). Any thread.
  void Recycle(std::vector<float> shard);
  // Queues any collective after those queued; its result at Drain or
  // through the future.
  std::shared_future<Status> Enqueue(std::function<Status(Communicator&)> job);
  // Parameters sharded: fills `into` (a pin of the transient param chunk
  // `param`, on the device or the host) with its group's parameters in the
  // param dtype, all-gathered from every rank's master shard; waits for it
  // (counted in wait_seconds()). Keeps the last kKeptGathers chunks pinned
  // and gathers ahead the kPrefetchDepth chunks that followed in the last
  // step (Note [Gathers kept and ahead]). IoError naming the ranks that could
  // not read their master shard; after any failed Gather every later one
  // returns that error.
  Status Gather(ChunkId param, const ChunkAccess& into);
  // Lets the kept chunks go and drops what was gathered ahead: stale once
  // the masters change, so call it before updating them; this step's
  // sequence of Gathers becomes the one the next step gathers ahead from.
  // Also at destruction.
  void ReleaseGathered();
  // Group `param`'s master shard is final for this step: of the first
  // kPrefetchDepth chunks of the last step's sequence (the next forward's
  // first), those whose masters are final are gathered ahead now.
  void Updated(ChunkId param);
  static constexpr size_t kKeptGathers = kKeptGatheredChunks;
  static constexpr size_t kPrefetchDepth = 4;
  // Values a gradient reduction's message carries beyond its shard: the group's tag, one value a bit.
  static constexpr size_t kTagBits = 32;
  uint64_t gathers() const { return gathers_; }  // Gather calls that communicated
  uint64_t gathered_ahead() const { return gathered_ahead_; }  // of them, those gathered ahead
  uint64_t filled_ahead() const { return filled_ahead_; }  // of those, the ones whose chunk was filled ahead too

  // Waits for everything queued (the gathers ahead too); the first error (in queue order: the cause,
  // not the failures of a broken group after it) of the jobs not taken.
  Status Drain();
  // Whether the calling thread is the reducer's own (one of its jobs): the
  // reducer must not be destroyed there.
  bool OnOwnThread() const;
  // Seconds Take and Drain have waited for the queue (communication not
  // hidden behind other work), since construction.
  double wait_seconds() const { return wait_seconds_; }

 private:
  struct Pending {
    std::shared_future<Status> done;
    std::shared_ptr<Buffer> send;  // the message, back to spare_sends_ once taken
    std::vector<float> shard;  // set by the job
    uint64_t bytes = 0;        // set by the job
    uint64_t seq = 0;          // its place in the queue
  };

  // The dtype `grad`'s reductions travel in: the grad dtype
  // (comm.reduce_dtype = grad) where W ranks' tags sum exactly in it, else fp32.
  DType WireDType(DType grad) const;
  // Every rank's slice of a reduction's message for `info` (read into
  // submit_raw_): its range in `wire`, then `tag` (Note [Reductions on a queue]).
  void PackReduction(const ChunkInfo& info, const memory::ShardRange& range, DType wire, uint64_t tag,
                     std::byte* message) const;
  // The queued job of a reduction: the reduce-scatter, the tags checked,
  // the mean into `into`.
  Status Reduce(const Buffer& send, size_t slice, uint32_t group, uint64_t tag, DType wire, Pending& into);

  Engine& engine_;
  Communicator& comm_;
  const std::vector<ChunkInfo> chunks_;
  std::map<uint32_t, std::shared_ptr<Pending>> pending_;  // by grad chunk id (shared with Holds)
  std::map<uint64_t, std::shared_future<Status>> queued_;  // every job not taken, by queue order
  uint64_t next_seq_ = 0;
  double wait_seconds_ = 0;
  // A parameter all-gather queued: every rank's slice lands in `landing`
  // (host memory); its job also fills the chunk where it finds it on the
  // device, unpinned (see Gather).
  struct Filled {
    std::optional<uint64_t> generation;  // the job filled the chunk in this placement (ChunkAccess::generation)
    bool copy_may_run = false;           // a copy out of the landing timed out
  };
  struct Queued {
    std::shared_future<Status> done;
    std::shared_ptr<Buffer> landing;
    std::shared_ptr<Filled> filled;  // written by the job, read once `done` is
    uint64_t seq = 0;  // its place in the queue
  };
  Queued QueueGather(ChunkId param);
  struct GatherJob;
  // The queued job of a gather: this rank's shard out, every rank's into
  // `landing`, and the chunk filled where it is on the device, unpinned.
  Status GatherOnQueue(const GatherJob& job, const Buffer& landing, Filled& filled);
  // This rank's master shard, in the param dtype, into gather_send_.
  Status PackGatherShard(const GatherJob& job);
  // InvalidArgument or IoError when a rank's tag in `all` is not `tag`.
  Status CheckGatheredTags(const GatherJob& job, const std::byte* all, uint64_t tag) const;
  // Copies `landing` (W slices of shard and tag) into `param`'s bytes at
  // `chunk` on `tier`; sets *copy_may_run when a device copy timed out (it
  // may still read the landing).
  Status FillFromLanding(const Buffer& landing, ChunkId param, std::byte* chunk, Tier tier, bool* copy_may_run);
  // A taken or dropped gather's landing, back for reuse (or quarantined: see Filled::copy_may_run).
  void GiveBackLanding(Queued& gather);
  // Queues the chunks at [position, position + kPrefetchDepth) of the last
  // step's sequence, but those kept, queued already or being gathered.
  void PrefetchFrom(size_t position, std::optional<ChunkId> gathering);

  uint64_t largest_grad_bytes_ = 0;
  uint64_t largest_message_bytes_ = 0;  // a reduction's send buffer
  Buffer submit_raw_;                   // Submit's: a grad chunk read
  std::vector<std::shared_ptr<Buffer>> spare_sends_;  // reductions' messages, for reuse
  std::mutex spare_shards_mu_;
  std::vector<std::vector<float>> spare_shards_;  // Recycle()d shards, for the queue's jobs
  Buffer reduce_recv_;                  // the queue thread's: a reduction's result
  uint64_t largest_landing_bytes_ = 0;  // a param all-gather's W slices
  uint64_t largest_master_bytes_ = 0;
  std::vector<std::shared_ptr<Buffer>> spare_landings_;  // gathers' landing buffers, for reuse
  Buffer gather_shard_;                     // the queue thread's: a master shard read
  std::vector<std::byte> gather_send_;      // the queue thread's: the all-gather's message
  static constexpr uint64_t kFailedTag = 0;  // a rank could not read its shard (group tags are group + 1)
  // Gathers recorded a step at most (an evaluation-only loop never steps).
  static constexpr size_t kMaxSequence = 1 << 16;
  std::vector<std::shared_ptr<Buffer>> quarantined_;  // sources of copies that timed out
  Status broken_ = Status::Ok();  // set by a Gather that failed: what this rank keeps may differ from its peers'
  std::vector<std::pair<ChunkId, ChunkAccess>> kept_;  // gathered chunks still pinned, oldest first
  std::map<uint32_t, Queued> prefetched_;   // gathered ahead, by param chunk id
  std::vector<ChunkId> sequence_;           // this step's Gathers, in order
  std::vector<ChunkId> last_sequence_;      // the last step's
  std::vector<ChunkId> updated_;            // param chunks whose masters this step has updated
  uint64_t gathers_ = 0;
  uint64_t gathered_ahead_ = 0;
  uint64_t filled_ahead_ = 0;
  std::unique_ptr<TaskQueue> queue_;  // last: its thread uses the members above
};

}  // namespace strata::offload
