#include "offload/training/grad_reducer.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <optional>
#include <string>

#include <fmt/format.h>

#include "memory/chunk_layout.h"
#include "optim/cpu/cpu_kernels.h"
#include "src/base/alignment.h"
#include "src/base/half.h"
#include "src/base/task_queue.h"
#include "strata/buffer.h"

namespace strata::offload {

// Note [Reductions on a queue]
// Submit copies the grad chunk (Engine::ReadChunk, from wherever it is) on
// the caller's thread and queues its reduce-scatter; the communicator is then
// used by the reducer's thread until the queue is empty, so the caller runs
// no other collective before Drain() (a train step drains it before its own
// collectives). The reduction travels in the grad dtype, or fp32 (option
// comm.reduce_dtype; see WireDType); the sum is divided by W in fp32.
//
// Every rank must submit the same groups in the same order. Each rank's slice
// of a message is its range of the gradients, then the group's tag (id + 1)
// as kTagBits values of 0 or 1: summed, each is 0 or W where every rank
// reduced the same group, something between where they did not (exact in a
// 16-bit dtype too: see WireDType). So a rank whose peers reduce another
// group of the same size gets InvalidArgument naming its own, instead of
// wrong sums (groups of different sizes are a mismatched collective, which
// the backend may only report as an error of its own).
//
// Note [Recycled shards]
// A taken shard's memory comes back through Recycle (a train step gives it
// back after its update): a fresh vector per reduction would be a page fault
// per 4 KiB of it, each step (they were half the CPU time of a sharded step
// in the replay bench).
//
// Note [Gathers kept and ahead]
// Parameters sharded, Gather fills a transient param chunk from every rank's
// master shard, on the reduction queue, so it runs after the reductions
// queued before it. The reducer keeps the last kKeptGathers chunks it
// gathered pinned, so a Gather of one of them sends nothing: a chunk's
// modules run one after another, each pinning it anew. The kept pins take
// kKeptGatheredChunks chunks of the device beyond what the pipeline plans
// (Engine::Finalize checks that the budget holds them). And it gathers
// ahead, into host memory, the kPrefetchDepth chunks that came next in the
// last step's sequence of Gathers, so that their collectives overlap the
// compute before them; one that is on the device already, unpinned (the
// pipeline's planned fetch came first), is filled there by the reducer's
// thread as well (Engine::FillChunkIfOn: others wanting the chunk meanwhile
// wait, and no room is taken that the plan did not give), and its Gather
// copies nothing if it is still in that placement then
// (ChunkAccess::generation). After a step's updates (Updated), the first
// chunks of the next forward whose masters are final are gathered ahead,
// overlapping the rest of the step.
//
// Every rank must gather the same chunks in the same order (so what is kept
// and gathered ahead is the same everywhere): each message carries its
// group's tag, and a rank whose peers gather another group gets
// InvalidArgument naming them. A rank that cannot read its master shard still
// joins the collective, tagged as failed, so every rank's gather fails
// (IoError naming it) and none falls a collective behind. After any failed
// Gather every later one returns that error: what this rank keeps may differ
// from its peers'.
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

}  // namespace

GradReducer::GradReducer(Engine& engine, Communicator& comm)
    : engine_(engine), comm_(comm), chunks_(engine.chunks()), queue_(std::make_unique<TaskQueue>(1)) {
  for (const ChunkInfo& c : chunks_) {
    if (c.transient) {
      const size_t width = DTypeSizeBytes(c.dtype);
      const size_t shard = memory::ShardOf(c.used_bytes / width, 0, comm_.world_size()).elems;
      largest_landing_bytes_ = std::max<uint64_t>(largest_landing_bytes_, (shard * width + sizeof(uint64_t)) * comm_.world_size());
    }
    if (c.kind == ChunkKind::kMaster) largest_master_bytes_ = std::max(largest_master_bytes_, c.size_bytes);
    if (c.kind != ChunkKind::kGrad) continue;
    largest_grad_bytes_ = std::max(largest_grad_bytes_, c.size_bytes);
    // A reduction's message: W slices of a shard and the tag, fp32 at the widest.
    const size_t shard = memory::ShardOf(c.used_bytes / DTypeSizeBytes(c.dtype), 0, comm_.world_size()).elems;
    largest_message_bytes_ = std::max<uint64_t>(largest_message_bytes_, (shard + kTagBits) * comm_.world_size() * 4);
  }
}

GradReducer::~GradReducer() {
  queue_.reset();  // its jobs done before the pins they may write into are let go
  ReleaseGathered();
}

Status GradReducer::Submit(ChunkId grad) {
  if (grad.value() >= chunks_.size() || chunks_[grad.value()].kind != ChunkKind::kGrad) {
    return InvalidArgument("gradient reduce-scatter: chunk {} is not a grad chunk", grad.value());
  }
  const ChunkInfo& info = chunks_[grad.value()];
  const memory::ShardRange range =
      memory::ShardOf(info.used_bytes / DTypeSizeBytes(info.dtype), comm_.rank(), comm_.world_size());
  const DType wire = WireDType(info.dtype);
  // The read and the message go to buffers kept for reuse: fresh ones would
  // be page faults by the chunk, for every chunk of every step.
  if (!submit_raw_) submit_raw_ = AllocateAlignedHost(largest_grad_bytes_, kIoAlignmentBytes);
  STRATA_RETURN_IF_ERROR(engine_.ReadChunk(grad, submit_raw_.data()).WithContext("reading gradients to reduce"));
  const uint64_t tag = info.group + 1;
  std::shared_ptr<Buffer> send;
  if (spare_sends_.empty()) {
    send = std::make_shared<Buffer>(AllocateAlignedHost(largest_message_bytes_, 64));
  } else {
    send = std::move(spare_sends_.back());
    spare_sends_.pop_back();
  }
  PackReduction(info, range, wire, tag, static_cast<std::byte*>(send->data()));
  // A gradient that arrives after its chunk was submitted (a parameter used
  // again, as reentrant checkpointing does) submits it again: the earlier
  // reduction is waited for and dropped.
  if (auto earlier = pending_.find(grad.value()); earlier != pending_.end()) {
    earlier->second->done.wait();
    queued_.erase(earlier->second->seq);
    spare_sends_.push_back(std::move(earlier->second->send));
    pending_.erase(earlier);
  }
  auto pending = std::make_shared<Pending>();
  Pending* into = pending.get();
  into->send = send;
  const size_t slice = range.elems + kTagBits;
  const uint32_t group = info.group;
  into->done = queue_->Push([this, send, slice, group, tag, wire, into]() -> Status {
    return Reduce(*send, slice, group, tag, wire, *into);
  });
  into->seq = next_seq_++;
  queued_[into->seq] = into->done;
  pending_[grad.value()] = std::move(pending);
  return Status::Ok();
}

void GradReducer::PackReduction(const ChunkInfo& info, const memory::ShardRange& range, DType wire, uint64_t tag,
                                std::byte* message) const {
  const size_t n = info.used_bytes / DTypeSizeBytes(info.dtype);
  const size_t width = DTypeSizeBytes(wire);
  const size_t slice = range.elems + kTagBits;
  const void* raw = submit_raw_.data();
  for (int r = 0; r < comm_.world_size(); ++r) {
    std::byte* out = message + r * slice * width;
    const size_t begin = std::min(n, r * range.elems), count = std::min(n, begin + range.elems) - begin;
    if (wire == info.dtype) {
      std::memcpy(out, static_cast<const std::byte*>(raw) + begin * width, count * width);
    } else {
      for (size_t j = 0; j < count; ++j) optim::StoreFloat(out, wire, j, optim::FloatAt(raw, info.dtype, begin + j));
    }
    std::memset(out + count * width, 0, (range.elems - count) * width);  // the last shard's padding
    for (size_t bit = 0; bit < kTagBits; ++bit) {
      optim::StoreFloat(out, wire, range.elems + bit, static_cast<float>((tag >> bit) & 1));
    }
  }
}

Status GradReducer::Reduce(const Buffer& send, size_t slice, uint32_t group, uint64_t tag, DType wire,
                           Pending& into) {
  const int world = comm_.world_size();
  // The queue's one thread owns the receive buffer.
  if (!reduce_recv_) reduce_recv_ = AllocateAlignedHost(largest_message_bytes_ / world, 64);
  const Buffer& mine = reduce_recv_;
  const uint64_t before = comm_.stats().total_bytes();
  STRATA_RETURN_IF_ERROR(comm_.ReduceScatterSum(send.data(), mine.data(), slice, wire)
                             .WithContext(fmt::format("reduce-scatter of the gradients of chunk group {}", group)));
  into.bytes = comm_.stats().total_bytes() - before;
  const size_t elems = slice - kTagBits;
  for (size_t bit = 0; bit < kTagBits; ++bit) {
    const float expected = static_cast<float>(world) * static_cast<float>((tag >> bit) & 1);
    if (optim::FloatAt(mine.data(), wire, elems + bit) != expected) {
      return InvalidArgument(
          "gradient reduce-scatter: rank {} reduced chunk group {} while other ranks reduced another (the group "
          "tags differ): every rank must run the same backward, so that gradients complete in the same order",
          comm_.rank(), group);
    }
  }
  const float mean = 1.0f / static_cast<float>(world);
  {
    std::lock_guard lock(spare_shards_mu_);
    if (!spare_shards_.empty()) {
      into.shard = std::move(spare_shards_.back());
      spare_shards_.pop_back();
    }
  }
  into.shard.resize(elems);
  for (size_t i = 0; i < elems; ++i) into.shard[i] = optim::FloatAt(mine.data(), wire, i) * mean;
  return Status::Ok();
}

DType GradReducer::WireDType(DType grad) const {
  // The tag's sums are W at most: exact in bf16 up to 256 ranks, fp16 up to 2048.
  const int exact = grad == DType::kBFloat16 ? 256 : grad == DType::kFloat16 ? 2048 : 1 << 24;
  if (engine_.options().comm.reduce_dtype == ReduceDType::kFloat32 || comm_.world_size() > exact) return DType::kFloat32;
  return grad;
}

Result<GradReducer::Reduced> GradReducer::Take(ChunkId grad) {
  if (!submitted(grad)) STRATA_RETURN_IF_ERROR(Submit(grad));
  auto it = pending_.find(grad.value());
  const Clock::time_point start = Clock::now();
  const Status status = it->second->done.get();
  wait_seconds_ += SecondsSince(start);
  Reduced reduced{std::move(it->second->shard), it->second->bytes};
  queued_.erase(it->second->seq);
  spare_sends_.push_back(std::move(it->second->send));
  pending_.erase(it);
  STRATA_RETURN_IF_ERROR(status);
  return reduced;
}

std::optional<GradReducer::Hold> GradReducer::HoldReduction(ChunkId grad) const {
  const auto it = pending_.find(grad.value());
  if (it == pending_.end()) return std::nullopt;
  const std::shared_ptr<Pending>& pending = it->second;
  return Hold{.done = pending->done, .shard = std::shared_ptr<const std::vector<float>>(pending, &pending->shard)};
}

void GradReducer::Recycle(std::vector<float> shard) {
  std::lock_guard lock(spare_shards_mu_);
  spare_shards_.push_back(std::move(shard));
}

std::shared_future<Status> GradReducer::Enqueue(std::function<Status(Communicator&)> job) {
  std::shared_future<Status> done = queue_->Push([this, job = std::move(job)] { return job(comm_); });
  queued_[next_seq_++] = done;
  return done;
}

Status GradReducer::Drain() {
  const Clock::time_point start = Clock::now();
  Status first = Status::Ok();
  for (const auto& [seq, done] : queued_) {
    const Status status = done.get();
    if (first.ok() && !status.ok()) first = status;
  }
  // The reductions and the gathers ahead stay to be taken; the other jobs are done with.
  std::map<uint64_t, std::shared_future<Status>> reductions;
  for (const auto& [id, pending] : pending_) reductions[pending->seq] = pending->done;
  for (const auto& [id, ahead] : prefetched_) reductions[ahead.seq] = ahead.done;
  queued_ = std::move(reductions);
  wait_seconds_ += SecondsSince(start);
  return first;
}

// One parameter all-gather, as its job on the queue needs it.
struct GradReducer::GatherJob {
  ChunkId param;
  ChunkId master;
  DType dtype;         // the param chunk's
  DType master_dtype;
  uint32_t group = 0;
  memory::ShardRange range;  // this rank's
  size_t slice = 0;          // each rank's slice of the message, in bytes
};

GradReducer::Queued GradReducer::QueueGather(ChunkId param) {
  const ChunkInfo& info = chunks_[param.value()];
  const ChunkInfo* master = nullptr;
  for (const ChunkInfo& c : chunks_) {
    if (c.group == info.group && c.kind == ChunkKind::kMaster) master = &c;
  }
  STRATA_CHECK(master != nullptr, "transient param chunk {} has no master shard", param.value());
  const size_t width = DTypeSizeBytes(info.dtype);
  const memory::ShardRange range = memory::ShardOf(info.used_bytes / width, comm_.rank(), comm_.world_size());
  // Each rank's slice: its range in the param dtype, then the group's tag.
  const GatherJob job{.param = param,
                      .master = master->id,
                      .dtype = info.dtype,
                      .master_dtype = master->dtype,
                      .group = info.group,
                      .range = range,
                      .slice = range.elems * width + sizeof(uint64_t)};
  // The all-gather lands in a buffer of W slices, tags and all, copied into
  // the chunk slice by slice at Gather (no copy to strip the tags).
  // Buffers are reused: a fresh one per gather would be page faults by the
  // chunk, twice a step.
  std::shared_ptr<Buffer> landing;
  if (spare_landings_.empty()) {
    // Pinned where a copy to the device follows (a pageable source is staged, and slower).
    Result<Buffer> pinned = engine_.device().host_accessible()
                                ? Result<Buffer>(AllocateAlignedHost(largest_landing_bytes_, kIoAlignmentBytes))
                                : engine_.device().AllocatePinnedHost(largest_landing_bytes_, kNumaNodeUnbound);
    landing = std::make_shared<Buffer>(pinned.ok() ? std::move(pinned).value()
                                                   : AllocateAlignedHost(largest_landing_bytes_, kIoAlignmentBytes));
  } else {
    landing = std::move(spare_landings_.back());
    spare_landings_.pop_back();
  }
  auto filled = std::make_shared<Filled>();
  std::shared_future<Status> done =
      queue_->Push([=, this]() -> Status { return GatherOnQueue(job, *landing, *filled); });
  const uint64_t seq = next_seq_++;
  queued_[seq] = done;
  return {std::move(done), std::move(landing), std::move(filled), seq};
}

Status GradReducer::GatherOnQueue(const GatherJob& job, const Buffer& landing, Filled& filled) {
  // A shard this rank cannot read still joins the collective, tagged as
  // failed (0), so that every rank fails this gather and none is left a
  // collective behind its peers.
  uint64_t tag = kFailedTag;
  const Status read = PackGatherShard(job);
  if (read.ok()) tag = job.group + 1;
  std::vector<std::byte>& send = gather_send_;
  std::memcpy(send.data() + job.range.elems * DTypeSizeBytes(job.dtype), &tag, sizeof tag);
  std::byte* all = static_cast<std::byte*>(landing.data());
  STRATA_RETURN_IF_ERROR(comm_.AllGather(send.data(), all, job.slice)
                             .WithContext(fmt::format("all-gather of the parameters of chunk group {}", job.group)));
  STRATA_RETURN_IF_ERROR(read);
  STRATA_RETURN_IF_ERROR(CheckGatheredTags(job, all, tag));
  // Where the chunk is on the device already, in hold (the pipeline's
  // planned fetch came first), it is filled here, off the training
  // thread; Gather copies nothing if it is still in that placement then.
  // A fill that fails here is left to Gather to make again (and report):
  // an error of this rank's own must not fail a collective its peers
  // completed, which would leave them a job ahead of it.
  Result<std::optional<uint64_t>> filled_in = engine_.FillChunkIfOn(job.param, Tier::kDevice, [&](void* chunk) {
    return FillFromLanding(landing, job.param, static_cast<std::byte*>(chunk), Tier::kDevice, &filled.copy_may_run);
  });
  if (filled_in.ok()) filled.generation = *filled_in;
  return Status::Ok();
}

Status GradReducer::PackGatherShard(const GatherJob& job) {
  // The queue's one thread owns the scratch buffers.
  if (!gather_shard_) gather_shard_ = AllocateAlignedHost(largest_master_bytes_, kIoAlignmentBytes);
  std::vector<std::byte>& send = gather_send_;
  if (send.size() < job.slice) send.resize(job.slice);  // the padding past this shard is never read
  STRATA_RETURN_IF_ERROR(
      engine_.ReadChunk(job.master, static_cast<std::byte*>(gather_shard_.data()))
          .WithContext(fmt::format("reading the master shard of chunk group {} to gather", job.group)));
  const float* weights = static_cast<const float*>(gather_shard_.data());
  const size_t mine = job.range.end - job.range.begin;
  if (job.dtype == job.master_dtype) {
    std::memcpy(send.data(), gather_shard_.data(), mine * DTypeSizeBytes(job.dtype));
  } else if (job.dtype == DType::kBFloat16) {  // as the optimizer writes a param chunk (the same rounding)
    optim::ConvertToBf16(optim::ActiveCpuIsa(), weights, reinterpret_cast<uint16_t*>(send.data()), mine);
  } else {
    optim::ConvertToFp16(optim::ActiveCpuIsa(), weights, reinterpret_cast<uint16_t*>(send.data()), mine);
  }
  return Status::Ok();
}

Status GradReducer::CheckGatheredTags(const GatherJob& job, const std::byte* all, uint64_t tag) const {
  std::string failed, others;
  for (int r = 0; r < comm_.world_size(); ++r) {
    uint64_t theirs = 0;
    std::memcpy(&theirs, all + r * job.slice + job.range.elems * DTypeSizeBytes(job.dtype), sizeof theirs);
    if (theirs == kFailedTag) {
      failed += fmt::format("{}{}", failed.empty() ? "" : ", ", r);
    } else if (theirs != tag) {
      others += fmt::format("{}rank {} gathered group {}", others.empty() ? "" : ", ", r, theirs - 1);
    }
  }
  if (!failed.empty()) {
    return IoError("parameter all-gather of chunk group {}: rank(s) {} could not read their master shard (their "
                   "own error says why)",
                   job.group, failed);
  }
  if (!others.empty()) {
    return InvalidArgument(
        "parameter all-gather: rank {} gathered chunk group {} while {}: every rank must run the same forward and "
        "backward, so that param chunks are needed in the same order (parameters are sharded: comm.shard_params)",
        comm_.rank(), job.group, others);
  }
  return Status::Ok();
}

Status GradReducer::FillFromLanding(const Buffer& landing, ChunkId param, std::byte* chunk, Tier tier,
                                    bool* copy_may_run) {
  // Rank r's slice (its shard, then its tag) into the chunk at its range.
  const ChunkInfo& info = chunks_[param.value()];
  const int world = comm_.world_size();
  const size_t width = DTypeSizeBytes(info.dtype);
  const size_t n = info.used_bytes / width;
  const size_t elems = memory::ShardOf(n, 0, world).elems;
  const size_t slice = elems * width + sizeof(uint64_t);
  const auto* from = static_cast<const std::byte*>(landing.data());
  const bool host = tier == Tier::kHost || engine_.device().host_accessible();
  Status status = Status::Ok();
  std::vector<std::shared_ptr<Event>> copies;
  for (int r = 0; r < world && status.ok(); ++r) {
    const size_t begin = std::min(n, r * elems), count = std::min(n, begin + elems) - begin;
    if (count == 0) continue;
    if (host) {
      std::memcpy(chunk + begin * width, from + r * slice, count * width);
      continue;
    }
    Result<std::shared_ptr<Event>> copy = engine_.device().CopyAsync(CopyStream::kHostToDevice, chunk + begin * width,
                                                                     from + r * slice, count * width);
    status = copy.status();
    if (copy.ok()) copies.push_back(std::move(copy).value());
  }
  for (const std::shared_ptr<Event>& copy : copies) {
    const Status waited = copy->Wait(engine_.options().device.copy_timeout_ms);
    if (!waited.ok()) *copy_may_run = true;
    if (status.ok()) status = waited;
  }
  return status;
}

Status GradReducer::Gather(ChunkId param, const ChunkAccess& into) {
  if (param.value() >= chunks_.size() || !chunks_[param.value()].transient) {
    return InvalidArgument(
        "parameter all-gather: chunk {} is not a transient param chunk (only a param chunk is, "
        "with comm.shard_params and more than one rank)",
        param.value());
  }
  if (!into.valid() || into.id() != param) {
    return InvalidArgument("parameter all-gather of chunk {}: `into` must be a pin of that chunk", param.value());
  }
  if (!broken_.ok()) return broken_;
  if (sequence_.size() <= kMaxSequence) sequence_.push_back(param);
  bool kept = false;
  for (size_t i = 0; i < kept_.size() && !kept; ++i) {
    if (kept_[i].first != param) continue;
    std::rotate(kept_.begin() + i, kept_.begin() + i + 1, kept_.end());  // the newest now
    kept = true;
  }
  std::optional<Queued> gather;
  if (!kept) {
    if (auto ahead = prefetched_.find(param.value()); ahead != prefetched_.end()) {
      gather = std::move(ahead->second);
      prefetched_.erase(ahead);
      gathered_ahead_++;
    } else {
      gather = QueueGather(param);
    }
  }
  // The chunks that followed this one last step are gathered ahead, behind
  // it in the queue: every rank decides from the same sequence, so their
  // collectives line up.
  if (sequence_.size() <= kMaxSequence) PrefetchFrom(sequence_.size(), param);
  if (kept) return Status::Ok();

  const Clock::time_point start = Clock::now();
  Status status = gather->done.get();
  queued_.erase(gather->seq);  // taken: its error is this call's
  Filled& filled = *gather->filled;
  if (status.ok() && filled.generation == into.generation()) {
    filled_ahead_++;  // by its job, in the slot `into` pins: nothing has moved or written the chunk since
  } else if (status.ok()) {
    status = FillFromLanding(*gather->landing, param, into.data(), into.tier(), &filled.copy_may_run);
  }
  wait_seconds_ += SecondsSince(start);
  GiveBackLanding(*gather);
  if (status.ok()) {
    Result<ChunkAccess> pin = engine_.AccessChunk(param, into.tier());
    status = pin.status();
    if (pin.ok()) {
      gathers_++;
      kept_.emplace_back(param, std::move(pin).value());
      if (kept_.size() > kKeptGathers) kept_.erase(kept_.begin());
      return Status::Ok();
    }
  }
  // What this rank keeps could now differ from its peers': every later
  // Gather fails with this error rather than fall out of step with them.
  broken_ = status.WithContext(fmt::format("gathering param chunk {}", param.value()));
  return broken_;
}

void GradReducer::PrefetchFrom(size_t position, std::optional<ChunkId> gathering) {
  for (size_t at = position; at < position + kPrefetchDepth && at < last_sequence_.size(); ++at) {
    const ChunkId next = last_sequence_[at];
    const bool held = next == gathering ||
                      std::any_of(kept_.begin(), kept_.end(), [&](const auto& k) { return k.first == next; });
    if (!held && prefetched_.count(next.value()) == 0) prefetched_[next.value()] = QueueGather(next);
  }
}

void GradReducer::Updated(ChunkId param) {
  updated_.push_back(param);
  for (size_t at = 0; at < kPrefetchDepth && at < last_sequence_.size(); ++at) {
    const ChunkId next = last_sequence_[at];
    if (std::find(updated_.begin(), updated_.end(), next) != updated_.end() && prefetched_.count(next.value()) == 0) {
      prefetched_[next.value()] = QueueGather(next);
    }
  }
}

void GradReducer::GiveBackLanding(Queued& gather) {
  // A copy that timed out may still read its source: that buffer is never reused.
  (gather.filled->copy_may_run ? quarantined_ : spare_landings_).push_back(std::move(gather.landing));
}

bool GradReducer::OnOwnThread() const { return queue_->OnWorker(); }

void GradReducer::ReleaseGathered() {
  kept_.clear();
  // Gathered ahead but not asked for (the step's sequence changed): read
  // from the masters before this step's update, so dropped. Every rank
  // queued the same ones, and a failed one failed on every rank alike (see
  // the failed tag), so dropping them keeps the ranks in step.
  for (auto& [id, ahead] : prefetched_) {
    ahead.done.wait();
    queued_.erase(ahead.seq);
    GiveBackLanding(ahead);
  }
  prefetched_.clear();
  last_sequence_ = std::move(sequence_);
  sequence_.clear();
  updated_.clear();
}

}  // namespace strata::offload
