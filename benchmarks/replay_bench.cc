#include "benchmarks/replay_bench.h"

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "memory/chunk_layout.h"
#include "offload/pipeline.h"
#include "src/selftest.h"
#include "strata/engine.h"
#include "strata/options.h"

namespace strata::bench {
namespace {

using Clock = std::chrono::steady_clock;

struct ReplayMoment {
  std::vector<ChunkId> chunks;
  uint64_t bytes = 0;
  double compute_seconds = 0;
};

// Forward over the groups (param chunks), backward in reverse (param and grad chunks).
std::vector<ReplayMoment> Moments(const Engine& engine, const std::vector<TensorSpec>& specs, uint32_t layers) {
  std::vector<std::vector<uint32_t>> groups(layers + 2);
  for (uint32_t t = 0; t < specs.size(); ++t) groups[GptForwardGroup(specs[t].name, layers)].push_back(t);
  // The output head is tied to the token embedding: the logits need it again.
  for (uint32_t t = 0; t < specs.size(); ++t) {
    if (specs[t].name == "embed.tokens.weight") groups.back().push_back(t);
  }
  std::vector<ChunkInfo> info = engine.chunks();
  const auto moment = [&](const std::vector<uint32_t>& tensors, bool backward) {
    ReplayMoment m;
    for (ChunkKind kind : {ChunkKind::kParam, ChunkKind::kGrad}) {
      if (kind == ChunkKind::kGrad && !backward) continue;
      for (uint32_t t : tensors) {
        std::optional<ChunkId> c = engine.ChunkOf(TensorId(t), kind);
        if (!c || std::find(m.chunks.begin(), m.chunks.end(), *c) != m.chunks.end()) continue;
        m.chunks.push_back(*c);
        m.bytes += info[c->value()].size_bytes;
      }
    }
    return m;
  };
  std::vector<ReplayMoment> moments;
  for (const auto& g : groups) moments.push_back(moment(g, false));
  for (auto g = groups.rbegin(); g != groups.rend(); ++g) moments.push_back(moment(*g, true));
  return moments;
}

void BusyFor(double seconds) {
  const Clock::time_point end = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                   std::chrono::duration<double>(seconds));
  while (Clock::now() < end) {
  }
}

struct RunResult {
  ReplayRun run;
  std::string pipeline_json;
  double planning_seconds = 0;
  double predicted_step_seconds = 0;
  uint64_t divergences = 0;
};

Result<RunResult> RunOnce(const ReplayBenchConfig& config, const Options& options,
                          const std::vector<TensorSpec>& specs, bool adaptive, std::vector<ReplayMoment>* moments_out,
                          uint32_t* chunks_out) {
  EngineSeams seams;
  if (config.dirs.empty()) {
    STRATA_ASSIGN_OR_RETURN(seams.storage, CreateMemoryStorage(options.nvme_capacity_bytes));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::Create(options, std::move(seams)));
  for (const TensorSpec& spec : specs) STRATA_RETURN_IF_ERROR(engine->RegisterTensor(spec).status());
  STRATA_RETURN_IF_ERROR(engine->Finalize());
  std::vector<ReplayMoment> moments = Moments(*engine, specs, config.layers);
  const double link = config.pcie_gbps * 1e9;
  for (ReplayMoment& m : moments) {
    m.compute_seconds = config.compute_ms > 0 ? config.compute_ms / 1e3 : 1.5 * static_cast<double>(m.bytes) / link;
  }
  offload::PipelineOptions pipeline_options{.adaptive = adaptive};
  pipeline_options.links.bytes_per_second = {link, link, 0, 0};  // the throttle; NVMe measured in the warm-up
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<offload::Pipeline> pipeline,
                          offload::Pipeline::Create(*engine, pipeline_options));
  RunResult result;
  for (uint32_t it = 0; it <= config.iterations; ++it) {
    STRATA_RETURN_IF_ERROR(pipeline->BeginIteration());
    for (const ReplayMoment& m : moments) {
      STRATA_RETURN_IF_ERROR(pipeline->BeginMoment());
      std::vector<ChunkAccess> held;
      for (ChunkId c : m.chunks) {
        STRATA_ASSIGN_OR_RETURN(ChunkAccess access, pipeline->Access(c));
        held.push_back(std::move(access));
      }
      BusyFor(m.compute_seconds);
      held.clear();
      STRATA_RETURN_IF_ERROR(pipeline->EndMoment());
    }
    STRATA_RETURN_IF_ERROR(pipeline->EndIteration());
    if (it == 0) continue;  // the warm-up
    const offload::PipelineStats s = pipeline->stats();
    result.run.step_seconds += s.step_seconds / config.iterations;
    result.run.stall_seconds += s.stall_seconds / config.iterations;
    for (int l = 0; l < offload::kNumLinks; ++l) result.run.bytes[l] += s.bytes[l] / config.iterations;
  }
  result.run.stall_fraction = result.run.step_seconds > 0 ? result.run.stall_seconds / result.run.step_seconds : 0;
  const offload::PipelineStats s = pipeline->stats();
  result.planning_seconds = s.planning_seconds;
  result.divergences = s.divergences;
  if (const offload::Plan* plan = pipeline->plan()) result.predicted_step_seconds = plan->prediction.step_seconds;
  result.pipeline_json = pipeline->StatsJson();
  if (moments_out != nullptr) *moments_out = moments;
  if (chunks_out != nullptr) *chunks_out = static_cast<uint32_t>(engine->chunks().size());
  return result;
}

}  // namespace

uint64_t ReplayRun::bytes_moved() const {
  uint64_t total = 0;
  for (uint64_t b : bytes) total += b;
  return total;
}

Result<ReplayBenchReport> RunReplayBench(const ReplayBenchConfig& config) {
  if (config.layers == 0 || config.hidden == 0 || config.vocab == 0 || config.sequence == 0) {
    return InvalidArgument("bench replay: --layers, --hidden, --vocab and --seq must be > 0");
  }
  if (config.iterations == 0) return InvalidArgument("bench replay: --iterations 0: at least one is measured");
  if (!(config.pcie_gbps > 0)) return InvalidArgument("bench replay: --pcie-gbps {} must be > 0", config.pcie_gbps);
  const SelftestConfig shape{.layers = config.layers, .hidden = config.hidden, .vocab = config.vocab,
                             .sequence = config.sequence};
  const std::vector<TensorSpec> specs = GptTensorSpecs(shape, DType::kBFloat16);

  Options options;
  options.device_backend = DeviceBackendKind::kEmulated;
  options.compute_dtype = DType::kBFloat16;
  options.device_emulated_bandwidth_gbps = config.pcie_gbps;
  options.log_level = LogLevel::kWarning;
  STRATA_ASSIGN_OR_RETURN(memory::ChunkLayout layout,
                          memory::ChunkLayout::Build(specs, options.chunk_size_elems, options.chunk_search_min_elems,
                                                     options.chunk_search_max_elems));
  const uint64_t total = layout.report().total_bytes;
  uint64_t largest = 0;
  for (const memory::ChunkDesc& chunk : layout.chunks()) largest = std::max(largest, chunk.size_bytes());
  ReplayBenchReport report;
  report.config = config;
  report.model_states_bytes = total;
  options.device_budget_bytes = config.device_budget_bytes > 0 ? config.device_budget_bytes
                                                                : std::max<uint64_t>(total / 4, 4 * largest);
  options.host_budget_bytes = config.host_budget_bytes > 0 ? config.host_budget_bytes
                                                            : std::max<uint64_t>(total / 2, 4 * largest);
  options.nvme_dirs = config.dirs;
  options.nvme_capacity_bytes = 2 * total + 4 * largest;
  report.device_budget_bytes = options.device_budget_bytes;
  report.host_budget_bytes = options.host_budget_bytes;
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

  std::vector<ReplayMoment> moments;
  STRATA_ASSIGN_OR_RETURN(RunResult planned, RunOnce(config, options, specs, true, &moments, &report.chunks));
  report.planned = planned.run;
  report.planning_seconds = planned.planning_seconds;
  report.predicted_step_seconds = planned.predicted_step_seconds;
  report.divergences = planned.divergences;
  report.pipeline_json = planned.pipeline_json;
  report.moments = static_cast<uint32_t>(moments.size());
  for (const ReplayMoment& m : moments) report.compute_seconds += m.compute_seconds;
  if (config.baseline) {
    STRATA_ASSIGN_OR_RETURN(RunResult lru, RunOnce(config, options, specs, false, nullptr, nullptr));
    report.lru = lru.run;
  }
  return report;
}

std::string FormatReplayBench(const ReplayBenchReport& r) {
  std::string out = fmt::format(
      "strata bench replay: GPT, {} layers, hidden {}, vocab {}: {} of model states in {} chunks, {} moments\n"
      "device budget {}, host budget {}, NVMe {}; links {} GB/s; compute {:.1f} ms per iteration; {} measured "
      "iterations after one warm-up\n",
      r.config.layers, r.config.hidden, r.config.vocab, FormatSize(r.model_states_bytes), r.chunks, r.moments,
      FormatSize(r.device_budget_bytes), FormatSize(r.host_budget_bytes),
      r.config.dirs.empty() ? std::string("emulated in memory") : fmt::format("{}", fmt::join(r.config.dirs, ",")),
      r.config.pcie_gbps, 1e3 * r.compute_seconds, r.config.iterations);
  out += fmt::format("{:<22} {:>10} {:>10} {:>8} {:>12} {:>12} {:>12} {:>12}\n", "", "step ms", "stall ms", "stall",
                     "host->dev", "dev->host", "nvme read", "nvme write");
  const auto row = [&](const char* name, const ReplayRun& run) {
    out += fmt::format("{:<22} {:>10.2f} {:>10.2f} {:>7.1f}% {:>12} {:>12} {:>12} {:>12}\n", name,
                       1e3 * run.step_seconds, 1e3 * run.stall_seconds, 100 * run.stall_fraction,
                       FormatSize(run.bytes[0]), FormatSize(run.bytes[1]), FormatSize(run.bytes[2]),
                       FormatSize(run.bytes[3]));
  };
  row("planned prefetch", r.planned);
  if (r.config.baseline) row("LRU, on demand", r.lru);
  out += fmt::format("planning {:.2f} ms ({:.2f}% of a step); predicted step {:.2f} ms ({:+.1f}% from the replay); "
                     "{} divergences\n",
                     1e3 * r.planning_seconds, 100 * r.planning_seconds / std::max(r.planned.step_seconds, 1e-12),
                     1e3 * r.predicted_step_seconds,
                     100 * (r.predicted_step_seconds / std::max(r.planned.step_seconds, 1e-12) - 1), r.divergences);
  return out;
}

std::string ReplayBenchJson(const ReplayBenchReport& r) {
  nlohmann::json j;
  j["config"] = {{"model", "gpt"},
                 {"layers", r.config.layers},
                 {"hidden", r.config.hidden},
                 {"vocab", r.config.vocab},
                 {"seq", r.config.sequence},
                 {"device_budget_bytes", r.device_budget_bytes},
                 {"host_budget_bytes", r.host_budget_bytes},
                 {"dirs", r.config.dirs},
                 {"pcie_gbps", r.config.pcie_gbps},
                 {"iterations", r.config.iterations}};
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
  j["bytes_moved"] = links(r.planned);
  j["bytes_moved_total"] = r.planned.bytes_moved();
  j["planning_seconds"] = r.planning_seconds;
  j["planning_fraction_of_step"] = r.planning_seconds / std::max(r.planned.step_seconds, 1e-12);
  j["predicted_step_seconds"] = r.predicted_step_seconds;
  j["divergences"] = r.divergences;
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
