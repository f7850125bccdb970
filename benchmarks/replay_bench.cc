#include "benchmarks/replay_bench.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "offload/schedule/pipeline.h"
#include "offload/training/accumulated_step.h"
#include "offload/training/grad_reducer.h"
#include "offload/training/overlap_updates.h"
#include "offload/training/train_step.h"
#include "offload/workloads/capacity_plan.h"
#include "offload/workloads/gpt_model.h"
#include "optim/optimizer.h"
#include "strata/engine.h"
#include "src/base/logging.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

double SecondsSince(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

offload::MachineSpec MachineOf(const ReplayBenchConfig& c) {
  offload::MachineSpec machine;
  machine.pcie_gbps = c.pcie_gbps;
  machine.gpu_tflops = c.gpu_tflops > 0 ? c.gpu_tflops : machine.gpu_tflops;
  machine.cpu_adam_gparams = c.cpu_adam_gparams;
  machine.gpu_adam_gparams = c.gpu_adam_gparams;
  return machine;
}

// One forward or backward pass of a module of one micro-batch: its compute and its activations.
struct PassCost {
  double seconds = 0;
  uint64_t activation_bytes = 0;
};

// The step the replay drives: the GPT's modules as the blocks of an
// offload::AccumulatedStep, each pass's emulated compute and activations
// taken from the planner's model of the step (offload::GptStepTrace), which
// the report also sums.
struct ReplayStep {
  offload::GptStep model;
  std::vector<std::vector<TensorId>> blocks;  // the embedding, each layer, the head
  std::array<std::vector<PassCost>, 2> passes;  // [backward][block]
};

// The modules' passes from the model's moments: --compute-ms, or FLOPs at
// --gpu-tflops, or 1.5 x the moment's chunks' time over the throttled link,
// each pass of one micro-batch (a layered moment covers every micro-batch;
// its backward recomputes the forward: Note [Layered accumulation]).
ReplayStep ReplayStepOf(const ReplayBenchConfig& config, const std::vector<TensorSpec>& specs,
                        const memory::ChunkLayout& layout) {
  ReplayStep step;
  step.model = offload::GptStepTrace(specs, layout, config.model, MachineOf(config), config.accumulation);
  const uint32_t modules = config.model.layers + 2;
  for (const std::vector<uint32_t>& tensors : offload::GptForwardGroups(specs, config.model.layers)) {
    step.blocks.emplace_back(tensors.begin(), tensors.end());
  }
  const double per_pass = config.accumulation.layered ? config.accumulation.micro_batches : 1;
  for (auto& costs : step.passes) costs.resize(modules);
  for (size_t k = 0; k < step.model.trace.moments.size(); ++k) {
    offload::TraceMoment& m = step.model.trace.moments[k];
    if (m.tier != Tier::kDevice) {  // an update: each rank updates its share
      m.compute_seconds /= config.ranks;
      continue;
    }
    if (config.compute_ms > 0 || config.gpu_tflops <= 0) {
      uint64_t bytes = 0;
      for (ChunkId c : m.chunks) bytes += layout.chunk(c).size_bytes();
      m.compute_seconds = step.model.passes[k] * (config.compute_ms > 0 ? config.compute_ms / 1e3
                                                                        : 1.5 * static_cast<double>(bytes) /
                                                                              (config.pcie_gbps * 1e9));
    }
    if (k >= 2 * modules) continue;  // the next micro-batch's (standard): the same again
    const bool backward = k >= modules;
    step.passes[backward][backward ? 2 * modules - 1 - k : k] = {m.compute_seconds / per_pass, m.non_model_bytes};
  }
  return step;
}

// Sleeps (on the device: the GPU works and the CPU's cores stay free for
// the transfers and the ranks' collectives, as on a real machine) or
// busy-waits (on the host: a CPU update takes a core) for `seconds`.
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
  std::array<uint64_t, offload::kNumLinks> predicted_bytes = {};
  uint64_t divergences = 0;
  offload::LinkBandwidths links;  // as the pipeline measured them
  uint32_t moments = 0;           // of the trace the plan was made from
  uint32_t updates = 0, updates_on_device = 0;
  uint32_t moments_covered = 0;    // whose compute is at least their chunks' transfer time
  std::string plan_error;          // why there is no plan, if the planner refused the trace
};

// Whether moment `m`'s compute (where the plan runs it) is at least the time
// its chunks take over the links at the measured rates: a device moment's
// chunks over host->device (and an NVMe read first for those homed there),
// a host moment's NVMe-homed chunks over the NVMe read (`chunks`: the
// engine's, read once). The premise of the replay's stall goal.
bool ComputeCoversTransfer(const offload::TraceMoment& m, Tier where, const Engine& engine,
                           const std::vector<ChunkInfo>& chunks, const offload::LinkBandwidths& links) {
  const auto rate = [&](offload::Link l) { return links.bytes_per_second[static_cast<int>(l)]; };
  double transfer = 0;
  for (ChunkId c : m.chunks) {
    const double bytes = static_cast<double>(chunks[c.value()].size_bytes);
    const Result<Tier> home = engine.ChunkHome(c);
    const bool on_nvme = home.ok() && *home == Tier::kNvme;
    if (where == Tier::kDevice) transfer += bytes / rate(offload::Link::kHostToDevice);
    if (on_nvme) transfer += bytes / rate(offload::Link::kNvmeRead);
  }
  const double compute = where == m.tier ? m.compute_seconds : *m.device_compute_seconds;
  return compute >= transfer;
}

// Note [The replay]
// The replay drives the engine's own step: offload::RunAccumulatedStep over
// the GPT's modules (the embedding, each layer, the tied head; one micro-
// batch, or --micro-batches in either --accumulation order), which runs a
// moment a module pass, hands each grad chunk, once final, to the reducer
// and to the overlapped updates (offload::OverlapUpdates, with --overlap),
// and ends with offload::RunTrainStep: the gradients' statistics, a host
// moment a chunk group, the plan deciding where each update runs, and data
// parallel the reduce-scatters and all-gathers. What is emulated is the
// compute alone. A pass sleeps (the GPU works) for --compute-ms, or when
// that is 0 for its module's FLOPs at --gpu-tflops, or by default 1.5 x
// the time its chunks take over the throttled link, each with the
// activations the planner's model gives it as non-model memory
// (offload::GptStepTrace); an update, through the engine's ComputeSeam,
// busy-waits for its parameters at --cpu-adam-gparams on the host or sleeps
// for them at --gpu-adam-gparams where the plan puts it on the device. So
// stalls are what remains of the transfers, and a change to the real step
// is measured as it is. Reported per iteration after the warm-up: stall
// time / step time, bytes per link, the planner's time against a step and,
// with --gpu-tflops, `strata plan`'s prediction for the same machine.
//
// Data parallel (--ranks): ranks as threads (a loopback group), each its own
// engine holding 1/ranks of the optimizer states and updating its share of
// every group, over a network of net_gbps (0: the loopback's memory speed);
// also reported: the time waiting for communication. With shard_params
// (ZeRO-3) each pass gathers its param chunks (GradReducer::Gather, ahead
// along the last step's order) and an update writes only its master shard.

// One replay of the step on a fresh engine; with `comm`, one rank of a
// data-parallel group. It is the engine's ComputeSeam: the updates' compute.
class Replay : public ComputeSeam {
 public:
  static Result<std::unique_ptr<Replay>> Create(const ReplayBenchConfig& config, const Options& options,
                                                const std::vector<TensorSpec>& specs, const ReplayStep& step,
                                                bool baseline, Communicator* comm) {
    std::unique_ptr<Replay> replay(new Replay(config, step, comm, comm != nullptr && options.comm.shard_params));
    STRATA_RETURN_IF_ERROR(replay->SetUp(options, specs, baseline));
    return replay;
  }

  // One iteration of the step; a measured one adds its share to the means.
  Status RunIteration(bool measured);
  // After the warm-up: the communication counted from here (the gathers
  // queued ahead by the last step done first, as Finish does).
  Status StartMeasuring();
  // The means, and what the pipeline and its plan report at the end.
  Result<RunResult> Finish();
  Status RunUpdate(const Update& update) override;

 private:
  // The reducer's and the communicator's counts.
  struct CommCounters {
    double waited = 0;
    uint64_t sent = 0;
    std::array<uint64_t, 3> gathered = {};  // gathers, gathered ahead, filled ahead
  };

  Replay(const ReplayBenchConfig& config, const ReplayStep& step, Communicator* comm, bool sharded_params)
      : config_(config), machine_(MachineOf(config)), step_(step), comm_(comm), sharded_params_(sharded_params) {}

  Status SetUp(const Options& options, const std::vector<TensorSpec>& specs, bool baseline);
  Status Pass(const offload::BlockPass& pass);
  CommCounters Counters() const;
  void AddMeasured(const offload::TrainStepReport& report);

  const ReplayBenchConfig& config_;
  const offload::MachineSpec machine_;  // the rates the emulated compute runs at
  const ReplayStep& step_;
  Communicator* const comm_;
  const bool sharded_params_;
  std::vector<ChunkInfo> chunks_;  // once: the engine builds them anew on every call
  std::map<uint32_t, DType> moments_of_group_;  // each trainable group's optimizer moments' dtype
  offload::AccumulatedStep accumulated_;
  // This iteration's timeline, from its start: the last backward pass's
  // end, and each overlapped update's span (added by the pipeline's thread).
  Clock::time_point iteration_start_;
  double backward_end_ = 0;
  std::mutex spans_mu_;
  std::vector<std::pair<double, double>> spans_;
  CommCounters measuring_from_;
  RunResult result_;
  // Each after what it uses, so that it goes first.
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<offload::Pipeline> pipeline_;
  std::unique_ptr<optim::Optimizer> optimizer_;
  std::unique_ptr<offload::GradReducer> reducer_;
  std::unique_ptr<offload::OverlapUpdates> overlap_;
};

Status Replay::SetUp(const Options& options, const std::vector<TensorSpec>& specs, bool baseline) {
  EngineSeams seams;
  seams.comm = comm_;
  seams.compute = this;
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
  STRATA_ASSIGN_OR_RETURN(const optim::OptimizerConfig optimizer, optim::OptimizerConfigFromOptions(options));
  STRATA_ASSIGN_OR_RETURN(optimizer_, optim::Optimizer::Create(optimizer));
  chunks_ = engine_->chunks();
  for (const ChunkInfo& chunk : chunks_) {
    if (chunk.kind == ChunkKind::kExpAvg) moments_of_group_[chunk.group] = chunk.dtype;
  }
  if (comm_ != nullptr) reducer_ = std::make_unique<offload::GradReducer>(*engine_, *comm_);
  if (config_.overlap) {  // room to keep a copy of every group's chunks: each update begins in backward
    uint64_t kept_bytes = 0;
    for (const ChunkInfo& chunk : chunks_) kept_bytes += chunk.used_bytes;
    const offload::OverlapOptions overlap{.kept_bytes = kept_bytes, .reducer = reducer_.get()};
    STRATA_ASSIGN_OR_RETURN(overlap_, offload::OverlapUpdates::Create(*engine_, *pipeline_, *optimizer_, overlap));
  }
  accumulated_.micro_batches = config_.accumulation.micro_batches;
  accumulated_.order =
      config_.accumulation.layered ? offload::AccumulationOrder::kLayered : offload::AccumulationOrder::kStandard;
  accumulated_.blocks = step_.blocks;
  accumulated_.activation_bytes = [this](const offload::BlockPass& pass) {
    return step_.passes[pass.backward][pass.block].activation_bytes;
  };
  return Status::Ok();
}

Status Replay::RunIteration(bool measured) {
  iteration_start_ = Clock::now();
  {
    std::lock_guard lock(spans_mu_);
    spans_.clear();
  }
  const offload::TrainStepOptions options{.comm = comm_, .reducer = reducer_.get(), .overlap = overlap_.get()};
  STRATA_ASSIGN_OR_RETURN(
      const offload::TrainStepReport report,
      offload::RunAccumulatedStep(*engine_, *pipeline_, *optimizer_, accumulated_,
                                  [this](const offload::BlockPass& pass) { return Pass(pass); }, options));
  // Its gradients never written, the step neither skips nor redoes an update: one that did would run on the
  // values nobody computed (the emulated updates keep no copy), and measure something else.
  if (report.plan.skip || report.redone_groups > 0) {
    return Internal("bench replay: the step skipped its update or redid {} of them, which its emulated compute "
                    "cannot: it keeps no values",
                    report.redone_groups);
  }
  if (measured) AddMeasured(report);
  return Status::Ok();
}

Status Replay::StartMeasuring() {
  if (reducer_) STRATA_RETURN_IF_ERROR(reducer_->Drain());
  measuring_from_ = Counters();
  return Status::Ok();
}

// A module's pass, its chunks pinned on the device (transient params gathered first).
Status Replay::Pass(const offload::BlockPass& pass) {
  if (sharded_params_) {
    for (const ChunkAccess& param : *pass.params) {
      if (chunks_[param.id().value()].transient) STRATA_RETURN_IF_ERROR(reducer_->Gather(param.id(), param));
    }
  }
  ComputeFor(step_.passes[pass.backward][pass.block].seconds, Tier::kDevice);
  if (pass.backward) backward_end_ = SecondsSince(iteration_start_);
  return Status::Ok();
}

// The seam: an update takes its parameters' time at the rate where the plan
// runs it; one begun beside backward goes into the timeline.
Status Replay::RunUpdate(const Update& update) {
  const double begin = SecondsSince(iteration_start_);
  const DType moments = moments_of_group_.at(update.group);
  ComputeFor(offload::UpdateSeconds(update.elems, moments, update.where, machine_), update.where);
  if (update.overlapped) {
    std::lock_guard lock(spans_mu_);
    spans_.emplace_back(begin, SecondsSince(iteration_start_));
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

void Replay::AddMeasured(const offload::TrainStepReport& report) {
  const double n = config_.iterations;
  const offload::PipelineStats s = pipeline_->stats();
  ReplayRun& run = result_.run;
  run.step_seconds += s.step_seconds / n;
  // The step's wait for the overlapped updates: the device idles, a stall.
  run.stall_seconds += (s.stall_seconds + report.seconds.overlap_wait) / n;
  run.update_wait_seconds += report.seconds.overlap_wait / n;
  run.backward_end_seconds = backward_end_;
  {
    std::lock_guard lock(spans_mu_);
    run.overlap_spans = spans_;
  }
  run.comm_stall_seconds += report.seconds.gather / n;  // the updated param chunks' all-gathers, in the step
  for (int l = 0; l < offload::kNumLinks; ++l) run.bytes[l] += s.bytes[l] / config_.iterations;
}

Result<RunResult> Replay::Finish() {
  RunResult& result = result_;
  if (reducer_) {  // the last step's gathers ahead stand for those the first measured step found done
    STRATA_RETURN_IF_ERROR(reducer_->Drain());
    const CommCounters now = Counters();
    const double n = config_.iterations;
    result.run.comm_stall_seconds += (now.waited - measuring_from_.waited) / n;
    result.run.comm_bytes = (now.sent - measuring_from_.sent) / config_.iterations;
    result.run.gathers = static_cast<double>(now.gathered[0] - measuring_from_.gathered[0]) / n;
    result.run.gathered_ahead = static_cast<double>(now.gathered[1] - measuring_from_.gathered[1]) / n;
    result.run.filled_ahead = static_cast<double>(now.gathered[2] - measuring_from_.gathered[2]) / n;
  }
  result.run.stall_fraction = result.run.step_seconds > 0 ? result.run.stall_seconds / result.run.step_seconds : 0;
  result.run.comm_stall_fraction =
      result.run.step_seconds > 0 ? result.run.comm_stall_seconds / result.run.step_seconds : 0;
  const offload::PipelineStats s = pipeline_->stats();
  result.planning_seconds = s.planning_seconds;
  result.divergences = s.divergences;
  result.links = pipeline_->links();
  result.plan_error = s.plan_error;
  const offload::Plan* plan = pipeline_->plan();
  if (plan != nullptr) {
    result.predicted_step_seconds = plan->prediction.step_seconds;
    result.predicted_bytes = plan->prediction.bytes;
  }
  // By chunk group: where the plan runs its update (begun beside backward, data parallel, a group has a host
  // moment in the step too, its update confirmed: the overlapped one is its update).
  std::map<uint32_t, Tier> update_tier;
  if (const offload::Trace* trace = pipeline_->trace()) {
    result.moments = static_cast<uint32_t>(trace->moments.size());
    for (size_t k = 0; k < trace->moments.size(); ++k) {
      const offload::TraceMoment& m = trace->moments[k];
      if (m.tier != Tier::kHost) continue;
      const uint32_t group = chunks_[m.chunks.front().value()].group;
      if (m.overlap || !update_tier.contains(group)) {
        update_tier[group] = plan != nullptr ? plan->compute_tier[k] : m.tier;
      }
    }
  }
  result.updates = static_cast<uint32_t>(update_tier.size());
  for (const auto& [group, where] : update_tier) result.updates_on_device += where == Tier::kDevice;
  // The premise counted on the emulated compute (the model's moments), not on the recorded times, which
  // hold what the recording iteration waited for besides.
  for (const offload::TraceMoment& m : step_.model.trace.moments) {
    Tier where = m.tier;
    if (m.tier == Tier::kHost && m.device_compute_seconds) {
      const auto placed = update_tier.find(chunks_[m.chunks.front().value()].group);
      if (placed != update_tier.end()) where = placed->second;
    }
    result.moments_covered += ComputeCoversTransfer(m, where, *engine_, chunks_, result.links);
  }
  result.pipeline_json = pipeline_->StatsJson();
  return std::move(result_);
}

Result<RunResult> RunOnce(const ReplayBenchConfig& config, const Options& options,
                          const std::vector<TensorSpec>& specs, const ReplayStep& step, bool baseline,
                          Communicator* comm = nullptr) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Replay> replay, Replay::Create(config, options, specs, step, baseline, comm));
  for (uint32_t it = 0; it < config.warmup; ++it) STRATA_RETURN_IF_ERROR(replay->RunIteration(/*measured=*/false));
  STRATA_RETURN_IF_ERROR(replay->StartMeasuring());
  for (uint32_t it = 0; it < config.iterations; ++it) STRATA_RETURN_IF_ERROR(replay->RunIteration(/*measured=*/true));
  return replay->Finish();
}

// RunOnce on `config.ranks` ranks (threads of a loopback group, throttled
// to config.net_gbps): rank 0's result, with the largest communication
// stall of any rank.
Result<RunResult> RunRanks(const ReplayBenchConfig& config, const Options& options,
                           const std::vector<TensorSpec>& specs, const ReplayStep& step, bool baseline) {
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
  report.predicted_bytes = planned.predicted_bytes;
  report.divergences = planned.divergences;
  report.pipeline_json = planned.pipeline_json;
  report.updates = planned.updates;
  report.updates_on_device = planned.updates_on_device;
  report.moments_covered = planned.moments_covered;
  report.moments = planned.moments;
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
  const ReplayStep step = ReplayStepOf(config, specs, ranks_layout);
  ReplayBenchReport report;
  report.config = config;
  report.model_states_bytes = layout.report().total_bytes;
  report.activation_peak_bytes = step.model.activation_peak_bytes;
  report.boundary_bytes = step.model.boundary_bytes;
  report.chunks = static_cast<uint32_t>(layout.chunks().size());
  report.modelled_moments = static_cast<uint32_t>(step.model.trace.moments.size());
  for (const offload::TraceMoment& m : step.model.trace.moments) report.compute_seconds += m.compute_seconds;
  STRATA_RETURN_IF_ERROR(SetBudgets(config, layout, step.model.activation_peak_bytes, options));
  report.device_budget_bytes = options.device.budget_bytes;
  report.host_budget_bytes = options.host.budget_bytes;

  const RemoveCreatedFiles remove_files(config.dirs);
  STRATA_ASSIGN_OR_RETURN(RunResult planned, RunRanks(config, options, specs, step, /*baseline=*/false));
  ReportPlanned(planned, report);
  if (config.gpu_tflops > 0 && config.compute_ms <= 0) PredictWithStrataPlan(config, options, planned.links, report);
  if (config.baseline) {
    STRATA_ASSIGN_OR_RETURN(RunResult lru, RunRanks(config, options, specs, step, /*baseline=*/true));
    report.lru = lru.run;
  }
  return report;
}

}  // namespace strata::bench
