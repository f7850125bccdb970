#include "benchmarks/replay_bench.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "offload/workloads/capacity_plan.h"
#include "offload/training/grad_reducer.h"
#include "offload/schedule/pipeline.h"
#include "offload/workloads/gpt_model.h"
#include "strata/engine.h"
#include "src/base/logging.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

// The step's updates are its host moments (offload::GptStepTrace's), whether or not they could run on the device.
bool IsUpdate(const offload::TraceMoment& m) { return m.tier == Tier::kHost; }

offload::MachineSpec MachineOf(const ReplayBenchConfig& c) {
  offload::MachineSpec machine;
  machine.pcie_gbps = c.pcie_gbps;
  machine.gpu_tflops = c.gpu_tflops > 0 ? c.gpu_tflops : machine.gpu_tflops;
  machine.cpu_adam_gparams = c.cpu_adam_gparams;
  machine.gpu_adam_gparams = c.gpu_adam_gparams;
  return machine;
}

// Each update moment moved to just after the last device moment that uses
// its group's grad chunk, and marked `overlap`: it begins as soon as its
// gradients are final, as OverlapUpdates begins it.
void OverlapBackward(const memory::ChunkLayout& layout, offload::Trace& trace) {
  std::vector<offload::TraceMoment> updates, device;
  for (offload::TraceMoment& m : trace.moments) (IsUpdate(m) ? updates : device).push_back(std::move(m));
  std::vector<std::vector<offload::TraceMoment>> after(device.size());  // by device moment
  std::vector<offload::TraceMoment> last;  // updates whose grads no device moment touches
  for (offload::TraceMoment& u : updates) {
    u.overlap = true;
    std::optional<size_t> final_grads;
    for (size_t k = 0; k < device.size(); ++k) {
      for (ChunkId c : device[k].chunks) {
        if (layout.chunk(c).kind == ChunkKind::kGrad &&
            std::find(u.chunks.begin(), u.chunks.end(), c) != u.chunks.end()) {
          final_grads = k;
        }
      }
    }
    (final_grads ? after[*final_grads] : last).push_back(std::move(u));
  }
  trace.moments.clear();
  for (size_t k = 0; k < device.size(); ++k) {
    trace.moments.push_back(std::move(device[k]));
    for (offload::TraceMoment& u : after[k]) trace.moments.push_back(std::move(u));
  }
  for (offload::TraceMoment& u : last) trace.moments.push_back(std::move(u));
}

// The step as the planner sees it (offload::GptStepTrace), with the compute
// each moment busy-waits: FLOPs at --gpu-tflops, or 1.5 x its chunks' time
// over the throttled link; an update 1/ranks of its time with several ranks.
offload::GptStep ReplayStep(const ReplayBenchConfig& config, const std::vector<TensorSpec>& specs,
                            const memory::ChunkLayout& layout) {
  offload::GptStep step = offload::GptStepTrace(specs, layout, config.model, MachineOf(config), config.accumulation);
  for (size_t k = 0; k < step.trace.moments.size(); ++k) {
    offload::TraceMoment& m = step.trace.moments[k];
    if (IsUpdate(m) && config.ranks > 1) {  // each rank updates its share
      m.compute_seconds /= config.ranks;
      if (m.device_compute_seconds) *m.device_compute_seconds /= config.ranks;
      if (config.shard_params) {  // which writes its master shard only
        std::erase_if(m.chunks, [&](ChunkId c) { return layout.chunk(c).kind == ChunkKind::kParam; });
      }
    }
    if (m.tier != Tier::kDevice || (config.gpu_tflops > 0 && config.compute_ms <= 0)) continue;
    uint64_t bytes = 0;
    for (ChunkId c : m.chunks) bytes += layout.chunk(c).size_bytes();
    // Per micro-batch pass: a layered moment computes for every micro-batch (Note [Layered accumulation]).
    m.compute_seconds = step.passes[k] * (config.compute_ms > 0 ? config.compute_ms / 1e3
                                                                : 1.5 * static_cast<double>(bytes) / (config.pcie_gbps * 1e9));
  }
  if (config.overlap && config.ranks == 1) OverlapBackward(layout, step.trace);
  if (config.ranks > 1) {
    // Data parallel, the updates run as RunTrainStep runs them: after
    // backward (the gradient norm is all-reduced first), in model order, so
    // that with parameters sharded the next forward's first chunks are the
    // first gathered ahead, behind the rest of the updates.
    std::vector<offload::TraceMoment>& moments = step.trace.moments;
    const auto updates = std::stable_partition(moments.begin(), moments.end(),
                                               [](const offload::TraceMoment& m) { return !IsUpdate(m); });
    std::stable_sort(updates, moments.end(), [&](const offload::TraceMoment& x, const offload::TraceMoment& y) {
      return layout.chunk(x.chunks.front()).group < layout.chunk(y.chunks.front()).group;
    });
  }
  return step;
}

// A moment's compute: on the device a sleep (the GPU works and the CPU's
// cores stay free for the transfers and the ranks' collectives, as on a
// real machine), on the host a busy-wait (a CPU update takes a core).
void ComputeFor(double seconds, Tier where) {
  const Clock::time_point end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(seconds));
  if (where == Tier::kDevice) {
    std::this_thread::sleep_until(end);
    return;
  }
  while (Clock::now() < end) {
  }
}

struct RunResult {
  ReplayRun run;
  std::string pipeline_json;
  double planning_seconds = 0;
  double predicted_step_seconds = 0;
  uint64_t divergences = 0;
  offload::LinkBandwidths links;  // as the pipeline measured them
  uint32_t updates = 0, updates_on_device = 0;
  uint32_t moments_covered = 0;    // whose compute is at least their chunks' transfer time
  std::string plan_error;          // why there is no plan, if the planner refused the trace
};

// Whether moment `m`'s compute (where the plan runs it) is at least the time
// its chunks take over the links at the measured rates: a device moment's
// chunks over host->device (and an NVMe read first for those homed there),
// a host moment's NVMe-homed chunks over the NVMe read. The premise of the
// replay's stall goal.
bool ComputeCoversTransfer(const offload::TraceMoment& m, Tier where, const Engine& engine,
                           const offload::LinkBandwidths& links) {
  const auto rate = [&](offload::Link l) { return links.bytes_per_second[static_cast<int>(l)]; };
  double transfer = 0;
  for (ChunkId c : m.chunks) {
    const double bytes = static_cast<double>(engine.chunks()[c.value()].size_bytes);
    const Result<Tier> home = engine.ChunkHome(c);
    const bool on_nvme = home.ok() && *home == Tier::kNvme;
    if (where == Tier::kDevice) transfer += bytes / rate(offload::Link::kHostToDevice);
    if (on_nvme) transfer += bytes / rate(offload::Link::kNvmeRead);
  }
  const double compute = where == m.tier ? m.compute_seconds : *m.device_compute_seconds;
  return compute >= transfer;
}

// Data parallel: where each moment's communication goes. A backward
// moment submits the grad chunks it is the last to touch; an update moment
// takes its group's reduced gradients first and queues its param chunk's
// all-gather after (parameters sharded: a device moment gathers its
// transient param chunks as it accesses them instead).
struct CommMoments {
  std::vector<std::vector<ChunkId>> submit;     // per moment
  std::vector<std::optional<ChunkId>> take;     // per moment: the grad chunk of an update
  std::vector<std::optional<ChunkId>> gather;   // per moment: the param chunk of an update
};

CommMoments CommMomentsOf(const offload::Trace& step, const std::vector<ChunkInfo>& chunks) {
  CommMoments out;
  out.submit.resize(step.moments.size());
  out.take.resize(step.moments.size());
  out.gather.resize(step.moments.size());
  std::map<uint32_t, size_t> last_backward;
  for (size_t k = 0; k < step.moments.size(); ++k) {
    const offload::TraceMoment& m = step.moments[k];
    for (ChunkId c : m.chunks) {
      const ChunkKind kind = chunks[c.value()].kind;
      if (IsUpdate(m)) {
        if (kind == ChunkKind::kGrad) out.take[k] = c;
        if (kind == ChunkKind::kParam && !chunks[c.value()].transient) out.gather[k] = c;
      } else if (kind == ChunkKind::kGrad) {
        last_backward[c.value()] = k;
      }
    }
  }
  for (const auto& [chunk, k] : last_backward) out.submit[k].push_back(ChunkId(chunk));
  return out;
}

// Note [The replay]
// Moments: offload::GptStepTrace's (the same `strata plan` predicts from):
// forward over the embedding, each layer and the tied head (param chunks,
// the activation estimate as non-model memory), backward in reverse with the
// grad chunks, then one update per chunk group (a host moment over all its
// chunks, which the plan may move to the device). Each moment computes by
// busy work: forward and backward for their FLOPs at --gpu-tflops, or when
// that is 0 for --compute-ms, or by default 1.5 x the time its chunks take
// over the throttled link, times the micro-batch passes it covers (with
// --micro-batches: once per micro-batch, or, --accumulation layered, each
// module for all of them at once, its backward recomputing its forward:
// Note [Layered accumulation] in capacity_plan.cc); an update for its parameters at
// --cpu-adam-gparams (on the host) or --gpu-adam-gparams (on the device).
// So stalls are what remains of the transfers. Reported per iteration after
// the warm-up: stall time / step time, bytes per link, the planner's time
// against a step and, with --gpu-tflops, `strata plan`'s prediction for
// the same machine.
//
// Data parallel (--ranks): ranks as threads (a loopback group), each its own
// engine holding 1/ranks of the optimizer states and updating its share of
// every group; each grad chunk's reduce-scatter starts as its last backward
// moment ends (offload::GradReducer), and each updated param chunk is
// all-gathered after its update, over a network of net_gbps (0: the
// loopback's memory speed); also reported: the time waiting for
// communication. With shard_params (ZeRO-3) each device moment gathers its
// param chunks (GradReducer::Gather, ahead along the last step's order) and
// an update writes only its master shard.

// One replay of the step on a fresh engine; with `comm`, one rank of a
// data-parallel group.
class Replay {
 public:
  static Result<std::unique_ptr<Replay>> Create(const ReplayBenchConfig& config, const Options& options,
                                                const std::vector<TensorSpec>& specs, const offload::Trace& step,
                                                bool baseline, Communicator* comm) {
    std::unique_ptr<Replay> replay(new Replay(config, step, comm, comm != nullptr && options.comm.shard_params));
    STRATA_RETURN_IF_ERROR(replay->SetUp(options, specs, baseline));
    return replay;
  }

  // One iteration of the step; a measured one adds its share to the means.
  Status RunIteration(bool measured) {
    const CommCounters before = Counters();
    STRATA_RETURN_IF_ERROR(pipeline_->BeginIteration());
    iteration_start_ = Clock::now();
    spans_.clear();
    bool updating = false;
    for (size_t k = 0; k < step_.moments.size(); ++k) {
      if (reducer_ && comm_moments_.take[k]) STRATA_RETURN_IF_ERROR(TakeReduced(k, updating));
      STRATA_RETURN_IF_ERROR(PlayMoment(step_.moments[k]));
      if (reducer_) STRATA_RETURN_IF_ERROR(Communicate(k));
    }
    // The step waits for the overlapped updates, as RunTrainStep does:
    // the device idles, a stall.
    const Clock::time_point wait = Clock::now();
    for (const std::shared_future<Status>& u : overlap_) STRATA_RETURN_IF_ERROR(u.get());
    overlap_.clear();
    const double waited = SecondsSince(wait);
    // The gathers are in before the next forward (parameters sharded: the
    // next forward's first chunks, gathered ahead as the updates end), so
    // each iteration counts its own bytes; the wait counts as a stall.
    if (reducer_) STRATA_RETURN_IF_ERROR(reducer_->Drain());
    STRATA_RETURN_IF_ERROR(pipeline_->EndIteration());
    if (measured) {
      AddMeasured(before);
      result_.run.stall_seconds += waited / config_.iterations;
      result_.run.update_wait_seconds += waited / config_.iterations;
      result_.run.backward_end_seconds = backward_end_;
      std::lock_guard lock(spans_mu_);
      result_.run.overlap_spans = spans_;
    }
    return Status::Ok();
  }

  // The means, and what the pipeline and its plan report at the end.
  RunResult Finish();

 private:
  // The reducer's and the communicator's counts at an iteration's start.
  struct CommCounters {
    double waited = 0;
    uint64_t sent = 0;
    std::array<uint64_t, 3> gathered = {};  // gathers, gathered ahead, filled ahead
  };

  Replay(const ReplayBenchConfig& config, const offload::Trace& step, Communicator* comm, bool sharded_params)
      : config_(config), step_(step), comm_(comm), sharded_params_(sharded_params) {}

  Status SetUp(const Options& options, const std::vector<TensorSpec>& specs, bool baseline);
  Status TakeReduced(size_t k, bool& updating);
  Status PlayMoment(const offload::TraceMoment& m);
  Status Communicate(size_t k);
  CommCounters Counters() const;
  void AddMeasured(const CommCounters& before);

  const ReplayBenchConfig& config_;
  const offload::Trace& step_;
  Communicator* const comm_;
  const bool sharded_params_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<offload::Pipeline> pipeline_;
  std::vector<std::byte> gather_buffer_;  // the all-gathers' bytes (the replay has no values to keep)
  std::unique_ptr<offload::GradReducer> reducer_;  // after the buffer its jobs use
  CommMoments comm_moments_;
  std::vector<ChunkInfo> chunks_;  // once: the engine builds them anew on every call
  std::map<uint32_t, ChunkId> param_of_group_;
  std::set<uint32_t> trained_groups_;  // those with gradients; the others are frozen
  // This iteration's timeline, and its overlapped updates in flight.
  Clock::time_point iteration_start_;
  double backward_end_ = 0;
  std::mutex spans_mu_;  // guards spans_, which the updates' thread adds to
  std::vector<std::pair<double, double>> spans_;
  std::vector<std::shared_future<Status>> overlap_;
  RunResult result_;
};

Status Replay::SetUp(const Options& options, const std::vector<TensorSpec>& specs, bool baseline) {
  EngineSeams seams;
  seams.comm = comm_;
  if (config_.dirs.empty()) {
    STRATA_ASSIGN_OR_RETURN(seams.storage, CreateMemoryStorage(options.nvme.capacity_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(engine_, Engine::Create(options, std::move(seams)));
  for (const TensorSpec& spec : specs) STRATA_RETURN_IF_ERROR(engine_->RegisterTensor(spec).status());
  STRATA_RETURN_IF_ERROR(engine_->Finalize());
  offload::PipelineOptions pipeline_options = offload::PipelineOptionsOf(options);
  if (baseline) pipeline_options.policy = offload::Policy::kOnDemand;
  const double link = config_.pcie_gbps * 1e9;
  pipeline_options.links.bytes_per_second = {link, link, 0, 0};  // the throttle; NVMe measured in the warm-up
  STRATA_ASSIGN_OR_RETURN(pipeline_, offload::Pipeline::Create(*engine_, pipeline_options));
  chunks_ = engine_->chunks();
  if (comm_ != nullptr) {
    reducer_ = std::make_unique<offload::GradReducer>(*engine_, *comm_);
    comm_moments_ = CommMomentsOf(step_, chunks_);
    uint64_t largest = 0;
    for (const ChunkInfo& chunk : chunks_) largest = std::max(largest, chunk.size_bytes);
    gather_buffer_.resize(2 * largest + 4096);
  }
  for (const ChunkInfo& chunk : chunks_) {
    if (chunk.kind == ChunkKind::kParam) param_of_group_.emplace(chunk.group, chunk.id);
    if (chunk.kind == ChunkKind::kGrad) trained_groups_.insert(chunk.group);
  }
  return Status::Ok();
}

// An update moment takes its group's reduced gradients first; the first
// update of an iteration, parameters sharded, releases the gathered chunks
// as RunTrainStep does before its updates.
Status Replay::TakeReduced(size_t k, bool& updating) {
  if (sharded_params_ && !updating) {
    reducer_->ReleaseGathered();
    for (const ChunkInfo& c : chunks_) {  // and the frozen groups' gathers ahead, their shards final
      if (c.kind == ChunkKind::kParam && c.transient && !trained_groups_.contains(c.group)) reducer_->Updated(c.id);
    }
  }
  updating = true;
  STRATA_ASSIGN_OR_RETURN(offload::GradReducer::Reduced reduced, reducer_->Take(*comm_moments_.take[k]));
  reducer_->Recycle(std::move(reduced.shard));  // as RunTrainStep does after the update
  return Status::Ok();
}

// A moment: begun where it runs (a host moment where the plan puts it), its
// chunks accessed (transient params gathered), its compute, its end.
Status Replay::PlayMoment(const offload::TraceMoment& m) {
  if (m.overlap) {  // its compute on the pipeline's host lane, timed there
    STRATA_ASSIGN_OR_RETURN(
        std::shared_future<Status> done,
        pipeline_->RunOverlapped(m.chunks, m.device_compute_seconds, [this, &m](Tier where, std::vector<ChunkAccess>&) {
          const double begin = SecondsSince(iteration_start_);
          ComputeFor(where == Tier::kHost ? m.compute_seconds : *m.device_compute_seconds, where);
          std::lock_guard lock(spans_mu_);
          spans_.emplace_back(begin, SecondsSince(iteration_start_));
          return Status::Ok();
        }));
    overlap_.push_back(std::move(done));
    return Status::Ok();
  }
  double compute = m.compute_seconds;
  Tier runs_on = m.tier;
  if (m.tier == Tier::kDevice) {
    STRATA_RETURN_IF_ERROR(pipeline_->BeginMoment(m.non_model_bytes));
  } else {
    STRATA_ASSIGN_OR_RETURN(runs_on, pipeline_->BeginHostMoment(m.device_compute_seconds));
    if (runs_on == Tier::kDevice) compute = *m.device_compute_seconds;
  }
  std::vector<ChunkAccess> held;
  for (ChunkId c : m.chunks) {
    STRATA_ASSIGN_OR_RETURN(ChunkAccess access, pipeline_->Access(c));
    if (sharded_params_ && chunks_[c.value()].transient) STRATA_RETURN_IF_ERROR(reducer_->Gather(c, access));
    held.push_back(std::move(access));
  }
  ComputeFor(compute, runs_on);
  held.clear();
  STRATA_RETURN_IF_ERROR(pipeline_->EndMoment());
  if (m.tier == Tier::kDevice) backward_end_ = SecondsSince(iteration_start_);
  return Status::Ok();
}

// After moment k: its grad chunks' reduce-scatters submitted, and an
// update's param chunk all-gathered (or, sharded, marked updated).
Status Replay::Communicate(size_t k) {
  if (sharded_params_ && comm_moments_.take[k]) {  // as RunTrainStep: the next forward's first chunks gather ahead
    reducer_->Updated(param_of_group_.at(chunks_[comm_moments_.take[k]->value()].group));
  }
  for (ChunkId c : comm_moments_.submit[k]) STRATA_RETURN_IF_ERROR(reducer_->Submit(c));
  if (comm_moments_.gather[k]) {
    const ChunkInfo& param = chunks_[comm_moments_.gather[k]->value()];
    const uint64_t width = DTypeSizeBytes(param.dtype);
    const uint64_t shard =
        memory::ShardOf(param.used_bytes / width, comm_->rank(), comm_->world_size()).elems * width;
    reducer_->Enqueue([this, shard](Communicator& c) {
      return c.AllGather(gather_buffer_.data(), gather_buffer_.data() + shard, shard);
    });
  }
  return Status::Ok();
}

Replay::CommCounters Replay::Counters() const {
  CommCounters counters;
  if (reducer_) {
    counters.waited = reducer_->wait_seconds();
    counters.gathered = {reducer_->gathers(), reducer_->gathered_ahead(), reducer_->filled_ahead()};
  }
  if (comm_ != nullptr) counters.sent = comm_->stats().total_bytes();
  return counters;
}

void Replay::AddMeasured(const CommCounters& before) {
  const double n = config_.iterations;
  const offload::PipelineStats s = pipeline_->stats();
  ReplayRun& run = result_.run;
  run.step_seconds += s.step_seconds / n;
  run.stall_seconds += s.stall_seconds / n;
  if (reducer_) {
    const CommCounters now = Counters();
    run.comm_stall_seconds += (now.waited - before.waited) / n;
    run.comm_bytes += (now.sent - before.sent) / config_.iterations;
    run.gathers += static_cast<double>(now.gathered[0] - before.gathered[0]) / n;
    run.gathered_ahead += static_cast<double>(now.gathered[1] - before.gathered[1]) / n;
    run.filled_ahead += static_cast<double>(now.gathered[2] - before.gathered[2]) / n;
  }
  for (int l = 0; l < offload::kNumLinks; ++l) run.bytes[l] += s.bytes[l] / config_.iterations;
}

RunResult Replay::Finish() {
  RunResult& result = result_;
  result.run.stall_fraction = result.run.step_seconds > 0 ? result.run.stall_seconds / result.run.step_seconds : 0;
  result.run.comm_stall_fraction =
      result.run.step_seconds > 0 ? result.run.comm_stall_seconds / result.run.step_seconds : 0;
  const offload::PipelineStats s = pipeline_->stats();
  result.planning_seconds = s.planning_seconds;
  result.divergences = s.divergences;
  result.links = pipeline_->links();
  result.plan_error = s.plan_error;
  const offload::Plan* plan = pipeline_->plan();
  if (plan != nullptr) result.predicted_step_seconds = plan->prediction.step_seconds;
  for (size_t k = 0; k < step_.moments.size(); ++k) {
    const Tier where = plan != nullptr ? plan->compute_tier[k] : step_.moments[k].tier;
    if (IsUpdate(step_.moments[k])) {
      result.updates++;
      if (where == Tier::kDevice) result.updates_on_device++;
    }
    result.moments_covered += ComputeCoversTransfer(step_.moments[k], where, *engine_, result.links);
  }
  result.pipeline_json = pipeline_->StatsJson();
  return std::move(result_);
}

Result<RunResult> RunOnce(const ReplayBenchConfig& config, const Options& options,
                          const std::vector<TensorSpec>& specs, const offload::Trace& step, bool baseline,
                          Communicator* comm = nullptr) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Replay> replay, Replay::Create(config, options, specs, step, baseline, comm));
  for (uint32_t it = 0; it < config.warmup + config.iterations; ++it) {
    STRATA_RETURN_IF_ERROR(replay->RunIteration(/*measured=*/it >= config.warmup));
  }
  return replay->Finish();
}

// RunOnce on `config.ranks` ranks (threads of a loopback group, throttled
// to config.net_gbps): rank 0's result, with the largest communication
// stall of any rank.
Result<RunResult> RunRanks(const ReplayBenchConfig& config, const Options& options,
                           const std::vector<TensorSpec>& specs, const offload::Trace& step, bool baseline) {
  if (config.ranks <= 1) return RunOnce(config, options, specs, step, baseline);
  const int world = static_cast<int>(config.ranks);
  STRATA_ASSIGN_OR_RETURN(auto group, CreateLoopbackGroup(world, {.timeout_ms = 600'000}));
  std::vector<std::unique_ptr<Communicator>> throttled(world);
  for (int r = 0; r < world; ++r) {
    if (config.net_gbps > 0) {
      STRATA_ASSIGN_OR_RETURN(throttled[r], CreateThrottledCommunicator(*group[r], config.net_gbps));
    }
  }
  std::vector<Result<RunResult>> results(world, Internal("rank did not run"));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r] {
      Communicator* comm = throttled[r] ? throttled[r].get() : group[r].get();
      results[r] = RunOnce(config, options, specs, step, baseline, comm);
    });
  }
  for (std::thread& t : threads) t.join();
  for (int r = 0; r < world; ++r) STRATA_RETURN_IF_ERROR(results[r].status().WithContext(fmt::format("rank {}", r)));
  RunResult out = std::move(results[0]).value();
  for (int r = 1; r < world; ++r) {
    if (results[r]->run.comm_stall_fraction > out.run.comm_stall_fraction) {
      out.run.comm_stall_seconds = results[r]->run.comm_stall_seconds;
      out.run.comm_stall_fraction = results[r]->run.comm_stall_fraction;
    }
  }
  return out;
}

// The shapes, counts and rates a replay is refused for.
Status ValidateReplayConfig(const ReplayBenchConfig& config) {
  if (config.model.layers == 0 || config.model.hidden == 0 || config.model.vocab == 0 || config.model.sequence == 0) {
    return InvalidArgument("bench replay: --layers, --hidden, --vocab and --seq must be > 0");
  }
  if (config.iterations == 0) return InvalidArgument("bench replay: --iterations 0: at least one is measured");
  if (config.warmup == 0) return InvalidArgument("bench replay: --warmup 0: the first iteration records the trace");
  if (config.model.batch == 0) return InvalidArgument("bench replay: --batch must be > 0");
  if (config.accumulation.micro_batches == 0) return InvalidArgument("bench replay: --micro-batches must be >= 1");
  for (double rate : {config.pcie_gbps, config.cpu_adam_gparams, config.gpu_adam_gparams}) {
    if (!(rate > 0)) {
      return InvalidArgument("bench replay: --pcie-gbps, --cpu-adam-gparams and --gpu-adam-gparams must be > 0 (got {})",
                             rate);
    }
  }
  if (!(config.gpu_tflops >= 0)) return InvalidArgument("bench replay: --gpu-tflops {} must be >= 0", config.gpu_tflops);
  if (config.ranks < 1 || config.ranks > 64) {
    return InvalidArgument("bench replay: --ranks {} is not allowed: expected 1 to 64", config.ranks);
  }
  STRATA_RETURN_IF_ERROR(ParseStatesDType(config.states).status().WithContext("bench replay: --states"));
  if (config.states == "int8" && config.ranks > 1) {
    return InvalidArgument("bench replay: --states int8 with --ranks {}: 8-bit states run on one rank", config.ranks);
  }
  if (!(config.net_gbps >= 0)) return InvalidArgument("bench replay: --net-gbps {} must be >= 0", config.net_gbps);
  if (config.overlap && config.ranks > 1) {
    return InvalidArgument("bench replay: --overlap runs one rank (data-parallel updates take the gradients reduced "
                           "at the step); drop --ranks {} or --overlap", config.ranks);
  }
  return Status::Ok();
}

// The engine's options before the budgets: the emulated device throttled to
// --pcie-gbps, bf16 compute, the chunk size searched within fixed bounds (the
// budgets are sized from the layout).
Options ReplayOptions(const ReplayBenchConfig& config) {
  Options options;
  options.chunk.search_min_elems = memory::kWidestSearchMinElems;
  options.chunk.search_max_elems = memory::kWidestSearchMaxElems;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.compute_dtype = DType::kBFloat16;
  options.device.emulated_bandwidth_gbps = config.pcie_gbps;
  options.log_level = LogLevel::kWarning;
  options.comm.shard_params = config.shard_params && config.ranks > 1;
  options.optimizer.state_dtype = *ParseStatesDType(config.states);  // checked by ValidateReplayConfig
  return options;
}

Result<memory::ChunkLayout> LayoutOf(const std::vector<TensorSpec>& specs, const Options& options,
                                     memory::ShardSpec shard = {}) {
  return memory::ChunkLayout::Build(specs, options.chunk.size_elems, options.chunk.search_min_elems,
                                    options.chunk.search_max_elems, shard, options.optimizer.state_dtype);
}

// The budgets (unless given: a quarter and half of the model states, but
// room for the chunks a moment holds), the NVMe tier and the placement.
Status SetBudgets(const ReplayBenchConfig& config, const memory::ChunkLayout& layout, uint64_t activation_peak_bytes,
                  Options& options) {
  const uint64_t total = layout.report().total_bytes;
  uint64_t largest = 0;
  for (const memory::ChunkDesc& chunk : layout.chunks()) largest = std::max(largest, chunk.size_bytes());
  options.device.budget_bytes = config.device_budget_bytes > 0
                                    ? config.device_budget_bytes
                                    : std::max<uint64_t>(total / 4, 4 * largest + activation_peak_bytes);
  // The host holds a CPU update's chunk group, pinned, beside what it homes.
  uint64_t largest_group = 0;
  for (const memory::ChunkGroup& group : layout.groups()) {
    uint64_t bytes = 0;
    for (const std::optional<ChunkId>& c : group.chunk_of_kind) bytes += c ? layout.chunk(*c).size_bytes() : 0;
    largest_group = std::max(largest_group, bytes);
  }
  options.host.budget_bytes = config.host_budget_bytes > 0 ? config.host_budget_bytes
                                                            : std::max<uint64_t>(total / 2, 2 * largest_group);
  options.nvme.dirs = config.dirs;
  STRATA_RETURN_IF_ERROR(SetOption(options, "placement.policy", config.policy));
  options.placement.device_params = config.device_params;
  options.placement.host_states = config.host_states;
  options.nvme.capacity_bytes = 2 * total + 4 * largest;
  return ValidateOptions(options);
}

// The backing files in `dirs` go when it does, unless they were there before.
class RemoveCreatedFiles {
 public:
  explicit RemoveCreatedFiles(const std::vector<std::string>& dirs) {
    for (const std::string& dir : dirs) {
      std::filesystem::path file = std::filesystem::path(dir) / "strata.nvme";
      if (!std::filesystem::exists(file)) created_.push_back(file);
    }
  }
  RemoveCreatedFiles(const RemoveCreatedFiles&) = delete;
  RemoveCreatedFiles& operator=(const RemoveCreatedFiles&) = delete;
  ~RemoveCreatedFiles() {
    for (const auto& f : created_) {
      std::error_code ignored;
      std::filesystem::remove(f, ignored);
    }
  }

 private:
  std::vector<std::filesystem::path> created_;
};

void ReportPlanned(const RunResult& planned, ReplayBenchReport& report) {
  report.planned = planned.run;
  report.planning_seconds = planned.planning_seconds;
  report.predicted_step_seconds = planned.predicted_step_seconds;
  report.divergences = planned.divergences;
  report.pipeline_json = planned.pipeline_json;
  report.updates = planned.updates;
  report.updates_on_device = planned.updates_on_device;
  report.moments_covered = planned.moments_covered;
  report.plan_error = planned.plan_error;
}

// What `strata plan` predicts for this machine: the budgets as HBM (no
// reserve) and DRAM, the links as the warm-up measured them.
void PredictWithStrataPlan(const ReplayBenchConfig& config, const Options& options,
                           const offload::LinkBandwidths& links, ReplayBenchReport& report) {
  offload::MachineSpec machine = MachineOf(config);
  machine.hbm_bytes = options.device.budget_bytes;
  machine.hbm_reserve_fraction = 0;
  machine.dram_bytes = options.host.budget_bytes;
  machine.nvme_bytes = options.nvme.capacity_bytes;
  machine.nvme_read_gbps = links.bytes_per_second[static_cast<int>(offload::Link::kNvmeRead)] / 1e9;
  machine.nvme_write_gbps = links.bytes_per_second[static_cast<int>(offload::Link::kNvmeWrite)] / 1e9;
  Result<offload::CapacityPlan> predicted = offload::PlanCapacity(config.model, machine, config.accumulation);
  if (!predicted.ok()) {
    STRATA_LOG_WARNING("bench replay: strata plan refuses this machine: {}", predicted.status().ToString());
    return;
  }
  report.strata_plan_step_seconds = predicted->step_seconds;
  report.strata_plan_command = fmt::format(
      "strata plan --layers {} --hidden {} --vocab {} --seq {} --batch {} --hbm {} --hbm-reserve 0 --dram {} "
      "--nvme-capacity {} --pcie-gbps {} --nvme-read-gbps {:.3f} --nvme-write-gbps {:.3f} --gpu-tflops {} "
      "--cpu-adam-gparams {} --gpu-adam-gparams {} --micro-batches {} --accumulation {}",
      config.model.layers, config.model.hidden, config.model.vocab, config.model.sequence, config.model.batch,
      machine.hbm_bytes, machine.dram_bytes, machine.nvme_bytes, config.pcie_gbps, machine.nvme_read_gbps,
      machine.nvme_write_gbps, config.gpu_tflops, config.cpu_adam_gparams, config.gpu_adam_gparams,
      config.accumulation.micro_batches, config.accumulation.order_name());
}

}  // namespace

uint64_t ReplayRun::bytes_moved() const {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  return total;
}

Result<ReplayBenchReport> RunReplayBench(const ReplayBenchConfig& config) {
  STRATA_RETURN_IF_ERROR(ValidateReplayConfig(config));
  const std::vector<TensorSpec> specs = offload::GptTensorSpecs(config.model, DType::kBFloat16);
  Options options = ReplayOptions(config);
  STRATA_ASSIGN_OR_RETURN(memory::ChunkLayout layout, LayoutOf(specs, options));
  // The trace names the chunks of the ranks' own layout (the same on every
  // rank), which sharding can give more chunks than the whole one (a master
  // shard for every group whose params are sharded).
  STRATA_ASSIGN_OR_RETURN(
      memory::ChunkLayout ranks_layout,
      LayoutOf(specs, options,
               {0, static_cast<int>(std::max<uint32_t>(config.ranks, 1)), options.comm.shard_params}));
  const offload::GptStep step = ReplayStep(config, specs, ranks_layout);
  ReplayBenchReport report;
  report.config = config;
  report.model_states_bytes = layout.report().total_bytes;
  report.activation_peak_bytes = step.activation_peak_bytes;
  report.boundary_bytes = step.boundary_bytes;
  report.chunks = static_cast<uint32_t>(layout.chunks().size());
  report.moments = static_cast<uint32_t>(step.trace.moments.size());
  for (const offload::TraceMoment& m : step.trace.moments) report.compute_seconds += m.compute_seconds;
  STRATA_RETURN_IF_ERROR(SetBudgets(config, layout, step.activation_peak_bytes, options));
  report.device_budget_bytes = options.device.budget_bytes;
  report.host_budget_bytes = options.host.budget_bytes;

  const RemoveCreatedFiles remove_files(config.dirs);
  STRATA_ASSIGN_OR_RETURN(RunResult planned, RunRanks(config, options, specs, step.trace, /*baseline=*/false));
  ReportPlanned(planned, report);
  if (config.gpu_tflops > 0 && config.compute_ms <= 0) PredictWithStrataPlan(config, options, planned.links, report);
  if (config.baseline) {
    STRATA_ASSIGN_OR_RETURN(RunResult lru, RunRanks(config, options, specs, step.trace, /*baseline=*/true));
    report.lru = lru.run;
  }
  return report;
}

}  // namespace strata::bench
