#include "benchmarks/replay_bench.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <filesystem>
#include <map>
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

offload::MachineSpec MachineOf(const ReplayBenchConfig& c) {
  offload::MachineSpec machine;
  machine.pcie_gbps = c.pcie_gbps;
  machine.gpu_tflops = c.gpu_tflops > 0 ? c.gpu_tflops : machine.gpu_tflops;
  machine.cpu_adam_gparams = c.cpu_adam_gparams;
  machine.gpu_adam_gparams = c.gpu_adam_gparams;
  return machine;
}

// The step as the planner sees it (offload::GptStepTrace), with the compute
// each moment busy-waits: FLOPs at --gpu-tflops, or 1.5 x its chunks' time
// over the throttled link; an update 1/ranks of its time with several ranks.
offload::GptStep ReplayStep(const ReplayBenchConfig& config, const std::vector<TensorSpec>& specs,
                            const memory::ChunkLayout& layout) {
  offload::GptStep step = offload::GptStepTrace(specs, layout, config.model, MachineOf(config));
  for (offload::TraceMoment& m : step.trace.moments) {
    if (m.device_compute_seconds && config.ranks > 1) {  // an update: each rank updates its share
      m.compute_seconds /= config.ranks;
      *m.device_compute_seconds /= config.ranks;
      if (config.shard_params) {  // which writes its master shard only
        std::erase_if(m.chunks, [&](ChunkId c) { return layout.chunk(c).kind == ChunkKind::kParam; });
      }
    }
    if (m.tier != Tier::kDevice || (config.gpu_tflops > 0 && config.compute_ms <= 0)) continue;
    uint64_t bytes = 0;
    for (ChunkId c : m.chunks) bytes += layout.chunk(c).size_bytes();
    m.compute_seconds =
        config.compute_ms > 0 ? config.compute_ms / 1e3 : 1.5 * static_cast<double>(bytes) / (config.pcie_gbps * 1e9);
  }
  if (config.ranks > 1) {
    // Data parallel, the updates run as RunTrainStep runs them: after
    // backward (the gradient norm is all-reduced first), in model order, so
    // that with parameters sharded the next forward's first chunks are the
    // first gathered ahead, behind the rest of the updates.
    std::vector<offload::TraceMoment>& moments = step.trace.moments;
    const auto updates = std::stable_partition(moments.begin(), moments.end(),
                                               [](const offload::TraceMoment& m) { return !m.device_compute_seconds; });
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
      if (m.device_compute_seconds) {  // an update
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

Result<RunResult> RunOnce(const ReplayBenchConfig& config, const Options& options,
                          const std::vector<TensorSpec>& specs, const offload::Trace& step, bool baseline,
                          Communicator* comm = nullptr) {
  EngineSeams seams;
  seams.comm = comm;
  if (config.dirs.empty()) {
    STRATA_ASSIGN_OR_RETURN(seams.storage, CreateMemoryStorage(options.nvme.capacity_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(options, std::move(seams)));
  for (const TensorSpec& spec : specs) STRATA_RETURN_IF_ERROR(engine->RegisterTensor(spec).status());
  STRATA_RETURN_IF_ERROR(engine->Finalize());
  offload::PipelineOptions pipeline_options = offload::PipelineOptionsOf(options);
  if (baseline) pipeline_options.policy = offload::Policy::kOnDemand;
  const double link = config.pcie_gbps * 1e9;
  pipeline_options.links.bytes_per_second = {link, link, 0, 0};  // the throttle; NVMe measured in the warm-up
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::Pipeline> pipeline,
                          offload::Pipeline::Create(*engine, pipeline_options));
  RunResult result;
  std::vector<std::byte> gather_buffer;  // the all-gathers' bytes (the replay has no values to keep)
  std::unique_ptr<offload::GradReducer> reducer;  // after the buffer its jobs use
  CommMoments comm_moments;
  const std::vector<ChunkInfo> chunks = engine->chunks();  // once: it is built anew on every call
  if (comm != nullptr) {
    reducer = std::make_unique<offload::GradReducer>(*engine, *comm);
    comm_moments = CommMomentsOf(step, chunks);
    uint64_t largest = 0;
    for (const ChunkInfo& chunk : chunks) largest = std::max(largest, chunk.size_bytes);
    gather_buffer.resize(2 * largest + 4096);
  }
  const auto gather = [&](const ChunkInfo& param) {
    const uint64_t width = DTypeSizeBytes(param.dtype);
    const uint64_t shard = memory::ShardOf(param.used_bytes / width, comm->rank(), comm->world_size()).elems * width;
    return [&gather_buffer, shard](Communicator& c) {
      return c.AllGather(gather_buffer.data(), gather_buffer.data() + shard, shard);
    };
  };
  const bool sharded_params = comm != nullptr && options.comm.shard_params;
  std::map<uint32_t, ChunkId> param_of_group;
  std::set<uint32_t> trained_groups;  // those with gradients; the others are frozen
  for (const ChunkInfo& chunk : chunks) {
    if (chunk.kind == ChunkKind::kParam) param_of_group.emplace(chunk.group, chunk.id);
    if (chunk.kind == ChunkKind::kGrad) trained_groups.insert(chunk.group);
  }
  for (uint32_t it = 0; it < config.warmup + config.iterations; ++it) {
    const double waited = reducer ? reducer->wait_seconds() : 0;
    const uint64_t sent = comm != nullptr ? comm->stats().total_bytes() : 0;
    const std::array<uint64_t, 3> gathered =
        reducer ? std::array<uint64_t, 3>{reducer->gathers(), reducer->gathered_ahead(), reducer->filled_ahead()}
                : std::array<uint64_t, 3>{};
    STRATA_RETURN_IF_ERROR(pipeline->BeginIteration());
    bool updating = false;
    for (size_t k = 0; k < step.moments.size(); ++k) {
      const offload::TraceMoment& m = step.moments[k];
      if (reducer && comm_moments.take[k]) {
        if (sharded_params && !updating) {  // as RunTrainStep does before its updates
          reducer->ReleaseGathered();
          for (const ChunkInfo& c : chunks) {  // and the frozen groups' gathers ahead, their shards final
            if (c.kind == ChunkKind::kParam && c.transient && !trained_groups.contains(c.group)) reducer->Updated(c.id);
          }
        }
        updating = true;
        STRATA_ASSIGN_OR_RETURN(offload::GradReducer::Reduced reduced, reducer->Take(*comm_moments.take[k]));
        reducer->Recycle(std::move(reduced.shard));  // as RunTrainStep does after the update
      }
      double compute = m.compute_seconds;
      Tier runs_on = m.tier;
      if (m.tier == Tier::kDevice) {
        STRATA_RETURN_IF_ERROR(pipeline->BeginMoment(m.non_model_bytes));
      } else {
        STRATA_ASSIGN_OR_RETURN(runs_on, pipeline->BeginHostMoment(m.device_compute_seconds));
        if (runs_on == Tier::kDevice) compute = *m.device_compute_seconds;
      }
      std::vector<ChunkAccess> held;
      for (ChunkId c : m.chunks) {
        STRATA_ASSIGN_OR_RETURN(ChunkAccess access, pipeline->Access(c));
        if (sharded_params && chunks[c.value()].transient) STRATA_RETURN_IF_ERROR(reducer->Gather(c, access));
        held.push_back(std::move(access));
      }
      ComputeFor(compute, runs_on);
      held.clear();
      STRATA_RETURN_IF_ERROR(pipeline->EndMoment());
      if (reducer) {
        if (sharded_params && comm_moments.take[k]) {  // as RunTrainStep: the next forward's first chunks gather ahead
          reducer->Updated(param_of_group.at(chunks[comm_moments.take[k]->value()].group));
        }
        for (ChunkId c : comm_moments.submit[k]) STRATA_RETURN_IF_ERROR(reducer->Submit(c));
        if (comm_moments.gather[k]) reducer->Enqueue(gather(chunks[comm_moments.gather[k]->value()]));
      }
    }
    // The gathers are in before the next forward (parameters sharded: the
    // next forward's first chunks, gathered ahead as the updates end), so
    // each iteration counts its own bytes; the wait counts as a stall.
    if (reducer) STRATA_RETURN_IF_ERROR(reducer->Drain());
    STRATA_RETURN_IF_ERROR(pipeline->EndIteration());
    if (it < config.warmup) continue;
    const offload::PipelineStats s = pipeline->stats();
    result.run.step_seconds += s.step_seconds / config.iterations;
    result.run.stall_seconds += s.stall_seconds / config.iterations;
    if (reducer) {
      result.run.comm_stall_seconds += (reducer->wait_seconds() - waited) / config.iterations;
      result.run.comm_bytes += (comm->stats().total_bytes() - sent) / config.iterations;
      result.run.gathers += static_cast<double>(reducer->gathers() - gathered[0]) / config.iterations;
      result.run.gathered_ahead += static_cast<double>(reducer->gathered_ahead() - gathered[1]) / config.iterations;
      result.run.filled_ahead += static_cast<double>(reducer->filled_ahead() - gathered[2]) / config.iterations;
    }
    for (int l = 0; l < offload::kNumLinks; ++l) result.run.bytes[l] += s.bytes[l] / config.iterations;
  }
  result.run.stall_fraction = result.run.step_seconds > 0 ? result.run.stall_seconds / result.run.step_seconds : 0;
  result.run.comm_stall_fraction =
      result.run.step_seconds > 0 ? result.run.comm_stall_seconds / result.run.step_seconds : 0;
  const offload::PipelineStats s = pipeline->stats();
  result.planning_seconds = s.planning_seconds;
  result.divergences = s.divergences;
  result.links = pipeline->links();
  result.plan_error = s.plan_error;
  const offload::Plan* plan = pipeline->plan();
  if (plan != nullptr) result.predicted_step_seconds = plan->prediction.step_seconds;
  for (size_t k = 0; k < step.moments.size(); ++k) {
    const Tier where = plan != nullptr ? plan->compute_tier[k] : step.moments[k].tier;
    if (step.moments[k].device_compute_seconds) {
      result.updates++;
      if (where == Tier::kDevice) result.updates_on_device++;
    }
    result.moments_covered += ComputeCoversTransfer(step.moments[k], where, *engine, result.links);
  }
  result.pipeline_json = pipeline->StatsJson();
  return result;
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

}  // namespace

uint64_t ReplayRun::bytes_moved() const {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  return total;
}

Result<ReplayBenchReport> RunReplayBench(const ReplayBenchConfig& config) {
  if (config.model.layers == 0 || config.model.hidden == 0 || config.model.vocab == 0 || config.model.sequence == 0) {
    return InvalidArgument("bench replay: --layers, --hidden, --vocab and --seq must be > 0");
  }
  if (config.iterations == 0) return InvalidArgument("bench replay: --iterations 0: at least one is measured");
  if (config.warmup == 0) return InvalidArgument("bench replay: --warmup 0: the first iteration records the trace");
  if (config.model.batch == 0) return InvalidArgument("bench replay: --batch must be > 0");
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
  if (!(config.net_gbps >= 0)) return InvalidArgument("bench replay: --net-gbps {} must be >= 0", config.net_gbps);
  const offload::GptShape shape{.layers = config.model.layers, .hidden = config.model.hidden, .vocab = config.model.vocab,
                             .sequence = config.model.sequence};
  const std::vector<TensorSpec> specs = offload::GptTensorSpecs(shape, DType::kBFloat16);

  Options options;
  options.device.backend = DeviceBackendKind::kEmulated;
  options.compute_dtype = DType::kBFloat16;
  options.device.emulated_bandwidth_gbps = config.pcie_gbps;
  options.log_level = LogLevel::kWarning;
  options.comm.shard_params = config.shard_params && config.ranks > 1;
  STRATA_ASSIGN_OR_RETURN(memory::ChunkLayout layout,
                          memory::ChunkLayout::Build(specs, options.chunk.size_elems, options.chunk.search_min_elems,
                                                     options.chunk.search_max_elems));
  const uint64_t total = layout.report().total_bytes;
  uint64_t largest = 0;
  for (const memory::ChunkDesc& chunk : layout.chunks()) largest = std::max(largest, chunk.size_bytes());
  // The trace names the chunks of the ranks' own layout (the same on every
  // rank), which sharding can give more chunks than the whole one (a master
  // shard for every group whose params are sharded).
  STRATA_ASSIGN_OR_RETURN(
      memory::ChunkLayout ranks_layout,
      memory::ChunkLayout::Build(specs, options.chunk.size_elems, options.chunk.search_min_elems,
                                 options.chunk.search_max_elems,
                                 {0, static_cast<int>(std::max<uint32_t>(config.ranks, 1)), options.comm.shard_params}));
  const offload::GptStep step = ReplayStep(config, specs, ranks_layout);
  ReplayBenchReport report;
  report.config = config;
  report.model_states_bytes = total;
  report.activation_peak_bytes = step.activation_peak_bytes;
  report.chunks = static_cast<uint32_t>(layout.chunks().size());
  report.moments = static_cast<uint32_t>(step.trace.moments.size());
  for (const offload::TraceMoment& m : step.trace.moments) report.compute_seconds += m.compute_seconds;
  options.device.budget_bytes =
      config.device_budget_bytes > 0 ? config.device_budget_bytes
                                     : std::max<uint64_t>(total / 4, 4 * largest + step.activation_peak_bytes);
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
  report.device_budget_bytes = options.device.budget_bytes;
  report.host_budget_bytes = options.host.budget_bytes;
  STRATA_RETURN_IF_ERROR(ValidateOptions(options));

  // The backing files go afterwards, unless they were there before.
  std::vector<std::filesystem::path> created;
  for (const std::string& dir : config.dirs) {
    std::filesystem::path file = std::filesystem::path(dir) / "strata.nvme";
    if (!std::filesystem::exists(file)) created.push_back(file);
  }
  struct RemoveFiles {
    std::vector<std::filesystem::path>& files;
    ~RemoveFiles() {
      for (const auto& f : files) {
        std::error_code ignored;
        std::filesystem::remove(f, ignored);
      }
    }
  } remove_files{created};

  STRATA_ASSIGN_OR_RETURN(RunResult planned, RunRanks(config, options, specs, step.trace, /*baseline=*/false));
  report.planned = planned.run;
  report.planning_seconds = planned.planning_seconds;
  report.predicted_step_seconds = planned.predicted_step_seconds;
  report.divergences = planned.divergences;
  report.pipeline_json = planned.pipeline_json;
  report.updates = planned.updates;
  report.updates_on_device = planned.updates_on_device;
  report.moments_covered = planned.moments_covered;
  report.plan_error = planned.plan_error;
  // What `strata plan` predicts for this machine: the budgets as HBM (no
  // reserve) and DRAM, the links as the warm-up measured them.
  if (config.gpu_tflops > 0 && config.compute_ms <= 0) {
    offload::MachineSpec machine = MachineOf(config);
    machine.hbm_bytes = options.device.budget_bytes;
    machine.hbm_reserve_fraction = 0;
    machine.dram_bytes = options.host.budget_bytes;
    machine.nvme_bytes = options.nvme.capacity_bytes;
    machine.nvme_read_gbps = planned.links.bytes_per_second[static_cast<int>(offload::Link::kNvmeRead)] / 1e9;
    machine.nvme_write_gbps = planned.links.bytes_per_second[static_cast<int>(offload::Link::kNvmeWrite)] / 1e9;
    Result<offload::CapacityPlan> predicted = offload::PlanCapacity(config.model, machine);
    if (predicted.ok()) {
      report.strata_plan_step_seconds = predicted->step_seconds;
      report.strata_plan_command = fmt::format(
          "strata plan --layers {} --hidden {} --vocab {} --seq {} --batch {} --hbm {} --hbm-reserve 0 --dram {} "
          "--nvme-capacity {} --pcie-gbps {} --nvme-read-gbps {:.3f} --nvme-write-gbps {:.3f} --gpu-tflops {} "
          "--cpu-adam-gparams {} --gpu-adam-gparams {}",
          config.model.layers, config.model.hidden, config.model.vocab, config.model.sequence, config.model.batch, machine.hbm_bytes,
          machine.dram_bytes, machine.nvme_bytes, config.pcie_gbps, machine.nvme_read_gbps, machine.nvme_write_gbps,
          config.gpu_tflops, config.cpu_adam_gparams, config.gpu_adam_gparams);
    } else {
      STRATA_LOG_WARNING("bench replay: strata plan refuses this machine: {}", predicted.status().ToString());
    }
  }
  if (config.baseline) {
    STRATA_ASSIGN_OR_RETURN(RunResult lru, RunRanks(config, options, specs, step.trace, /*baseline=*/true));
    report.lru = lru.run;
  }
  return report;
}

std::string FormatReplayBench(const ReplayBenchReport& r) {
  std::string out = fmt::format(
      "strata bench replay: GPT, {} layers, hidden {}, vocab {}, seq {}, batch {}: {} of model states in {} chunks, "
      "{} moments, activations up to {}\n"
      "device budget {}, host budget {}, NVMe {}; links {} GB/s; compute {:.1f} ms per iteration (updates on the "
      "CPU); {} measured iterations after {} of warm-up\n",
      r.config.model.layers, r.config.model.hidden, r.config.model.vocab, r.config.model.sequence, r.config.model.batch,
      FormatSize(r.model_states_bytes), r.chunks, r.moments, FormatSize(r.activation_peak_bytes),
      FormatSize(r.device_budget_bytes), FormatSize(r.host_budget_bytes),
      r.config.dirs.empty() ? std::string("emulated in memory") : fmt::format("{}", fmt::join(r.config.dirs, ",")),
      r.config.pcie_gbps, 1e3 * r.compute_seconds, r.config.iterations, r.config.warmup);
  out += fmt::format("{:<22} {:>10} {:>10} {:>8} {:>12} {:>12} {:>12} {:>12}\n", "", "step ms", "stall ms", "stall",
                     "host->dev", "dev->host", "nvme read", "nvme write");
  const auto row = [&](const char* name, const ReplayRun& run) {
    out += fmt::format("{:<22} {:>10.2f} {:>10.2f} {:>7.1f}% {:>12} {:>12} {:>12} {:>12}\n", name,
                       1e3 * run.step_seconds, 1e3 * run.stall_seconds, 100 * run.stall_fraction,
                       FormatSize(run.bytes[0]), FormatSize(run.bytes[1]), FormatSize(run.bytes[2]),
                       FormatSize(run.bytes[3]));
  };
  row(r.config.policy == "static" ? "static placement" : "planned prefetch", r.planned);
  if (r.config.baseline) row("LRU, on demand", r.lru);
  if (!r.plan_error.empty()) {
    out += fmt::format("no plan: the planner refused the trace ({}); the run above was on demand\n", r.plan_error);
  }
  if (r.predicted_step_seconds > 0) {
    out += fmt::format(
        "planning {:.2f} ms ({:.2f}% of a step); predicted step {:.2f} ms ({:+.1f}% from the replay); {} divergences\n",
        1e3 * r.planning_seconds, 100 * r.planning_seconds / std::max(r.planned.step_seconds, 1e-12),
        1e3 * r.predicted_step_seconds, 100 * (r.predicted_step_seconds / std::max(r.planned.step_seconds, 1e-12) - 1),
        r.divergences);
  }
  if (r.config.ranks > 1) {
    const double network_ms =
        r.config.net_gbps > 0 ? 1e3 * static_cast<double>(r.planned.comm_bytes) / (r.config.net_gbps * 1e9) : 0;
    out += fmt::format(
        "data parallel, {} ranks{} over {}: each sends {} a step ({:.2f} ms on that network); communication "
        "stall {:.2f} ms ({:.1f}% of the step, the most of any rank){}\n",
        r.config.ranks, r.config.shard_params ? " (parameters sharded)" : "",
        r.config.net_gbps > 0 ? fmt::format("a {} GB/s network", r.config.net_gbps) : std::string("the loopback"),
        FormatSize(r.planned.comm_bytes), network_ms, 1e3 * r.planned.comm_stall_seconds,
        100 * r.planned.comm_stall_fraction,
        r.config.baseline ? fmt::format("; LRU run {:.1f}%", 100 * r.lru.comm_stall_fraction) : std::string());
    if (r.config.shard_params) {
      out += fmt::format(
          "param chunks gathered a step: {:.0f}, {:.0f} of them ahead of their need, {:.0f} of those filled into "
          "their device slot ahead too\n",
          r.planned.gathers, r.planned.gathered_ahead, r.planned.filled_ahead);
    }
  }
  out += fmt::format("{} of {} chunk-group updates on the device, the rest on the CPU; compute at least its chunks' "
                     "transfer time in {} of {} moments\n",
                     r.updates_on_device, r.updates, r.moments_covered, r.moments);
  if (r.strata_plan_step_seconds > 0) {
    out += fmt::format("strata plan predicts {:.2f} ms ({:+.1f}% from the replay): {}\n",
                       1e3 * r.strata_plan_step_seconds,
                       100 * (r.strata_plan_step_seconds / std::max(r.planned.step_seconds, 1e-12) - 1),
                       r.strata_plan_command);
  }
  return out;
}

std::string ReplayBenchJson(const ReplayBenchReport& r) {
  nlohmann::json j;
  j["config"] = {{"model", "gpt"},
                 {"layers", r.config.model.layers},
                 {"hidden", r.config.model.hidden},
                 {"vocab", r.config.model.vocab},
                 {"seq", r.config.model.sequence},
                 {"batch", r.config.model.batch},
                 {"gpu_tflops", r.config.gpu_tflops},
                 {"cpu_adam_gparams", r.config.cpu_adam_gparams},
                 {"gpu_adam_gparams", r.config.gpu_adam_gparams},
                 {"device_budget_bytes", r.device_budget_bytes},
                 {"host_budget_bytes", r.host_budget_bytes},
                 {"dirs", r.config.dirs},
                 {"pcie_gbps", r.config.pcie_gbps},
                 {"iterations", r.config.iterations},
                 {"warmup", r.config.warmup},
                 {"policy", r.config.policy},
                 {"device_params", r.config.device_params},
                 {"host_states", r.config.host_states},
                 {"ranks", r.config.ranks},
                 {"shard_params", r.config.shard_params},
                 {"net_gbps", r.config.net_gbps}};
  j["model_states_bytes"] = r.model_states_bytes;
  j["chunks"] = r.chunks;
  j["moments"] = r.moments;
  j["compute_seconds"] = r.compute_seconds;
  const auto links = [](const ReplayRun& run) {
    nlohmann::json b;
    for (int l = 0; l < offload::kNumLinks; ++l) b[std::string(offload::LinkName(static_cast<offload::Link>(l)))] = run.bytes[l];
    return b;
  };
  j["step_seconds"] = r.planned.step_seconds;
  j["stall_fraction"] = r.planned.stall_fraction;
  if (r.config.ranks > 1) {
    j["comm_bytes_per_rank"] = r.planned.comm_bytes;
    j["comm_stall_seconds"] = r.planned.comm_stall_seconds;
    j["comm_stall_fraction"] = r.planned.comm_stall_fraction;
    if (r.config.shard_params) {
      j["param_gathers"] = r.planned.gathers;
      j["param_gathers_ahead"] = r.planned.gathered_ahead;
      j["param_gathers_filled_ahead"] = r.planned.filled_ahead;
    }
  }
  j["bytes_moved"] = links(r.planned);
  j["bytes_moved_total"] = r.planned.bytes_moved();
  j["planning_seconds"] = r.planning_seconds;
  j["planning_fraction_of_step"] = r.planning_seconds / std::max(r.planned.step_seconds, 1e-12);
  j["predicted_step_seconds"] = r.predicted_step_seconds;
  j["divergences"] = r.divergences;
  j["activation_peak_bytes"] = r.activation_peak_bytes;
  j["updates"] = r.updates;
  j["updates_on_device"] = r.updates_on_device;
  j["moments_compute_covers_transfer"] = r.moments_covered;
  if (r.strata_plan_step_seconds > 0) {
    j["strata_plan_step_seconds"] = r.strata_plan_step_seconds;
    j["strata_plan_command"] = r.strata_plan_command;
  }
  j["pipeline"] = nlohmann::json::parse(r.pipeline_json);  // the last iteration, stalls per moment
  if (r.config.baseline) {
    j["lru_step_seconds"] = r.lru.step_seconds;
    j["lru_stall_fraction"] = r.lru.stall_fraction;
    j["lru_bytes_moved"] = links(r.lru);
    j["lru_bytes_moved_total"] = r.lru.bytes_moved();
  }
  return j.dump(2);
}

}  // namespace strata::bench
